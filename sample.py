"""Generate from GPT-2 and stream it to the terminal:  python sample.py --prompt "Once upon a time"

--prompt may repeat: the prompts run together, continuously batched. The first one streams live; each
later one is printed as soon as the ones before it are done (usually it is finished by then too).
Exit status: 0, or 1 when a prompt is refused or the model cannot load, 2 for a bad flag, 130 on Ctrl-C.
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", action="append", help="a prompt (repeat for several; empty generates unconditionally)")
    ap.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, -large, -xl, distilgpt2, or a directory")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=None, help="makes the samples reproducible")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float16", "float32"], help="default: fp16 on GPU, fp32 on CPU")
    args = ap.parse_args()
    prompts = args.prompt or [""]
    from nanoinfer import LLM, SamplingParams  # here: a Ctrl-C while numpy loads exits quietly too
    try:
        params = [SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=None if args.seed is None else args.seed + i)
                  for i in range(len(prompts))]
    except ValueError as e:
        ap.error(str(e))
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
    except Exception as e:  # a model directory's problem, the download, the GPU: the message says what to do
        sys.exit(f"error: {e}")
    return stream_to_terminal(llm, prompts, params)


def stream_to_terminal(llm, prompts, params):
    out = sys.stdout
    pending = [[] for _ in prompts]  # text of prompts not yet on screen
    done = [False] * len(prompts)
    shown = 0  # the prompt streaming live now
    refused, n_tokens, t_first, t0 = 0, 0, None, time.perf_counter()

    def show_header(i):
        if len(prompts) > 1:
            out.write(f"{'' if i == 0 else chr(10) * 2}--- [{i + 1}/{len(prompts)}] ---\n")
        out.write(prompts[i])

    def show_ready(everything=False):  # what is ready, in prompt order (everything: the rest too, as far as it got)
        nonlocal shown
        while shown < len(prompts):
            out.write("".join(pending[shown]))
            pending[shown].clear()
            if not (done[shown] or everything) or shown + 1 == len(prompts):
                break
            shown += 1
            show_header(shown)
        out.flush()

    status = 0
    try:
        show_header(0)
        for i, _, delta, finished in llm.stream(prompts, params):
            if finished is not None and finished.error:
                print(f"error: prompt {i + 1} refused: {finished.error}", file=sys.stderr)
                refused += 1
            else:  # an event carries a run of tokens (up to 16 with CUDA graphs): count them at the end
                t_first = t_first or time.perf_counter()
                n_tokens += sum(len(c.token_ids) for c in finished.outputs) if finished is not None else 0
            pending[i].append(delta)
            done[i] = finished is not None
            show_ready()
        out.write("\n")
        out.flush()
    except KeyboardInterrupt:
        try:
            show_ready(everything=True)
            out.write("\n[interrupted]\n")
            out.flush()
        except BrokenPipeError:
            pass
        status = 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as a program killed by SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # the interpreter's last flush must not fail too
        return 141
    dt = time.perf_counter() - t0
    ttft = f"{(t_first - t0) * 1e3:.0f} ms" if t_first else "-"
    print(f"[{llm.backend.name}] time to first token {ttft}, {n_tokens} tokens in {dt:.2f} s, "
          f"{n_tokens / dt:.1f} tokens/s", file=sys.stderr)
    return status or (1 if refused else 0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # while loading
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
