"""Generate from GPT-2 and stream it to the terminal:  python sample.py --prompt "Once upon a time"

--prompt may repeat (and --prompt-file, "-" for standard input): the prompts run together, continuously batched,
each --num-samples times. The first streams live; each later one is printed as soon as those before it are done
(usually it is finished by then too). Why a text stopped, unless at the end-of-text token, goes to stderr.
vLLM's names for flags are taken too: --max-tokens for --max-new-tokens, --n for --num-samples.
Exit status: 0, or 1 when a prompt is refused or the model cannot load, 2 for a bad flag, 130 on Ctrl-C.
"""
import argparse
import json
import os
import sys
import time


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # every default, unless there is none or the text gives it already
        none = action.default is None or action.default is False or action.default == [] or \
            action.default == argparse.SUPPRESS
        return (action.help or "") + ("" if none or "default" in (action.help or "") else " (default: %(default)s)")


def json_object(text):
    """A flag's JSON value (argparse names the flag when this raises)."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--prompt", action="append", default=[],
                    help="a prompt (repeat for several; none: one empty prompt, generating unconditionally)")
    ap.add_argument("--prompt-file", action="append", default=[],
                    help="a file whose text, less its final newline, is a prompt; - reads stdin")
    ap.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, -large, -xl, distilgpt2, a directory, or "
                    "random:gpt2 (random weights at a GPT-2 size: no network, the text is noise)")
    ap.add_argument("--max-new-tokens", "--max-tokens", type=int, default=100, metavar="N",
                    help="tokens per text at most")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 is greedy: always the most likely token")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 is off")
    ap.add_argument("--top-p", type=float, default=0.95, help="from the fewest tokens holding this much probability; "
                                                               "1 is off")
    ap.add_argument("--num-samples", "--n", type=int, default=1, metavar="N",
                    help="texts per prompt, sharing the prompt's KV cache")
    ap.add_argument("--stop", action="append", default=None, help="a string that ends a text (repeat for several)")
    ap.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-text token")
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="after each text, every token's log-probability and the K most likely (on stderr)")
    ap.add_argument("--seed", type=int, default=None,
                    help="fixes the random draws: the same seed gives the same texts (default: new draws each run)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: the GPU if CuPy sees one, else the CPU")
    ap.add_argument("--dtype", default=None, choices=["float16", "float32"], help="default: fp16 on GPU, fp32 on CPU")
    ap.add_argument("--quantization", choices=["int8"], help="weight-only int8 (W8A16): one scale per output channel, quantized at load")
    ap.add_argument("--speculative-config", type=json_object, metavar="JSON", help='speculative decoding (no token '
                    'changes): {"method": "ngram", "num_speculative_tokens": 3} or {"model": "distilgpt2", '
                    '"num_speculative_tokens": 3}')
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each layer is split over (Megatron's "
                    "split; a process a GPU)")
    ap.add_argument("--kernels", default="fast", choices=["fast", "simple"], help="simple: matmul, layernorm and "
                    "attention on the kernel ladder's first rungs (kernels.cu, section L), to see what the fast ones buy")
    args = ap.parse_args()
    prompts = args.prompt + [read_prompt(ap, f) for f in args.prompt_file] or [""]
    from nanoinfer import LLM, SamplingParams  # here: a Ctrl-C while numpy loads exits quietly too
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(7), "little")
    try:
        params = [SamplingParams(n=args.num_samples, max_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, stop=args.stop, ignore_eos=args.ignore_eos,
                                 logprobs=args.logprobs, seed=seed + i) for i in range(len(prompts))]
    except ValueError as e:  # "SamplingParams.<field>=<value>: must be ...", said as the flag typed
        field, rest = str(e).removeprefix("SamplingParams.").split("=", 1)
        ap.error(f"{FLAGS.get(field, field)} {rest.split(': ', 1)[0]}: {rest.split(': ', 1)[-1]}")
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                  speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                  kernels=args.kernels)
    except Exception as e:  # a model directory's problem, the download, the GPU: the message says what to do
        sys.exit(f"error: {e}")
    return stream_to_terminal(llm, prompts, params)


FLAGS = {"n": "--num-samples", "max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "stop": "--stop", "logprobs": "--logprobs", "seed": "--seed"}  # SamplingParams' fields


def read_prompt(ap, name):
    """A --prompt-file's text, less its final newline: the end of its last line (as echo and editors write it), not
    something to continue from."""
    try:
        text = sys.stdin.read() if name == "-" else open(name, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        ap.error(f"--prompt-file {name}: {e}")
    return text.removesuffix("\n").removesuffix("\r")


def why_stopped(llm, out, sample):
    """Why a text stopped, unless at the end-of-text token (None then)."""
    if sample.finish_reason == "length":
        full = len(out.prompt_token_ids) + len(sample.token_ids) >= llm.config.n_ctx
        return f"the context is full ({llm.config.n_ctx} tokens)" if full else \
            f"max tokens ({len(sample.token_ids)}; --max-new-tokens)"
    if sample.finish_reason == "stop" and sample.stop_reason is not None:
        return f"stop string {sample.stop_reason!r}"
    return None


def notes(llm, out, sample):
    """What stderr says after a text: why it stopped (unless at the end-of-text token), and its log-probabilities."""
    why = why_stopped(llm, out, sample)
    lines = [f"\n[stopped: {why}]"] if why else []
    for lp, token in zip(sample.logprobs or [], sample.token_ids):
        others = "  ".join(f"{x.decoded_token!r} {x.logprob:.2f}" for x in sorted(lp.values(), key=lambda x: x.rank))
        lines.append(f"  {lp[token].decoded_token!r:>16} {lp[token].logprob:8.3f}   {others}")
    return "\n".join(lines) + "\n" if lines else ""


def stream_to_terminal(llm, prompts, params):
    out, n = sys.stdout, params[0].n
    slots = len(prompts) * n  # one per text: prompt i's sample j is slot i * n + j
    pending = [[] for _ in range(slots)]  # text not yet on screen
    done, after = [False] * slots, [""] * slots  # finished; what stderr says after it
    refused = set()  # prompts the engine refused: their text is not echoed
    shown = None  # the slot streaming live now (None: before the first event)
    failed, n_tokens, t_first, t0 = 0, 0, None, time.perf_counter()

    def show_header(k):
        if slots > 1:
            label = f"{k + 1}/{slots}" if n == 1 else f"prompt {k // n + 1}/{len(prompts)}, sample {k % n + 1}/{n}"
            out.write(f"{'' if k == 0 else chr(10) * 2}--- [{label}] ---\n")
        out.write("" if k // n in refused else prompts[k // n])

    def show_ready(everything=False):  # what is ready, in slot order (everything: the rest too, as far as it got)
        nonlocal shown
        if shown is None:  # the first event: by now the engine has refused what it refuses
            shown = 0
            show_header(0)
        while shown < slots:
            out.write("".join(pending[shown]))
            pending[shown].clear()
            if after[shown] and done[shown]:
                out.flush()
                sys.stderr.write(after[shown])
                after[shown] = ""
            if not (done[shown] or everything) or shown + 1 == slots:
                break
            shown += 1
            show_header(shown)
        out.flush()

    status = 0
    try:
        for i, j, delta, finished in llm.stream(prompts, params):
            pending[i * n + j].append(delta)
            n_tokens += len(getattr(delta, "token_ids", ()))  # a TextDelta: the tokens it came from
            if finished is not None and finished.error:
                what = "refused" if finished.request_id is None else "failed"
                if finished.request_id is None:
                    refused.add(i)
                print(f"error: prompt {i + 1} {what}: {finished.error}", file=sys.stderr)
                failed += 1
            elif finished is None:  # an event carries a run of tokens (up to 16 with CUDA graphs)
                t_first = t_first or time.perf_counter()
            if finished is not None:
                for k in range(i * n, i * n + n):
                    done[k] = True
                for c in finished.outputs:
                    after[i * n + c.index] = "" if finished.error else notes(llm, finished, c)
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
    if n_tokens:  # none (every prompt refused, or Ctrl-C before the first): no speed to speak of
        print(f"[{llm.backend.name}] time to first token {ttft}, {n_tokens} tokens in {dt:.2f} s, "
              f"{n_tokens / dt:.1f} tokens/s", file=sys.stderr)
    return status or (1 if failed else 0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # while loading
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
