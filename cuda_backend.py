"""The CUDA backend: the op set as kernels, behind one door, imported only for device="cuda". A first reading can skip
it: nanoinfer.py's numpy op set defines what each op computes. It imports nothing from nanoinfer.py.

1. Compiling kernels.cu, and launching its kernels (in a CUDA graph, as dependent launches).
2. CudaBackend, the op set as kernels; plan_matmul and plan_attention pick a kernel, tile and split for each shape.
(graph_runner.py replays the engine's steps from CUDA graphs over this op set.)
"""
import ctypes
import functools
import math
import os
import re
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import cupy as cp  # the GPU's arrays (the file imports without CuPy: its plans are plain Python, tested on the CPU)
except ImportError:
    cp = None


def cdiv(a, b):
    return -(-a // b)


def find_gpu():
    """None if CuPy sees a Hopper GPU (the kernels use its wgmma and dependent launches), else why not."""
    try:
        import cupy
        cc = cupy.cuda.Device().attributes if cupy.cuda.runtime.getDeviceCount() else None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if cc is not None and cc.get("ComputeCapabilityMajor", 9) != 9:
        return (f"the GPU has compute capability {cc['ComputeCapabilityMajor']}.{cc.get('ComputeCapabilityMinor', 0)}; "
                "the kernels are Hopper's (9.0: H100, H200)")
    return None if cc is not None else "no GPU is visible"


# -----------------------------------------------------------------------------
# 1. compiling and launching kernels.cu

KERNELS_CU = Path(__file__).with_name("kernels.cu")
PLAIN = ["matmul_mma", "attention_prefill", "penalize", "sample_pass", "sample_pick", "decode_advance", "ngram_propose",
         "spec_accept", "draft_inputs"]  # the kernels that are no template
LADDER = ("matmul_naive", "matmul_tiled", "matmul_mma", "layernorm_thread", "layernorm_warp", "attention_naive",
          "attention_online")  # the ladder's rungs (kernels.cu, section L): launched plainly, never as dependents
GEMV_SMEM = 224 * 1024  # matmul_gemv keeps x in shared memory: K * 2 bytes at most
SAMPLE_WARP, SAMPLE_CAP, SUMMARY_BYTES = 512, 16, 24  # kernels.cu's sampler: a pass warp's logits, its candidates
SAMPLE_THREADS = 256  # the pick's block: its head holds 128 warps' candidates (16 KB), its exact way a row of logits
SAMPLE_MAX_V = (227 - 20) * 1024 // 4  # the row in the shared memory left (of the 227 KB a block may have on Hopper)
SAMPLE_ROWS = 1024  # rows sampled per launch: the scratch from the pass to the pick is sized for this many


def tc_smem(bm, bn, stages):
    return stages * (bm + bn) * 128 + 1024  # (BM + BN) rows of 128 bytes per stage, and room to align to 1024


def templates(src):
    """The template instantiations kernels.cu lists (its one list): 'matmul_tc<64,128,3>', 'embed<half>', ..."""
    return re.findall(r"INSTANTIATE\((\w+<[\w,]+>)\)", src)


@functools.cache
def compile_kernels():
    """Compile kernels.cu once per process (CuPy caches the binary on disk): ({name: cupy.RawKernel}, how it went)."""
    src = KERNELS_CU.read_text()
    names = templates(src)
    cache = Path(os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")).expanduser()
    cached, t0 = len(list(cache.glob("*"))) if cache.is_dir() else 0, time.perf_counter()
    try:
        mod = cp.RawModule(code=src, options=("-arch=sm_90a",), name_expressions=names)  # sm_90a: wgmma
        kernels = {name: mod.get_function(name) for name in names + PLAIN}
    except cp.cuda.compiler.CompileException as e:  # name the source lines, not NVRTC's temporary file
        messages, lines = e.get_message(), src.splitlines()
        where = [f"  kernels.cu:{n}: {lines[int(n) - 1].strip()}"
                 for n in dict.fromkeys(re.findall(r"\((\d+)\): error", messages)) if 0 < int(n) <= len(lines)]
        raise RuntimeError(f"{KERNELS_CU} failed to compile (NVRTC):\n" + "\n".join(where) +
                           "\n\nfull compiler log:\n" + messages.replace("kern.cu(", "kernels.cu(")) from None
    new = (len(list(cache.glob("*"))) if cache.is_dir() else 0) > cached
    how = "compiled by NVRTC (cached for next time)" if new else "loaded from CuPy's cache"
    for name, kernel in kernels.items():  # more than 48 KB of shared memory needs an opt-in per kernel
        if name.startswith("matmul_tc<"):
            kernel.max_dynamic_shared_size_bytes = tc_smem(*map(int, re.findall(r"\d+", name)))
        elif name.startswith("matmul_gemv<"):
            kernel.max_dynamic_shared_size_bytes = GEMV_SMEM
    kernels["sample_pick"].max_dynamic_shared_size_bytes = SAMPLE_MAX_V * 4
    return kernels, f"kernels.cu: {how} in {time.perf_counter() - t0:.1f} s"


class _LaunchAttribute(ctypes.Structure):  # cuda.h's CUlaunchAttribute: an id, then a 64-byte union at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # cuda.h's CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")  # the driver, loaded already by CuPy
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def launch_dependent(kernel, grid, block, args, shared_mem):
    """A programmatic dependent launch: the kernel may start (load its weights) while the one before still runs, and
    wait for its outputs at griddepcontrol.wait (kernels.cu). CuPy cannot ask for one: cuLaunchKernelEx via ctypes."""
    values = [ctypes.c_void_p(a.data.ptr) if isinstance(a, cp.ndarray) else  # an array: its pointer
              ctypes.create_string_buffer(a.tobytes(), a.nbytes) if isinstance(a, np.generic) else  # its bytes
              ctypes.c_int64(a) for a in args]  # a Python int (0: a null pointer) as a 64-bit integer
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = _LaunchAttribute(id=6, value=1)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: allowed
    dims = [tuple(d) + (1,) * (3 - len(d)) for d in (grid, block)]
    config = _LaunchConfig(dims[0], dims[1], shared_mem, cp.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
    err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(kernel.kernel.ptr), params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")

# -----------------------------------------------------------------------------
# 2. the op set as kernels, and the plans that pick a kernel for each shape

SPLITK_SCRATCH = 1 << 22  # floats of split-K partial sums (16 MB), enough for every GPT-2 decode shape
GEMV_SHORT = 8 << 20  # fp16 matrices up to this many bytes take the gemv's shorter rounds
SKINNY_MAX_M = 8  # decode batches up to this many rows stream the weights through matmul_skinny
SKINNY_BLOCKS_PER_SM = 6  # ... their K split until the SMs hold this many blocks each (more loads in flight)
LAYERNORM_BLOCKS_PER_SM = 16  # a layernorm's blocks (a row each) beyond this many an SM take further rows in turn
PREFILL_MIN_Q = 16  # fp16 sequences with this many queries in a step use the tensor-core prefill attention
INVARIANT_SPLITS = 16  # batch-invariant attention: a row of L keys always in min(16, L/32) splits, whatever the batch


@dataclass(frozen=True)
class MatmulPlan:
    kernel: str
    grid: tuple  # (x, y, z) blocks
    block: int  # threads per block
    shared_mem: int = 0  # bytes of dynamic shared memory
    splits: int = 1  # K split over this many blocks, the last to finish adding up the partial sums
    k_per_split: int = 0
    ln_fused: bool = False  # the layernorm in front runs in the kernel's prologue (else as a kernel of its own)
    rows_per_launch: int = 0  # M in launches of this many rows (0: one launch), each with its grid's rows
    rows_per_warp: int = 0  # matmul_gemv: rows of w a warp streams, as many for every warp
    dequantize: bool = False  # int8 weights made fp16 (or fp32) first, for a kernel that reads no int8


def split_k(blocks, per_sm, K, most, MN, num_sms):
    """(splits, k_per_split): when `blocks` leave SMs idle, K is split too, up to per_sm blocks per SM, in chunks
    of 64 and at most `most` ways (a split that leaves each block little of K costs more to add up than it saves)."""
    splits = 1
    if blocks < num_sms:
        splits = max(1, min(per_sm * num_sms // blocks, most, SPLITK_SCRATCH // MN))
    k_per_split = cdiv(cdiv(K, 64), splits) * 64
    return cdiv(K, k_per_split), k_per_split


def plan_matmul(M, N, K, ln, dtype, num_sms, invariant=False, int8=False, simple=False):
    """Kernel, tiles and split for y = epilogue(layernorm(x) @ w.T), x (M, K), w (N, K); ln: fuse the layernorm.
    Decode is memory-bound (stream w once, keep every SM busy); prefill compute-bound (big tiles, few rounds).
    invariant: one tile and one K split for every M (by N and K alone): a row's sums run in one order in any batch.
    int8: w is int8 (W8A16): the gemv and the skinny kernel read it as it is; the others get it dequantized first.
    simple: the ladder's first rung, a thread an output (kernels="simple")."""
    if simple:
        return MatmulPlan(f"matmul_naive<{'half' if np.dtype(dtype) == np.float16 else 'float'}>", (cdiv(N, 256), M, 1),
                          256, dequantize=int8)
    if np.dtype(dtype) == np.float32:  # the exact path: plain fp32 FMAs, 64 x 64 tiles
        return MatmulPlan("matmul_blocked<float>", (cdiv(N, 64), cdiv(M, 64), 1), 256, dequantize=int8)
    if invariant:  # decode's tile, and K split by N and K alone (as for a 64-row batch), M cut to fit the scratch
        most = cdiv(K, 64) if N % 4 == 0 else 1
        splits, k_per_split = split_k(cdiv(N, 32), 2, K, most, 64 * N, num_sms)
        rows = min(M, max(64, SPLITK_SCRATCH // (N * splits) // 64 * 64) if splits > 1 else M)
        return MatmulPlan("matmul_tc<64,32,8>", (cdiv(N, 32), cdiv(rows, 64), splits), 128, tc_smem(64, 32, 8),
                          splits, k_per_split, rows_per_launch=rows, dequantize=int8)
    weight = "i8" if int8 else "half"
    if M == 1 and K * 2 <= GEMV_SMEM and N <= 16384 and (not ln or K <= 2048):
        # one stream's decode: warps streaming rows of w, as many each, in at most 2 blocks an SM; the lm_head's 50257
        # rows stream as fast through the tensor cores. Rounds of R 16-byte loads a lane: 8 for gpt2-xl's long fp16
        # rows, 4 (3 rounds in flight) for int8's rows, half as long, and for matrices up to GEMV_SHORT bytes
        rows_per_warp = cdiv(N, 8 * 2 * num_sms)
        R = 4 if int8 or N * K * 2 <= GEMV_SHORT else 8
        return MatmulPlan(f"matmul_gemv<{weight},{R}>", (cdiv(cdiv(N, rows_per_warp), 8), 1, 1), 256, K * 2,
                          ln_fused=ln, rows_per_warp=rows_per_warp)
    if M <= SKINNY_MAX_M:  # small decode batches: 16 rows of w per block through the tensor cores, K split >= 16 ways
        splits, k_per_split = split_k(cdiv(N, 16), SKINNY_BLOCKS_PER_SM, K, cdiv(K, 64) // 16, M * N, num_sms)
        return MatmulPlan(f"matmul_skinny<{weight}>", (cdiv(N, 16), splits, 1), 128, 0, splits, k_per_split)
    # matmul_tc (wgmma). Prefill whose 128 x 128 tiles fill the SMs: 3 stages, two blocks per SM. Fewer tiles than SMs:
    # a block has its SM alone, so more stages; 128-row tiles while 64-row ones would fill the SMs. Decode batches of
    # 9-512 rows, whose 64 x 128 tiles would leave SMs idle: two blocks an SM, 64 x 32 tiles (8 stages) while they fit
    # (more blocks, fewer k-steps each), else 64 x 64 (6 stages, which always fit); K split, 12+ k-steps a part.
    gn, bn, per_sm = cdiv(N, 128), 128, 1
    if M > 64 and cdiv(M, 128) * gn >= num_sms:
        bm, stages = 128, 3
    elif cdiv(M, 64) * gn >= num_sms:
        bm, stages = (64, 3) if M <= 64 else (128, 4)
    else:
        bm, per_sm = 64, 2
        bn, stages = (32, 8) if cdiv(M, 64) * cdiv(N, 32) <= 2 * num_sms else (64, 6)
    most = cdiv(K, 64) // 12 if N % 4 == 0 else 1
    splits, k_per_split = split_k(cdiv(M, bm) * cdiv(N, bn), per_sm, K, most, M * N, num_sms)
    return MatmulPlan(f"matmul_tc<{bm},{bn},{stages}>", (cdiv(N, bn), cdiv(M, bm), splits), 2 * bm,
                      tc_smem(bm, bn, stages), splits, k_per_split, dequantize=int8)


def plan_attention(cu_seqlens_q, context_lens, min_q):
    """Split a step's queries between the attention kernels, in numpy (no per-token loops): a sequence with min_q or
    more queries (fp16 only: None on the fp32 path) is cut into 64-query tiles for attention_prefill, most keys first
    (so the longest tiles do not finish last); every other query is a row for attention_decode. {name: int array}."""
    cu, ctx = np.asarray(cu_seqlens_q, np.int64), np.asarray(context_lens, np.int64)
    n_q = np.diff(cu)
    tiled = n_q >= (min_q or np.inf)
    rs = np.nonzero(~tiled & (n_q > 0))[0]  # rows: every query of the untiled sequences
    counts = n_q[rs]
    row_seq = np.repeat(rs, counts)
    offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    row_len = ctx[row_seq] - n_q[row_seq] + offs + 1  # keys visible to this query
    ts = np.nonzero(tiled)[0]  # tiles
    ntile = cdiv(n_q[ts], 64)
    tile_seq = np.repeat(ts, ntile)
    tile_q0 = (np.arange(ntile.sum()) - np.repeat(np.cumsum(ntile) - ntile, ntile)) * 64
    order = np.argsort(-(ctx[tile_seq] - n_q[tile_seq] + tile_q0), kind="stable")
    return dict(row_q=cu[row_seq] + offs, row_seq=row_seq, row_len=row_len, tile_seq=tile_seq[order],
                tile_q0=tile_q0[order])


def prefill_splits(blocks, num_sms):
    """attention_prefill's key splits for `blocks` (query tile, head) pairs: enough for two blocks an SM, at most 8 (a
    split walks its tiles' keys alone; the merge reads every split's outputs again)."""
    return max(1, min(cdiv(2 * num_sms, blocks), 8))


def layout(fields):
    """Where each of `fields`, {name: (shape, dtype)}, lies in one int32 buffer: one after another, each at a 16-byte
    step, so that one copy moves them all. ({name: (start, shape, dtype)}, the buffer's length in int32s)."""
    where, start = {}, 0
    for name, (shape, dtype) in fields.items():
        where[name] = (start, tuple(shape), np.dtype(dtype))
        start += cdiv(math.prod(shape) * np.dtype(dtype).itemsize, 16) * 4
    return where, start


def views(buffer, where):
    """The named arrays of an int32 buffer (numpy or CuPy) laid out by layout()."""
    return {name: buffer[a:a + math.prod(shape) * dtype.itemsize // 4].view(dtype).reshape(shape)
            for name, (a, shape, dtype) in where.items()}


def batch_fields(batch, min_q):
    """The int32 arrays of a batch that the ops read, its attention plan (plan_attention) with them."""
    fields = {f: getattr(batch, f) for f in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q",
                                             "context_lens", "block_tables", "logits_idx")}
    fields.update(plan_attention(batch.cu_seqlens_q, batch.context_lens, min_q))
    return {f: np.asarray(a, np.int32) for f, a in fields.items() if a is not None}


def device_batch(**fields):
    """A Batch on the GPU with its attention plan: what every op of a step reads."""
    return types.SimpleNamespace(n_rows=len(fields["row_seq"]), n_tiles=len(fields["tile_seq"]), **fields)


class CudaBackend:
    """The numpy backend's ops as hand-written kernels on CuPy arrays. Kernels get bare pointers, so each op makes its
    inputs contiguous (q, k, v: see _heads) and passes scalars as np.int32 / np.float32 (a Python float is a double)."""
    name = "cuda"

    def __init__(self, dtype=np.float16):
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float16, np.float32):
            raise ValueError(f"CudaBackend: dtype must be float16 or float32, got {self.dtype}")
        self.kernels, self.loaded = compile_kernels()
        self.t = "half" if self.dtype == np.float16 else "float"
        self.vec = 16 // self.dtype.itemsize  # elements per 16-byte vector
        self.num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        # LLM's switches, set by nanoinfer.make_backend (EngineConfig says what each does)
        self.fused, self.dependent_launches, self.batch_invariant, self.simple = True, True, False, False
        self._dependent = False  # launching into a graph capture with dependent launches on
        self._gelu = cp.ElementwiseKernel("T x", "T y", "float v = x; y = 0.5f * v * (1.f + tanhf(0.7978845608f * "
                                          "(v + 0.044715f * v * v * v)))", "gelu_tanh")  # the unfused GELU
        # split-K scratch, allocated once: a CUDA graph keeps pointers, so nothing it uses may move later
        self._counters = cp.zeros(4096, np.int32)  # split-K and split-context arrival counters (self-resetting)
        self._partial = cp.empty(SPLITK_SCRATCH, np.float32)  # split-K partial sums
        self._sample_scratch = {}  # V: (chunk summaries, candidates) from the sampler's pass to its pick
        self._dequantized = [cp.empty(0, self.dtype)]  # int8 weights dequantized for matmul_tc (_dequantize)

    @property
    def tile_min_q(self):
        """The fewest queries of a sequence that go to attention_prefill's tiles; None: none do (fp32). Batch-invariant
        fp16 tiles every query, decode's too: a query's sums then run over the same 64-key tiles in any step (the
        keys a query does not see add exact zeros), as attention_decode's warps and splits would not."""
        if self.dtype == np.float32 or self.simple:
            return None
        return 1 if self.batch_invariant else PREFILL_MIN_Q

    def check_model(self, config):
        if config.head_dim != 64 or config.n_inner % 8 or config.vocab_size > SAMPLE_MAX_V:
            raise ValueError(f"the CUDA kernels are written for head_dim 64 (every GPT-2), an MLP width that is a "
                             f"multiple of 8 and at most {SAMPLE_MAX_V} tokens (the sampler keeps a row in shared "
                             f"memory); this model has {config.head_dim}, {config.n_inner} and {config.vocab_size}: "
                             "use device='cpu'")

    def launch(self, name, grid, block, args, shared_mem=0, dependent=True):
        """Launch `name` on the current stream: as a dependent launch while capture() has them on, else through CuPy."""
        if self._dependent and dependent and not name.startswith(LADDER):
            return launch_dependent(self.kernels[name], grid, block, args, shared_mem)
        self.kernels[name](grid, block, args, shared_mem=shared_mem)

    def capture(self, stream, record):
        """The kernels record() launches on `stream`, captured as a CUDA graph."""
        stream.begin_capture()
        self._dependent = self.dependent_launches
        try:
            record()
        finally:
            self._dependent = False
            graph = stream.end_capture()
        return graph

    # ---- arrays -------------------------------------------------------------------------------
    def asarray(self, a, dtype=None):  # floating arrays take the backend's dtype, as in NumpyBackend
        a = cp.asarray(a)
        return cp.ascontiguousarray(a, dtype=dtype or (self.dtype if a.dtype.kind == "f" else a.dtype))

    def tohost(self, a):
        return cp.asnumpy(a)

    def empty(self, shape, dtype=None):  # every op allocates its output here (tests poison it)
        return cp.empty(shape, dtype=self.dtype if dtype is None else dtype)

    def zeros(self, shape, dtype=None):
        return cp.zeros(shape, dtype=self.dtype if dtype is None else dtype)

    def kv_cache_budget(self, fraction):
        """Bytes for the KV cache: the GPU's memory up to `fraction` of it, less what is in use (the weights, other
        processes) and 1 GiB for activations, logits and CUDA graphs."""
        cp.get_default_memory_pool().free_all_blocks()  # blocks CuPy caches for reuse count as free here
        free, total = cp.cuda.runtime.memGetInfo()
        return total * fraction - (total - free) - 2 ** 30

    # ---- tensor parallelism: NCCL (parallel.py runs a process a GPU) ----------------------------
    @property
    def num_gpus(self):
        return cp.cuda.runtime.getDeviceCount()

    def new_comm_id(self):
        """Rank 0's: the id every rank makes its communicator with."""
        from cupy.cuda import nccl
        return nccl.get_unique_id()

    def communicator(self, comm_id, rank, size):
        return NcclComm(comm_id, rank, size)

    def _contiguous(self, a, dtype=None):
        """a as a C-contiguous, 16-byte-aligned array of `dtype` (default: ours), untouched if it is one already."""
        dtype = self.dtype if dtype is None else dtype
        if type(a) is not cp.ndarray or a.dtype != dtype:
            a = cp.asarray(a, dtype=dtype)
        return a if a.flags.c_contiguous and a.data.ptr % 16 == 0 else a.copy()

    def _heads(self, a):
        """(a, its token stride) for a (T, H, D) array, copied unless each token's heads are contiguous (qkv views)."""
        a = cp.asarray(a, dtype=self.dtype)
        D, isz = a.shape[2], a.itemsize
        if a.strides[1:] != (D * isz, isz) or a.strides[0] % 16 or a.data.ptr % 16:
            a = a.copy()
        return a, a.strides[0] // isz

    def to_device(self, batch):
        """The batch's int32 arrays and attention plan on the GPU in one copy (a copy each costs more host time)."""
        fields = batch_fields(batch, self.tile_min_q)
        where, size = layout({f: (a.shape, np.int32) for f, a in fields.items()})
        host = np.zeros(size, np.int32)
        for f, view in views(host, where).items():
            view[...] = fields[f]
        max_row_len = int(fields["row_len"].max(initial=0))
        return device_batch(**{"logits_idx": None, **views(cp.asarray(host), where)}, max_row_len=max_row_len)

    # ---- ops ----------------------------------------------------------------------------------
    def embed(self, wte, wpe, input_ids, positions):
        ids, pos = self._contiguous(input_ids, np.int32), self._contiguous(positions, np.int32)
        C = wte.shape[1]
        assert C % self.vec == 0, f"embed: C={C} must be a multiple of {self.vec}"
        out = self.empty((ids.shape[0], C))
        if ids.shape[0]:
            self.launch(f"embed<{self.t}>", (ids.shape[0],), (128,),
                        (self._contiguous(wte), self._contiguous(wpe), ids, pos, out, np.int32(C)))
        return out

    def layernorm(self, x, w, b, eps):
        x = self._contiguous(x)
        T, C = x.shape
        assert C % self.vec == 0 and C <= 2048, f"layernorm: C={C} must be a multiple of {self.vec} and <= 2048"
        y = self.empty((T, C))
        if T:
            args = (x, self._contiguous(w), self._contiguous(b), y, np.int32(T), np.int32(C), np.float32(eps))
            if self.simple:
                self.launch(f"layernorm_thread<{self.t}>", (cdiv(T, 128),), (128,), args)
            else:
                threads = cdiv(C // self.vec, 32) * 32  # a 16-byte vector a thread, whole warps
                self.launch(f"layernorm<{self.t}>", (min(T, LAYERNORM_BLOCKS_PER_SM * self.num_sms),), (threads,), args)
        return y

    def matmul(self, x, w, bias=None, gelu=False, residual=None, ln=None, out_dtype=None):
        q, scale = (w.q, w.scale) if hasattr(w, "scale") else (w, None)  # an Int8Weight: int8 rows, a scale each
        M, K = x.shape
        N = q.shape[0]
        plan = plan_matmul(M, N, K, ln is not None and self.fused, self.dtype, self.num_sms, self.batch_invariant,
                           int8=scale is not None, simple=self.simple)
        if ln is not None and not plan.ln_fused:  # the layernorm as a kernel of its own
            x, ln = self.layernorm(x, *ln), None
        if not self.fused and (bias is not None or gelu or residual is not None):
            y = self.matmul(x, w)  # what fusion saves, to measure it: each epilogue step one more pass over y
            y = y if bias is None else y + bias
            y = self._gelu(y) if gelu else y
            y = y if residual is None else y + residual
            return y if out_dtype is None else y.astype(out_dtype)
        x, q = self._contiguous(x), self._contiguous(q, None if scale is None else np.int8)
        if q.shape[1] != K:
            raise ValueError(f"matmul: x is (M, K) = {x.shape} but w is {q.shape}, expected (N, {K})")
        if self.dtype == np.float16 and K % (8 if scale is None else 16):
            raise ValueError(f"matmul: K={K} must be a multiple of {8 if scale is None else 16} (rows are read as "
                             "16-byte vectors)")
        f32 = self.dtype == np.float32 or np.dtype(out_dtype or self.dtype) == np.float32  # logits: the accumulator
        y = self.empty((M, N), np.float32 if f32 else self.dtype)
        if M == 0 or N == 0:
            return y
        if plan.dequantize:
            q = self._dequantize(q)
        scale = 0 if scale is None else self._contiguous(scale, np.float32)
        bias = 0 if bias is None else self._contiguous(bias)
        residual = None if residual is None else self._contiguous(residual)
        rows = plan.rows_per_launch or M  # batch-invariant plans: launches whose split-K partial sums fit the scratch
        for r in range(0, M, rows):
            m = min(rows, M - r)
            grid = (plan.grid[0], cdiv(m, 64), plan.grid[2]) if plan.rows_per_launch else plan.grid  # 64-row tiles
            self._matmul_launch(plan, grid, x[r:r + m], q, scale, bias, None if residual is None else residual[r:r + m],
                                y[r:r + m], gelu, f32, ln)
        return y if out_dtype is None else y.astype(out_dtype, copy=False)

    def _matmul_launch(self, plan, grid, x, w, scale, bias, residual, y, gelu, f32, ln):
        """One launch of plan's kernel over these rows of x, y (and residual) on this grid."""
        M, K = x.shape
        head = (x, w, scale, bias, 0 if residual is None else residual, y)
        tail = (np.int32(len(w)), np.int32(K), np.int32(bool(gelu)))
        if plan.kernel.startswith("matmul_gemv"):
            ln_w, ln_b, eps = (0, 0, 0.0) if ln is None else (self._contiguous(ln[0]), self._contiguous(ln[1]), ln[2])
            args = head + tail + (np.int32(f32), ln_w, ln_b, np.float32(eps), np.int32(plan.rows_per_warp))
        elif plan.kernel.startswith("matmul_blocked"):
            args = head + (np.int32(M),) + tail
        elif plan.kernel.startswith("matmul_naive"):
            args = head + (np.int32(M),) + tail + (np.int32(f32),)
        else:
            args = head + (np.int32(M),) + tail + (np.int32(f32), np.int32(plan.k_per_split), self._partial,
                                                   self._counters)
        # after a dequantize, not a dependent launch: the kernel would load its weights before they are written
        self.launch(plan.kernel, grid, (plan.block,), args, shared_mem=plan.shared_mem, dependent=not plan.dequantize)

    def _dequantize(self, q):
        """int8 weights as our dtype, unscaled (the matmul's epilogue scales), in a scratch grown to the largest so far
        and never freed (a CUDA graph may hold the pointer of an outgrown one). Not a dependent launch: the matmul
        before it may still be reading the scratch."""
        if self._dequantized[-1].size < q.size:
            self._dequantized.append(cp.empty(q.size, self.dtype))
        out = self._dequantized[-1][:q.size].reshape(q.shape)
        self.launch(f"dequantize<{self.t}>", (min(cdiv(q.size, 8 * 256), 4 * self.num_sms),), (256,),
                    (q, out, np.int64(q.size)), dependent=False)
        return out

    def cache_write(self, k, v, k_cache, v_cache, slot_mapping):
        (k, ks), (v, vs) = self._heads(k), self._heads(v)
        T, H, D = k.shape
        if T:
            self.launch(f"cache_write<{self.t}>", (T,), (128,),
                        (k, v, np.int32(ks), np.int32(vs), k_cache, v_cache, self._contiguous(slot_mapping, np.int32),
                         np.int32(H * D)))

    def attention(self, q, k, v, k_cache, v_cache, batch, scale):
        T, H, D = q.shape
        if D != 64:
            raise NotImplementedError(f"attention: the kernels are written for head_dim 64 (every GPT-2), got {D}")
        # rows only (decode, verification chunks): attention_decode writes this step's K and V, reading them from qkv;
        # with tiles (attention_prefill reads every key from the cache) cache_write first
        new_kv = (0, 0, np.int32(0), 0)
        if self.fused and batch.n_tiles == 0:
            (k, ks), (v, vs) = self._heads(k), self._heads(v)
            assert ks == vs, "attention: k and v must share a token stride (views into one qkv array)"
            new_kv = (k, v, np.int32(ks), batch.slot_mapping)
        else:
            self.cache_write(k, v, k_cache, v_cache, batch.slot_mapping)
        q, qs = self._heads(q)
        out = self.empty((T, H, D))
        common = (batch.block_tables, np.int32(batch.block_tables.shape[1]), np.int32(k_cache.shape[1]))
        if self.simple:  # the ladder's first rung: every query a row, its scores in shared memory (up to every key)
            if batch.n_rows:
                self.launch(f"attention_naive<{self.t}>", (batch.n_rows, H), (128,),
                            (q, np.int32(qs), k_cache, v_cache) + common + (batch.row_q, batch.row_seq, batch.row_len,
                                                                            np.int32(H), np.float32(scale), out),
                            shared_mem=batch.block_tables.shape[1] * k_cache.shape[1] * 4)
            return out
        scale_log2 = np.float32(scale * math.log2(math.e))
        if batch.n_tiles:  # each tile's keys in nsplit splits when few tiles would leave SMs idle (not batch-invariant)
            nsplit = prefill_splits(batch.n_tiles * H, self.num_sms) if not self.batch_invariant else 1
            part_o = cp.empty(batch.n_tiles * 64 * H * nsplit * 64 if nsplit > 1 else 0, np.float32)
            part_lse = cp.empty(batch.n_tiles * 64 * H * nsplit if nsplit > 1 else 0, np.float32)
            self.launch("attention_prefill", (batch.n_tiles, H, nsplit), (256,),
                        (q, np.int32(qs), k_cache, v_cache) + common + (batch.cu_seqlens_q, batch.context_lens,
                                                                        batch.tile_seq, batch.tile_q0, np.int32(H),
                                                                        scale_log2, out, part_o, part_lse,
                                                                        self._counters))
        if batch.n_rows:  # flash-decoding: ~4 blocks per SM, >= 32 keys and <= 32 splits (the merge keeps their LSEs);
            # batch-invariant (fp32): a fixed count, so a row's splits follow its own length alone
            nsplit = INVARIANT_SPLITS if self.batch_invariant else \
                max(1, min(cdiv(4 * self.num_sms, batch.n_rows * H), cdiv(batch.max_row_len, 32), 32))
            # split rows: launches of as many as the arrival counters count at once (batch-invariant prefill has more)
            per_launch = self._counters.size // H if nsplit > 1 else batch.n_rows
            for r in range(0, batch.n_rows, per_launch):
                rows, n = slice(r, r + per_launch), min(per_launch, batch.n_rows - r)
                part_o = cp.empty(n * H * nsplit * 64 if nsplit > 1 else 0, np.float32)  # each split's outputs
                part_lse = cp.empty(n * H * nsplit if nsplit > 1 else 0, np.float32)  # and log-sum-exps, merged
                self.launch(f"attention_decode<{self.t}>", (n, H, nsplit), (128,), (
                    q, np.int32(qs), *new_kv, k_cache, v_cache, batch.cu_seqlens_q, *common, batch.row_q[rows],
                    batch.row_seq[rows], batch.row_len[rows], np.int32(H), scale_log2, out, part_o, part_lse,
                    self._counters))
        return out

    def penalize(self, logits, e):
        """NumpyBackend.penalize, in place on the (R, V) fp32 logits."""
        logits, E = self._contiguous(logits, np.float32), len(e.ids)
        if E:
            self.launch("penalize", (-(-E // 256),), (256,), (logits, np.int32(logits.shape[1]), *(
                cp.asarray(a) for a in (e.rows, e.ids, e.output_counts, e.banned)), np.int32(E), *(
                cp.asarray(a) for a in (e.repetition, e.presence, e.frequency, e.bias))))
        return logits

    def sample_device(self, logits, temperature, top_k, top_p, seed, token_index, min_p):
        """sample() without the copy back: the (R,) int32 token ids on the GPU. A warp per 512 logits of a row hands on
        its summary and candidates (sample_pass), then a block a row picks (sample_pick): kernels.cu, section 11."""
        logits = self._contiguous(logits, np.float32)
        R, V = logits.shape
        if V > SAMPLE_MAX_V:
            raise ValueError(f"the sampler keeps a row in shared memory: at most {SAMPLE_MAX_V} logits, not {V}")
        W = cdiv(V, SAMPLE_WARP)  # pass warps a row
        if V not in self._sample_scratch:  # kept for good: captured graphs hold its pointers
            self._sample_scratch[V] = (cp.empty((SAMPLE_ROWS, W, SUMMARY_BYTES), np.uint8),  # kernels.cu's WarpSummary
                                       cp.empty((SAMPLE_ROWS, W, SAMPLE_CAP), np.uint64))
        params = [self._contiguous(a, t) for a, t in ((temperature, np.float32), (top_k, np.int32),
                                                      (top_p, np.float32), (min_p, np.float32), (seed, np.uint64),
                                                      (token_index, np.int32))]
        tokens = self.empty((R,), np.int32)
        for r in range(0, R, SAMPLE_ROWS):
            n, rows = min(SAMPLE_ROWS, R - r), slice(r, r + SAMPLE_ROWS)
            args = (logits[rows], np.int32(V), np.int32(W), *(a[rows] for a in params), *self._sample_scratch[V])
            self.launch("sample_pass", (cdiv(W, 8), n), (256,), args)
            self.launch("sample_pick", (n,), (SAMPLE_THREADS,), args + (tokens[rows],), shared_mem=V * 4)
        return tokens

    def sample(self, logits, temperature, top_k, top_p, seed, token_index, min_p):
        return cp.asnumpy(self.sample_device(logits, temperature, top_k, top_p, seed, token_index,
                                             min_p)).astype(np.int64)


class NcclComm:
    """This GPU's rank among `size` (parallel.py): NCCL's collectives on the current stream, so that a CUDA graph
    captures them between the kernels around them. An all-reduce moves 2 (size - 1) / size of the array's bytes in and
    out of each GPU over NVLink (a ring); a decode step's rows (gpt2-xl: 3.2 KB) cost its latency, not bytes."""
    def __init__(self, comm_id, rank, size):
        from cupy.cuda import nccl
        self.nccl, self.rank, self.size = nccl, rank, size
        self.comm = nccl.NcclCommunicator(size, comm_id, rank)  # waits for every rank to make its own
        self.types = {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32}

    def all_reduce(self, x):
        """x summed over the ranks, in place; every rank gets the same bits (each element is summed by one rank)."""
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self.types[x.dtype], self.nccl.NCCL_SUM,
                            cp.cuda.get_current_stream().ptr)
        return x

    def all_gather(self, x, n):
        """Each rank's (R, part) side by side: (R, n). NCCL gathers equal parts, so the last (shorter) is padded."""
        R, width = x.shape[0], -(-n // self.size)
        part = x  # (R, width)
        if x.shape[1] < width:  # the vocabulary's last part
            part = cp.zeros((R, width), x.dtype)
            part[:, :x.shape[1]] = x
        out = cp.empty((self.size, R, width), x.dtype)  # (size, R, width): rank r's part at out[r]
        self.comm.allGather(part.data.ptr, out.data.ptr, part.size, self.types[x.dtype],
                            cp.cuda.get_current_stream().ptr)
        return cp.ascontiguousarray(out.transpose(1, 0, 2).reshape(R, self.size * width)[:, :n])

    def abort(self):
        """Ends the communicator: collectives waiting for a lost rank return (their results are not to be used)."""
        self.comm.abort()
