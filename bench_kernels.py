"""Per-kernel timings at GPT-2 124M shapes (C=768, 12 heads, V=50257), fp16, on the GPU.

Temporary file: the lead folds it into bench.py. Workloads: a decode step at batch 1 and 64 (context
512) and a 2048-token prefill (two sequences of 1024). Each kernel is captured into a CUDA graph of
many launches and the graph replayed: the median replay time over the launch count is one launch's
time (graph-launched, as the engine will run). Memory-bound kernels rotate through copies of their
inputs larger than 3x L2, so the numbers are HBM, not L2. Ceilings come from the same run: a
device-to-device copy (bytes read + written) and cuBLAS (cupy.matmul) fp16 at 8192^3, plus cuBLAS at
each of our GEMM shapes: cupy.matmul (eager) and, where torch is installed, F.linear replayed from a
CUDA graph (the fair reference: no host launch overhead in it).
"""
import json
import math
import os
import types

import numpy as np
import cupy as cp

from nanoinfer import CudaBackend

C, H, D, V, CTX = 768, 12, 64, 50257, 512
BS = 16
be = CudaBackend(np.float16)
L2 = cp.cuda.Device().attributes["L2CacheSize"]
stream = cp.cuda.Stream(non_blocking=True)
rows = []


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(times))


def time_graph(launch, n_rot, per_graph=None, reps=15):
    """us per launch of launch(i), i cycling over n_rot input sets, replayed from a CUDA graph."""
    per_graph = per_graph or max(n_rot, 30)
    cp.cuda.Device().synchronize()  # inputs were made on the default stream; ours does not wait for it
    with stream:
        for i in range(n_rot):
            launch(i)  # warm-up: allocations and first-touch outside the capture
        stream.synchronize()
        stream.begin_capture()
        for i in range(per_graph):
            launch(i % n_rot)
        graph = stream.end_capture()
        graph.upload(stream)
        graph.launch(stream)
        return median_ms(lambda: graph.launch(stream), reps) * 1e3 / per_graph


def time_eager(fn, n_rot, per_loop=30, reps=7):
    cp.cuda.Device().synchronize()
    with stream:
        for i in range(n_rot):
            fn(i)
        return median_ms(lambda: [fn(i % n_rot) for i in range(per_loop)], reps) * 1e3 / per_loop


def n_rot_for(nbytes, cap=256):
    return int(min(cap, max(1, math.ceil(3 * L2 / max(nbytes, 1)))))


def randn(shape, dtype=np.float16):
    return cp.random.standard_normal(shape, dtype=np.float32).astype(dtype)


def record(work, kernel, shape, us, nbytes, flops, cublas_us=None, cupy_us=None):
    rows.append(dict(work=work, kernel=kernel, shape=shape, us=us, bytes=nbytes, flops=flops,
                     gbs=nbytes / us / 1e3, tflops=flops / us / 1e6, cublas_us=cublas_us, cupy_us=cupy_us))
    r = rows[-1]
    extra = f"  cupy.matmul {cupy_us:7.2f} us (eager)" if cupy_us else ""
    extra += f"  cuBLAS graph {cublas_us:7.2f} us ({100 * cublas_us / us:4.0f}% of cuBLAS speed)" if cublas_us else ""
    print(f"{work:11s} {kernel:15s} {shape:20s} {us:9.2f} us {r['gbs']:8.0f} GB/s {r['tflops']:7.1f} TFLOP/s{extra}",
          flush=True)


# ---- ceilings -------------------------------------------------------------------------------
def ceilings():
    n = 1 << 30
    a, b = cp.empty(n, np.uint8), cp.empty(n, np.uint8)
    a.fill(1)
    with stream:
        b.data.copy_from_device_async(a.data, n, stream)
        ms = median_ms(lambda: b.data.copy_from_device_async(a.data, n, stream), 10)
    copy_gbs = 2 * n / ms / 1e6
    del a, b
    x, y = randn((8192, 8192)), randn((8192, 8192))
    with stream:
        cp.matmul(x, y)
        ms = median_ms(lambda: cp.matmul(x, y), 10)
    cublas_tflops = 2 * 8192 ** 3 / ms / 1e9
    print(f"ceilings: device copy {copy_gbs:.0f} GB/s (read + write), cuBLAS fp16 8192^3 {cublas_tflops:.0f} TFLOP/s, "
          f"L2 {L2 / 2**20:.0f} MiB", flush=True)
    return copy_gbs, cublas_tflops


# ---- kernels --------------------------------------------------------------------------------
def bench_matmul(work, name, M, N, K, bias=True, gelu=False, residual=False):
    wbytes = N * K * 2
    nbytes = wbytes + (M * K + M * N + (N if bias else 0) + (M * N if residual else 0)) * 2
    n_rot = n_rot_for(nbytes, cap=64)
    xs = [randn((M, K)) for _ in range(min(n_rot, 4))]
    ws = [randn((N, K)) * (1 / math.sqrt(K)) for _ in range(n_rot)]
    bs = [randn(N) for _ in range(n_rot)] if bias else [None] * n_rot
    rs = randn((M, N)) if residual else None
    us = time_graph(lambda i: be.matmul(xs[i % len(xs)], ws[i], bs[i], gelu, rs), n_rot)
    wts = [w.T for w in ws]
    cupy_us = time_eager(lambda i: cp.matmul(xs[i % len(xs)], wts[i]), n_rot)
    record(work, name, f"{M}x{N}x{K}", us, nbytes, 2 * M * N * K, cublas_graph_us(M, N, K, n_rot), cupy_us)


def cublas_graph_us(M, N, K, n_rot, reps=10):
    """cuBLAS at the same shape without host overhead: cupy.matmul cannot be graph-captured and an eager
    call costs ~15 us of host time, so the reference is torch's F.linear (cuBLAS, same (N, K) weight
    layout) replayed from a CUDA graph, with the same rotation. None without torch."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    F = torch.nn.functional
    xs = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in range(min(n_rot, 4))]
    ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) / math.sqrt(K) for _ in range(n_rot)]
    per = max(n_rot, 30)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_rot):
            F.linear(xs[i % len(xs)], ws[i])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per):
            F.linear(xs[i % len(xs)], ws[i % n_rot])
    g.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / per)
    del g, xs, ws
    torch.cuda.empty_cache()
    return float(np.median(times))


def bench_layernorm(work, T):
    nbytes = 4 * T * C * 2 + 2 * C * 2
    n_rot = n_rot_for(nbytes)
    xs, res = [randn((T, C)) for _ in range(n_rot)], [randn((T, C)) for _ in range(n_rot)]
    w, b = randn(C), randn(C)
    us = time_graph(lambda i: be.layernorm(xs[i], w, b, 1e-5, res[i]), n_rot)
    record(work, "layernorm+res", f"{T}x{C}", us, nbytes, 10 * T * C)


def bench_embed(work, T):
    wte, wpe = randn((V, C)), randn((1024, C))
    n_rot = 64
    ids = [cp.asarray(np.random.randint(0, V, T).astype(np.int32)) for _ in range(n_rot)]
    pos = [cp.asarray(np.random.randint(0, 1024, T).astype(np.int32)) for _ in range(n_rot)]
    us = time_graph(lambda i: be.embed(wte, wpe, ids[i], pos[i]), n_rot)
    record(work, "embed", f"{T}x{C}", us, 3 * T * C * 2, T * C)


def make_cache(num_blocks):
    return randn((num_blocks, BS, H, D)), randn((num_blocks, BS, H, D))


def bench_cache_write(work, T):
    nbytes = 4 * T * C * 2
    n_rot = n_rot_for(nbytes, cap=64)
    kc, vc = make_cache(max(64, n_rot * T // BS + 1))
    qkv = randn((T, 3 * C))
    k, v = qkv[:, C:2 * C].reshape(T, H, D), qkv[:, 2 * C:].reshape(T, H, D)
    slots = [cp.asarray((np.arange(T) + i * T).astype(np.int32) % (kc.shape[0] * BS)) for i in range(n_rot)]
    us = time_graph(lambda i: be.cache_write(k, v, kc, vc, slots[i]), n_rot)
    record(work, "cache_write", f"{T}x{C}", us, nbytes, 0)


def attention_batches(seqs, n_rot):
    """n_rot batches of the same shapes on disjoint, scattered blocks of one cache pool."""
    n_q = np.array([s[0] for s in seqs])
    ctx = np.array([s[1] for s in seqs])
    nblk = -(-ctx // BS)
    perm = np.random.permutation(int(nblk.sum()) * n_rot)
    kc, vc = make_cache(len(perm))
    batches, used = [], 0
    for _ in range(n_rot):
        tables = np.zeros((len(seqs), nblk.max()), np.int32)
        for s in range(len(seqs)):
            tables[s, :nblk[s]] = perm[used:used + nblk[s]]
            used += nblk[s]
        cu = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
        T = int(cu[-1])
        z = np.zeros(T, np.int32)
        batches.append(be.to_device(types.SimpleNamespace(
            input_ids=z, positions=z, slot_mapping=z, cu_seqlens_q=cu, context_lens=ctx.astype(np.int32),
            block_tables=tables, logits_idx=cu[1:] - 1)))
    return batches, kc, vc, int(n_q.sum())


def bench_attention(work, seqs):
    n_q = np.array([s[0] for s in seqs])
    ctx = np.array([s[1] for s in seqs])
    visible = sum(int((c - n + np.arange(n) + 1).sum()) for n, c in zip(n_q, ctx))  # (query, key) pairs
    kv_bytes = int(ctx.sum()) * C * 2 * 2
    nbytes = kv_bytes + 2 * int(n_q.sum()) * C * 2
    n_rot = n_rot_for(nbytes, cap=64)
    batches, kc, vc, T = attention_batches(seqs, n_rot)
    q = randn((T, 3 * C))[:, :C].reshape(T, H, D)
    us = time_graph(lambda i: be.attention(q, kc, vc, batches[i], 1 / math.sqrt(D)), n_rot)
    record(work, "attention", f"{len(seqs)}seq q{int(n_q.max())} ctx{int(ctx.max())}", us, nbytes, 4 * H * D * visible)


def bench_sample(work, R):
    n_rot = n_rot_for(R * V * 4, cap=64)
    logits = [randn((R, V), np.float32) * 3 for _ in range(n_rot)]
    t, k, p = (cp.full(R, 0.8, np.float32), cp.full(R, 50, np.int32), cp.full(R, 0.9, np.float32))
    seed, step = cp.arange(R, dtype=np.uint64), cp.zeros(R, np.int32)
    us = time_graph(lambda i: be.sample_device(logits[i], t, k, p, seed, step), n_rot)
    record(work, "sample k50 p.9", f"{R}x{V}", us, R * V * 4, 0)
    zero = cp.zeros(R, np.float32)
    us = time_graph(lambda i: be.sample_device(logits[i], zero, k, p, seed, step), n_rot)
    record(work, "sample greedy", f"{R}x{V}", us, R * V * 4, 0)


def decode(B):
    work = f"decode{B}"
    bench_embed(work, B)
    bench_layernorm(work, B)
    bench_matmul(work, "qkv", B, 3 * C, C)
    bench_cache_write(work, B)
    bench_attention(work, [(1, CTX)] * B)
    bench_matmul(work, "attn_proj+res", B, C, C, residual=True)
    bench_matmul(work, "fc+gelu", B, 4 * C, C, gelu=True)
    bench_matmul(work, "mlp_proj+res", B, C, 4 * C, residual=True)
    bench_matmul(work, "lm_head", B, V, C, bias=False)
    bench_sample(work, B)


def prefill(T=2048):
    work = f"prefill{T}"
    bench_embed(work, T)
    bench_layernorm(work, T)
    bench_matmul(work, "qkv", T, 3 * C, C)
    bench_cache_write(work, T)
    bench_attention(work, [(1024, 1024)] * (T // 1024))
    bench_matmul(work, "attn_proj+res", T, C, C, residual=True)
    bench_matmul(work, "fc+gelu", T, 4 * C, C, gelu=True)
    bench_matmul(work, "mlp_proj+res", T, C, 4 * C, residual=True)
    bench_matmul(work, "lm_head", T // 1024, V, C, bias=False)


if __name__ == "__main__":
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {dev}, {be.num_sms} SMs, cupy {cp.__version__}", flush=True)
    copy_gbs, cublas_tflops = ceilings()
    for B in (1, 64):
        decode(B)
    prefill()
    print(f"\n{'workload':11s} {'kernel':15s} {'shape':20s} {'us':>8s} {'GB/s':>6s} {'TFLOP/s':>7s} {'%copy':>5s} "
          f"{'%cuBLAS8k':>9s} {'cupy.mm':>8s} {'cuBLASg':>8s} {'%cuBLASg':>8s}  bound")
    for r in rows:
        ai = r["flops"] / max(r["bytes"], 1)  # FLOP per byte against the ridge of the two ceilings
        bound = "compute" if ai > cublas_tflops * 1e3 / copy_gbs else "memory"
        cb = f"{r['cupy_us']:8.2f} " if r["cupy_us"] else f"{'':9s}"
        cb += f"{r['cublas_us']:8.2f} {100 * r['cublas_us'] / r['us']:8.0f}" if r["cublas_us"] else f"{'':17s}"
        print(f"{r['work']:11s} {r['kernel']:15s} {r['shape']:20s} {r['us']:8.2f} {r['gbs']:6.0f} {r['tflops']:7.1f} "
              f"{100 * r['gbs'] / copy_gbs:5.0f} {100 * r['tflops'] / cublas_tflops:9.1f} {cb}  {bound}")
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, cuBLAS 8192^3 {cublas_tflops:.0f} TFLOP/s. cupy.mm: cupy.matmul at "
          f"the shape, eager (host-bound below ~15 us); cuBLASg: cuBLAS (torch F.linear) at the shape, graph-"
          f"replayed; %cuBLASg = its time / ours")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_kernels.json"), "w") as f:
            json.dump(dict(device=dev, copy_gbs=copy_gbs, cublas_tflops=cublas_tflops, rows=rows), f, indent=1)
