"""Every kernel of kernels.cu (through CudaBackend) against a float64 numpy reference.

Temporary file: the lead merges it into test_nanoinfer.py, where NumpyBackend replaces the small
references below. Fresh random inputs every run (the seed is printed on failure); every output is
poisoned with NaN before the launch, so an element the kernel forgot to write fails. Error =
max|ours - ref| / max|ref|: fp32 < 1e-4, fp16 < 1e-2, NaN never.
"""
import math
import types

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="cupy is not installed: the CUDA kernel tests need cupy and a GPU")


def _gpu_count():
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


pytestmark = pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA GPU visible (CUDA kernel tests need one)")

from nanoinfer import CudaBackend  # noqa: E402

TOL = {np.float16: 1e-2, np.float32: 1e-4}
DTYPES = [np.float16, np.float32]
SEED = int(np.random.SeedSequence().entropy % 2**32)
rng = np.random.default_rng(SEED)


@pytest.fixture(scope="module", params=DTYPES, ids=["fp16", "fp32"])
def be(request):
    b = CudaBackend(request.param)
    plain_empty = b.empty

    def poisoned_empty(shape, dtype=None):
        a = plain_empty(shape, dtype)
        a.fill(np.nan if a.dtype.kind == "f" else -7)
        return a

    b.empty = poisoned_empty
    return b


def check(ours, ref, dtype, what=""):
    ours = cp.asnumpy(ours).astype(np.float64)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert not np.isnan(ours).any(), f"{what}: NaN in the output (unwritten element?) seed={SEED}"
    err = np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < TOL[np.dtype(dtype).type], f"{what}: relative error {err:.3g} seed={SEED}"


def to_gpu(a, dtype):
    return cp.asarray(np.asarray(a, dtype=dtype))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# ---- matmul ----------------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 3, 17, 64, 65, 1000, 4096])
@pytest.mark.parametrize("N,K", [(2304 + 40, 776), (768, 3072)])
@pytest.mark.parametrize("epi", ["none", "bias_gelu", "bias_residual", "all"])
def test_matmul(be, M, N, K, epi):
    dt = be.dtype.type
    x = rng.standard_normal((M, K))
    w = rng.standard_normal((N, K)) / math.sqrt(K)
    bias = rng.standard_normal(N) if epi != "none" else None
    res = rng.standard_normal((M, N)) if epi in ("bias_residual", "all") else None
    gelu = epi in ("bias_gelu", "all")
    # the reference sees the inputs rounded to the kernel's dtype
    x, w = x.astype(dt).astype(np.float64), w.astype(dt).astype(np.float64)
    ref = x @ w.T
    if bias is not None:
        bias = bias.astype(dt).astype(np.float64)
        ref = ref + bias
    if gelu:
        ref = gelu_tanh(ref)
    if res is not None:
        res = res.astype(dt).astype(np.float64)
        ref = ref + res
    y = be.matmul(to_gpu(x, dt), to_gpu(w, dt), None if bias is None else to_gpu(bias, dt), gelu,
                  None if res is None else to_gpu(res, dt))
    check(y, ref, dt, f"matmul M={M} N={N} K={K} {epi}")


@pytest.mark.parametrize("M", [1, 64])
def test_matmul_lm_head_shape_and_repeat(be, M):
    # V = 50257 rows of w (odd N); run twice: split-K counters must reset, results must repeat exactly
    dt = be.dtype.type
    x = to_gpu(rng.standard_normal((M, 768)), dt)
    w = to_gpu(rng.standard_normal((50257, 768)) / math.sqrt(768), dt)
    ref = cp.asnumpy(x).astype(np.float64) @ cp.asnumpy(w).astype(np.float64).T
    y1 = be.matmul(x, w)
    check(y1, ref, dt, "lm_head")
    x2 = to_gpu(rng.standard_normal((M, 3072)), dt)
    w2 = to_gpu(rng.standard_normal((768, 3072)) / math.sqrt(3072), dt)
    a, b = be.matmul(x2, w2), be.matmul(x2, w2)
    assert cp.array_equal(a, b), "split-K matmul is not repeatable"


def test_matmul_bad_k():
    be = CudaBackend(np.float16)
    with pytest.raises(ValueError, match="multiple of 8"):
        be.matmul(cp.zeros((4, 100), np.float16), cp.zeros((8, 100), np.float16))


# ---- layernorm, embed, cache_write -----------------------------------------------------------
@pytest.mark.parametrize("T", [1, 3, 17, 1000])
@pytest.mark.parametrize("C", [768, 1600])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layernorm(be, T, C, with_residual):
    dt = be.dtype.type
    x = (rng.standard_normal((T, C)) * 2 + 0.5).astype(dt)
    w, b = rng.standard_normal(C).astype(dt), rng.standard_normal(C).astype(dt)
    res = (rng.standard_normal((T, C)) * 3).astype(dt)
    r_gpu = to_gpu(res, dt)
    y = be.layernorm(to_gpu(x, dt), to_gpu(w, dt), to_gpu(b, dt), 1e-5, r_gpu if with_residual else None)
    r = (res + x).astype(np.float64) if with_residual else x.astype(np.float64)  # numpy adds in dt
    if with_residual:
        assert np.array_equal(cp.asnumpy(r_gpu), res + x), "residual += x was not written back exactly"
    mean = r.mean(-1, keepdims=True)
    ref = (r - mean) / np.sqrt(r.var(-1, keepdims=True) + 1e-5) * w.astype(np.float64) + b.astype(np.float64)
    check(y, ref, dt, f"layernorm T={T} C={C}")


def test_embed(be):
    dt = be.dtype.type
    V, n_ctx, C, T = 1000, 1024, 768, 37
    wte, wpe = rng.standard_normal((V, C)).astype(dt), rng.standard_normal((n_ctx, C)).astype(dt)
    ids, pos = rng.integers(0, V, T).astype(np.int32), rng.integers(0, n_ctx, T).astype(np.int32)
    y = be.embed(to_gpu(wte, dt), to_gpu(wpe, dt), cp.asarray(ids), cp.asarray(pos))
    check(y, wte[ids].astype(np.float64) + wpe[pos].astype(np.float64), dt, "embed")


def test_cache_write(be):
    dt = be.dtype.type
    T, H, D, nb, bs = 37, 12, 64, 20, 16
    qkv = to_gpu(rng.standard_normal((T, 3 * H * D)), dt)  # k, v are strided views, as in the engine
    k, v = qkv[:, H * D:2 * H * D].reshape(T, H, D), qkv[:, 2 * H * D:].reshape(T, H, D)
    slots = rng.permutation(nb * bs)[:T].astype(np.int32)
    slots[rng.random(T) < 0.2] = -1
    kc0, vc0 = rng.standard_normal((nb, bs, H, D)).astype(dt), rng.standard_normal((nb, bs, H, D)).astype(dt)
    kc, vc = to_gpu(kc0, dt), to_gpu(vc0, dt)
    be.cache_write(k, v, kc, vc, cp.asarray(slots))
    keep = slots >= 0
    kc0.reshape(-1, H, D)[slots[keep]] = cp.asnumpy(k)[keep]
    vc0.reshape(-1, H, D)[slots[keep]] = cp.asnumpy(v)[keep]
    assert np.array_equal(cp.asnumpy(kc), kc0) and np.array_equal(cp.asnumpy(vc), vc0)


# ---- attention -------------------------------------------------------------------------------
def make_batch(seqs, dt, H=12, D=64, bs=16):
    """seqs: [(n_q, context_len)]. A paged cache full of NaN except the slots the sequences own;
    block ids scattered and non-increasing; q as a strided view into a qkv-shaped array."""
    S = len(seqs)
    n_q = np.array([s[0] for s in seqs])
    ctx = np.array([s[1] for s in seqs])
    nblk = -(-ctx // bs)
    num_blocks = int(nblk.sum()) + 7
    perm = rng.permutation(num_blocks)
    max_blocks = int(nblk.max())
    tables = np.zeros((S, max_blocks), np.int32)
    kc = np.full((num_blocks, bs, H, D), np.nan)
    vc = np.full((num_blocks, bs, H, D), np.nan)
    keys, vals, used = [], [], 0
    for s in range(S):
        tables[s, :nblk[s]] = np.sort(perm[used:used + nblk[s]])[::-1]  # scattered and decreasing
        used += nblk[s]
        kk = rng.standard_normal((ctx[s], H, D)).astype(dt).astype(np.float64)
        vv = rng.standard_normal((ctx[s], H, D)).astype(dt).astype(np.float64)
        j = np.arange(ctx[s])
        kc[tables[s, j // bs], j % bs] = kk
        vc[tables[s, j // bs], j % bs] = vv
        keys.append(kk)
        vals.append(vv)
    cu = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    T = int(cu[-1])
    qkv = rng.standard_normal((T, 3 * H * D)).astype(dt)
    q = qkv[:, :H * D].reshape(T, H, D).astype(np.float64)
    ref = np.zeros((T, H, D))
    scale = 1 / math.sqrt(D)
    for s in range(S):
        qs = q[cu[s]:cu[s + 1]]  # (n_q, H, D)
        sc = qs.transpose(1, 0, 2) @ keys[s].transpose(1, 2, 0) * scale  # (H, n_q, ctx)
        pos = ctx[s] - n_q[s] + np.arange(n_q[s])
        sc[:, np.arange(ctx[s])[None, :] > pos[:, None]] = -np.inf
        p = np.exp(sc - sc.max(-1, keepdims=True))
        ref[cu[s]:cu[s + 1]] = ((p / p.sum(-1, keepdims=True)) @ vals[s].transpose(1, 0, 2)).transpose(1, 0, 2)
    host = types.SimpleNamespace(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                                 slot_mapping=np.zeros(T, np.int32), cu_seqlens_q=cu,
                                 context_lens=ctx.astype(np.int32), block_tables=tables,
                                 logits_idx=(cu[1:] - 1).astype(np.int32))
    return host, to_gpu(qkv, dt)[:, :H * D].reshape(T, H, D), to_gpu(kc, dt), to_gpu(vc, dt), ref, scale


ATTENTION_CASES = {
    "decode": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 1023)],
    "prefill": [(17, 17), (16, 16), (64, 64), (1023, 1023)],
    "chunked_prefill": [(100, 1023), (64, 80), (5, 40), (16, 33), (129, 300)],
    "mixed": [(1, 500), (200, 200), (1, 17), (33, 1000), (3, 10), (1, 1), (70, 90)],
    "decode_batch": [(1, int(n)) for n in np.random.default_rng(SEED).integers(1, 700, 64)],
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(be, case):
    dt = be.dtype.type
    host, q, kc, vc, ref, scale = make_batch(ATTENTION_CASES[case], dt)
    batch = be.to_device(host)
    out = be.attention(q, kc, vc, batch, scale)
    check(out, ref, dt, f"attention {case}")


def test_attention_head_dim():
    be = CudaBackend(np.float16)
    host, q, kc, vc, ref, scale = make_batch([(1, 5)], np.float16, H=2, D=32)
    with pytest.raises(NotImplementedError, match="head_dim 64"):
        be.attention(q, kc, vc, be.to_device(host), scale)


# ---- sampling --------------------------------------------------------------------------------
def uniform(seed, step):
    m = (1 << 64) - 1
    z = (int(seed) + (int(step) + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return np.float32(z >> 40) * np.float32(2.0 ** -24)


def ref_sample(logits, temperature, top_k, top_p, seed, step):
    """API.md's definition; returns (token, kept p in vocab order (float64), r)."""
    if temperature == 0:
        return int(np.argmax(logits)), None, None
    p = np.exp((logits - logits.max()) / np.float32(temperature)).astype(np.float64)
    keep = np.ones_like(p, bool)
    if 0 < top_k < len(p):
        keep &= p >= np.sort(p)[-top_k]
    if top_p < 1:
        srt = np.sort(p[keep])[::-1]
        n = int(np.searchsorted(np.cumsum(srt), top_p * srt.sum()))  # first prefix reaching the target
        keep &= p >= srt[min(n, len(srt) - 1)]
    kept = np.where(keep, p, 0.0)
    r = float(uniform(seed, step)) * kept.sum()
    c = np.cumsum(kept)
    tok = int(np.searchsorted(c, r, side="right"))
    return (tok if tok < len(p) and keep[tok] else int(np.nonzero(keep)[0][-1])), kept, r


def test_sample_matches_definition():
    be = CudaBackend(np.float16)
    V = 50257
    params = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (1.0, 20, 0.5), (0.8, 1, 1.0),
              (1.5, 0, 0.99), (1.0, V + 5, 1.0), (0.3, 0, 0.95), (2.0, 1000, 0.8)] * 3
    R = len(params)
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    temp = np.array([p[0] for p in params], np.float32)
    top_k = np.array([p[1] for p in params], np.int32)
    top_p = np.array([p[2] for p in params], np.float32)
    seed = rng.integers(0, 2**63, R, dtype=np.uint64)
    step = rng.integers(0, 1000, R).astype(np.int32)
    toks = be.sample(cp.asarray(logits), temp, top_k, top_p, seed, step)
    assert toks.dtype == np.int64 and toks.shape == (R,)
    for i in range(R):
        ref, kept, r = ref_sample(logits[i], temp[i], top_k[i], top_p[i], seed[i], step[i])
        assert kept is not None or toks[i] == ref, f"row {i}: greedy gave {toks[i]}, argmax is {ref}"
        if toks[i] != ref:  # only acceptable at a rounding boundary of the running sum
            c = np.cumsum(kept)
            t = toks[i]
            assert kept[t] > 0 and abs(min(abs(c[t] - r), abs(c[t] - kept[t] - r))) < 1e-5 * c[-1], \
                f"row {i} {params[i]}: got {t}, definition says {ref} (seed={SEED})"


def test_sample_greedy_and_batch_invariance():
    be = CudaBackend(np.float16)
    V, R = 50257, 16
    logits = rng.standard_normal((R, V)).astype(np.float32)
    logits[3, [10, 4000, 50000]] = 100.0  # ties: the first index wins
    z = np.zeros(R, np.float32)
    toks = be.sample(cp.asarray(logits), z, np.zeros(R, np.int32), np.ones(R, np.float32),
                     np.zeros(R, np.uint64), np.zeros(R, np.int32))
    assert np.array_equal(toks, logits.argmax(-1)) and toks[3] == 10
    # a seeded row samples the same token wherever it sits in the batch
    t, k, p = np.full(R, 0.9, np.float32), np.full(R, 40, np.int32), np.full(R, 0.95, np.float32)
    s, st = np.full(R, 1234, np.uint64), np.full(R, 7, np.int32)
    row = np.broadcast_to(logits[5], (R, V)).copy()
    toks = be.sample(cp.asarray(row), t, k, p, s, st)
    assert (toks == toks[0]).all()


def test_sample_distribution():
    # 20000 draws (different steps) from a 5-token distribution match its probabilities
    be = CudaBackend(np.float16)
    R = 20000
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.05, 0.35], np.float32))
    toks = be.sample(cp.asarray(np.tile(logits, (R, 1))), np.ones(R, np.float32), np.zeros(R, np.int32),
                     np.ones(R, np.float32), np.full(R, 99, np.uint64), np.arange(R, dtype=np.int32))
    freq = np.bincount(toks, minlength=5) / R
    assert np.abs(freq - np.exp(logits)).max() < 0.015, freq
