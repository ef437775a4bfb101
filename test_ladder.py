"""The kernel ladder (kernels.cu, section L; ladder.py): every rung of matmul, layernorm and attention against its
numpy definition at the shapes the engine uses, fp16 and fp32, held as test_kernels.py holds the engine's kernels
(float64 reference on the very rounded inputs, outputs poisoned with NaN, error = max|ours - ref| / max|ref| under
1e-2 in fp16, 1e-4 in fp32); then the engine on the first rungs (kernels="simple") against transformers, as
test_nanoinfer.py holds the default one. Needs CuPy and a Hopper GPU, except the setting's own checks.
"""
import functools
import math

import numpy as np
import pytest

from conftest import (NO_GPU, TOL, Driver, attention_case, check_kernel, greedy, heads, hf_logits, poison_outputs,
                      random_ids, rel_err, rounded, to_gpu)
from nanoinfer import LLM, NumpyBackend

try:
    import cupy as cp
except ImportError:
    cp = None

SEED = int(np.random.SeedSequence().entropy % 2**32)
rng = np.random.default_rng(SEED)
ref = NumpyBackend(np.float64)
check = functools.partial(check_kernel, seed=SEED)


@pytest.fixture(scope="module", params=[np.float16, np.float32], ids=["fp16", "fp32"])
def ladder(request):
    from ladder import Ladder
    lad = Ladder(request.param)
    for be in (lad.fast, lad.simple):  # every output starts as NaN: an element a rung forgets fails
        poison_outputs(be)
    return lad


@NO_GPU
@pytest.mark.parametrize("M, N, K", [(1, 2304, 768), (1, 6400, 1600), (7, 768, 3072), (64, 50257, 768),
                                     (300, 3072, 768), (1024, 2304, 768)])
def test_matmul_rungs(ladder, M, N, K):
    """y = x @ w.T on every rung, at GPT-2's matmuls: one decode row (124M's QKV, gpt2-xl's MLP), a small batch,
    the lm_head's odd width, prefills whose rows and columns end inside a tile."""
    dt = ladder.fast.dtype.type
    x, w = rounded(rng.standard_normal((M, K)), dt), rounded(rng.standard_normal((N, K)) / math.sqrt(K), dt)
    want = x @ w.T
    for name, _, rung in ladder.matmul():
        check(rung(to_gpu(x, dt), to_gpu(w, dt)), want, dt, f"matmul {name} {M}x{N}x{K}")
    if M == 1:
        check(ladder.wgmma_for_one_row(to_gpu(x, dt), to_gpu(w, dt)), want, dt, "matmul_tc for one row")


@NO_GPU
@pytest.mark.parametrize("T, C", [(1, 768), (5, 1600), (300, 768), (4099, 1280)])
def test_layernorm_rungs(ladder, T, C):
    """layernorm on every rung: a decode row, a few rows, prefills (rows a warp's block does not divide)."""
    dt = ladder.fast.dtype.type
    x = rounded(rng.standard_normal((T, C)) * 2 + 0.5, dt)
    w, b = rounded(rng.standard_normal(C), dt), rounded(rng.standard_normal(C), dt)
    want = ref.layernorm(x, w, b, 1e-5)
    for name, _, rung in ladder.layernorm():
        check(rung(to_gpu(x, dt), to_gpu(w, dt), to_gpu(b, dt), 1e-5), want, dt, f"layernorm {name} T={T} C={C}")


ATTENTION = {"decode": [(1, 1), (1, 16), (1, 17), (1, 300), (1, 1024)], "prefill": [(45, 45), (200, 200)],
             "chunks and decodes": [(1, 40), (20, 60), (64, 64), (1, 33)]}


@NO_GPU
@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention_rungs(ladder, case):
    """Causal attention over the paged cache on every rung, this step's k and v written first: decode rows up to the
    full context, prefills, and a mix of chunks and decodes; q, k, v strided views into qkv as in the engine."""
    dt, H, scale = ladder.fast.dtype.type, 12, 1 / math.sqrt(64)
    batch, qkv, kc, vc = attention_case(ATTENTION[case], dt, rng, H=H)
    want_kc, want_vc = kc.copy(), vc.copy()
    want = ref.attention(*(heads(qkv, j, H) for j in range(3)), want_kc, want_vc, batch, scale)
    for name, _, rung in ladder.attention(batch):
        qkv_gpu, kc_gpu, vc_gpu = to_gpu(qkv, dt), to_gpu(kc, dt), to_gpu(vc, dt)
        out = rung(*(heads(qkv_gpu, j, H) for j in range(3)), kc_gpu, vc_gpu, scale)
        check(out, want, dt, f"attention {name} {case}")
        for ours, theirs in ((kc_gpu, want_kc), (vc_gpu, want_vc)):
            assert np.array_equal(cp.asnumpy(ours).astype(np.float64), theirs, equal_nan=True), f"{name}: KV cache"


# ---- the engine on the first rungs ----------------------------------------------------------------
@NO_GPU
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_simple_kernels_logits_match_transformers(tiny, dtype):
    """kernels="simple": a prefill of 45 tokens, then 20 decode steps, each step's logits within TOL of
    transformers' (the lm_head's logits in fp32, as on the fast path)."""
    llm = LLM(str(tiny.path), device="cuda", dtype=dtype, num_kv_tokens=4096, kernels="simple")
    assert llm.backend.simple and not llm.backend.fused
    ids, d = random_ids(65, 4), Driver(llm)
    got = d.step([(0, ids[:45])]) + [d.step([(0, [t])])[0] for t in ids[45:]]
    assert rel_err(np.concatenate(got), hf_logits(tiny, ids)) < TOL[dtype]


@NO_GPU
def test_simple_kernels_greedy_matches_transformers(tiny, greedy_cases):
    """kernels="simple" in fp16 through the whole engine (CUDA graphs, multi-step runs, batching): each prompt's
    greedy tokens, alone and all in one batch, equal transformers'."""
    llm = LLM(str(tiny.path), device="cuda", dtype="float16", num_kv_tokens=4096, kernels="simple")
    outs = llm.generate([ids for _, ids, _ in greedy_cases], greedy())
    for out, (prompt, _, want) in zip(outs, greedy_cases):
        assert out.outputs[0].token_ids == want, prompt
    for prompt, ids, want in greedy_cases[:2]:
        assert llm.generate([ids], greedy())[0].outputs[0].token_ids == want, prompt


def test_kernels_setting_is_checked(tiny):
    """kernels= is "fast" or "simple", and "simple" names CUDA kernels: the CPU engine refuses it, saying why."""
    with pytest.raises(ValueError, match="kernels"):
        LLM(str(tiny.path), device="cpu", num_kv_tokens=256, kernels="fastest")
    with pytest.raises(ValueError, match="kernels='simple'.*device='cpu'"):
        LLM(str(tiny.path), device="cpu", num_kv_tokens=256, kernels="simple")
