"""The kernel ladder from Python: every rung of matmul, layernorm and attention (kernels.cu, section L), then the
engine's own kernel, each a function of the engine's arrays. test_ladder.py holds every rung to numpy; bench.py times
them. The engine itself needs none of this file: LLM(kernels="simple") runs the first rungs through CudaBackend.
"""
import numpy as np

from cuda_backend import CudaBackend, cdiv, plan_matmul


class Ladder:
    """The rungs at one dtype: lists of (name, what the rung adds, function), simplest first."""

    def __init__(self, dtype):
        self.fast = CudaBackend(dtype)
        self.simple = CudaBackend(dtype)  # the engine's kernels="simple": first rungs, nothing fused
        self.simple.simple, self.simple.fused = True, False
        self.t = self.fast.t

    def _launch(self, name, grid, block, x, w):
        """A rung of signature (x, w, y, M, N, K): y = x @ w.T."""
        (M, K), N = x.shape, w.shape[0]
        y = self.fast.empty((M, N))
        self.fast.launch(name, grid, block, (x, w, y, np.int32(M), np.int32(N), np.int32(K)))
        return y

    def matmul(self):
        """y = x @ w.T, x (M, K), w (N, K), on each rung (mma: fp16 only, K a multiple of 16)."""
        be, t = self.fast, self.t

        def tiled(x, w):
            return self._launch(f"matmul_tiled<{t}>", (cdiv(w.shape[0], 32), cdiv(len(x), 32)), (32, 32), x, w)

        def blocked(x, w):
            (M, K), N = x.shape, w.shape[0]
            y = be.empty((M, N))
            be.launch(f"matmul_blocked<{t}>", (cdiv(N, 64), cdiv(M, 64)), (256,),
                      (x, w, 0, 0, 0, y, np.int32(M), np.int32(N), np.int32(K), np.int32(0)))
            return y

        def mma(x, w):
            return self._launch("matmul_mma", (cdiv(w.shape[0], 64), cdiv(len(x), 64)), (128,), x, w)

        rungs = [("naive", "a thread an output, straight from memory", self.simple.matmul),
                 ("tiled", "coalesced loads into shared-memory tiles", tiled),
                 ("blocked", "a 4 x 4 patch a thread (register blocking)", blocked)]
        if be.dtype == np.float16:
            rungs.append(("mma", "tensor cores (mma.sync)", mma))
        return rungs + [("engine", "wgmma tiles, the gemv for one row", be.matmul)]

    def wgmma_for_one_row(self, x, w):
        """matmul_tc as it runs 9 rows, given one: why a batch of one wants the gemv (bench's decode rows)."""
        N, K = w.shape
        plan = plan_matmul(9, N, K, False, self.fast.dtype, self.fast.num_sms)
        y = self.fast.empty((len(x), N))
        self.fast._matmul_launch(plan, plan.grid, x, w, 0, 0, None, y, False, False, None)
        return y

    def layernorm(self):
        """y = layernorm(x) * w + b, x (T, C), on each rung."""
        be = self.fast

        def warp(x, w, b, eps):
            y = be.empty(x.shape)
            be.launch(f"layernorm_warp<{self.t}>", (cdiv(len(x), 4),), (128,),
                      (x, w, b, y, np.int32(len(x)), np.int32(x.shape[1]), np.float32(eps)))
            return y

        return [("thread", "a thread a row", self.simple.layernorm),
                ("warp", "a warp a row, coalesced, sums by shuffles", warp),
                ("engine", "a block a row, 16-byte vectors in registers", be.layernorm)]

    def attention(self, batch):
        """Attention over the paged cache for one host Batch, on each rung: functions of (q, k, v, k_cache, v_cache,
        scale) that write this step's k and v into the cache first (cache_write), as the engine's step does."""
        simple, fast = self.simple, self.fast
        rows, planned = simple.to_device(batch), fast.to_device(batch)  # every query a row; the engine's plan

        def online(q, k, v, k_cache, v_cache, scale):
            fast.cache_write(k, v, k_cache, v_cache, rows.slot_mapping)
            q, qs = fast._heads(q)
            out = fast.empty(q.shape)
            fast.launch(f"attention_online<{self.t}>", (rows.n_rows, q.shape[1]), (128,),
                        (q, np.int32(qs), k_cache, v_cache, rows.block_tables, np.int32(rows.block_tables.shape[1]),
                         np.int32(k_cache.shape[1]), rows.row_q, rows.row_seq, rows.row_len, np.int32(q.shape[1]),
                         np.float32(scale), out))
            return out

        return [("naive", "three passes, every score kept", lambda *a: simple.attention(*a[:5], rows, a[5])),
                ("online", "one pass, online softmax, 16-byte loads", online),
                ("engine", "split context, cp.async, tensor-core prefill", lambda *a: fast.attention(*a[:5], planned,
                                                                                                   a[5]))]
