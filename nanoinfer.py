"""
nanoinfer: GPT-2 inference, fast, in a few files.

Read top to bottom: weights and tokenizer, the numpy backend (the readable definition of every op),
the CUDA backend (the same ops as hand-written kernels from kernels.cu), the GPT-2 forward over one flat
batch of tokens, the sampler, and the LLM engine that ties them to the paged KV cache (paged_kv.py) and
the continuous-batching scheduler (scheduler.py).
"""
import ctypes
import functools
import itertools
import json
import math
import re
import sys
import types
import time
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paged_kv import PagedKVCache
from scheduler import Scheduler, Sequence

# -----------------------------------------------------------------------------
# config and weights

HF_REPOS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}
MODEL_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    n_ctx: int
    vocab_size: int
    eps: float = 1e-5

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


def resolve_model(model):
    """A local directory as it is, or a GPT-2 name fetched through the Hugging Face cache (downloaded once)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model not in HF_REPOS:
        raise FileNotFoundError(f"--model {model!r} is neither a directory nor one of {', '.join(HF_REPOS)}: "
                                "pass a GPT-2 name or a directory holding " + ", ".join(MODEL_FILES))
    from huggingface_hub import hf_hub_download
    try:  # the cached copy first, with no network round trip; else download, with a progress bar
        files = [hf_hub_download(HF_REPOS[model], name, local_files_only=True) for name in MODEL_FILES]
    except Exception:
        files = None
    try:
        files = files or [hf_hub_download(HF_REPOS[model], name) for name in MODEL_FILES]
    except Exception as e:
        raise RuntimeError(
            f"could not download {model} ({HF_REPOS[model]}) from the Hugging Face Hub, and no cached copy is there "
            f"({type(e).__name__}: {e}). Connect to the network once (the files are cached for later), or pass "
            "--model PATH to a local directory holding " + ", ".join(MODEL_FILES)) from None
    return Path(files[0]).parent


def _need(path, name):
    f = path / name
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: a GPT-2 model directory holds " + ", ".join(MODEL_FILES))
    return f


def load_config(path):
    f = _need(path, "config.json")
    try:
        cfg = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f} is not valid JSON ({e})") from None
    if cfg.get("model_type") != "gpt2":
        raise ValueError(f"{f} says model_type={cfg.get('model_type')!r}: nanoinfer runs GPT-2 models only")
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{f}: activation_function={cfg['activation_function']!r}; nanoinfer implements GPT-2's tanh GELU")
    return GPTConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"],
                     n_ctx=cfg.get("n_positions", cfg.get("n_ctx", 1024)), vocab_size=cfg["vocab_size"],
                     eps=cfg.get("layer_norm_epsilon", 1e-5))


def expected_shapes(c):
    """Every tensor of a GPT-2 checkpoint, in Hugging Face's names and layout (Conv1D weights are (in, out))."""
    C = c.n_embd
    shapes = {"wte.weight": (c.vocab_size, C), "wpe.weight": (c.n_ctx, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(c.n_layer):
        shapes.update({f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
                       f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
                       f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
                       f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
                       f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
                       f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,)})
    return shapes


def load_weights(path, config):
    """numpy float32 weights, every matmul weight transposed once to (out, in): y = x @ w.T everywhere."""
    from safetensors import safe_open
    f = _need(path, "model.safetensors")
    try:
        with safe_open(f, framework="np") as st:
            # save_pretrained of GPT2LMHeadModel prefixes "transformer."; the Hub's files do not
            tensors = {k.removeprefix("transformer."): st.get_tensor(k) for k in st.keys()}
    except Exception as e:
        raise ValueError(f"{f} cannot be read as safetensors ({e}): the file is truncated or corrupt; "
                         "delete it and download or save it again") from None
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise ValueError(f"{f} has no tensor {name!r}: is this a GPT-2 checkpoint matching its config.json?")
        if tensors[name].shape != shape:
            raise ValueError(f"{f}: tensor {name!r} has shape {tensors[name].shape}, config.json implies {shape}")
        w = tensors[name].astype(np.float32)
        is_conv1d = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        weights[name] = np.ascontiguousarray(w.T) if is_conv1d else w
    return weights

# -----------------------------------------------------------------------------
# tokenizer: tiktoken's fast BPE, built from the model directory's own vocab.json + merges.txt

GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode():
    """GPT-2's files spell every byte as a printable character; this is that map."""
    n, mapping = 0, {}
    for b in range(256):
        if ord("!") <= b <= ord("~") or ord("¡") <= b <= ord("¬") or ord("®") <= b <= ord("ÿ"):  # printable as is
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


class Tokenizer:
    def __init__(self, path):
        import tiktoken
        vocab_file, merges_file = _need(path, "vocab.json"), _need(path, "merges.txt")
        vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
        byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
        self.eot_token = vocab.pop("<|endoftext|>")
        # GPT-2's token ids are its merge ranks, which is exactly what tiktoken wants
        ranks = {bytes(byte_of[ch] for ch in tok): i for tok, i in vocab.items()}
        merges = [l for l in merges_file.read_text(encoding="utf-8").split("\n")[1:] if l]
        if len(merges) != len(ranks) - 256:
            raise ValueError(f"{merges_file} has {len(merges)} merges but {vocab_file} implies {len(ranks) - 256}: "
                             "the two files do not belong together")
        self.enc = tiktoken.Encoding("gpt2-local", pat_str=GPT2_SPLIT, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eot_token})

    def encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        return self.enc.decode(ids)

    def token_bytes(self, token):
        return self.enc.decode_single_token_bytes(token)

# -----------------------------------------------------------------------------
# the numpy backend: the readable definition of every op, the reference in tests, and a CPU engine


def gelu_tanh(x):
    """GPT-2's GELU, the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def uniform(seed, step):
    """A counter-based random number in [0, 1) per (seed, step): splitmix64, the same bits on CPU and GPU.
    A request's samples depend only on its own seed and token index, never on what else is in the batch."""
    seed, step = np.asarray(seed, np.uint64), np.asarray(step, np.uint64)
    z = seed + (step + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def sample_row(logits, temperature, top_k, top_p, u):
    """One token from one row of logits: temperature, then top-k, then top-p, by thresholds on p."""
    if temperature == 0:
        return int(np.argmax(logits))
    p = np.exp((logits - logits.max()) / np.float32(temperature))  # unnormalized; the largest is 1
    if 0 < top_k < len(p):
        p[p < np.partition(p, -top_k)[-top_k]] = 0  # keep the k largest (and any ties with the k-th)
    if top_p < 1:
        desc = np.sort(p)[::-1]
        mass = np.cumsum(desc)
        p[p < desc[np.searchsorted(mass, np.float32(top_p) * mass[-1])]] = 0  # smallest head holding top_p
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.flatnonzero(p)[-1]))


class NumpyBackend:
    """Every op of the forward pass, in numpy: short enough to read as the definition of what the kernels do."""
    name = "cpu"

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)

    def asarray(self, a, dtype=None):  # floating arrays take the backend's dtype; integers stay integers
        a = np.asarray(a)
        return np.ascontiguousarray(a, dtype=dtype or (self.dtype if a.dtype.kind == "f" else a.dtype))

    def tohost(self, a):
        return a

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype or self.dtype)

    def to_device(self, batch):
        return batch

    def embed(self, wte, wpe, input_ids, positions):
        return wte[input_ids] + wpe[positions]  # (T, C)

    def layernorm(self, x, w, b, eps):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * w + b

    def matmul(self, x, w, bias=None, gelu=False, residual=None, ln=None, out_dtype=None):
        """epilogue(layernorm(x) @ w.T): ln = (weight, bias, eps) of the layernorm in front, if any; the
        epilogue adds the bias, applies GELU, adds the residual, in that order."""
        if ln is not None:
            x = self.layernorm(x, *ln)
        y = x @ w.T  # (M, K) @ (K, N) -> (M, N)
        if bias is not None:
            y += bias
        if gelu:
            y = gelu_tanh(y)
        if residual is not None:
            y += residual
        return y.astype(out_dtype or y.dtype, copy=False)

    def cache_write(self, k, v, k_cache, v_cache, slot_mapping):
        H, D = k.shape[1:]
        k_cache.reshape(-1, H, D)[slot_mapping] = k  # a slot is one token's K for all heads
        v_cache.reshape(-1, H, D)[slot_mapping] = v

    def attention(self, q, k, v, k_cache, v_cache, batch, scale):
        """Causal attention of each sequence's queries over its cached keys, after this step's k and v
        went into the cache (so a query sees its own token too)."""
        self.cache_write(k, v, k_cache, v_cache, batch.slot_mapping)
        out = np.empty_like(q)  # (T, H, D)
        _, block_size, H, D = k_cache.shape
        for s, n_ctx in enumerate(batch.context_lens):
            q0, q1 = batch.cu_seqlens_q[s], batch.cu_seqlens_q[s + 1]
            blocks = batch.block_tables[s, :-(-n_ctx // block_size)]
            k = k_cache[blocks].reshape(-1, H, D)[:n_ctx].transpose(1, 2, 0)  # (H, D, L) gathered by block table
            v = v_cache[blocks].reshape(-1, H, D)[:n_ctx].transpose(1, 0, 2)  # (H, L, D)
            att = (q[q0:q1].transpose(1, 0, 2) @ k) * scale  # (H, n_q, L)
            q_pos = np.arange(n_ctx - (q1 - q0), n_ctx)  # the queries are the last n_q tokens
            att = np.where(np.arange(n_ctx) <= q_pos[:, None], att, -np.inf)  # causal
            att = np.exp(att - att.max(-1, keepdims=True))
            out[q0:q1] = ((att / att.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2)  # (n_q, H, D)
        return out

    def sample(self, logits, temperature, top_k, top_p, seed, step):
        u = uniform(seed, step)  # float64 below: the running sum over 50257 probabilities stays exact
        return np.array([sample_row(logits[r].astype(np.float64), temperature[r], top_k[r], top_p[r], u[r])
                         for r in range(len(logits))], dtype=np.int64)


def make_backend(device, dtype):
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'")
    if device != "cpu":
        try:
            import cupy
            gpu = cupy.cuda.runtime.getDeviceCount() > 0
            cc = cupy.cuda.Device().attributes if gpu else {}
        except Exception as e:
            gpu, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "no GPU is visible"
            if gpu and cc.get("ComputeCapabilityMajor", 9) != 9:  # kernels.cu uses Hopper's wgmma
                gpu, why = False, (f"the GPU has compute capability {cc['ComputeCapabilityMajor']}."
                                   f"{cc.get('ComputeCapabilityMinor', 0)}; the kernels are Hopper's (9.0: H100, H200)")
        if gpu:
            return CudaBackend(np.dtype(dtype or np.float16))
        if device == "cuda":
            raise RuntimeError(f"device='cuda' needs CuPy and an NVIDIA Hopper GPU ({why}): "
                               "pip install cupy-cuda13x on an H100 or H200, or use device='cpu'")
        print(f"nanoinfer: no usable GPU ({why}); running on the CPU with numpy", file=sys.stderr)
    if dtype is not None and np.dtype(dtype) != np.float32:
        raise ValueError(f"dtype={np.dtype(dtype).name} on the CPU: numpy has no fast half-precision matmul; use float32")
    return NumpyBackend(np.float32)

# -----------------------------------------------------------------------------
# the CUDA backend: the same ops as hand-written kernels (kernels.cu), launched through CuPy

cp = None  # cupy, imported when a CudaBackend is made
KERNELS_CU = Path(__file__).with_name("kernels.cu")
# matmul_tc<BM, BN, stages>
TC_SHAPES = ((128, 128, 3), (128, 144, 3), (128, 128, 4), (64, 128, 3), (64, 128, 8), (64, 32, 8))
TEMPLATES = ([f"matmul_tc<{bm},{bn},{s}>" for bm, bn, s in TC_SHAPES] + ["matmul_gemv<1,4>", "matmul_gemv<1,8>"] +
             [f"{k}<{t}>" for t in ("float", "half") for k in ("layernorm", "embed", "cache_write", "attention_rows")])
PLAIN = ["matmul_f32", "matmul_skinny", "attention_prefill", "sample_tokens", "decode_advance", "take_rows"]
SPLITK_SCRATCH = 1 << 22  # floats of split-K partial sums (16 MB), enough for every GPT-2 decode shape
GEMV_LIGHT = 8 << 20  # single-stream matrices up to this many bytes take matmul_gemv<1,4> (4 blocks per SM)
GEMV_SMEM = 224 * 1024  # matmul_gemv keeps x in shared memory: K * 2 bytes at most
SKINNY_MAX_M = 8      # decode batches up to this many rows stream the weights through matmul_skinny
PREFILL_MIN_Q = 16    # fp16 sequences with this many queries in a step use the tensor-core attention
SAMPLE_SMEM = 200 * 1024 + 4 * 1024  # sample_tokens caches a row's p in shared memory up to V = 52224
_kernels = None       # compiled once per process (and cached on disk by CuPy across processes)


def compile_kernels():
    """Compile kernels.cu once; return {name: cupy.RawKernel}. A compile error names the source lines."""
    global _kernels
    if _kernels is None:
        src = KERNELS_CU.read_text()
        try:
            # sm_90a: Hopper's wgmma (matmul_tc); CuPy adds --std=c++17
            mod = cp.RawModule(code=src, options=("-arch=sm_90a",), name_expressions=TEMPLATES)
            kernels = {name: mod.get_function(name) for name in TEMPLATES + PLAIN}
        except cp.cuda.compiler.CompileException as e:
            log, lines = e.get_message(), src.splitlines()
            where = [f"  kernels.cu:{n}: {lines[int(n) - 1].strip()}"
                     for n in dict.fromkeys(re.findall(r"\((\d+)\): error", log)) if 0 < int(n) <= len(lines)]
            raise RuntimeError(f"{KERNELS_CU} failed to compile (NVRTC):\n" + "\n".join(where) +
                               "\n\nfull compiler log:\n" + log.replace("kern.cu(", "kernels.cu(")) from None
        for bm, bn, stages in TC_SHAPES:  # its pipeline needs > 48 KB of shared memory
            kernels[f"matmul_tc<{bm},{bn},{stages}>"].max_dynamic_shared_size_bytes = _tc_smem(bm, bn, stages)
        for name in ("matmul_gemv<1,4>", "matmul_gemv<1,8>"):
            kernels[name].max_dynamic_shared_size_bytes = GEMV_SMEM
        kernels["sample_tokens"].max_dynamic_shared_size_bytes = SAMPLE_SMEM  # p of a whole row
        _kernels = kernels
    return _kernels


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


def _tc_smem(bm, bn, stages):
    return stages * (bm + bn) * 128 + 1024  # (BM + BN) rows of 128 bytes per stage, and room to align to 1024


def _cdiv(a, b):
    return -(-a // b)


class CudaBackend:
    """The numpy backend's ops as hand-written kernels. Arrays are CuPy arrays; kernels get bare pointers, so
    each op makes sure its inputs are contiguous (or row-strided views with contiguous heads, for q/k/v in
    the qkv output) and passes every scalar as np.int32 / np.float32 (a Python float would arrive as a double)."""
    name = "cuda"

    def __init__(self, dtype=np.float16):
        global cp
        import cupy as cp
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float16, np.float32):
            raise ValueError(f"CudaBackend: dtype must be float16 or float32, got {self.dtype}")
        self.k = compile_kernels()
        self.t = "half" if self.dtype == np.float16 else "float"
        self.vec = 16 // self.dtype.itemsize  # elements per 16-byte vector
        self.num_sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.fuse = True  # False runs layernorms, bias, GELU and residual adds as kernels of their own
        self._gelu = cp.ElementwiseKernel("T x", "T y", "float v = x; y = 0.5f * v * (1.f + tanhf(0.7978845608f * "
                                          "(v + 0.044715f * v * v * v)))", "gelu_tanh")  # the unfused GELU
        # split-K scratch, allocated once: a CUDA graph keeps pointers, so nothing it uses may move later
        self._counters = cp.zeros(4096, np.int32)  # split-K and split-context arrival counters (self-resetting)
        self._partial = cp.empty(SPLITK_SCRATCH, np.float32)  # split-K partial sums
        self.pdl = True  # False captures CUDA graphs whose kernels each wait for the one before to finish
        self._dependent = False  # launching into a graph capture with pdl on

    # ---- launching ----------------------------------------------------------------------------
    def launch(self, name, grid, block, args, shared_mem=0):
        """Launch kernels.cu's kernel `name` on the current stream. Inside capture() with pdl on, as a
        programmatic dependent launch: the kernel may start while the kernel before it is still running, loads
        its weights, and waits for that kernel's outputs at griddepcontrol.wait (kernels.cu, wait_for_inputs).
        CuPy cannot ask for that, so the driver's cuLaunchKernelEx is called through ctypes; eager steps keep
        CuPy's launcher, which costs less host time per launch."""
        kernel = self.k[name]
        if not self._dependent:
            return kernel(grid, block, args, shared_mem=shared_mem)
        values = [ctypes.c_void_p(a.data.ptr) if isinstance(a, cp.ndarray) else  # as CuPy passes them:
                  ctypes.create_string_buffer(a.tobytes(), a.nbytes) if isinstance(a, np.generic) else  # its bytes
                  ctypes.c_int64(a) for a in args]  # a Python int (0: a null pointer) as a 64-bit integer
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        attr = _LaunchAttribute(id=6, value=1)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: allowed
        dims = [tuple(d) + (1,) * (3 - len(d)) for d in (grid, block)]
        config = _LaunchConfig(dims[0], dims[1], shared_mem, cp.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
        err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(kernel.kernel.ptr), params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx({name}) failed with CUresult {err}")

    def capture(self, stream, step):
        """The kernels step() launches on `stream`, captured as a CUDA graph (with dependent launches if pdl)."""
        stream.begin_capture()
        self._dependent = self.pdl
        try:
            step()
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

    def memory_info(self):
        cp.get_default_memory_pool().free_all_blocks()  # blocks CuPy caches for reuse count as free here
        return cp.cuda.runtime.memGetInfo()  # (free, total) bytes

    def _ready(self, a, dtype=None):
        """a as a C-contiguous, 16-byte-aligned cupy array of `dtype` (default: the backend's). Most inputs
        already are one, and cp.asarray would cost a microsecond or two of host time even for them."""
        dtype = self.dtype if dtype is None else dtype
        if type(a) is not cp.ndarray or a.dtype != dtype:
            a = cp.asarray(a, dtype=dtype)
        return a if a.flags.c_contiguous and a.data.ptr % 16 == 0 else a.copy()

    def _rows(self, a):
        """(a, row stride in elements) for a (T, H, D) array whose heads are contiguous within a token
        (q, k, v as views into the qkv matmul output need no copy); anything else is copied."""
        a = cp.asarray(a, dtype=self.dtype)
        D, isz = a.shape[2], a.itemsize
        if a.strides[1:] != (D * isz, isz) or a.strides[0] % 16 or a.data.ptr % 16:
            a = a.copy()
        return a, a.strides[0] // isz

    # ---- ops ----------------------------------------------------------------------------------
    def embed(self, wte, wpe, input_ids, positions):
        ids, pos = self._ready(input_ids, np.int32), self._ready(positions, np.int32)
        C = wte.shape[1]
        assert C % self.vec == 0, f"embed: C={C} must be a multiple of {self.vec}"
        out = self.empty((ids.shape[0], C))
        if ids.shape[0]:
            self.launch(f"embed<{self.t}>", (ids.shape[0],), (128,),
                        (self._ready(wte), self._ready(wpe), ids, pos, out, np.int32(C)))
        return out

    def layernorm(self, x, w, b, eps):
        x = self._ready(x)
        T, C = x.shape
        assert C % self.vec == 0 and C <= 2048, f"layernorm: C={C} must be a multiple of {self.vec} and <= 2048"
        y = self.empty((T, C))
        if T:
            self.launch(f"layernorm<{self.t}>", (_cdiv(T, 4),), (128,),
                        (x, self._ready(w), self._ready(b), y, np.int32(T), np.int32(C), np.float32(eps)))
        return y

    def matmul(self, x, w, bias=None, gelu=False, residual=None, ln=None, out_dtype=None):
        M, K = x.shape
        N = w.shape[0]
        # matmul_gemv for one row of x (the layernorm rides along for K <= 2048: every GPT-2), but not for the
        # lm_head's 50257 rows, which stream as fast through the tensor cores; from two rows on, the tensor cores
        # win everywhere (H200: batch 8 decoded 21,900 tokens/s with matmul_skinny, 13,800 with a gemv)
        gemv = self.dtype == np.float16 and M == 1 and K * 2 <= GEMV_SMEM and N <= 16384 and \
            (ln is None or K <= 2048)
        if ln is not None and not (self.fuse and gemv):  # the layernorm as a kernel of its own
            x, ln = self.layernorm(x, *ln), None
        if not self.fuse and (bias is not None or gelu or residual is not None):
            # the unfused path, to measure what fusion saves: each epilogue step is one more pass over y
            y = self.matmul(x, w)
            if bias is not None:
                y += bias
            if gelu:
                y = self._gelu(y)
            if residual is not None:
                y += residual
            return y if out_dtype is None else y.astype(out_dtype)
        x, w = self._ready(x), self._ready(w)
        if w.shape[1] != K:
            raise ValueError(f"matmul: x is (M, K) = {x.shape} but w is {w.shape}, expected (N, {K})")
        if self.dtype == np.float16 and K % 8:
            raise ValueError(f"matmul: K={K} must be a multiple of 8 (rows are read as 16-byte vectors)")
        f32 = self.dtype == np.float32 or np.dtype(out_dtype or self.dtype) == np.float32  # logits: from the accumulator
        y = self.empty((M, N), np.float32 if f32 else self.dtype)
        if M == 0 or N == 0:
            return y
        bias = 0 if bias is None else self._ready(bias)
        residual = 0 if residual is None else self._ready(residual)
        args = (x, w, bias, residual, y, np.int32(M), np.int32(N), np.int32(K), np.int32(bool(gelu)))
        if self.dtype == np.float32:
            self.launch("matmul_f32", (_cdiv(N, 64), _cdiv(M, 64)), (256,), args)
        elif gemv:
            ln_w, ln_b, eps = (0, 0, 0.0) if ln is None else (self._ready(ln[0]), self._ready(ln[1]), ln[2])
            blocks = min(_cdiv(N, 8), 2 * self.num_sms)  # one wave: each warp walks its rows of w
            light = N * K * 2 <= GEMV_LIGHT  # 4 loads per lane per round leave room for the next kernel's blocks
            self.launch(f"matmul_gemv<1,{4 if light else 8}>", (blocks,), (256,),
                        args + (np.int32(f32), ln_w, ln_b, np.float32(eps)), shared_mem=K * 2)
        elif M <= SKINNY_MAX_M:
            # small decode batches: stream w through the tensor cores, 16 rows of w per block, K split in
            # >= 16 chunks of 64 (4 per warp) where the rows alone leave SMs idle (from 9 rows on, the 64 x 32
            # tiles below win: H200, 64 x 2304 x 768 in 6.5 us against 12.7; a batch of 64 decoded 86-94,000
            # tokens/s against 63-67,000)
            blocks_n = _cdiv(N, 16)
            splits, k_per_split = self._split_k(blocks_n, 2, K, _cdiv(K, 64) // 16, M * N)
            self.launch("matmul_skinny", (blocks_n, splits), (128,),
                        args + (np.int32(f32), np.int32(k_per_split), self._partial, self._counters))
        else:
            # prefill, when the 128-row tiles fill the SMs: 3 stages, two blocks per SM. Fewer tiles than SMs: a
            # block has its SM alone, so more stages, with a wgmma group left running across the barrier; 128-row
            # tiles while the 64-row ones would fill the SMs (H200, against cupy.matmul: 2048 x 768 x 3072 at 68 %,
            # against 53 % with two 64-row blocks per SM). Decode batches of 9-512 rows: 64 x 32 tiles while they
            # make no more than two blocks per SM, else 64 x 128, 8 stages, and K split in >= 12 tiles of 64
            # (partial sums go as float4s: N % 4 == 0). cuBLAS's kernel at 256 x 768 x 768 uses 64 x 32 tiles
            # too: more blocks, each with less to do one k-step after another (H200: 5.3 us, against 8.5 with
            # 64 x 128 tiles and 4.5 for cuBLAS). The lm_head of a 9-64 batch: 64 rows, three blocks per SM.
            gn, bn, per_sm = _cdiv(N, 128), 128, 1
            if M > 64 and _cdiv(M, 128) * gn >= self.num_sms:
                bm, stages = 128, 3
                # 144-wide tiles where they take fewer rounds of two blocks per SM, a round costing about the tile
                # width: 2048 x 2304 makes 288 tiles of 128 for 2 x 132 slots (two rounds) and 256 of 144 (one)
                # (H200: 71 % of cupy.matmul against 54 %; 4096 x 2304 66 % against 60 %)
                rounds = lambda width: _cdiv(_cdiv(M, 128) * _cdiv(N, width), 2 * self.num_sms) * width
                bn = 144 if rounds(144) < rounds(128) else 128
            elif _cdiv(M, 64) * gn >= self.num_sms:
                bm, stages = (64, 3) if M <= 64 else (128, 4)
            else:
                bm, stages = 64, 8
                if _cdiv(M, 64) * _cdiv(N, 32) <= 2 * self.num_sms:
                    bn, per_sm = 32, 2
            most = _cdiv(K, 64) // 12 if N % 4 == 0 else 1
            splits, k_per_split = self._split_k(_cdiv(M, bm) * _cdiv(N, bn), per_sm, K, most, M * N)
            self.launch(f"matmul_tc<{bm},{bn},{stages}>", (_cdiv(N, bn), _cdiv(M, bm), splits), (2 * bm,),
                        args + (np.int32(f32), np.int32(k_per_split), self._partial, self._counters),
                        shared_mem=_tc_smem(bm, bn, stages))
        return y if out_dtype is None else y.astype(out_dtype, copy=False)

    def _split_k(self, blocks, per_sm, K, most, MN):
        """(splits, k_per_split): when `blocks` leave SMs idle, K is split over up to per_sm blocks per SM too, in
        chunks of 64 and at most `most` ways; the last block of each group adds up the MN partial sums."""
        splits = 1
        if blocks < self.num_sms:
            splits = max(1, min(per_sm * self.num_sms // blocks, most, SPLITK_SCRATCH // MN))
        k_per_split = _cdiv(_cdiv(K, 64), splits) * 64
        return _cdiv(K, k_per_split), k_per_split

    def cache_write(self, k, v, k_cache, v_cache, slot_mapping):
        (k, ks), (v, vs) = self._rows(k), self._rows(v)
        T, H, D = k.shape
        slots = self._ready(slot_mapping, np.int32)
        if T:
            self.launch(f"cache_write<{self.t}>", (T,), (128,),
                        (k, v, np.int32(ks), np.int32(vs), k_cache, v_cache, slots, np.int32(H * D)))

    def to_device(self, batch):
        """The batch's int32 arrays on the GPU, plus the attention launch plan, built with numpy (no per-token
        Python loops): query rows that go to the row kernel (decode; every row in fp32) and 64-query tiles of
        the sequences that go to the tensor-core prefill kernel. All of them travel in one host-to-device copy
        (12 copies cost an eager step about 0.3 ms of host time), each a 16-byte-aligned view of it."""
        cu = np.asarray(batch.cu_seqlens_q, np.int64)
        ctx = np.asarray(batch.context_lens, np.int64)
        n_q = np.diff(cu)
        tiled = n_q >= PREFILL_MIN_Q if self.dtype == np.float16 else np.zeros(len(n_q), bool)
        # row plan: every query of the untiled sequences is one row
        rs = np.nonzero(~tiled & (n_q > 0))[0]
        counts = n_q[rs]
        row_seq = np.repeat(rs, counts)
        offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        row_len = ctx[row_seq] - n_q[row_seq] + offs + 1  # keys visible to this query
        # tile plan: 64-query tiles, the longest (most keys) first so they do not finish last
        ts = np.nonzero(tiled)[0]
        ntile = _cdiv(n_q[ts], 64)
        tile_seq = np.repeat(ts, ntile)
        tile_q0 = (np.arange(ntile.sum()) - np.repeat(np.cumsum(ntile) - ntile, ntile)) * 64
        order = np.argsort(-(ctx[tile_seq] - n_q[tile_seq] + tile_q0), kind="stable")
        fields = {f: getattr(batch, f) for f in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q",
                                                 "context_lens", "block_tables", "logits_idx")}
        fields.update(row_q=cu[row_seq] + offs, row_seq=row_seq, row_len=row_len, tile_seq=tile_seq[order],
                      tile_q0=tile_q0[order])
        fields = {f: np.asarray(a, np.int32) for f, a in fields.items() if a is not None}
        starts = np.cumsum([0] + [_cdiv(a.size, 4) * 4 for a in fields.values()])  # in int32s: 16-byte steps
        host = np.zeros(starts[-1], np.int32)
        for a, start in zip(fields.values(), starts):
            host[start:start + a.size] = a.ravel()
        dev = cp.asarray(host)
        d = types.SimpleNamespace(logits_idx=None, n_rows=len(row_seq), n_tiles=len(tile_seq),
                                  max_row_len=int(row_len.max()) if len(row_seq) else 0)
        for (f, a), start in zip(fields.items(), starts):
            setattr(d, f, dev[start:start + a.size].reshape(a.shape))
        return d

    def attention(self, q, k, v, k_cache, v_cache, batch, scale):
        T, H, D = q.shape
        if D != 64:
            raise NotImplementedError(f"attention: the kernels are written for head_dim 64 (every GPT-2), got {D}")
        # decode (one query per sequence, so no other query needs this step's keys from the cache): the
        # attention kernel writes the cache itself; otherwise a cache_write kernel goes first
        new_kv = (0, 0, np.int32(0), 0)
        if self.fuse and batch.n_tiles == 0 and batch.n_rows == len(batch.context_lens):
            (k, ks), (v, vs) = self._rows(k), self._rows(v)
            assert ks == vs, "attention: k and v must share a row stride (views into one qkv array)"
            new_kv = (k, v, np.int32(ks), batch.slot_mapping)
        else:
            self.cache_write(k, v, k_cache, v_cache, batch.slot_mapping)
        q, qs = self._rows(q)
        out = self.empty((T, H, D))
        block_size, max_blocks = k_cache.shape[1], batch.block_tables.shape[1]
        scale_log2 = np.float32(scale * math.log2(math.e))
        common = (batch.block_tables, np.int32(max_blocks), np.int32(block_size))
        if batch.n_tiles:
            self.launch("attention_prefill", (batch.n_tiles, H), (128,),
                        (q, np.int32(qs), k_cache, v_cache) + common +
                        (batch.cu_seqlens_q, batch.context_lens, batch.tile_seq, batch.tile_q0, np.int32(H),
                         scale_log2, out))
        if batch.n_rows:
            # flash-decoding: split the context until there are ~4 blocks per SM, >= 32 keys per split, and at
            # most 32 splits (the merge holds their log-sum-exps in shared memory)
            nsplit = max(1, min(_cdiv(4 * self.num_sms, batch.n_rows * H), _cdiv(batch.max_row_len, 32), 32))
            assert nsplit == 1 or batch.n_rows * H <= self._counters.size
            part_o = cp.empty(batch.n_rows * H * nsplit * 64 if nsplit > 1 else 0, np.float32)
            part_lse = cp.empty(batch.n_rows * H * nsplit if nsplit > 1 else 0, np.float32)
            self.launch(f"attention_rows<{self.t}>", (batch.n_rows, H, nsplit), (128,),
                        (q, np.int32(qs)) + new_kv + (k_cache, v_cache) + common +
                        (batch.row_q, batch.row_seq, batch.row_len, np.int32(H), scale_log2, out, part_o, part_lse,
                         self._counters))
        return out

    def sample_device(self, logits, temperature, top_k, top_p, seed, step):
        """sample() without the copy back: the (R,) int32 token ids on the GPU."""
        logits = self._ready(logits, np.float32)
        R, V = logits.shape
        tokens = self.empty((R,), np.int32)
        if R:
            cache = V * 4 <= SAMPLE_SMEM
            self.launch("sample_tokens", (R,), (1024,),
                        (logits, np.int32(V), self._ready(temperature, np.float32), self._ready(top_k, np.int32),
                         self._ready(top_p, np.float32), self._ready(seed, np.uint64), self._ready(step, np.int32),
                         tokens, np.int32(cache)), shared_mem=V * 4 if cache else 0)
        return tokens

    def sample(self, logits, temperature, top_k, top_p, seed, step):
        return cp.asnumpy(self.sample_device(logits, temperature, top_k, top_p, seed, step)).astype(np.int64)

# -----------------------------------------------------------------------------
# GPT-2 over one flat batch of tokens


@dataclass
class Batch:
    """One engine step's tokens, every sequence's side by side, and where their K/V live."""
    input_ids: np.ndarray  # (T,) int32
    positions: np.ndarray  # (T,) int32
    slot_mapping: np.ndarray  # (T,) int32, the cache slot each new token's K/V goes to
    cu_seqlens_q: np.ndarray  # (S+1,) int32, sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]
    context_lens: np.ndarray  # (S,) int32, tokens in each sequence's cache after this step
    block_tables: np.ndarray  # (S, max_blocks) int32
    logits_idx: np.ndarray  # (R,) int32, rows whose next-token logits are wanted (None: every row)


class GPT:
    """GPT-2's forward pass, written once against the backend's op set."""

    def __init__(self, config, weights, backend):
        self.config, self.backend = config, backend
        self.w = {name: backend.asarray(a) for name, a in weights.items()}

    def forward(self, batch, kv):
        """Logits (R, V), float32, for the rows batch.logits_idx; writes every token's K/V into the cache."""
        return self.forward_on_device(self.backend.to_device(batch), kv)

    def forward_on_device(self, d, kv):
        """forward() on a batch already on the backend (what backend.to_device made of it)."""
        be, w, c = self.backend, self.w, self.config
        T, C, H, D = len(d.input_ids), c.n_embd, c.n_head, c.head_dim
        h = be.embed(w["wte.weight"], w["wpe.weight"], d.input_ids, d.positions)  # (T, C) the residual stream
        for i in range(c.n_layer):
            p = f"h.{i}."
            # each residual add rides in a matmul's epilogue; in one stream's decode, each layernorm in its prologue
            ln_1, ln_2 = ((w[p + f"ln_{j}.weight"], w[p + f"ln_{j}.bias"], c.eps) for j in (1, 2))
            qkv = be.matmul(h, w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"], ln=ln_1)  # (T, 3C)
            q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(T, H, D) for j in range(3))  # (T, H, D) each
            att = be.attention(q, k, v, kv.k[i], kv.v[i], d, 1.0 / math.sqrt(D)).reshape(T, C)  # caches k, v
            h = be.matmul(att, w[p + "attn.c_proj.weight"], w[p + "attn.c_proj.bias"], residual=h)
            f = be.matmul(h, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"], gelu=True, ln=ln_2)  # (T, 4C)
            h = be.matmul(f, w[p + "mlp.c_proj.weight"], w[p + "mlp.c_proj.bias"], residual=h)
        # only the rows that sample need the last layernorm and the 50257-wide lm_head (tied to the embedding)
        rows = h if d.logits_idx is None else h[d.logits_idx]  # (R, C)
        return be.matmul(rows, w["wte.weight"], ln=(w["ln_f.weight"], w["ln_f.bias"], c.eps), out_dtype=np.float32)


class DecodeGraph:
    """A decode step of up to B sequences replayed from one CUDA graph: the 65 kernel launches of a step
    cost one launch instead of ~7 us of Python and driver time each. A graph freezes every pointer and scalar
    it was captured with, so the step's inputs live in one fixed buffer (a step costs one host-to-device copy),
    attention is planned for the longest context (its kernels stop at each row's real length), unused rows
    are padding (cache slot -1, never written), and the activations come from a memory pool that only the
    graphs allocate from (they share it: on one stream, they never run at once), so their addresses stay
    theirs. The step ends by turning its sampled tokens into the next step's inputs on the GPU
    (decode_advance), so it can be replayed several times in a row, each step's tokens kept in a ring of
    history rows: the host's work for a step, and its wait for the tokens, are paid once per run of steps."""

    def __init__(self, model, kv, B, stream, pool):
        be, c = model.backend, model.config
        self.B, max_blocks = B, kv.blocks_needed(c.n_ctx)
        fields = [("seed", 2 * B), ("temperature", B), ("top_p", B), ("top_k", B), ("input_ids", B), ("substep", 1),
                  # the host knows these for any step ahead, so carry_on rewrites them (input_ids come from the GPU)
                  ("step", B), ("remaining", B), ("positions", B), ("context_lens", B), ("slot_mapping", B),
                  ("block_tables", B * max_blocks)]
        self.host = np.zeros(sum(n for _, n in fields), np.int32)  # (all fields,) in one int32 buffer
        self.stream = stream
        # the graphs' stream does not wait for the default stream, where the weights and the cache were made (a
        # warm-up step could read this graph's buffers before they were written): from here on, all in stream order
        cp.cuda.Device().synchronize()
        with stream:
            self.dev = cp.zeros_like(self.host)
            self.history = cp.zeros((2 * LOOKAHEAD, B), np.int32)  # a ring: one run's tokens while the next runs
            self.h, self.d, self.offset, start = {}, {}, {}, 0
            for name, n in fields:
                self.h[name], self.d[name], self.offset[name] = self.host[start:start + n], self.dev[start:start + n], start
                start += n
            arange = cp.arange(B + 1, dtype=np.int32)
            self.batch = types.SimpleNamespace(  # the fields CudaBackend.to_device makes, for B decode rows
                input_ids=self.d["input_ids"], positions=self.d["positions"], slot_mapping=self.d["slot_mapping"],
                context_lens=self.d["context_lens"], block_tables=self.d["block_tables"].reshape(B, max_blocks),
                cu_seqlens_q=arange, logits_idx=None, n_rows=B, max_row_len=c.n_ctx, row_q=arange[:B],
                row_seq=arange[:B], row_len=self.d["context_lens"], n_tiles=0, tile_seq=arange[:0], tile_q0=arange[:0])
            self.start([], [], [], [], [], step=[], remaining=[], positions=[], slot_mapping=[],
                       block_tables=np.zeros((0, 1), np.int32))
            # the step's activations, and only they, come from the pool the graphs share: what one graph leaves free
            # there, the next one captured may take (a buffer kept from one step to the next, above, must not)
            with cp.cuda.using_allocator(pool.malloc):
                self._step(model, kv)  # warm-up: the first launches and allocations stay out of the capture
                self.stream.synchronize()
                self.graph = be.capture(self.stream, lambda: self._step(model, kv))
        self.graph.upload(self.stream)

    def _step(self, model, kv):
        d, b, be = self.d, self.batch, model.backend
        logits = model.forward_on_device(b, kv)
        tokens = be.sample_device(logits, d["temperature"].view(np.float32), d["top_k"], d["top_p"].view(np.float32),
                                  d["seed"].view(np.uint64), d["step"])
        be.launch("decode_advance", (1,), (self.B,),
                  (tokens, d["input_ids"], d["positions"], d["context_lens"], d["slot_mapping"], d["step"],
                   d["remaining"], d["block_tables"], np.int32(b.block_tables.shape[1]), np.int32(kv.block_size),
                   self.history, np.int32(len(self.history)), d["substep"], np.int32(self.B)))

    def start(self, input_ids, temperature, top_k, top_p, seed, **rows):
        """Load a decode batch of n <= B sequences: each one's last token and sampling parameters, and the
        per-row fields of _set_rows. Rows past n are padding: greedy, cache slot -1 (never written)."""
        h, self.n = self.h, len(input_ids)
        n = self.n
        h["input_ids"][:n], h["input_ids"][n:] = input_ids, 0
        h["top_k"][:n], h["top_k"][n:] = top_k, 0
        h["temperature"].view(np.float32)[:n], h["temperature"][n:] = temperature, 0
        h["top_p"].view(np.float32)[:n], h["top_p"].view(np.float32)[n:] = top_p, 1
        h["seed"].view(np.uint64)[:n], h["seed"].view(np.uint64)[n:] = seed, 0
        h["substep"][0] = 0
        self._set_rows(**rows)
        self.dev.set(self.host, stream=self.stream)
        self.substep = 0  # the history row the next step writes (the GPU keeps its own count)

    def _set_rows(self, step, remaining, positions, slot_mapping, block_tables):
        """Per row: its sampling counter, the steps it may still take (decode_advance makes it padding after the
        last), its position, its cache slot (-1: padding) and its block table."""
        h, n = self.h, self.n
        for name, values, pad in (("step", step, 0), ("remaining", remaining, 0), ("positions", positions, 0),
                                  ("slot_mapping", slot_mapping, -1)):
            h[name][:n], h[name][n:] = values, pad
        h["context_lens"][:] = h["positions"] + 1  # a token at position p sees p + 1 keys; padding sees 1
        tables = h["block_tables"].reshape(self.B, -1)
        tables[:] = 0
        tables[:n, :block_tables.shape[1]] = block_tables

    def take_inputs(self, backend, other, rows):
        """Each row's input token is graph `other`'s row `rows[i]` (after its launches: one stream), gathered on the
        GPU, where they left it, so the host need not wait for them."""
        with self.stream:
            backend.launch("take_rows", (1,), (len(rows),), (other.d["input_ids"], cp.asarray(rows, np.int32),
                                                             self.d["input_ids"], np.int32(len(rows))))

    def carry_on(self, **rows):
        """Let the next launches go on from where the launched ones stop: the GPU has each row's next input
        token; the host rewrites the rest (blocks added since, rows that are done now padding); stream-ordered."""
        self._set_rows(**rows)
        first = self.offset["step"]
        self.dev[first:].set(self.host[first:], stream=self.stream)

    def launch(self, steps):
        """Replay the step `steps` times; (its first history row, an event recorded after the last)."""
        first, self.substep = self.substep, self.substep + steps
        for _ in range(steps):
            self.graph.launch(self.stream)
        done = cp.cuda.Event()
        done.record(self.stream)
        return first, done

    def tokens(self, first, steps, done):
        """(steps, n) tokens, as numpy, of the launches that began at history row `first`, once they are done.
        The copy goes on the default stream, which does not wait for launches made after them."""
        done.synchronize()
        ring = self.history.get()
        return ring[(first + np.arange(steps)) % len(ring), :self.n].astype(np.int64)


# -----------------------------------------------------------------------------
# sampling parameters and outputs, with the names vLLM users know


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 is off
    seed: int = None  # a seeded request samples the same tokens whatever else is in the batch
    stop: list = None  # strings that end the request (not included in the text)
    ignore_eos: bool = False
    logprobs: int = None  # k: the chosen token's log-probability and the k most likely, at every token

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stop_ok = isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop)
        for name, ok, rule in (
                ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
                ("temperature", isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf,
                 "a number >= 0 (0 is greedy)"),
                ("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "a number in (0, 1]"),
                ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 is off)"),
                ("seed", self.seed is None or isinstance(self.seed, int) and 0 <= self.seed < 2 ** 64,
                 "None or an integer in [0, 2**64)"),
                ("stop", self.stop is None or stop_ok, "None, a string, or a list of non-empty strings"),
                ("logprobs", self.logprobs is None or isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20,
                 "None or an integer in [0, 20]")):
            if not ok or isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: must be {rule}")


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str = None  # 'stop' (EOS or a stop string), 'length' (max_tokens or the context), 'error'
    logprobs: list = None  # with logprobs=k: per token {'token': logprob of the chosen one, 'top': [(id, logprob)] * k}
    error: str = None

# -----------------------------------------------------------------------------
# the engine: schedule, run one flat batch, sample, stream


# decode batch sizes that get a CUDA graph each: every 16 rows from 16 on (vLLM: every 8), so a batch pads at most 15
# rows (H200, offline, alternating in one process: 99,200-99,800 tokens/s against 97,000-98,000 with powers of two)
GRAPH_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 257, 16))
Run = namedtuple("Run", "graph seqs steps first done")  # launched decode steps: their history rows, an end event
LOOKAHEAD = 16  # decode steps one graph run may take (multi-step decoding)
ADMIT_GROUP = 8  # with CUDA graphs, a full engine lets waiting requests in once 1/8 of its seats are free


class LLM:
    def __init__(self, model, device="auto", dtype=None, block_size=16, max_num_seqs=256,
                 max_num_batched_tokens=16384, num_kv_tokens=None, gpu_memory_utilization=0.9, seed=0,
                 cuda_graphs=True, fused=True):
        path = resolve_model(model)
        self.config = c = load_config(path)
        self.tokenizer = Tokenizer(path)
        self.backend = make_backend(device, dtype)
        self.backend.fuse = fused  # the switches that measure two lessons: fusion, and launch overhead
        self.cuda_graphs = cuda_graphs and self.backend.name == "cuda"
        self.lookahead = LOOKAHEAD  # decode steps per graph run; 1 turns multi-step decoding off
        self._inflight = None  # a graph run launched and not yet turned into tokens
        self._free_later = []  # finished sequences whose blocks a launched run may still write
        self.model = GPT(c, load_weights(path, c), self.backend)
        if num_kv_tokens is None:
            num_kv_tokens = self._kv_tokens_that_fit(gpu_memory_utilization)
        num_blocks = -(-num_kv_tokens // block_size)
        self.kv = PagedKVCache(self.backend, c.n_layer, c.n_head, c.head_dim, num_blocks, block_size)
        # a step's token budget: a prefill step pays ~2.5 ms of host time launching its ~110 kernels one by one,
        # so larger steps take fewer of them (H200, the offline workload: 73-84k tokens/s with 2048, 89-90k with
        # 8192, 91-94k with 16384, vLLM's default for its LLM class on H100/H200), while each one stalls the
        # running decodes for longer
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens)
        self._rng = np.random.default_rng(seed)  # seeds for requests that bring none
        self._next_id = 0
        # the graphs share one stream, so they never run at once, and so one memory pool for their activations
        self._graph_memory = (cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()) if self.backend.name == "cuda" \
            else None
        self.capture_graphs()

    def capture_graphs(self):
        """A CUDA graph for each bucket up to max_num_seqs, captured up front as serving engines do, so that no
        request waits for one (H200: ~6 ms each for GPT-2); the largest first, whose activations the smaller ones
        then reuse. Called again after a switch that changes what a step launches (pdl, fuse)."""
        self._graphs = {}  # batch-size bucket -> DecodeGraph
        m = self.scheduler.max_num_seqs
        needed = [b for b in GRAPH_BUCKETS if b < m] + [b for b in GRAPH_BUCKETS if b >= m][:1]
        for B in reversed(needed if self.cuda_graphs else []):
            self._graph(B)

    def _kv_tokens_that_fit(self, fraction):
        """On the GPU: what the fraction of its memory leaves after the weights. On the CPU: 1 GiB."""
        c = self.config
        per_token = PagedKVCache.bytes_per_token(c.n_layer, c.n_head, c.head_dim, self.backend.dtype.itemsize)
        if self.backend.name == "cpu":
            budget = 2 ** 30
        else:
            free, total = self.backend.memory_info()
            budget = total * fraction - (total - free)
            budget -= 2 ** 30  # room for a step's activations and logits, and the CUDA graphs' own
        if budget < per_token * c.n_ctx:
            raise RuntimeError(f"the KV cache would hold only {int(max(budget, 0) // per_token)} tokens, less than one "
                               f"full context ({c.n_ctx}): raise gpu_memory_utilization or pass num_kv_tokens")
        return int(budget // per_token)

    def add_request(self, prompt, params=None):
        """Queue a request; a bad one raises ValueError here and leaves the engine serving the others."""
        params = params or SamplingParams()
        c = self.config
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)) and \
                all(isinstance(t, (int, np.integer)) and 0 <= t < c.vocab_size for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"a prompt is a string or a list of token ids in [0, {c.vocab_size})")
        ids = ids or [self.tokenizer.eot_token]  # an empty prompt generates unconditionally
        if len(ids) >= c.n_ctx:
            raise ValueError(f"the prompt is {len(ids)} tokens, and this model's context is {c.n_ctx} tokens with at "
                             f"least one to generate: shorten the prompt to at most {c.n_ctx - 1} tokens")
        most_tokens = min(len(ids) + params.max_tokens, c.n_ctx)
        if self.kv.blocks_needed(most_tokens) > self.kv.num_blocks:
            raise ValueError(f"the request may need {most_tokens} tokens of KV cache, but the whole pool holds "
                             f"{self.kv.num_blocks * self.kv.block_size}: lower max_tokens, or give the engine a larger "
                             "pool (num_kv_tokens, gpu_memory_utilization)")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
        seq = Sequence(self._next_id, ids, params, seed, self.tokenizer)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def has_unfinished(self):
        return self.scheduler.has_unfinished()

    def _make_batch(self, scheduled):
        """Flatten this step's work into one batch: Python loops over sequences, numpy over tokens."""
        seqs = [seq for seq, _ in scheduled]
        counts = np.array([n for _, n in scheduled], np.int32)
        starts = np.array([seq.num_computed for seq in seqs], np.int32)
        cu_seqlens_q = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)  # (S+1,)
        row = np.repeat(np.arange(len(seqs)), counts)  # (T,) the sequence of each token
        positions = (np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[row] + starts[row]).astype(np.int32)
        block_tables = self.kv.block_table_array([seq.seq_id for seq in seqs])  # (S, max_blocks)
        samples = starts + counts == np.array([len(seq.token_ids) for seq in seqs])  # reached their last token
        input_ids = np.fromiter(itertools.chain.from_iterable(
            seq.token_ids[a:a + n] for seq, a, n in zip(seqs, starts.tolist(), counts.tolist())), np.int32, len(row))
        return Batch(input_ids, positions, self.kv.slot_mapping(block_tables, row, positions), cu_seqlens_q,
                     starts + counts, block_tables, (cu_seqlens_q[1:] - 1)[samples]), \
            [seq for seq, s in zip(seqs, samples) if s]

    def step(self):
        """One engine step (on the GPU, a run of decode steps). Returns (request_id, new text, RequestOutput if it
        just finished else None) per request that produced tokens."""
        run = self._inflight
        if run is None:
            scheduled = self.scheduler.schedule(self._admission_group())
            if not scheduled:
                return []
            graph = self._decode_graph(scheduled)
            if graph is None:
                return self._eager_step(scheduled)
            seqs = [seq for seq, _ in scheduled]
            steps, rows = self._plan(seqs, 0)
            graph.start([seq.token_ids[-1] for seq in seqs], *self._sampling_arrays(seqs)[:4], **rows)
            run = Run(graph, seqs, steps, *graph.launch(steps))
        # the next run can usually go on from where this one stops: launch it now, so that the GPU computes it
        # while the host turns this run's tokens into text
        self._inflight = self._carry_on(run)
        return self._collect(run)

    def _eager_step(self, scheduled):
        """A step of kernels launched one by one (prefill, logprobs, or CUDA graphs off)."""
        batch, sampling = self._make_batch(scheduled)
        logits = self.model.forward(batch, self.kv)  # (R, V)
        tokens = self.backend.sample(logits, *self._sampling_arrays(sampling))
        for seq, n in scheduled:
            seq.num_computed += n
        events = []
        for row, (seq, token) in enumerate(zip(sampling, tokens)):
            if seq.logprobs is not None:
                seq.logprobs.append(self._logprobs(logits[row], int(token), seq.params.logprobs))
            seq.append(int(token), self.config.n_ctx)
            if seq.finish_reason:
                self.scheduler.finish(seq)
            events.append(self._event(seq))
        return events

    def _left(self, seqs, ahead):
        """(S,) the decode steps each sequence may still take, `ahead` steps past the host's tokens (0: done)."""
        c = self.config
        return np.array([0 if s.finish_reason else min(s.params.max_tokens - s.num_output, c.n_ctx - len(s.token_ids))
                         - ahead for s in seqs]).clip(0)

    def _plan(self, seqs, ahead):
        """A graph run that starts `ahead` steps past the host's tokens: (steps, the per-row fields of
        DecodeGraph._set_rows). Up to LOOKAHEAD steps, and no more than the longest sequence may still take (a
        shorter one, or one that is done, is a padding row after its last), with every step's blocks free
        (reserved here). A sequence that stops early (EOS, a stop string) wastes the steps after that; it never
        emits them. 0 steps: not even one."""
        kv, left = self.kv, self._left(seqs, ahead)
        last = [len(s.token_ids) - 1 + ahead for s in seqs]  # the position each one's next step computes
        steps = int(min(self.lookahead, LOOKAHEAD, left.max()))
        while steps > 0 and sum(max(0, kv.blocks_needed(p + min(steps, n)) - len(kv.block_tables[s.seq_id]))
                                for s, p, n in zip(seqs, last, left) if n) > kv.allocator.num_free():
            steps //= 2
        for s, p, n in zip(seqs, last, left):
            if n:
                kv.grow(s.seq_id, p + min(steps, n))
        positions = np.where(left > 0, last, 0)
        tables = kv.block_table_array([s.seq_id for s in seqs])  # (S, max_blocks)
        slots = np.where(left > 0, kv.slot_mapping(tables, np.arange(len(seqs)), positions), -1)
        return steps, dict(step=[s.num_output + ahead for s in seqs], remaining=left, positions=positions,
                           slot_mapping=slots, block_tables=tables)

    def _carry_on(self, run):
        """The run after `run`, launched, if it can go on without the scheduler: multi-step decoding is on and no
        waiting request is to come in now (_admission_group). The sequences that go on keep their graph (the ones
        that are done become padding) or, when they fit a smaller one, move there with their input tokens gathered
        on the GPU, so the GPU does not idle while the host reads this run (H200, offline: 98,700-98,800 tokens/s
        against 97,700-97,800 when each move waited for the host; measured with the nine power-of-two buckets).
        Else None."""
        s = self.scheduler
        if self.lookahead == 1 or s.wants_admission(self._admission_group()):
            return None
        live = np.flatnonzero(self._left(run.seqs, run.steps))  # the rows that go on
        if not len(live):
            return None
        graph = self._graph(len(live))
        seqs = run.seqs if graph is run.graph else [run.seqs[i] for i in live]
        steps, rows = self._plan(seqs, run.steps)
        if steps == 0:
            return None
        if graph is run.graph:
            graph.carry_on(**rows)
        else:
            graph.start(np.zeros(len(seqs), np.int32), *self._sampling_arrays(seqs)[:4], **rows)
            graph.take_inputs(self.backend, run.graph, live)
        return Run(graph, seqs, steps, *graph.launch(steps))

    def _admission_group(self):
        """How many free seats let waiting requests in. With CUDA graphs each admission ends the run of graph steps
        with an eager step (the new prompts and every running decode, ~110 kernels launched from Python, about
        2.5 ms of host time), after which the runs start again from the host; so a full engine lets them in by
        groups, once an eighth of its seats are free, the freed seats idling until then (TGI's
        waiting_served_ratio is the same trade). H200, the mixed workload at most 64 at a time, in one process:
        55.4-57.7k tokens/s (27 eager steps) against 52.7-56.0k (46) letting each in as its seat frees; by groups
        of 4, 53.1-57.1k; of 16, 55.4-55.9k. Eager steps admit at once: they cost no more for it."""
        return max(1, self.scheduler.max_num_seqs // ADMIT_GROUP) if self.cuda_graphs else 1

    def _collect(self, run):
        """Wait for a graph run's tokens and hand them to their sequences; one that finishes drops the rest, and
        its blocks are freed once no launched run writes to them any more."""
        tokens = run.graph.tokens(run.first, run.steps, run.done)  # (steps, n)
        for seq_id in self._free_later:  # the run that still wrote to them is this one, now done
            self.kv.free(seq_id)
        self._free_later = []
        events = []
        for row, seq in enumerate(run.seqs):
            if seq.finish_reason:  # it finished in the run before this one
                continue
            for token in tokens[:, row]:
                seq.num_computed += 1  # the token this step computed; it samples the next
                seq.append(int(token), self.config.n_ctx)
                if seq.finish_reason:
                    self.scheduler.finish(seq, free=self._inflight is None)
                    if self._inflight is not None:
                        self._free_later.append(seq.seq_id)
                    break
            events.append(self._event(seq))
        return events

    def _event(self, seq):
        return seq.seq_id, seq.new_text(), self._output(seq) if seq.finish_reason else None

    def _decode_graph(self, scheduled):
        """The CUDA graph for this step if every sequence decodes one token (its last; none wants logprobs)."""
        n = len(scheduled)
        if not self.cuda_graphs or n > GRAPH_BUCKETS[-1] or \
                any(k != 1 or s.num_uncomputed != 1 or s.logprobs is not None for s, k in scheduled):
            return None
        return self._graph(n)

    def _graph(self, n):
        """The DecodeGraph of the smallest bucket that holds n rows, captured now if it was not yet."""
        B = next(b for b in GRAPH_BUCKETS if b >= n)
        if B not in self._graphs:
            self._graphs[B] = DecodeGraph(self.model, self.kv, B, *self._graph_memory)
        return self._graphs[B]

    @staticmethod
    def _sampling_arrays(seqs):
        params = [s.params for s in seqs]
        return (np.array([p.temperature for p in params], np.float32),
                np.array([p.top_k for p in params], np.int32),
                np.array([p.top_p for p in params], np.float32),
                np.array([s.seed for s in seqs], np.uint64),
                np.array([s.num_output for s in seqs], np.int32))  # the index of the token being sampled

    def _logprobs(self, logits_row, token, k):
        """Log-probabilities under the model's own distribution (before temperature, top-k and top-p)."""
        row = self.backend.tohost(logits_row).astype(np.float64)
        logp = row - row.max()
        logp -= np.log(np.exp(logp).sum())
        top = np.argsort(-logp, kind="stable")[:k]
        return {"token": float(logp[token]), "top": [(int(t), float(logp[t])) for t in top]}

    @staticmethod
    def _output(seq):
        return RequestOutput(seq.seq_id, seq.prompt_token_ids, seq.text, seq.output_token_ids,
                             seq.finish_reason, seq.logprobs)

    def stream(self, prompts, params=None):
        """Yield (prompt index, new text, RequestOutput once finished else None) as tokens are made. A refused
        request yields its error output at once; the others carry on."""
        prompts, params = _as_lists(prompts, params)
        index = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                index[self.add_request(prompt, p)] = i
            except ValueError as e:
                yield i, "", RequestOutput(None, [], finish_reason="error", error=str(e))
        remaining = len(index)
        while remaining:
            for rid, delta, out in self.step():
                if rid in index:
                    remaining -= out is not None
                    yield index[rid], delta, out
        if self._inflight is not None:  # launched before the last requests finished: the next step() drops it,
            self._inflight.done.synchronize()  # but no GPU work outlives this call

    def generate(self, prompts, params=None):
        """Run prompts to completion, continuously batched. One RequestOutput per prompt, in order. (Requests
        queued earlier with add_request advance too; their events are step()'s to report, not generate's.)"""
        outputs = {}
        for i, _, out in self.stream(prompts, params):
            if out is not None:
                outputs[i] = out
        return [outputs[i] for i in range(len(outputs))]


def _as_lists(prompts, params):
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
    prompts = [prompts] if single else list(prompts)
    params = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
    return prompts, params
