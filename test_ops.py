"""The numpy op set, nanoinfer.NumpyBackend (the definition every CUDA kernel is held to), against torch on the CPU, op
by op: embed, layernorm, matmul with each epilogue and the fused layernorm (and gelu_tanh itself), cache_write,
attention over block tables (decode, prefill, chunked prefill, mixed; batch_invariant on and off), penalize, greedy
sampling, and the sampler's filters (sampling_probs) against transformers' logits warpers.

Float64 throughout, on fresh random inputs every run: the seed is in every failure message, and
NANOINFER_OPS_SEED=<seed> runs a test on that seed again. The error is max|ours - ref| / max|ref| against torch in
float64, under the tolerance each test states: 1e-12 where both compute the same formula element by element, 1e-10
where their sums run in another order (matmul, layernorm, attention); equality, bit for bit, where an op only moves or
adds values (embed, cache_write) or picks a token (greedy); and NaN never. CPU only: these run on every machine.
"""
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nanoinfer as ni
from conftest import CPU, EOT, LOGIT_BIAS, attention_case, heads, make_llm, penalty_case, rel_err
from nanoinfer import NumpyBackend

SAME_FORMULA = 1e-12  # float64, both sides computing the same expression element by element
OTHER_ORDER = 1e-10  # float64, sums (dot products, means, softmax) that torch adds up in another order


@pytest.fixture
def seed():
    """A fresh seed for each test (NANOINFER_OPS_SEED=<seed> repeats one), printed too: pytest shows it on failure."""
    s = int(os.environ.get("NANOINFER_OPS_SEED") or np.random.SeedSequence().entropy % 2 ** 32)
    print(f"seed={s}")
    return s


def t64(a):
    """A float64 (or int64) torch tensor holding the numpy array's values."""
    a = np.asarray(a)
    return torch.from_numpy(np.ascontiguousarray(a, np.float64 if a.dtype.kind == "f" else np.int64))


def assert_close(ours, want, tol, what):
    """ours against the float64 reference: the same shape, no NaN or inf, max|ours - ref| / max|ref| < tol (rel_err,
    the metric of every comparison)."""
    ours, want = np.asarray(ours, np.float64), np.asarray(want, np.float64)
    assert ours.shape == want.shape, f"{what}: shape {ours.shape}, want {want.shape}"
    err = rel_err(ours, want)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g}"


def backend(batch_invariant=False):
    be = NumpyBackend(np.float64)
    be.batch_invariant = batch_invariant  # what LLM(batch_invariant=...) sets
    return be


# -----------------------------------------------------------------------------
# embed, layernorm, gelu_tanh

def test_embed(seed):
    """embed is wte[ids] + wpe[positions], for scattered and repeated ids and positions: torch's embedding lookups
    added, bit for bit."""
    r = np.random.default_rng(seed)
    V, n_ctx, C, T = 1000, 256, 64, 41
    wte, wpe = r.standard_normal((V, C)), r.standard_normal((n_ctx, C))
    ids, pos = r.integers(0, V, T).astype(np.int32), r.integers(0, n_ctx, T).astype(np.int32)
    ids[:3], pos[:3] = ids[3], pos[3]  # repeats
    ours = backend().embed(wte, wpe, ids, pos)
    want = (F.embedding(t64(ids), t64(wte)) + F.embedding(t64(pos), t64(wpe))).numpy()
    assert ours.dtype == np.float64 and np.array_equal(ours, want), f"embed differs from torch (seed={seed})"


@pytest.mark.parametrize("T,C", [(1, 64), (7, 768), (300, 128)])
def test_layernorm(seed, T, C):
    """layernorm(x, w, b, eps) is torch.nn.functional.layer_norm over the last axis (the biased variance), with a
    gain and bias that are not the identity and rows that are not centred: within 1e-10 in float64."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((T, C)) * 2 + r.standard_normal((T, 1)) * 3
    w, b = 1 + 0.5 * r.standard_normal(C), r.standard_normal(C)
    ours = backend().layernorm(x, w, b, 1e-5)
    want = F.layer_norm(t64(x), (C,), t64(w), t64(b), 1e-5).numpy()
    assert_close(ours, want, OTHER_ORDER, f"layernorm T={T} C={C} (seed={seed})")


def test_gelu_tanh(seed):
    """nanoinfer.gelu_tanh, GPT-2's GELU, is torch's F.gelu(approximate='tanh'), within 1e-12 in float64, on random
    inputs and far into both tails."""
    x = np.concatenate([np.random.default_rng(seed).standard_normal(10000) * 4, [-30, -10, -1e-3, 0, 1e-3, 10, 30]])
    assert_close(ni.gelu_tanh(x), F.gelu(t64(x), approximate="tanh").numpy(), SAME_FORMULA, f"gelu_tanh (seed={seed})")


# -----------------------------------------------------------------------------
# matmul: every epilogue, and the fused layernorm

# name: (bias, GELU, residual, layernorm first); the engine's are c_attn's ln_bias, c_proj's bias_residual, c_fc's
# ln_bias_gelu and the lm_head's ln
EPILOGUES = {"none": (False, False, False, False), "bias": (True, False, False, False),
             "bias_gelu": (True, True, False, False), "bias_residual": (True, False, True, False),
             "all": (True, True, True, False), "ln": (False, False, False, True), "ln_bias": (True, False, False, True),
             "ln_bias_gelu": (True, True, False, True), "ln_all": (True, True, True, True)}


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "invariant"])
@pytest.mark.parametrize("epi", list(EPILOGUES))
def test_matmul(seed, epi, batch_invariant):
    """matmul(x, w, bias, gelu, residual, ln) is F.linear(F.layer_norm(x) if ln else x, w, bias), then F.gelu(tanh),
    then + residual, for one row (decode) and many (prefill), within 1e-10 in float64. batch_invariant=True: the same,
    and each row's result is bit for bit that row's alone (no row's sums depend on the batch). The lm_head's
    out_dtype=float32: float32 logits within float32 rounding (1e-7) of the float64 result."""
    r = np.random.default_rng(seed)
    bias_on, gelu, residual_on, ln_on = EPILOGUES[epi]
    be, N, K = backend(batch_invariant), 96, 64
    for M in (1, 7, 100):
        x = r.standard_normal((M, K)) * 2 + 0.5
        w = r.standard_normal((N, K)) / math.sqrt(K)
        bias = r.standard_normal(N) if bias_on else None
        residual = r.standard_normal((M, N)) if residual_on else None
        ln = (1 + 0.5 * r.standard_normal(K), r.standard_normal(K), 1e-5) if ln_on else None
        ours = be.matmul(x, w, bias, gelu, residual, ln=ln)
        h = t64(x) if ln is None else F.layer_norm(t64(x), (K,), t64(ln[0]), t64(ln[1]), ln[2])
        y = F.linear(h, t64(w), None if bias is None else t64(bias))
        y = F.gelu(y, approximate="tanh") if gelu else y
        want = (y if residual is None else y + t64(residual)).numpy()
        what = f"matmul {epi} M={M} batch_invariant={batch_invariant} (seed={seed})"
        assert_close(ours, want, OTHER_ORDER, what)
        if batch_invariant:
            for i in sorted({0, M // 2, M - 1}):
                alone = be.matmul(x[i:i + 1], w, bias, gelu, None if residual is None else residual[i:i + 1], ln=ln)
                assert np.array_equal(alone[0], ours[i]), f"{what}: row {i} differs from its run alone"
        if epi == "ln":  # the lm_head's shape: fp32 logits
            logits = be.matmul(x, w, ln=ln, out_dtype=np.float32)
            assert logits.dtype == np.float32
            assert_close(logits, want, 1e-7, what + " out_dtype=float32")


# -----------------------------------------------------------------------------
# cache_write and attention over block tables

def test_cache_write(seed):
    """cache_write puts each token's k and v (strided views into qkv, as the engine slices them) in its slot of the
    paged cache: the cache equals torch's index_put_ of those rows into the (num_blocks * block_size, H, D) view, bit
    for bit, every other slot untouched."""
    r = np.random.default_rng(seed)
    T, H, D, nb, bs = 37, 4, 16, 20, 16
    qkv = r.standard_normal((T, 3 * H * D))
    slots = r.permutation(nb * bs)[:T].astype(np.int32)
    kc, vc = r.standard_normal((nb, bs, H, D)), r.standard_normal((nb, bs, H, D))
    want = [t64(c).clone() for c in (kc, vc)]
    for j, cache in ((1, want[0]), (2, want[1])):
        cache.view(-1, H, D).index_put_((t64(slots),), t64(heads(qkv, j, H)))
    backend().cache_write(heads(qkv, 1, H), heads(qkv, 2, H), kc, vc, slots)
    assert np.array_equal(kc, want[0].numpy()), f"K cache (seed={seed})"
    assert np.array_equal(vc, want[1].numpy()), f"V cache (seed={seed})"


ATTENTION_CASES = {  # [(queries this step, context length after it)] per sequence
    "decode": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 300)],
    "prefill": [(17, 17), (16, 16), (64, 64), (200, 200)],
    "chunked_prefill": [(100, 300), (64, 80), (5, 40), (16, 33), (129, 300)],
    "mixed": [(1, 500), (200, 200), (1, 17), (33, 400), (3, 10), (1, 1), (70, 90)],
    "decode_batch": None,  # 24 decodes of random context lengths, drawn from the test's seed
}


def attention_by_hand(q, k, v, k_cache, v_cache, batch, scale):
    """The reference: per sequence, its earlier K/V gathered token by token from the paged cache through its block
    table (token j in block block_table[j // bs], row j % bs), this step's k and v after them, and
    F.scaled_dot_product_attention with the causal mask of queries that are the last n_q tokens."""
    bs, out = k_cache.shape[1], []
    for s, ctx in enumerate(batch.context_lens):
        q0, q1 = batch.cu_seqlens_q[s], batch.cu_seqlens_q[s + 1]
        past, table = ctx - (q1 - q0), batch.block_tables[s]
        j = np.arange(past)
        K = np.concatenate([k_cache[table[j // bs], j % bs], k[q0:q1]])  # (ctx, H, D)
        V = np.concatenate([v_cache[table[j // bs], j % bs], v[q0:q1]])
        mask = np.arange(ctx)[None, :] <= past + np.arange(q1 - q0)[:, None]  # query i is token past + i
        o = F.scaled_dot_product_attention(*(t64(a).permute(1, 0, 2)[None] for a in (q[q0:q1], K, V)),
                                           attn_mask=torch.from_numpy(mask), scale=scale)
        out.append(o[0].permute(1, 0, 2).numpy())  # (n_q, H, D)
    return np.concatenate(out)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "invariant"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention(seed, case, batch_invariant):
    """attention over block tables for one flat batch (decode, prefill, chunked prefill and mixes; contexts at and
    around block edges; each sequence's blocks scattered in the pool; q, k, v strided views into qkv) is torch's
    scaled_dot_product_attention with a causal mask, per sequence, on K/V gathered by hand from the block table,
    within 1e-10 in float64, batch_invariant on and off. It reads no slot the sequences do not own (those hold NaN),
    and leaves this step's k and v in their slots, every other slot as it was."""
    r = np.random.default_rng(seed)
    H, D = 4, 64
    seqs = ATTENTION_CASES[case] or [(1, int(n)) for n in r.integers(1, 400, 24)]
    batch, qkv, kc, vc = attention_case(seqs, np.float64, r, H=H, D=D)
    q, k, v = (heads(qkv, j, H) for j in range(3))
    scale = 1 / math.sqrt(D)
    want = attention_by_hand(q, k, v, kc, vc, batch, scale)
    want_kc, want_vc = kc.copy(), vc.copy()
    blocks, rows = batch.slot_mapping // kc.shape[1], batch.slot_mapping % kc.shape[1]
    want_kc[blocks, rows], want_vc[blocks, rows] = k, v
    ours = backend(batch_invariant).attention(q, k, v, kc, vc, batch, scale)  # writes kc, vc
    assert_close(ours, want, OTHER_ORDER, f"attention {case} batch_invariant={batch_invariant} (seed={seed})")
    assert np.array_equal(kc, want_kc, equal_nan=True) and np.array_equal(vc, want_vc, equal_nan=True), \
        f"the KV cache after attention {case} (seed={seed})"


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "invariant"])
def test_int8_matmul(seed, batch_invariant):
    """quantize_int8: each row's scale is max|row| / 127 and every weight within half a step of q * scale, q in
    [-127, 127] (a zero row: scale 1, all zeros). matmul with the Int8Weight (W8A16) is F.linear(x, q) * scale, with
    the epilogue after: within 1e-10 in float64, one row and many."""
    from checkpoint import quantize_int8
    r = np.random.default_rng(seed)
    w = r.standard_normal((96, 64)) / 8
    w[5] = 0
    q = quantize_int8(w)
    assert q.q.dtype == np.int8 and np.abs(q.q.astype(int)).max() <= 127 and q.scale[5] == 1 and not q.q[5].any()
    assert np.allclose(np.delete(q.scale, 5), np.abs(np.delete(w, 5, 0)).max(1) / 127, rtol=1e-6)
    assert (np.abs(w - q.q * q.scale[:, None].astype(np.float64)) <= q.scale[:, None] * (0.5 + 1e-4)).all()
    be, bias = backend(batch_invariant), r.standard_normal(96)
    for M in (1, 9):
        x = r.standard_normal((M, 64))
        want = (F.linear(t64(x), t64(q.q.astype(np.float64))) * t64(q.scale.astype(np.float64)) + t64(bias)).numpy()
        assert_close(be.matmul(x, q, bias), want, OTHER_ORDER, f"int8 matmul M={M} (seed={seed})")


# -----------------------------------------------------------------------------
# penalize, and the sampler's definition where torch has the same op

def test_penalties_match_transformers(tiny, seed):
    """The numpy logits pass against transformers' RepetitionPenaltyLogitsProcessor (prompt and output),
    MinNewTokensLengthLogitsProcessor (the stop tokens and EOS banned before min_tokens) and SequenceBiasLogitsProcessor
    (OpenAI's logit_bias: one-token sequences), and against vLLM's definition of the presence and frequency penalties
    (output tokens only), one row each: on penalty_case's fp32
    logits (rtol 1e-6); then in float64 on fresh logits and histories, with the penalties as the op holds them
    (float32), within 1e-12 of max|ref| and the same tokens banned."""
    from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                              SequenceBiasLogitsProcessor)
    tok = make_llm(tiny, CPU).tokenizer
    logits, seqs = penalty_case(tok)
    ours = NumpyBackend().penalize(logits, ni.penalties([(s, 0) for s in seqs]))
    hf = lambda proc, s, row: proc(torch.tensor([s.token_ids]), torch.tensor(row[None]))[0].numpy()
    want = [hf(RepetitionPenaltyLogitsProcessor(1.3), seqs[0], logits[0])]
    row, s = logits[1].copy(), seqs[1]
    out = np.bincount(s.output_token_ids, minlength=row.size)
    bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in LOGIT_BIAS.items()])
    want.append(hf(bias, s, (row - 0.7 * (out > 0) - (-0.4) * out).astype(np.float32)))
    row, s = hf(RepetitionPenaltyLogitsProcessor(0.8), seqs[2], logits[2]), seqs[2]
    out = np.bincount(s.output_token_ids, minlength=row.size)
    row = row - (-1.5) * (out > 0) - 1.1 * out
    want.append(hf(MinNewTokensLengthLogitsProcessor(20, 60, [7, 11, EOT]), seqs[2], row.astype(np.float32)))
    np.testing.assert_allclose(ours, np.array(want), rtol=1e-6, atol=1e-6)
    assert np.isneginf(ours[2, [7, 11, EOT]]).all() and not np.isinf(ours[:2]).any()

    r, f32 = np.random.default_rng(seed), lambda v: float(np.float32(v))
    logits, seqs = penalty_case(tok, seed=seed)
    logits = logits + r.standard_normal(logits.shape) * 1e-3  # float64 values, not fp32 ones widened
    ours = NumpyBackend(np.float64).penalize(logits, ni.penalties([(s, 0) for s in seqs]))
    want = [hf(RepetitionPenaltyLogitsProcessor(f32(1.3)), seqs[0], logits[0])]
    out = np.bincount(seqs[1].output_token_ids, minlength=logits.shape[1])
    biased = np.zeros(logits.shape[1])
    biased[list(LOGIT_BIAS)] = [f32(b) for b in LOGIT_BIAS.values()]
    want.append(logits[1] - f32(0.7) * (out > 0) - f32(-0.4) * out + biased)
    row = hf(RepetitionPenaltyLogitsProcessor(f32(0.8)), seqs[2], logits[2])
    out = np.bincount(seqs[2].output_token_ids, minlength=logits.shape[1])
    want.append(hf(MinNewTokensLengthLogitsProcessor(20, 60, [7, 11, EOT]), seqs[2],
                   row - f32(-1.5) * (out > 0) - f32(1.1) * out))
    want = np.array(want)
    assert ours.dtype == np.float64 and np.array_equal(np.isneginf(ours), np.isneginf(want)), f"bans (seed={seed})"
    kept = ~np.isneginf(want)
    assert_close(ours[kept], want[kept], SAME_FORMULA, f"penalize in float64 (seed={seed})")


def test_greedy_is_torch_argmax(seed):
    """NumpyBackend.sample at temperature 0 is torch.argmax of each row, ties going to the first index, whatever the
    other settings, seeds and steps say."""
    r = np.random.default_rng(seed)
    R, V = 8, 5000
    logits = np.round(r.standard_normal((R, V)) * 3, 1).astype(np.float32)  # rounded: ties, some at the max
    logits[2, [10, 4000]] = logits[2].max() + 1  # a tie at the max, far apart
    logits[5, 7:] = -np.inf
    toks = NumpyBackend().sample(logits, np.zeros(R, np.float32), r.integers(0, 100, R).astype(np.int32),
                                 r.uniform(0.1, 1, R).astype(np.float32), r.integers(0, 2 ** 63, R, dtype=np.uint64),
                                 r.integers(0, 1000, R).astype(np.int32), r.uniform(0, 0.5, R).astype(np.float32))
    want = torch.argmax(torch.from_numpy(logits), dim=-1).numpy()
    assert toks.dtype == np.int64 and np.array_equal(toks, want) and toks[2] == 10, (toks, want, f"seed={seed}")


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.02), (1.3, 200, 1.0, 0.05), (1.0, 0, 1.0, 1.0),  # min-p
    (1.0, 0, 0.875, 0.0), (0.75, 0, 0.5, 0.0), (2.0, 0, 0.96875, 0.0),  # top-p
    (1.25, 50, 0.9375, 0.0), (0.5, 0, 0.75, 0.0625), (1.0, 40, 0.25, 0.03125)])  # their mixes
def test_sampling_probs_match_transformers(seed, temperature, top_k, top_p, min_p):
    """The tokens the sampler may pick (nanoinfer.sampling_probs > 0) and their probabilities are those transformers'
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper leave, applied in that order, on
    random float64 logits: four fixed rows (seed 3) and four fresh ones. Probabilities to rtol 1e-6, since the
    definition divides by temperature in fp32; the top-p cases use settings exact in fp32, so that the kept set
    cannot differ from transformers' by the rounding of top_p or of 1 / temperature at the boundary. Grown from
    test_min_p_matches_transformers (the min-p cases, on the fixed rows) to top-p."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    rows = np.concatenate([np.random.default_rng(3).standard_normal((4, 5000)) * 2,
                           np.random.default_rng(seed).standard_normal((4, 5000)) * 2])
    for i, row in enumerate(rows):
        p = ni.sampling_probs(row.copy(), temperature, top_k, top_p, min_p)
        ids, scores = torch.zeros(1, 1, dtype=torch.long), torch.tensor(row[None])
        warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + \
            ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else [])
        for warp in warpers:
            scores = warp(ids, scores)
        want = torch.softmax(scores, -1)[0].numpy()
        what = f"row {i} ({'fixed, seed 3' if i < 4 else f'fresh, seed={seed}'})"
        assert np.array_equal(p > 0, want > 0), f"{what}: kept {(p > 0).sum()}, transformers {(want > 0).sum()}"
        assert np.allclose(p / p.sum(), want, rtol=1e-6, atol=1e-12), what  # T in fp32
