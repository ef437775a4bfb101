"""The sampler: each backend's sample() against the one definition, nanoinfer's sample_row (greedy's first argmax, or
the exponential race: the kept token, by sampling_probs, with the largest logit / temperature + gumbel(sample_key(seed,
step))), and its draws against the exact renormalised distribution (chi-square).

The definition's kept set and probabilities are held to transformers' logits warpers in test_ops.py; here the numpy
sampler (CPU) and the CUDA kernel (NO_GPU) are held to the definition: the CPU bit for bit, the GPU to the same token
except at a near tie of the race (its logf and fp32 sums round differently). Then rows of only -inf, the race's noise
near u = 1, the exact threshold, batch invariance and too-wide rows; the sampler's ways (the race standing, the
head of candidates, the exact way over the whole row) each run under every test of a wide row.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import cuda_backend
import nanoinfer as ni
from conftest import NO_GPU, chi2_critical
from cuda_backend import CudaBackend
from nanoinfer import NumpyBackend

try:
    import cupy as cp
except ImportError:
    cp = None


SEED = int(np.random.SeedSequence().entropy % 2**32)
rng = np.random.default_rng(SEED)
ref = NumpyBackend(np.float64)  # the definition of every op, in float64


def near_race(logits, temperature, top_k, top_p, seed, step, min_p, token, rtol=1e-5):
    """Whether `token` wins the race when scores within rtol of each other may fall either way (the GPU's logf and
    fp32 sums round differently): it is kept by the definition, and its score is within rtol of the best. A greedy
    row (temperature 0) has no race: only the definition's token will do."""
    if temperature == 0:
        return False
    key = ni.sample_key(np.array([seed], np.uint64), np.array([step], np.int32))[0]  # arrays: uint64 wraps silently
    score = ni.race_scores(logits, temperature, top_k, top_p, key, min_p)
    best = score.max()
    return bool(np.isfinite(score[token]) and score[token] >= best - rtol * max(1.0, abs(best)))


def assert_draws_fit(toks, p):
    """The drawn tokens' frequencies fit the distribution p (chi-square, failing by chance about once in a million
    runs), and no token outside it is ever drawn."""
    N, counts = len(toks), np.bincount(toks, minlength=len(p))
    assert counts[p == 0].sum() == 0, "a token outside the kept set was drawn"
    big = N * p >= 5  # the tokens expected fewer than 5 times are pooled into one cell, as the test needs
    observed = np.append(counts[big], counts[~big & (p > 0)].sum())
    expected = np.append(N * p[big], N * p[~big].sum())
    cells = expected > 0
    if cells.sum() == 1:  # one token kept (~0.3 % of min-p 0.05 rows): no degrees of freedom, and the check above
        return            # has shown that every draw is that token
    chi2 = (((observed - expected)[cells] ** 2) / expected[cells]).sum()
    assert chi2 < chi2_critical(cells.sum() - 1), (chi2, cells.sum())


# -----------------------------------------------------------------------------
# the sampler against its definition

def test_sample_matches_definition(dev):
    """backend.sample against the sampler's definition, nanoinfer.sample_row (temperature, top-k, top-p, min-p, the
    race keyed by seed, step and token; greedy is the first argmax), on two sets of rows:
    - 12 random rows of 3000 logits, one setting each (top-k equal to V and min-p 1 among them), with seeds from the
      whole uint64 range (seed + step * c wraps around 2**64);
    - 39 rows at GPT-2's vocabulary, under greedy, temperature, top-k (also k > V), top-p, min-p and their mixes:
      plain, crowded (rounded logits: ties everywhere, warps with more than 16 candidates), and with a third of each
      row banned and some peaked; there the kernels split each row among 99 warps and both of the sampler's ways run
      (the race standing, the head, the exact way over the whole row).
    The numpy sampler picks the definition's token bit for bit; the GPU's may differ only at a near tie of the race.
    Merges test_sampler_follows_the_spec (the V = 3000 rows, every backend, held to a second sampler written in the
    tests, now gone: the definition is nanoinfer's) and test_sample_matches_definition (the V = 50257 rows, CUDA
    fp16), keeping every check of both."""
    be = ni.make_backend(dev.device, dev.dtype)
    row_sets = []  # (what, logits, temperature, top_k, top_p, min_p, seed, step)

    r, R, V = np.random.default_rng(5), 12, 3000
    logits = (r.standard_normal((R, V)) * 3).astype(np.float32)
    temp = np.array([0, 0.8, 1, 1.5, 0.8, 0.8, 1, 0.5, 2, 1, 0.7, 1.2], np.float32)
    top_k = np.array([0, 0, 40, 0, 1, 5, 0, 100, 0, 3000, 20, 0], np.int32)
    top_p = np.array([1, 1, 1, 0.9, 1, 0.5, 0.3, 0.95, 0.99, 1, 0.8, 0.05], np.float32)
    min_p = np.array([0, 0.1, 0, 0, 0, 0.3, 0, 0.01, 0.05, 1, 0, 0], np.float32)
    seed = r.integers(0, 2 ** 64, R, dtype=np.uint64)  # the whole range: seed + step * c wraps around 2**64
    step = r.integers(0, 500, R).astype(np.int32)
    row_sets.append(("V=3000", logits, temp, top_k, top_p, min_p, seed, step))

    V = 50257
    params = [(0.0, 0, 1.0, 0), (1.0, 0, 1.0, 0), (0.7, 50, 1.0, 0), (1.0, 0, 0.9, 0), (1.0, 20, 0.5, 0),
              (0.8, 1, 1.0, 0), (1.5, 0, 0.99, 0), (1.0, V + 5, 1.0, 0), (0.3, 0, 0.95, 0), (2.0, 1000, 0.8, 0),
              (1.0, 0, 1.0, 0.01), (0.8, 40, 0.9, 0.05), (2.0, 0, 1.0, 0.3)] * 3
    R = len(params)
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    logits[13:26] = np.round(logits[13:26])  # crowded: ties everywhere, warps with more than 16 candidates
    logits[26:, ::3] = -np.inf  # a third of each row banned
    logits[26:33] *= 4  # peaked
    temp = np.array([p[0] for p in params], np.float32)
    top_k = np.array([p[1] for p in params], np.int32)
    top_p = np.array([p[2] for p in params], np.float32)
    min_p = np.array([p[3] for p in params], np.float32)
    seed = rng.integers(0, 2**63, R, dtype=np.uint64)
    step = rng.integers(0, 1000, R).astype(np.int32)
    row_sets.append(("V=50257", logits, temp, top_k, top_p, min_p, seed, step))

    for what, logits, temp, top_k, top_p, min_p, seed, step in row_sets:
        R = len(logits)
        toks = np.asarray(be.sample(be.asarray(logits, np.float32), temp, top_k, top_p, seed, step, min_p))
        assert toks.dtype == np.int64 and toks.shape == (R,), (what, toks.dtype, toks.shape)
        keys = ni.sample_key(seed, step)
        for i in range(R):
            want = ni.sample_row(logits[i], temp[i], top_k[i], top_p[i], keys[i], min_p[i])
            setting = (float(temp[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]))
            message = f"{what} row {i} {setting}: got {toks[i]}, the definition picks {want} (seed={SEED})"
            if dev.device == "cpu":
                assert toks[i] == want, message
            else:
                assert toks[i] == want or near_race(logits[i], temp[i], top_k[i], top_p[i], int(seed[i]),
                                                    int(step[i]), min_p[i], toks[i]), message


def test_sample_row_of_only_neg_inf(dev):
    """A row whose every logit is -inf (everything banned) samples token 0 under every setting, argmax's first index,
    on every backend: never an id past the vocabulary."""
    V = 3000
    logits = np.full((4, V), -np.inf, np.float32)
    temp, top_k = np.float32([0, 1, 0.8, 1]), np.int32([0, 0, 40, 0])
    top_p, min_p = np.float32([1, 1, 0.9, 1]), np.float32([0, 0, 0, 0.1])
    be = ni.make_backend(dev.device, dev.dtype)
    with np.errstate(invalid="ignore"):  # the definition's p of a row of -inf is nan (kept nowhere)
        got = np.asarray(be.sample(be.asarray(logits, np.float32), temp, top_k, top_p, np.zeros(4, np.uint64),
                                   np.zeros(4, np.int32), min_p)).tolist()
    assert got == [0, 0, 0, 0]


@NO_GPU
def test_sample_greedy_and_batch_invariance():
    """Greedy is NumpyBackend.sample's argmax (ties: the first index); a seeded row samples the same token
    wherever it sits in the batch."""
    be = CudaBackend(np.float16)
    V, R = 50257, 16
    logits = rng.standard_normal((R, V)).astype(np.float32)
    logits[3, [10, 4000, 50000]] = 100.0
    greedy = (np.zeros(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32), np.zeros(R, np.uint64),
              np.zeros(R, np.int32), np.zeros(R, np.float32))
    toks = be.sample(cp.asarray(logits), *greedy)
    assert np.array_equal(toks, ref.sample(logits, *greedy)) and toks[3] == 10, toks
    t, k, p = np.full(R, 0.9, np.float32), np.full(R, 40, np.int32), np.full(R, 0.95, np.float32)
    s, st = np.full(R, 1234, np.uint64), np.full(R, 7, np.int32)
    row = np.broadcast_to(logits[5], (R, V)).copy()
    toks = be.sample(cp.asarray(row), t, k, p, s, st, np.zeros(R, np.float32))
    assert (toks == toks[0]).all()


@NO_GPU
def test_race_noise_where_u_nears_one():
    """The race's winners draw u near 1, where -log(u) is tiny: the kernel's noise is right to within rounding there
    too. Under one key, the token at u's top value (1 - 2^-24), and the one with the next largest noise, each race a
    rival whose logit puts it ahead or behind by a little (0.5, 0.005); the other rows are random."""
    be = CudaBackend(np.float32)
    V, R, r = 50257, 96, np.random.default_rng(SEED)
    logits = (r.standard_normal((R, V)) * 2).astype(np.float32)
    seed, step = r.integers(0, 2**63, R, dtype=np.uint64), np.zeros(R, np.int32)
    tries = ni.sample_key(np.arange(5000, dtype=np.uint64), np.zeros(5000, np.int32))
    seed[:4] = next(s for s, key in enumerate(tries) if ni.gumbel(key, V).max() > 16)  # a token at u's top value
    noise = ni.gumbel(tries[seed[0]], V)  # the definition's, in float32
    order = np.argsort(noise)[::-1]
    for row, near, margin in ((0, order[0], 0.5), (1, order[0], -0.5), (2, order[1], 0.005), (3, order[1], -0.005)):
        rival = order[V // 2]  # a token of middling noise
        logits[row] = -40
        logits[row, near] = 0
        logits[row, rival] = noise[near] - noise[rival] + margin  # the rival's score: near's + margin
    top_k, top_p = np.tile(np.int32([0, 0, 1000]), R // 3), np.tile(np.float32([1, 0.99, 1]), R // 3)
    top_k[:4], top_p[:4] = 0, 1
    temp, min_p = np.ones(R, np.float32), np.zeros(R, np.float32)
    toks = be.sample(cp.asarray(logits), temp, top_k, top_p, seed, step, min_p)
    keys = ni.sample_key(seed, step)
    for i in range(R):
        want = ni.sample_row(logits[i], temp[i], top_k[i], top_p[i], keys[i])
        assert toks[i] == want or near_race(logits[i], temp[i], top_k[i], top_p[i], int(seed[i]), 0, 0.0, toks[i]), \
            f"row {i}: got {toks[i]}, the definition picks {want} (seed={SEED})"
    assert [tok == order[V // 2] for tok in toks[:4]] == [True, False, True, False]  # the rows as built


@NO_GPU
def test_exact_threshold_tells_apart_logits_one_ulp_apart():
    """top-k 1000 on a row the warps' candidates cannot settle (the exact way: the row's threshold by bisection): the
    1000th and 1001st largest logits are one float apart, far below the max, and the 1001st has the row's largest
    noise, so keeping it by mistake makes it win. A linear scale from the row's least logit to its max ties the two,
    as a bisection by value alone would stop short of them: its last steps halve the bit patterns."""
    be = CudaBackend(np.float32)
    V, k, T = 4096, 1000, np.float32(1000)  # T: a logit moves a score by < 0.3, so the noise decides among the kept
    keys = ni.sample_key(np.arange(1000, dtype=np.uint64), np.zeros(1000, np.int32))
    seed = next(s for s, key in enumerate(keys) if np.diff(np.sort(ni.gumbel(key, V))[-2:])[0] > 0.5)
    order = np.argsort(ni.gumbel(keys[seed], V))[::-1]
    last, rest = order[0], order[1:]  # the 1001st: the largest noise
    logits = np.full(V, -200, np.float32)
    logits[rest[0]], logits[rest[1:999]], logits[rest[999]] = 100, 0, -50  # the max, 998 more, the 1000th
    logits[last] = np.nextafter(np.float32(-50), np.float32(-np.inf))
    scale = np.float32(4294967040) / np.float32(300)  # the tie a linear scale makes
    assert np.float32(100 - logits[last]) * scale == np.float32(100 - logits[rest[999]]) * scale
    got = be.sample(cp.asarray(logits[None]), np.float32([T]), np.int32([k]), np.float32([1]),
                    np.uint64([seed]), np.int32([0]), np.float32([0]))[0]
    assert got == ni.sample_row(logits, T, k, 1.0, keys[seed]) != last, got


@NO_GPU
def test_sample_refuses_rows_wider_than_shared_memory():
    """The sampler's exact way keeps a row in shared memory: a wider row is refused, not read past, and the engine
    refuses a model whose vocabulary is wider (use device='cpu')."""
    be = CudaBackend(np.float16)
    zeros = [np.zeros(1, t) for t in (np.float32, np.int32, np.float32, np.uint64, np.int32, np.float32)]
    with pytest.raises(ValueError, match=f"at most {cuda_backend.SAMPLE_MAX_V} logits"):
        be.sample(cp.zeros((1, cuda_backend.SAMPLE_MAX_V + 1), np.float32), *zeros)
    config = SimpleNamespace(head_dim=64, n_inner=3072, vocab_size=cuda_backend.SAMPLE_MAX_V + 1)
    with pytest.raises(ValueError, match="device='cpu'"):
        be.check_model(config)


# -----------------------------------------------------------------------------
# the sampler's distributions

@pytest.mark.parametrize("temperature,top_k,top_p,min_p,draws", [
    (1.0, 0, 1.0, 0.0, "fresh"), (0.7, 10, 1.0, 0.0, "fresh"), (1.3, 0, 0.8, 0.0, "fresh"),
    (1.0, 0, 1.0, 0.05, "fresh"), (0.9, 20, 0.9, 0.02, "fresh"), (1.0, 0, 1.0, 0.0, "five-tokens-seed-99"),
    (1.0, 1000, 1.0, 0.0, "wide"), (1.0, 0, 0.9, 0.0, "wide"), (0.8, 0, 1.0, 0.02, "wide")])
def test_sampler_distribution(dev, temperature, top_k, top_p, min_p, draws):
    """Draws from one row, each with its own (seed, step): the tokens' frequencies fit the exact renormalised
    temperature / top-k / top-p / min-p distribution (a chi-square test failing by chance about once in a million
    runs), and nothing outside it is ever drawn. "fresh": 30000 draws from 40 random logits, every seed and step
    random, unseeded (other draws every run). "five-tokens-seed-99": 20000 draws from the distribution
    (0.1, 0.2, 0.3, 0.05, 0.35), one request's steps 0..19999 under seed 99, whose frequencies are also within 0.015
    of the probabilities. "wide": 10000 draws from 4096 random logits, unseeded, where the GPU's head of candidates
    cannot hold top-k 1000 (the exact way over the row) and top-p or min-p alone mostly let the race over every token
    stand. Merges test_sampler_distribution (the fresh rows, every backend) and test_sample_distribution (the five
    tokens, CUDA fp16), keeping every check of both."""
    if draws in ("fresh", "wide"):
        rng, N = np.random.default_rng(), 30000 if draws == "fresh" else 10000
        logits = (rng.standard_normal(40 if draws == "fresh" else 4096) * 1.5).astype(np.float32)
    else:
        N = 20000
        logits = np.log(np.array([0.1, 0.2, 0.3, 0.05, 0.35], np.float32))
    p = ni.sampling_probs(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    p /= p.sum()
    be = ni.make_backend(dev.device, dev.dtype)
    full = lambda v, t: np.full(N, v, t)
    if draws in ("fresh", "wide"):
        seed, step = rng.integers(0, 2 ** 64, N, dtype=np.uint64), rng.integers(0, 1000, N).astype(np.int32)
    else:
        seed, step = np.full(N, 99, np.uint64), np.arange(N, dtype=np.int32)
    toks = np.asarray(be.sample(be.asarray(np.tile(logits, (N, 1)), np.float32), full(temperature, np.float32),
                                full(top_k, np.int32), full(top_p, np.float32), seed, step, full(min_p, np.float32)))
    assert_draws_fit(toks, p)
    if draws == "five-tokens-seed-99":
        freq = np.bincount(toks, minlength=5) / N
        assert np.abs(freq - np.exp(logits)).max() < 0.015, freq


