"""The kernels alone (bench.py's GPU stage): the ceilings (device copy bandwidth, cuBLAS), the matmul plans, a roofline
of every kernel of a decode step and of a prefill at the real shapes, and the kernel targets against their references.
Kernels are timed inside CUDA graphs, rotating through inputs larger than L2, so neither launches nor cache hits count.
"""
import numpy as np

from checkpoint import SIZES
from nanoinfer import Batch


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

    def ladder(self, ladder):
        """Every rung of the kernel ladder (ladder.py), work "ladder": matmul at a decode row of GPT-2 124M (QKV) and
        gpt2-xl (MLP up), and at a 1024-token prefill (MLP up); layernorm at a decode row and a prefill; attention at
        64 decode rows of 512 keys and at one causal 1024-token prompt."""
        C, H, self.ideas = self.C, self.H, {}
        for M, N, K in ((1, 3 * C, C), (1, 6400, 1600), (1024, 4 * C, C)):
            nbytes = (N * K + M * K + M * N) * 2
            n = self.n_rot(nbytes)
            xs, ws = [self.randn(M, K) for _ in range(min(n, 4))], [self.randn(N, K) / K ** 0.5 for _ in range(n)]
            one_row = [("wgmma 1 row", "the tensor-core tiles, for one row", ladder.wgmma_for_one_row)] * (M == 1)
            for name, idea, rung in ladder.matmul()[:-1] + one_row + ladder.matmul()[-1:]:
                self.ideas[f"matmul {name}"] = idea
                self.time_kernel("ladder", f"matmul {name}", f"{M}x{N}x{K}", nbytes, 2 * M * N * K,
                                 lambda i, rung=rung: rung(xs[i % len(xs)], ws[i]), n)
        for T in (1, 1024):
            n = self.n_rot(2 * T * C * 2, cap=256)
            xs, w = [self.randn(T, C) for _ in range(n)], self.randn(C)
            for name, idea, rung in ladder.layernorm():
                self.ideas[f"layernorm {name}"] = idea
                self.time_kernel("ladder", f"layernorm {name}", f"{T}x{C}", 2 * T * C * 2, 8 * T * C,
                                 lambda i, rung=rung: rung(xs[i], w, w, 1e-5), n)
        for S, n_q, ctx in ((64, 1, 512), (1, 1024, 1024)):
            T, nblk = S * n_q, -(-ctx // 16)
            n = self.n_rot(S * ctx * C * 4)
            caches = [(self.randn(S * nblk, 16, H, C // H), self.randn(S * nblk, 16, H, C // H)) for _ in range(n)]
            cu, lens = np.arange(S + 1, dtype=np.int32) * n_q, np.full(S, ctx, np.int32)
            tables = np.random.permutation(S * nblk).reshape(S, nblk).astype(np.int32)
            positions = np.tile(np.arange(ctx - n_q, ctx, dtype=np.int32), S)
            slots = tables[np.repeat(np.arange(S), n_q), positions // 16] * 16 + positions % 16
            batch = Batch(positions, positions, slots.astype(np.int32), cu, lens, tables, cu[1:] - 1)
            qkv = self.randn(T, 3 * C)
            q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(T, H, C // H) for j in range(3))
            pairs = S * int((ctx - n_q + np.arange(n_q) + 1).sum())  # (query, key) pairs
            nbytes = (S * ctx * 2 + 4 * T) * C * 2  # K and V read, q read, out and this step's k, v written
            for name, idea, rung in ladder.attention(batch):
                self.ideas[f"attention {name}"] = idea
                self.time_kernel("ladder", f"attention {name}", f"{S}seq q{n_q} ctx{ctx}", nbytes, 4 * C * pairs,
                                 lambda i, rung=rung: rung(q, k, v, *caches[i], 0.125), n)

    def sampler(self):
        """The sampler on random logits (sd 3) of batch 1 and 256: greedy, temperature alone, top-k 50 with top-p 0.95
        (the head's way), top-p 0.95 alone (on rows this flat the race over every token mostly stands), top-k 1000
        (the exact way: the row in shared memory)."""
        cp, be, V = self.cp, self.be, self.V
        for R in (1, 256):
            logits = [self.randn(R, V, dtype=np.float32) * 3 for _ in range(self.n_rot(R * V * 4, cap=8))]
            seed, token_index, min_p = cp.arange(R, dtype=np.uint64), cp.zeros(R, np.int32), cp.zeros(R, np.float32)
            for name, t, k, p in (("greedy", 0, 0, 1), ("T.8", 0.8, 0, 1), ("T.8 k50 p.95", 0.8, 50, 0.95),
                                  ("T.8 p.95", 0.8, 0, 0.95), ("T.8 k1000", 0.8, 1000, 1)):
                params = [cp.full(R, v, d) for v, d in ((t, np.float32), (k, np.int32), (p, np.float32))]

                def sample(i, params=params):
                    be.sample_device(logits[i], *params, seed, token_index, min_p)
                self.time_kernel(f"sample{R}", name, f"{R}x{V}", R * V * 4, 0, sample, len(logits))

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


def print_ladder(roof, copy_gbs, cublas):
    """The kernel ladder (ladder.py), fp16: each rung's time, its share of the ceiling that binds it, and what its
    idea bought over the rung before (x prev)."""
    from ladder import Ladder
    roof.ladder(Ladder(np.float16))
    print(f"\nthe kernel ladder, fp16 (x prev: the rung before's time over this one's)\n{'rung':20} {'shape':19} "
          f"{'us':>9} {'GB/s':>6} {'TFLOP/s':>7} {'share':>12} {'x prev':>6}  the idea")
    prev = None
    for r in (r for r in roof.rows if r["work"] == "ladder"):
        same = prev is not None and prev["shape"] == r["shape"] and prev["kernel"].split()[0] == r["kernel"].split()[0]
        share = f"{r['gbs'] / copy_gbs:5.0%} copy" if r["bound"] == "memory" else f"{r['tflops'] / cublas:5.0%} cuBLAS"
        speedup = f"{prev['us'] / r['us']:6.1f}" if same else f"{'':6}"
        print(f"{r['kernel']:20} {r['shape']:19} {r['us']:9.2f} {r['gbs']:6.0f} {r['tflops']:7.1f} {share:>12} "
              f"{speedup}  {roof.ideas[r['kernel']]}")
        prev = r


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
    print_ladder(roof, copy_gbs, cublas)
    print(f"{'workload':11} {'kernel':14} {'shape':19} {'us':>8} {'GB/s':>6} {'TFLOP/s':>7} {'%copy':>5} "
          f"{'%cuBLAS':>7}  bound")
    for r in (r for r in roof.rows if r["work"] != "ladder"):
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
