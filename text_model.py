"""Models that predict text, for the lessons whose numbers depend on the weights (bench.py): speculation's acceptance,
int8's perplexity, sampled text. A model of random weights copies its prompt only by accident, so on it those numbers
say nothing about the lever. Speed is still measured on random weights: a kernel's time does not depend on values.

Made where the GPU is, with no network: GPT-2 124M's shape and a 2-layer draft with the same vocabulary, trained by
PyTorch on Python's standard library source (every 10th file held out), about three minutes in all on an H200. Saved
by transformers' save_pretrained (safetensors) with the GPT-2 vocabulary under ~/.cache/nanoinfer/trained, and
reused while there. Nothing of them is in the repository. `python text_model.py` makes them and prints their loss.
"""
import functools
import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np

from checkpoint import Tokenizer, resolve_model

CACHE = Path("~/.cache/nanoinfer/trained").expanduser()
MODELS = {"target": dict(n_layer=12, seconds=140), "draft": dict(n_layer=2, seconds=40)}  # both 768 wide, 12 heads
BATCH, CONTEXT = 16, 1024  # sequences a step, tokens each
EOT = 50256


def corpus(held_out):
    """The texts of the standard library's .py files, in path order: every 10th (held_out) or the others."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return [f.read_text(encoding="utf-8", errors="replace") for i, f in enumerate(files) if (i % 10 == 0) == held_out]


def tokens(texts):
    """The texts as one token array, each followed by <|endoftext|>. The tokenizer is GPT-2's, from random:gpt2's
    directory (no network)."""
    tokenizer = Tokenizer(resolve_model("random:gpt2"))
    return np.concatenate([np.array(tokenizer.encode(text) + [EOT], np.int32) for text in texts])


@functools.cache
def held_out_tokens():
    """The held-out files as one token array, made once a process (training, and two lessons, read it)."""
    return tokens(corpus(held_out=True))


def train(n_layer, seconds, tokens, device):
    """A GPT-2 of n_layer layers trained on `tokens` for `seconds`: AdamW, bf16 autocast, warm-up then cosine decay
    of the learning rate over the time budget, random windows of CONTEXT tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=12, n_embd=768, n_positions=1024)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.from_numpy(tokens.astype(np.int64)).to(device)
    t0, step = time.perf_counter(), 0
    while (done := (time.perf_counter() - t0) / seconds) < 1:
        lr = 6e-4 * min(1, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(data) - CONTEXT, (BATCH,), device=device)
        x = data[starts[:, None] + torch.arange(CONTEXT, device=device)]  # (BATCH, CONTEXT)
        with torch.autocast(device.split(":")[0], torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
    return model, step


def held_out_loss(model, tokens, device, windows=32):
    """Mean next-token loss (nats) over `windows` evenly spaced windows of CONTEXT held-out tokens."""
    import torch
    starts = np.linspace(0, len(tokens) - CONTEXT - 1, windows).astype(np.int64)
    x = torch.from_numpy(np.stack([tokens[s:s + CONTEXT] for s in starts]).astype(np.int64)).to(device)
    with torch.no_grad(), torch.autocast(device.split(":")[0], torch.bfloat16):
        return float(model(x, labels=x).loss)


def make_models(device="cuda", log=print):
    """{name: directory} of the target and the draft, trained now unless the cache has them; their held-out loss
    is logged either way (it is in each directory's loss.txt)."""
    paths = {name: CACHE / name for name in MODELS}
    if not all((p / "loss.txt").exists() for p in paths.values()):
        train_tokens, test_tokens = tokens(corpus(held_out=False)), held_out_tokens()
        log(f"corpus: the standard library, {len(train_tokens):,} tokens to train on, {len(test_tokens):,} held out")
        vocab = resolve_model("random:gpt2")
        for name, p in paths.items():
            model, steps = train(MODELS[name]["n_layer"], MODELS[name]["seconds"], train_tokens, device)
            loss = held_out_loss(model, test_tokens, device)
            shutil.rmtree(p, ignore_errors=True)
            model.save_pretrained(p, safe_serialization=True)
            for f in ("vocab.json", "merges.txt"):
                shutil.copy(vocab / f, p / f)
            (p / "loss.txt").write_text(f"{loss:.3f} held-out loss after {steps} steps of {BATCH}x{CONTEXT} tokens\n")
    for name, p in paths.items():
        log(f"{name} ({MODELS[name]['n_layer']} layers): {(p / 'loss.txt').read_text().strip()}")
    return paths


# -----------------------------------------------------------------------------
# the lessons whose numbers depend on the weights, measured on the trained pair (bench.py prints them)

def workloads(tokenizer, n_new):
    """(label, prompt ids, SamplingParams) on held-out files: a copy-heavy edit (a file's first 384 tokens, then its
    first 32 again: the output should re-emit it), greedy continuation of a file's first 256 tokens, and seeded
    sampling (T 0.8, top-p 0.95) of the same. Each with the ids a copy would emit (None: not a copy)."""
    from sampling_params import SamplingParams
    files = [tokenizer.encode(text) for text in corpus(held_out=True)]
    copy_src = next(ids for ids in files if len(ids) > 384 + n_new)
    code = next(ids for ids in files[1:] if len(ids) > 256)
    greedy = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    return [("copy-heavy edit", copy_src[:384] + [198, 198] + copy_src[:32], greedy, copy_src[32:32 + n_new]),
            ("greedy continuation of held-out code", code[:256], greedy, None),
            ("seeded sampling (T 0.8, top-p 0.95)", code[:256],
             SamplingParams(max_tokens=n_new, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True), None)]


def repeats_itself(ids, n=4):
    """The share of tokens whose n-gram ending there occurred earlier in ids: how much an n-gram draft can find."""
    seen, hits = set(), 0
    for i in range(n, len(ids) + 1):
        gram = tuple(ids[i - n:i])
        hits += gram in seen
        seen.add(gram)
    return hits / max(1, len(ids) - n + 1)


def speculation_lessons(paths, repeats, n_new=256, device="cuda"):
    """n-gram (k 5) and the trained draft (k 4) against plain decoding on each workload, single stream, alternating
    in one process: tok/s and their ratio, the acceptance rate, tokens a target step, tokens identical to plain."""
    from nanoinfer import LLM
    engine = dict(device=device, num_kv_tokens=8192, max_num_seqs=8)  # single stream: few graphs to capture
    plain = LLM(str(paths["target"]), **engine)
    specs = {"n-gram k 5": {"method": "ngram", "num_speculative_tokens": 5},
             "draft model k 4": {"model": str(paths["draft"]), "num_speculative_tokens": 4}}
    lines = []
    for label, prompt, params, copy in workloads(plain.tokenizer, n_new):
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        what = f"copied {np.mean([a == b for a, b in zip(want, copy)]):.0%} of the file" if copy else \
            f"{repeats_itself(prompt + want):.0%} of its 4-grams seen before"
        for name, spec in specs.items():
            llm = LLM(str(paths["target"]), speculative_config=spec, **engine)
            times, same = {id(plain): [], id(llm): []}, True
            for i in range(2 * repeats):
                timed = (plain, llm)[(i + i // 2) % 2]  # alternating, each first in every other round
                t0 = time.perf_counter()
                got = timed.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
                times[id(timed)].append(len(got) / (time.perf_counter() - t0))
                same = same and got == want
            a, b, s = np.median(times[id(llm)]), np.median(times[id(plain)]), llm.proposer
            steps = repeats * n_new - s.accepted  # target steps: every token not a kept draft took one
            ranges = [f"{min(t):,.0f}-{max(t):,.0f}" for t in times.values()]
            lines.append(f"{label} ({what}), {name}: {a:,.0f} against {b:,.0f} tok/s ({a / b:.2f}x; runs "
                         f"{ranges[1]} against {ranges[0]}), acceptance "
                         f"{s.accepted / max(s.proposed, 1):.0%}, {repeats * n_new / steps:.2f} tokens a target step, "
                         f"tokens {'identical to' if same else 'NOT'} plain decoding's")
            del llm
    return lines


def log_probs(llm, ids):
    """Teacher-forced next-token log-probs (len(ids), V) of one sequence, in the first slots of the engine's pool."""
    from nanoinfer import Batch
    from sampling_params import log_softmax
    n, i32 = len(ids), lambda a: np.asarray(a, np.int32)
    batch = Batch(i32(ids), i32(range(n)), i32(range(n)), i32([0, n]), i32([n]), i32([range(-(-n // 16))]),
                  i32(range(n)))
    return log_softmax(llm.backend.tohost(llm.model.forward(batch, llm.kv)).astype(np.float64))


def quality_lessons(paths, windows=8, n_new=256, device="cuda"):
    """What the weights decide, on held-out text: perplexity in fp32, fp16 and int8 (teacher-forced over windows of
    1024 tokens); int8 against fp16: greedy tokens that agree, mean KL of the next-token distributions; and the
    loss (under fp32) of text sampled at T 0.8, top-p 0.95, beside the held-out text's own."""
    from nanoinfer import LLM
    from sampling_params import SamplingParams
    test = held_out_tokens()
    starts = np.linspace(0, len(test) - CONTEXT, windows).astype(int)
    texts = [test[s:s + CONTEXT].tolist() for s in starts]
    llms = {name: LLM(str(paths["target"]), device=device, num_kv_tokens=2048, **kw) for name, kw in (
        ("fp32", dict(dtype="float32")), ("fp16", {}), ("int8", dict(quantization="int8")))}
    nll, kl = {name: [] for name in llms}, []
    for ids in texts:
        lp = {name: log_probs(llm, ids) for name, llm in llms.items()}
        for name in llms:
            nll[name].append(-lp[name][np.arange(len(ids) - 1), ids[1:]].mean())
        kl.append((np.exp(lp["fp16"]) * (lp["fp16"] - lp["int8"])).sum(-1).mean())
    greedy = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    outs = {name: llms[name].generate([texts[0][:256]], greedy, use_tqdm=False)[0].outputs[0].token_ids
            for name in ("fp16", "int8")}
    sampled = llms["fp16"].generate([texts[1][:256]], SamplingParams(max_tokens=n_new, temperature=0.8, top_p=0.95,
                                                                     seed=1, ignore_eos=True), use_tqdm=False)
    ids = texts[1][:256] + sampled[0].outputs[0].token_ids
    sampled_nll = -log_probs(llms["fp32"], ids)[np.arange(255, len(ids) - 1), ids[256:]].mean()
    ppl = ", ".join(f"{name} {np.exp(np.mean(v)):.3f}" for name, v in nll.items())
    return (f"held-out perplexity ({windows} x {CONTEXT} tokens): {ppl}; int8 against fp16: greedy tokens agree "
            f"{np.mean([a == b for a, b in zip(*outs.values())]):.0%}, mean KL {np.mean(kl):.2e}; text sampled at "
            f"T 0.8, top-p 0.95: loss {sampled_nll:.2f} nats a token under fp32 (held-out text: "
            f"{np.mean(nll['fp32']):.2f})")


def fp16_long_context(path, prompts, n_new=32, device="cuda"):
    """fp16's error where rounding adds up: greedy decoding after long prompts, ours and transformers' fp16 (each on
    its own tokens), against transformers in float64 on the same tokens. {who: (the largest gap between the
    reference's best logit and the chosen token's, the largest log-prob error)}."""
    import torch
    from transformers import GPT2LMHeadModel
    from nanoinfer import LLM
    from sampling_params import SamplingParams
    llm = LLM(str(path), device=device, dtype="float16", num_kv_tokens=len(prompts) * (len(prompts[0]) + n_new + 64))
    runs = {"ours": [], "transformers": []}
    for out in llm.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, logprobs=0),
                            use_tqdm=False):
        got = out.outputs[0]
        runs["ours"].append((got.token_ids, [d[t].logprob for d, t in zip(got.logprobs, got.token_ids)]))
    del llm
    model = {dtype: GPT2LMHeadModel.from_pretrained(path, torch_dtype=dtype).to(device).eval()
             for dtype in (torch.float16, torch.float64)}
    worst = {}
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            new = model[torch.float16].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                                do_sample=False, eos_token_id=None, pad_token_id=EOT)[0, len(p):]
            lp = torch.log_softmax(model[torch.float16](torch.cat([ids[0], new])[None]).logits[0, len(p) - 1:-1], -1)
            runs["transformers"].append((new.tolist(), lp[torch.arange(n_new), new].double().tolist()))
        for who, outs in runs.items():
            gap = err = 0.0
            for p, (new, lps) in zip(prompts, outs):
                ref = model[torch.float64](torch.tensor([p + new], device=device)).logits[0, len(p) - 1:-1]
                chosen = torch.arange(len(new)), torch.tensor(new)
                gap = max(gap, (ref.max(-1).values - ref[chosen]).max().item())
                ref_lp = torch.log_softmax(ref, -1)[chosen].cpu().numpy()
                err = max(err, float(np.abs(np.array(lps) - ref_lp).max()))
            worst[who] = (gap, err)
    return worst


def long_context_lesson(paths, n_prompts=4, length=960, n_new=32):
    """fp16_long_context on the trained target, prompts of held-out text."""
    test = held_out_tokens()
    prompts = [test[s:s + length].tolist() for s in np.linspace(0, len(test) - length, n_prompts).astype(int)]
    worst = fp16_long_context(paths["target"], prompts, n_new)
    return (f"fp16 after {length}-token prompts ({n_prompts} x {n_new} greedy tokens) against float64: largest gap "
            "below the best logit, largest log-prob error: " +
            ", ".join(f"{who} {gap:.3f} / {err:.4f}" for who, (gap, err) in worst.items()))


if __name__ == "__main__":
    make_models()
