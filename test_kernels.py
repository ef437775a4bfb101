"""Every CUDA kernel against its numpy twin, the launch plans, and the engine on the CUDA backend.

The kernels (cuda_backend.CudaBackend, kernels.cu) are held to NumpyBackend in float64 (`ref`), the definition of
every op, fed float64 copies of the very inputs the kernel gets (already rounded to its dtype). Fresh random inputs
every run (the seed is printed on failure); every output is poisoned with NaN before the launch, so an element a kernel
forgot to write fails. Error = max|ours - ref| / max|ref|: fp32 < 1e-4, fp16 < 1e-2, NaN never.

The plans (plan_matmul) are plain Python and run without a GPU; everything else needs CuPy and a Hopper GPU (NO_GPU).
The engine tests on CUDA hold its speed tricks (CUDA graphs, dependent launches, multi-step decoding, admission by
groups, fused epilogues) to the tokens of the plain way. The sampler's kernel has test_sampler.py.
"""
import functools
import itertools
import math

import numpy as np
import pytest

import cuda_backend
import graph_runner
import nanoinfer as ni
from checkpoint import Int8Weight, quantize_int8
from conftest import (HERE, NO_GPU, _run_py, attention_case, check_kernel, greedy, heads, penalty_case, poison_outputs,
                      random_ids, rounded, to_gpu)
from cuda_backend import CudaBackend
from nanoinfer import LLM, NumpyBackend, SamplingParams

try:
    import cupy as cp
except ImportError:
    cp = None


DTYPES = [np.float16, np.float32]
SEED = int(np.random.SeedSequence().entropy % 2**32)
rng = np.random.default_rng(SEED)
ref = NumpyBackend(np.float64)  # the definition of every op, in float64


check = functools.partial(check_kernel, seed=SEED)


@pytest.fixture(scope="module", params=DTYPES, ids=["fp16", "fp32"])
def be(request):
    return poison_outputs(CudaBackend(request.param))


# ---- the launch plans: plain Python, no GPU -------------------------------------------------------
def gpt2_matmuls(C):
    """(N, K, layernorm in front) of GPT-2's five matmuls at width C: QKV, attention projection, MLP up and down,
    lm_head."""
    return (3 * C, C, True), (C, C, False), (4 * C, C, True), (C, 4 * C, False), (50257, C, True)


@pytest.mark.parametrize("C", [768, 1024, 1280, 1600])
def test_matmul_plan_for_every_gpt2_shape(C):
    """cuda_backend.plan_matmul (plain Python, no GPU), for the five matmuls of GPT-2 at this width and batches from
    one stream's decode to a long prefill: one row takes the gemv (its layernorm fused) unless the matrix has more
    rows than it handles (the lm_head), up to 8 rows the skinny kernel, more the tensor-core tiles; the grid covers
    y, the split covers K in whole 64-wide chunks, and the split-K scratch and shared memory suffice."""
    sms = 132
    for M, int8 in itertools.product((1, 2, 8, 9, 64, 256, 2048, 8192), (False, True)):
        for N, K, ln in gpt2_matmuls(C):
            p = cuda_backend.plan_matmul(M, N, K, ln, np.float16, sms, int8=int8)
            kind = p.kernel.split("<")[0]
            assert kind == ("matmul_gemv" if M == 1 and N <= 16384 else "matmul_skinny" if M <= 8 else "matmul_tc"), \
                (M, N, K, p)
            assert p.ln_fused == (ln and kind == "matmul_gemv")
            assert p.dequantize == (int8 and kind == "matmul_tc") and ("<i8" in p.kernel) == (int8 and not p.dequantize)
            if kind == "matmul_gemv":  # every warp as many rows, all blocks on the SMs at once
                assert p.grid[0] <= 2 * sms and p.shared_mem == 2 * K
                assert (p.grid[0] - 1) * 8 * p.rows_per_warp < N <= p.grid[0] * 8 * p.rows_per_warp
                continue
            bm, bn = (16, 16) if kind == "matmul_skinny" else map(int, p.kernel[10:-1].split(",")[:2])
            assert p.grid[0] * bn >= N and (kind == "matmul_skinny" or p.grid[1] * bm >= M)
            assert p.splits == (p.grid[1] if kind == "matmul_skinny" else p.grid[2])
            assert p.k_per_split % 64 == 0 and (p.splits - 1) * p.k_per_split < K <= p.splits * p.k_per_split
            assert p.splits == 1 or M * N <= cuda_backend.SPLITK_SCRATCH
            assert p.shared_mem <= 227 * 1024
    assert cuda_backend.plan_matmul(5, 768, 768, True, np.float32, sms).kernel == "matmul_blocked<float>"
    assert cuda_backend.plan_matmul(5, 768, 768, True, np.float32, sms, int8=True).dequantize


@pytest.mark.parametrize("C", [768, 1600])
def test_batch_invariant_matmul_plan_ignores_M(C):
    """plan_matmul(invariant=True): for every M one tile and one K split (a row's sums then run in one order in any
    batch); M is cut into launches whose split-K partial sums fit the scratch, and the grid covers y and K."""
    for N, K, _ in gpt2_matmuls(C):
        plans = [cuda_backend.plan_matmul(M, N, K, True, np.float16, 132, invariant=True)
                 for M in (1, 2, 8, 9, 64, 256, 2048, 16384)]
        assert len({(p.kernel, p.grid[0], p.grid[2], p.splits, p.k_per_split, p.block) for p in plans}) == 1
        for M, p in zip((1, 2, 8, 9, 64, 256, 2048, 16384), plans):
            assert p.splits == 1 or p.rows_per_launch * N * p.splits <= cuda_backend.SPLITK_SCRATCH
            assert p.grid[1] * 64 >= p.rows_per_launch and p.grid[0] * 32 >= N and not p.ln_fused
            assert (p.splits - 1) * p.k_per_split < K <= p.splits * p.k_per_split


def test_every_matmul_kernel_is_planned():
    """No dead kernel: each matmul template that kernels.cu instantiates is plan_matmul's pick for some GPT-2 shape
    (one H200's 132 SMs; fp16 and fp32, int8, batch-invariant, kernels="simple" or not) or a rung of the ladder only
    ladder.py launches, and it picks nothing kernels.cu does not build."""
    planned = {cuda_backend.plan_matmul(M, N, K, ln, dt, 132, invariant=inv, int8=int8, simple=simple).kernel
               for C in (768, 1600) for M in (*range(1, 520), 2048, 8192)
               for N, K, ln in gpt2_matmuls(C)
               for dt, int8, inv, simple in itertools.product((np.float16, np.float32), *[(False, True)] * 3)}
    planned |= {"matmul_tiled<half>", "matmul_tiled<float>", "matmul_blocked<half>"}  # ladder.py's middle rungs
    built = {t for t in cuda_backend.templates(cuda_backend.KERNELS_CU.read_text()) if t.startswith("matmul")}
    assert built == planned, f"built, never planned: {sorted(built - planned)}; planned, not built: " \
                             f"{sorted(planned - built)}"


# ---- matmul ---------------------------------------------------------------------------------------
def matmul_inputs(M, N, K, epi, dt):
    """x (M, K) and what epilogue `epi` names ("none", "bias_gelu", "bias_residual", "all", "ln", "ln_all"): bias,
    residual, GELU, layernorm (host, and its GPU copy), rounded to dt."""
    x = rounded(rng.standard_normal((M, K)) * 2 + 0.5, dt)
    bias = rounded(rng.standard_normal(N), dt) if epi not in ("none", "ln") else None
    res = rounded(rng.standard_normal((M, N)), dt) if epi in ("bias_residual", "all", "ln_all") else None
    ln = (rounded(rng.standard_normal(K), dt), rounded(rng.standard_normal(K), dt), 1e-5) if "ln" in epi else None
    ln_gpu = None if ln is None else (to_gpu(ln[0], dt), to_gpu(ln[1], dt), ln[2])
    return x, bias, res, epi in ("bias_gelu", "all", "ln_all"), ln, ln_gpu


@NO_GPU
@pytest.mark.parametrize("M", [1, 3, 8, 17, 64, 65, 700, 1000, 4096])
@pytest.mark.parametrize("N,K,epi", [(N, K, epi) for N, K in ((2304 + 40, 776), (768, 3072))
                                     for epi in ("none", "bias_gelu", "bias_residual", "all")] +
                         [(N, K, epi) for N, K in ((2304 + 40, 776), (6400, 1600)) for epi in ("ln", "ln_all")])
def test_matmul(be, M, N, K, epi):
    """y = epilogue(layernorm(x) @ w.T) with each epilogue (bias, GELU, residual) and with and without the
    layernorm in front, for decode- and prefill-sized M and N, K off the tiles."""
    dt = be.dtype.type
    x, bias, res, gelu, ln, ln_gpu = matmul_inputs(M, N, K, epi, dt)
    w = rounded(rng.standard_normal((N, K)) / math.sqrt(K), dt)
    y = be.matmul(to_gpu(x, dt), to_gpu(w, dt), to_gpu(bias, dt), gelu, to_gpu(res, dt), ln=ln_gpu)
    check(y, ref.matmul(x, w, bias, gelu, res, ln=ln), dt, f"matmul M={M} N={N} K={K} {epi}")


@NO_GPU
@pytest.mark.parametrize("M", [1, 3, 8, 17, 200])
@pytest.mark.parametrize("N,K,epi", [(2304 + 40, 784, "all"), (768, 3072, "bias_residual"), (6400, 1600, "ln_all"),
                                     (50257, 768, "ln")])
def test_int8_matmul(be, M, N, K, epi):
    """W8A16 (quantization='int8'): int8 rows with a float32 scale each, against the numpy twin (x @ q.T, then the
    scale) in float64: the gemv and the skinny kernel read int8 as it is, matmul_tc and matmul_blocked get it
    dequantized, every one scales in its epilogue; the layernorm in front and the epilogue as in test_matmul."""
    dt = be.dtype.type
    x, bias, res, gelu, ln, ln_gpu = matmul_inputs(M, N, K, epi, dt)
    q8 = quantize_int8(rng.standard_normal((N, K)).astype(np.float32) / math.sqrt(K))
    w = Int8Weight(cp.asarray(q8.q), cp.asarray(q8.scale))
    y = be.matmul(to_gpu(x, dt), w, to_gpu(bias, dt), gelu, to_gpu(res, dt), ln=ln_gpu)
    want = ref.matmul(x, Int8Weight(q8.q, q8.scale.astype(np.float64)), bias, gelu, res, ln=ln)
    check(y, want, dt, f"int8 matmul M={M} N={N} K={K} {epi}")
    again = be.matmul(to_gpu(x, dt), w, to_gpu(bias, dt), gelu, to_gpu(res, dt), ln=ln_gpu)
    assert cp.array_equal(y, again), "int8 matmul: a second run differs"


@NO_GPU
@pytest.mark.parametrize("M", [1, 8, 64, 200])
def test_matmul_lm_head_shape_and_repeat(be, M):
    """The lm_head shape (V = 50257, an odd N) is right, its fp32 logits come from the fp32 accumulator (not an
    fp16 result widened), and a split-K matmul run twice repeats bit for bit (its counters reset themselves;
    M = 8 splits K in matmul_skinny, M = 64 and 200 in matmul_tc)."""
    dt = be.dtype.type
    x = to_gpu(rng.standard_normal((M, 768)), dt)
    w = to_gpu(rng.standard_normal((50257, 768)) / math.sqrt(768), dt)
    exact = ref.matmul(cp.asnumpy(x).astype(np.float64), cp.asnumpy(w).astype(np.float64))
    logits = be.matmul(x, w, out_dtype=np.float32)
    assert logits.dtype == np.float32
    check(logits, exact, dt, "lm_head")
    err = float(np.abs(cp.asnumpy(logits) - exact).max() / np.abs(exact).max())
    assert err < 1e-4, f"fp32 logits are {err:.1e} off: rounded through fp16 on the way?"
    x2 = to_gpu(rng.standard_normal((M, 3072)), dt)
    w2 = to_gpu(rng.standard_normal((768, 3072)) / math.sqrt(3072), dt)
    a, b = be.matmul(x2, w2), be.matmul(x2, w2)
    assert cp.array_equal(a, b), "split-K matmul is not repeatable"


@NO_GPU
def test_matmul_bad_k():
    """fp16 rows are read as 16-byte vectors: K not a multiple of 8 is refused, not read past."""
    be = CudaBackend(np.float16)
    with pytest.raises(ValueError, match="multiple of 8"):
        be.matmul(cp.zeros((4, 100), np.float16), cp.zeros((8, 100), np.float16))


# ---- layernorm, embed, cache_write ----------------------------------------------------------------
@NO_GPU
@pytest.mark.parametrize("T", [1, 3, 17, 1000, 5000])
@pytest.mark.parametrize("C", [64, 768, 1600, 2048])
def test_layernorm(be, T, C):
    """layernorm on its own (prefill, decode batches; one row's decode folds it into the gemv). A block a row: C from
    a partial warp to the widest block; 5000 rows exceed the grid (LAYERNORM_BLOCKS_PER_SM), so blocks take several."""
    assert 5000 > cuda_backend.LAYERNORM_BLOCKS_PER_SM * be.num_sms, "5000 rows no longer exceed the layernorm's grid"
    dt = be.dtype.type
    x = rounded(rng.standard_normal((T, C)) * 2 + 0.5, dt)
    w, b = rounded(rng.standard_normal(C), dt), rounded(rng.standard_normal(C), dt)
    y = be.layernorm(to_gpu(x, dt), to_gpu(w, dt), to_gpu(b, dt), 1e-5)
    check(y, ref.layernorm(x, w, b, 1e-5), dt, f"layernorm T={T} C={C}")


@NO_GPU
def test_embed(be):
    """wte[ids] + wpe[positions] for scattered ids and positions."""
    dt = be.dtype.type
    V, n_ctx, C, T = 1000, 1024, 768, 37
    wte, wpe = rounded(rng.standard_normal((V, C)), dt), rounded(rng.standard_normal((n_ctx, C)), dt)
    ids, pos = rng.integers(0, V, T).astype(np.int32), rng.integers(0, n_ctx, T).astype(np.int32)
    y = be.embed(to_gpu(wte, dt), to_gpu(wpe, dt), cp.asarray(ids), cp.asarray(pos))
    check(y, ref.embed(wte, wpe, ids, pos), dt, "embed")


@NO_GPU
def test_cache_write(be):
    """k and v (strided views into qkv, as in the engine) land exactly in their slots; slot -1 (a padding row
    of a CUDA-graph step) writes nothing; every other slot keeps its value."""
    dt = be.dtype.type
    T, H, D, nb, bs = 37, 12, 64, 20, 16
    qkv = rounded(rng.standard_normal((T, 3 * H * D)), dt)
    slots = rng.permutation(nb * bs)[:T].astype(np.int32)
    slots[rng.random(T) < 0.2] = -1
    kc, vc = rounded(rng.standard_normal((nb, bs, H, D)), dt), rounded(rng.standard_normal((nb, bs, H, D)), dt)
    qkv_gpu, kc_gpu, vc_gpu = to_gpu(qkv, dt), to_gpu(kc, dt), to_gpu(vc, dt)
    be.cache_write(heads(qkv_gpu, 1, H), heads(qkv_gpu, 2, H), kc_gpu, vc_gpu, cp.asarray(slots))
    real = slots >= 0  # the numpy engine never pads (only CUDA graphs do), so its twin gets the real rows alone
    ref.cache_write(heads(qkv, 1, H)[real], heads(qkv, 2, H)[real], kc, vc, slots[real])
    assert np.array_equal(cp.asnumpy(kc_gpu).astype(np.float64), kc), "K cache"
    assert np.array_equal(cp.asnumpy(vc_gpu).astype(np.float64), vc), "V cache"


# ---- attention ------------------------------------------------------------------------------------
ATTENTION_CASES = {
    "decode": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 1023)],
    "prefill": [(17, 17), (16, 16), (64, 64), (1023, 1023)],
    "chunked_prefill": [(100, 1023), (64, 80), (5, 40), (16, 33), (129, 300)],
    "mixed": [(1, 500), (200, 200), (1, 17), (33, 1000), (3, 10), (1, 1), (70, 90)],
    "decode_batch": [(1, int(n)) for n in np.random.default_rng(SEED).integers(1, 700, 64)],
    "verify": [(5, 300), (5, 17), (9, 64), (2, 2), (15, 1000), (5, 5)],  # speculation's chunks: rows, no tiles
}


@NO_GPU
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(be, case):
    """Causal attention over block tables for one flat batch: decode, prefill, chunked prefill and mixes, with
    contexts at and around block edges; q, k and v are strided views into qkv. This step's k and v land in the
    cache exactly (a batch of rows only, decode and verification chunks, has attention_decode write them, reading this
    step's keys from qkv; with tiles cache_write runs first). The prefill cases have few query tiles, so
    attention_prefill splits their keys (and merges the splits)."""
    dt, H = be.dtype.type, 12
    batch, qkv, kc, vc = attention_case(ATTENTION_CASES[case], dt, rng, H=H)
    tiles = len(cuda_backend.plan_attention(batch.cu_seqlens_q, batch.context_lens, be.tile_min_q)["tile_seq"])
    assert not tiles or cuda_backend.prefill_splits(tiles * H, be.num_sms) > 1, "the split path goes untested"
    scale = 1 / math.sqrt(64)
    qkv_gpu, kc_gpu, vc_gpu = to_gpu(qkv, dt), to_gpu(kc, dt), to_gpu(vc, dt)
    out = be.attention(*(heads(qkv_gpu, j, H) for j in range(3)), kc_gpu, vc_gpu, be.to_device(batch), scale)
    want = ref.attention(*(heads(qkv, j, H) for j in range(3)), kc, vc, batch, scale)  # writes kc, vc
    check(out, want, dt, f"attention {case}")
    for ours, theirs in ((kc_gpu, kc), (vc_gpu, vc)):
        assert np.array_equal(cp.asnumpy(ours).astype(np.float64), theirs, equal_nan=True), "KV cache"


@NO_GPU
def test_attention_head_dim():
    """The kernels are written for head_dim 64: another is refused, not computed wrong."""
    be = CudaBackend(np.float16)
    batch, qkv, kc, vc = attention_case([(1, 5)], np.float16, rng, H=2, D=32)
    with pytest.raises(NotImplementedError, match="head_dim 64"):
        qkv_gpu = to_gpu(qkv, np.float16)
        be.attention(*(heads(qkv_gpu, j, 2) for j in range(3)), to_gpu(kc, np.float16), to_gpu(vc, np.float16),
                     be.to_device(batch), 1 / math.sqrt(32))


# ---- penalize -------------------------------------------------------------------------------------
@NO_GPU
def test_penalize_matches_numpy(tiny):
    """The penalize kernel gives NumpyBackend.penalize's logits (within fp32 rounding: the GPU may fuse a multiply and
    subtract), the same bans, and leaves every other logit untouched."""
    logits, seqs = penalty_case(LLM(str(tiny.path), device="cpu", num_kv_tokens=256).tokenizer)
    edits = ni.penalties([(s, 0) for s in seqs])
    got = CudaBackend(np.float32).penalize(cp.asarray(logits), edits).get()
    want = NumpyBackend().penalize(logits, edits)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)) and np.isneginf(got).sum() == 3
    untouched = np.ones(logits.shape, bool)
    untouched[edits.rows, edits.ids] = False
    assert np.array_equal(got[untouched], logits[untouched])


# ---- the engine on CUDA: a tiny random GPT-2 ------------------------------------------------------
PROMPTS = [np.random.default_rng(n).integers(0, 50256, n).tolist() for n in (1, 7, 16, 17, 45)]


def generate_greedy(ckpt, **kw):
    """(the LLM, its 24 greedy tokens for each of PROMPTS, EOS ignored), on CUDA."""
    llm = LLM(str(ckpt.path), device="cuda", num_kv_tokens=4096, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


@NO_GPU
def test_fp16_weights_stay_fp16(tiny):
    """Every floating weight of an fp16 engine is stored in fp16 (they were once kept in fp32 and converted at
    every use, doubling the weight traffic of each step)."""
    llm = LLM(str(tiny.path), device="cuda", dtype="float16", num_kv_tokens=4096)
    wrong = {name: a.dtype.name for name, a in llm.model.w.items() if a.dtype.kind == "f" and a.dtype != np.float16}
    assert not wrong, f"weights not stored in fp16: {wrong}"


def graph_launches(monkeypatch):
    """[(bucket, steps)] of every graph run launched from here on."""
    launches, launch = [], graph_runner.DecodeGraph.launch

    def recorded(graph, seqs, sampling, plan):
        launches.append((graph.B, plan.num_steps))
        return launch(graph, seqs, sampling, plan)
    monkeypatch.setattr(graph_runner.DecodeGraph, "launch", recorded)
    return launches


@NO_GPU
def test_cuda_graphs_change_no_token(tiny, monkeypatch):
    """Decode steps replayed from CUDA graphs (padded to a bucket of 8) give the same greedy tokens as the same
    steps launched one kernel at a time. fp32: the graph plans attention for the whole context, so its
    splits, and roundings, differ from the eager step's; in fp32 that cannot flip a greedy choice."""
    launches = graph_launches(monkeypatch)
    graphed, tokens = generate_greedy(tiny, dtype="float32")
    assert launches, "no decode step was replayed from a CUDA graph"
    assert tokens == generate_greedy(tiny, dtype="float32", cuda_graphs=False)[1]



@NO_GPU
def test_a_lone_prefill_replays_its_graph(tiny, monkeypatch):
    """A lone prompt's prefill, whole or after a prefix-cache hit, is one replay of the prefill graph of its size,
    padded, and gives the eager step's tokens: greedy, and a seeded draw (T 0.8), for prompts of 2 to 127 tokens
    (a bucket's edges: 64, 65). fp32, as test_cuda_graphs_change_no_token: the padded rows and the graph's attention
    plan change only roundings, which cannot flip a choice there."""
    runs = []
    run = graph_runner.ChunkGraph.run
    monkeypatch.setattr(graph_runner.ChunkGraph, "run", lambda g, *a: runs.append(g.T) or run(g, *a))
    graphed, eager = (LLM(str(tiny.path), device="cuda", dtype="float32", num_kv_tokens=4096, cuda_graphs=on)
                      for on in (True, False))
    prompts = [random_ids(n, n) for n in (2, 40, 64, 65, 100, 127)] + [random_ids(64, 64) + random_ids(30, 1)]
    for params in (greedy(3), SamplingParams(max_tokens=3, temperature=0.8, seed=5, ignore_eos=True)):
        for p in prompts:  # one at a time: each prefill is lone; the last one finds the 64-token prompt's blocks
            want = eager.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
            assert graphed.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == want, len(p)
    assert runs[:len(prompts)] == [64, 64, 64, 128, 128, 128, 64], runs


@NO_GPU
@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_dependent_launches_change_no_token(which, request, monkeypatch):
    """Graph steps whose kernels may start before the kernel before them has finished (programmatic dependent
    launch: each reads its inputs only after griddepcontrol.wait, and never through the non-coherent cache) give
    exactly the tokens of graphs whose kernels wait for each other: fp16, one stream, 6 at once and 20 at once (the
    gemv, the skinny and the 64-row tiled matmuls), so the kernels and their plans are the same either way and
    an input read too early, or stale, shows as a different token."""
    rng = np.random.default_rng(2)
    batch = [rng.integers(0, 50256, n).tolist() for n in rng.integers(1, 40, 20)]
    tokens = {}
    for pdl in (False, True):
        launches = graph_launches(monkeypatch)
        llm = LLM(str(request.getfixturevalue(which).path), device="cuda", dtype="float16", num_kv_tokens=4096,
                  dependent_launches=pdl)
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) + \
            llm.generate(batch[:6], greedy) + llm.generate(batch, greedy)
        assert {1, 8, 32} <= {B for B, _ in launches}, f"graphs replayed: {sorted(set(launches))}"
        tokens[pdl] = [o.outputs[0].token_ids for o in outs]
    assert tokens[True] == tokens[False]


GRAPH_ON_A_BUSY_GPU = """
import numpy as np, cupy as cp, graph_runner
from nanoinfer import LLM, SamplingParams
make = lambda: LLM({path!r}, device="cuda", dtype="float32", num_kv_tokens=4096, max_num_seqs=8)
prompts = [[464, 2068, 7586], [15496, 11], [40, 716, 257, 3303]]
greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
want = [o.outputs[0].token_ids for o in make().generate(prompts, greedy)]
busy = cp.empty(1 << 29, np.uint8)
junk = cp.full(1 << 28, 0x7F7F7F7F, np.int32)  # 1 GiB of large numbers, handed back to the driver
cp.cuda.Device().synchronize()
del junk
cp.get_default_memory_pool().free_all_blocks()
capture = graph_runner.DecodeGraph.__init__
def on_a_busy_gpu(*args):
    for _ in range(200):  # the default stream busy for tens of ms while the graph is made
        busy.fill(1)
    capture(*args)
graph_runner.DecodeGraph.__init__ = on_a_busy_gpu
llm = make()
assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
print("same tokens")
"""


@NO_GPU
def test_graph_capture_waits_for_the_default_stream(tiny):
    """The decode graphs run on a stream of their own, which does not wait for the default stream, where the
    weights, the KV cache and a graph's own buffers are made: each capture must wait for them. An engine made while the
    default stream is busy, in memory that held large numbers, gives the same greedy tokens as before, and no
    illegal address (there was one, 3 runs in 3 on the H200, while the graph's warm-up step could read its buffers
    before the default stream had written them). In a process of its own, so that a CUDA error cannot take the rest
    of the suite with it."""
    run = _run_py(GRAPH_ON_A_BUSY_GPU.format(path=str(tiny.path)), {}, HERE)
    assert run.returncode == 0 and "same tokens" in run.stdout, run.stderr[-3000:]


@NO_GPU
def test_multi_step_decoding_changes_no_token(tiny, monkeypatch):
    """Graph runs of several decode steps (each sampled token fed back on the GPU by decode_advance, a row that
    reaches its max_tokens turning into padding), and runs launched while the host still reads the run before,
    give the same tokens, texts and finish reasons as eager steps one at a time: greedy and seeded top-p
    requests of different lengths, one ended mid-run by a stop string and carried along as padding, its blocks
    freed, while the others go on; every block is free at the end; fp32."""
    def run(stop=None, **kw):
        llm = LLM(str(tiny.path), device="cuda", dtype="float32", num_kv_tokens=4096, **kw)
        runs, plan = [], graph_runner.plan_run  # (steps ahead of the host's tokens, steps in the run)

        def recorded_plan(kv, seqs, ahead, max_steps, n_ctx):
            p = plan(kv, seqs, ahead, max_steps, n_ctx)
            runs.append((ahead, p.num_steps if p else 0))
            return p
        monkeypatch.setattr(graph_runner, "plan_run", recorded_plan)
        params = [SamplingParams(max_tokens=m, temperature=t, top_p=0.9, seed=i, ignore_eos=True,
                                 stop=stop if i == 0 else None)
                  for i, (m, t) in enumerate([(60, 0), (90, 1.0), (85, 0.8), (99, 0)])]
        outs = llm.generate(PROMPTS[:4], params)
        assert llm.kv.allocator.num_free() == llm.kv.num_blocks
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], runs

    eager, _ = run(cuda_graphs=False)
    text = eager[0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2]  # ends request 0 partway, inside a run of steps
    eager, _ = run(stop, cuda_graphs=False)
    graphed, runs = run(stop)
    assert max(n for _, n in runs) == graph_runner.MAX_STEPS_PER_RUN, runs
    assert any(ahead and n for ahead, n in runs), f"no run was launched ahead of the host: {runs}"
    assert graphed == eager
    assert eager[0][2] == "stop"


@NO_GPU
def test_graph_runs_in_a_pool_too_tight_for_one_more_step(tiny, monkeypatch):
    """The smallest engine where a run launched ahead finds no free block for even one more step (two requests,
    blocks of one token, a pool of 19 for 3 + 16 tokens each): it must not be launched (it was, with a slot past
    its block table: IndexError in slot_mapping); the scheduler preempts instead, and both requests get the greedy
    tokens of a roomy engine; every block is free at the end; fp32."""
    prompts, params = [[464, 2068, 7586], [15496, 11, 616]], greedy(16)
    roomy = [o.outputs[0].token_ids for o in LLM(str(tiny.path), device="cuda", dtype="float32", num_kv_tokens=4096)
             .generate(prompts, params)]
    launches = graph_launches(monkeypatch)
    llm = LLM(str(tiny.path), device="cuda", dtype="float32", num_kv_tokens=19, block_size=1, max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == roomy
    assert launches and llm.scheduler.num_preemptions > 0, (launches, llm.scheduler.num_preemptions)
    assert llm.kv.allocator.num_free() == llm.kv.num_blocks


@NO_GPU
def test_a_full_engine_admits_by_groups(tiny):
    """With CUDA graphs, requests that wait for a seat come in by groups, once an eighth of the seats are free (or
    as many as wait), so that fewer admissions end the runs of graph steps; eager steps let each one in as soon
    as a seat frees. The two give every request the same tokens (fp32)."""
    def run(cuda_graphs):
        llm = LLM(str(tiny.path), device="cuda", dtype="float32", num_kv_tokens=8192, max_num_seqs=32,
                  cuda_graphs=cuda_graphs)
        admissions, schedule = [], llm.scheduler.schedule  # (waiting before, let in) of each step that let some in

        def recorded(admit=True):
            waiting = len(llm.scheduler.waiting)
            scheduled = schedule(admit)
            if waiting > len(llm.scheduler.waiting):
                admissions.append((waiting, waiting - len(llm.scheduler.waiting)))
            return scheduled
        llm.scheduler.schedule = recorded
        outs = llm.generate([random_ids(5, i) for i in range(96)], [greedy(4 + 5 * i % 37) for i in range(96)])
        return [o.outputs[0].token_ids for o in outs], admissions

    eager, one_by_one = run(cuda_graphs=False)
    graphed, by_groups = run(cuda_graphs=True)
    assert any(n == 1 for w, n in one_by_one if w > 1), one_by_one
    assert all(n >= min(w, 32 // graph_runner.ADMIT_GROUP) for w, n in by_groups), by_groups
    assert graphed == eager


@NO_GPU
def test_unfused_epilogues_change_no_token(tiny):
    """fused=False (bias, GELU and residual adds as separate kernels) gives the same greedy tokens as the
    fused epilogues; fp32, where the two differ only in the last bits."""
    assert generate_greedy(tiny, dtype="float32", fused=False)[1] == \
        generate_greedy(tiny, dtype="float32", fused=True)[1]
