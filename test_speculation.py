"""Speculative decoding (speculation.py): drafts by n-gram or by a draft model, verified in the target's step, change
no token. The references: plain decoding's tokens (greedy and seeded), its log-probs, and the exact filtered
distribution of transformers' logits; the n-gram rule's own cases; the graph helpers' numpy twins (speculation.py)
for their kernels and the engine's emulated GPU; and a fault anywhere in a verifying step undone as any step is.
"""
import json
import shutil
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import graph_runner
import nanoinfer as ni
import speculation
from conftest import (CPU, EOT, EXACT_DEVICES, NO_GPU, Dev, Fault, chi2_critical, check_undone, greedy, hf_logits,
                      inject, make_llm, random_ids, write_checkpoint)
from nanoinfer import LLM, SamplingParams
from scheduler import Sequence

try:
    import cupy as cp
    from cuda_backend import CudaBackend
except ImportError:
    cp = None

rng = np.random.default_rng()

# -----------------------------------------------------------------------------
# the engine: no token changed

@pytest.mark.parametrize("dev", EXACT_DEVICES)
@pytest.mark.parametrize("method", ["ngram", "draft model: the target", "draft model: another"])
def test_speculation_changes_no_token(tiny, wide, dev, method):
    """speculative_config, vLLM's two ways: n-gram drafts, and a draft model (the target itself: nearly every draft
    kept; or another GPT-2 of the same vocabulary and a longer context). On prompts that repeat themselves drafts are
    proposed and some kept, each request counting its own, and every output is plain decoding's, token for token:
    greedy, seeded sampling (T 0.3), a stop string, n = 2, max_tokens edges, log-probs (within fp32's tolerance),
    penalties, a logit bias and min_tokens (a draft token counts as output for the rows after it), and a pool small
    enough to preempt; every block is free after. With batch_invariant=True the log-probs are bitwise plain decoding's.
    A bad config is refused, naming what is wrong."""
    rng = np.random.default_rng(4)
    prompts = [(lambda b: b * 3)(rng.integers(0, EOT, 8).tolist()) for _ in range(9)]
    params = [greedy(30), SamplingParams(max_tokens=30, temperature=0.3, seed=9, ignore_eos=True),
              greedy(30, n=2), greedy(1), greedy(2), SamplingParams(max_tokens=30, temperature=0, stop=["e"]),
              greedy(30, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.3, seed=2, repetition_penalty=1.2, frequency_penalty=0.3,
                             presence_penalty=0.2, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, min_tokens=20, logit_bias={int(prompts[8][0]): 2.0})]
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            "draft model: the target": {"model": str(tiny.path), "num_speculative_tokens": 3},
            "draft model: another": {"model": str(wide.path), "num_speculative_tokens": 2}}[method]
    for kw in (dict(), dict(num_kv_tokens=160, block_size=16)):
        plain = make_llm(tiny, dev, **kw).generate(prompts, params, use_tqdm=False)
        llm = make_llm(tiny, dev, speculative_config=spec, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in plain]
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in plain]
        for a, b in zip(outs[6:8], plain[6:8]):
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        s = llm.proposer
        assert s.proposed > s.accepted > 0, (s.proposed, s.accepted)
        assert (sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)) == (s.proposed,
                                                                                                     s.accepted)
        if method == "draft model: the target":  # (its logits unedited: no penalties, bias or bans to apply)
            unedited = [(o.num_draft_tokens, o.num_accepted_tokens) for o in outs[:7]]
            assert sum(a for _, a in unedited) > 0.9 * sum(d for d, _ in unedited), unedited
        assert llm.kv.allocator.num_free() == llm.kv.num_blocks and (llm.scheduler.num_preemptions > 0) == bool(kw)
    plain, outs = (make_llm(tiny, dev, batch_invariant=True, speculative_config=sc).generate(prompts[6:8], params[6:8],
                                                                                            use_tqdm=False)
                   for sc in (None, spec))
    assert [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs] == \
        [[(c.token_ids, c.logprobs) for c in o.outputs] for o in plain]
    for bad in ({"method": "draft"}, {"method": "ngram", "num_speculative_tokens": 0}, "ngram", 0, {},
                {"model": str(wide.path)}, {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}):
        with pytest.raises(ValueError, match="speculative_config"):
            make_llm(tiny, dev, speculative_config=bad)


def test_ngram_drafts():
    """The n-gram draft: what followed the latest earlier occurrence of the longest suffix (prompt_lookup_max down to
    _min) that occurred, copied a token at a time so that an occurrence near the end runs on into the draft (a loop
    of d tokens goes on repeating); as long as the room allows (k, and max_tokens - 1 more tokens); none without a
    match."""
    from speculation import NgramProposer
    ngram = NgramProposer({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}, 1024)

    def draft(ids, max_tokens=100, budget=100):
        p = types.SimpleNamespace(max_tokens=max_tokens)
        return ngram.propose(types.SimpleNamespace(token_ids=ids, params=p, num_output=0), budget)
    assert draft([9, 5, 6, 7, 8, 5, 6]) == [7, 8, 5, 6, 7]  # after "5 6": 7 8, then on into what it drafts
    assert draft([5, 6, 7, 1, 6, 7, 2, 6, 7]) == [2, 6, 7, 2, 6]  # the latest of two occurrences
    assert draft([4, 4, 4]) == [4] * 5 and draft([1, 2, 1, 2]) == [1, 2, 1, 2, 1]  # loops of 1 and 2
    assert draft([1, 2, 3, 7, 9, 3, 1, 2, 3]) == [7, 9, 3, 1, 2]  # "1 2 3" before "3" alone, though "3" is later
    assert draft([1, 2, 3]) == [] and draft([7]) == []  # no earlier occurrence
    assert draft([4, 4, 4], max_tokens=3) == [4, 4] and draft([4, 4, 4], budget=2) == [4, 4]


def test_speculation_waits_for_a_small_batch(tiny):
    """speculative_config's disable_by_batch_size (vLLM's): a step of more running sequences than it drafts nothing;
    as requests finish and the batch shrinks to it, drafting starts; every output is plain decoding's."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, EOT, 6).tolist() * 3 for _ in range(4)]
    params = [greedy(n) for n in (6, 12, 24, 40)]
    plain = make_llm(tiny, CPU).generate(prompts, params, use_tqdm=False)
    llm = make_llm(tiny, CPU, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "disable_by_batch_size": 2})
    steps, schedule = [], llm.scheduler.schedule

    def logged(**kw):
        running, scheduled = len(llm.scheduler.running), schedule(**kw)
        steps.append((running, sum(len(seq.draft) for seq, _ in scheduled)))
        return scheduled
    llm.scheduler.schedule = logged
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(drafts == 0 for running, drafts in steps if running > 2)
    assert any(drafts > 0 for running, drafts in steps if running <= 2) and llm.proposer.proposed > 0


def test_bench_speculation_lessons_keep_every_token(tmp_path):
    """bench's speculation lessons on the text model (text_model.speculation_lessons), run here on tiny 1024-position
    checkpoints on the CPU: each workload and method runs, and reports tokens identical to plain decoding."""
    import text_model
    paths = {"target": tmp_path / "target", "draft": tmp_path / "draft"}
    write_checkpoint(paths["target"], seed=0, n_layer=2, n_embd=64, n_positions=1024)
    write_checkpoint(paths["draft"], seed=1, n_layer=1, n_embd=64, n_positions=1024)
    lines = text_model.speculation_lessons(paths, repeats=1, n_new=8, device="cpu")
    assert len(lines) == 6 and all("tokens identical to plain decoding's" in line for line in lines), lines


def test_a_draft_model_of_another_vocabulary_or_a_shorter_context_is_refused(tiny, tmp_path):
    """A draft model whose token ids mean other bytes (two vocabulary entries swapped), or whose context is shorter
    than the target's, is refused with a ValueError that says which."""
    for what, edit in (("another vocabulary", "vocab.json"), ("a context of 64", "config.json")):
        d = tmp_path / edit
        shutil.copytree(tiny.path, d)
        data = json.loads((d / edit).read_text())
        if edit == "vocab.json":
            a, b = list(data)[300:302]
            data[a], data[b] = data[b], data[a]
        else:
            data["n_positions"] = data["n_ctx"] = 64
        (d / edit).write_text(json.dumps(data))
        with pytest.raises(ValueError, match=what):
            make_llm(tiny, CPU, speculative_config={"model": str(d), "num_speculative_tokens": 2})


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_speculation_samples_the_exact_distribution(tiny, dev):
    """With n-gram speculation on, unseeded requests (T 0.3, top-k 20) on a prompt that repeats itself: every token
    drawn, drafted and kept or sampled, follows the exact filtered distribution p of transformers' logits given the
    tokens before it. A token t gives u = p(tokens before t in id order) + V p(t), V uniform on [0, 1): u is uniform
    exactly when t is drawn from p, so u's counts in 20 equal bins pass a chi-square test (failing by chance about
    once in a million runs). Some drafted tokens are kept along the way."""
    rng = np.random.default_rng()  # the draws: unseeded requests, and V; the prompt: one the drafts often hit
    prompt, T, k = np.random.default_rng(2).integers(0, EOT, 6).tolist() * 3, 0.3, 20
    # one step a schedule: a graph run of 16 steps (no drafts in it) would finish most requests before they draft
    llm = make_llm(tiny, dev, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_scheduler_steps=1)
    outs = llm.generate([prompt] * 300, SamplingParams(max_tokens=12, temperature=T, top_k=k, ignore_eos=True))
    u = []
    for o in outs:
        toks = o.outputs[0].token_ids
        for t, row in zip(toks, hf_logits(tiny, prompt + toks)[len(prompt) - 1:-1]):
            p = ni.sampling_probs(row, T, k, 1.0, 0.0)
            p /= p.sum()
            u.append(p[:t].sum() + rng.random() * p[t])
    counts = np.bincount(np.minimum((np.array(u) * 20).astype(int), 19), minlength=20)
    chi2 = ((counts - len(u) / 20) ** 2 / (len(u) / 20)).sum()
    assert chi2 < chi2_critical(19), (chi2, counts)
    assert llm.proposer.accepted > 0.04 * len(u), (llm.proposer.accepted, len(u))  # ~10 % of them


VERIFY_POINTS = {"forward": (ni.GPT, "forward_on_device"), "judge": (speculation.Proposer, "count"),
                 "append": (Sequence, "append"), "spec_run": (speculation.SpecGraph, "run")}
VERIFY_CASES = [pytest.param(d.values[0], point, marks=d.marks, id=f"{point}-{d.id}") for d in EXACT_DEVICES
                for point in VERIFY_POINTS if d.values[0].device == "cuda" or point != "spec_run"]


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("dev,point", VERIFY_CASES)
def test_a_failed_verification_step_is_undone(tiny, dev, point, error, monkeypatch):
    """Speculative decoding on: an exception in the first step that verifies drafts (in its forward, while its
    draft rows are judged, while its kept tokens are appended; on the GPU also in a run of chained n-gram steps,
    speculation.SpecGraph) is undone as any step is, and every request then gets plain decoding's tokens: no
    rejected draft's KV is read or found in the prefix cache."""
    check_failed_verification(tiny, dev, point, error("injected"), monkeypatch)


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("point", ["spec_run", "append"])
def test_a_failed_speculating_run_is_undone_on_the_emulated_gpu(tiny, emulated_gpu, point, error):
    """The same through the graph runner's chained n-gram runs (SpecGraph) with the GPU emulated: an error or a
    Ctrl-C while a run's tokens are read, or while they are appended, is undone; every request then gets plain
    decoding's tokens and every block is free. (The fault's own monkeypatch: undoing it must leave the emulation in
    place.)"""
    with pytest.MonkeyPatch.context() as faults:
        check_failed_verification(tiny, Dev("cuda", "float32"), point, error("injected"), faults)


def check_failed_verification(tiny, dev, point, error, monkeypatch):
    llm = make_llm(tiny, dev, num_kv_tokens=64, block_size=4, max_num_batched_tokens=16,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # a step verifies host drafts, or (on the GPU) comes after drafts were verified there
    verifying = lambda: any(s.draft for s in llm.scheduler.running) or llm.proposer.proposed > 0  # noqa: E731
    check_undone(tiny, dev, llm, error, lambda: inject(monkeypatch, *VERIFY_POINTS[point], error, 1, verifying), 1,
                 monkeypatch, point)
    assert llm.proposer.proposed > 0


# -----------------------------------------------------------------------------
# the graphs that speculate, on the emulated GPU and on the GPU

@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 8), n=st.sampled_from(
    [(1, 1), (1, 4), (2, 3), (3, 3)]), max_tokens=st.integers(1, 12))
def test_ngram_propose_twin_drafts_what_the_host_drafts(ids, k, n, max_tokens):
    """ngram_propose's twin (and so the kernel: test_kernels.py) drafts what speculation.NgramProposer.propose does
    on the host, for short histories over 4 token ids (matches everywhere, loops), every n-gram range, drafts cut
    short by max_tokens and the context (48): a row's chunk is its last token, then the draft."""
    from speculation import NgramProposer
    n_ctx, T = 48, k + 1
    proposer = NgramProposer({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": n[0],
                              "prompt_lookup_max": n[1]}, n_ctx)
    want = proposer.propose(types.SimpleNamespace(token_ids=ids, params=types.SimpleNamespace(max_tokens=max_tokens),
                                                  num_output=0), budget=100)
    history = np.zeros(n_ctx, np.int32)
    history[:len(ids)] = ids
    length, remaining, ndraft = np.array([len(ids)]), np.array([min(max_tokens, n_ctx - len(ids))]), np.zeros(1, int)
    input_ids, *chunk = [np.zeros(T, np.int32) for _ in range(6)]
    speculation.ngram_propose(history, length, remaining, [0], ndraft, input_ids, *chunk, np.zeros(4, np.int32), 4, 16,
                              n_ctx, T, *n)
    assert ndraft[0] == len(want) and input_ids[0] == ids[-1] and input_ids[1:1 + len(want)].tolist() == want


def test_a_prompt_found_whole_in_the_prefix_cache_drafts_at_once(tiny, emulated_gpu):
    """A prompt found in the prefix cache up to its last token computes that token alone, a step shaped like a decode:
    with a draft model it drafts at once (a chained run: DraftGraph, the draft model's K/V of the cached prompt made
    first by catch_up), not after a plain run of 16. Its tokens are the eager engine's."""
    prompt = random_ids(2 * 16 + 1, 7)  # two full blocks cached, then its last token
    spec = {"model": str(tiny.path), "num_speculative_tokens": 3}
    graphed, eager = (LLM(str(tiny.path), device=d, num_kv_tokens=1024, speculative_config=spec) for d in ("cuda", "cpu"))
    for llm in (graphed, eager):
        llm.generate([prompt], greedy(2), use_tqdm=False)
    want, got = (llm.generate([prompt], greedy(8), use_tqdm=False)[0] for llm in (eager, graphed))
    assert got.num_cached_tokens == 32 and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_draft_tokens > 0, "the first decode step ran a plain 16-step run, no drafts"


@NO_GPU
@pytest.mark.parametrize("method", ["ngram", "draft model"])
def test_speculation_replays_cuda_graphs(tiny, method, monkeypatch):
    """Speculating (k = 3), a lone decode's steps run chained on the GPU: drafts made there (n-gram's SpecGraph, a
    draft model's DraftGraph, its forwards inside the graph) and verified as one chunk of k + 1 rows (a shorter draft
    padded), many steps a run; both give plain decoding's tokens, as the same engine's eager steps do: greedy and a
    seeded draw (T 0.8), on prompts that repeat themselves (so that n-gram drafts are found), up to max_tokens' edge
    (drafts cut short). The draft model is the target itself: its drafts are kept. fp32, as
    test_cuda_graphs_change_no_token."""
    spec_runs, spec_run = [], speculation.SpecGraph.run
    monkeypatch.setattr(speculation.SpecGraph, "run", lambda g, *a: spec_runs.append(g.T) or spec_run(g, *a))
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3},
            "draft model": {"model": str(tiny.path), "num_speculative_tokens": 3}}[method]
    plain, graphed, eager = (LLM(str(tiny.path), device="cuda", dtype="float32", num_kv_tokens=4096, cuda_graphs=on,
                                 speculative_config=sp) for on, sp in ((False, None), (True, spec), (False, spec)))
    prompts = [random_ids(n, n) * 4 for n in (3, 7, 12)]
    for params in (greedy(24), SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)):
        for p in prompts:  # one at a time: each step is lone
            want = plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
            for llm in (eager, graphed):
                assert llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert spec_runs and max(spec_runs) == 4, spec_runs
    s = graphed.proposer
    assert s.proposed >= s.accepted > 0
    if method == "draft model":
        assert s.accepted > 0.9 * s.proposed, (s.proposed, s.accepted)


@NO_GPU
@pytest.mark.parametrize("T", [2, 5, 9])
def test_speculation_kernels(T):
    """ngram_propose and spec_accept (SpecGraph's step around its verification chunk) and draft_inputs (DraftGraph's
    draft model steps) against their numpy twins (speculation.py): random histories over 4 token ids (many matches,
    loops), lengths 1-200, rows finished or near their last token, n-gram sizes 1-3 and a draft model's (n_max 0);
    sampled tokens that keep a random part of each draft. Every field any of them writes, poisoned first (-7), equal."""
    propose_np, accept_np = speculation.ngram_propose, speculation.spec_accept
    be, B, n_ctx, width, block_size = CudaBackend(np.float16), 37, 256, 17, 16
    ids = rng.integers(0, 4, (B, n_ctx)).astype(np.int32)
    length = rng.integers(1, 200, B).astype(np.int32)
    state = dict(history=ids.ravel(), length=length, remaining=rng.choice([0, 1, 2, 3, 50], B).astype(np.int32),
                 token_base=rng.integers(0, 99, B).astype(np.int32), ndraft=np.full(B, -7, np.int32))
    chunk = {f: np.full(n, -7, np.int32) for f, n in (("input_ids", B * T), ("positions", B * T), ("context_lens", B),
                                                       ("slot_mapping", B * T), ("row_len", B * T),
                                                       ("token_index", B * T))}
    tables = rng.integers(0, 500, (B, width)).astype(np.int32)
    order = ("input_ids", "positions", "slot_mapping", "context_lens", "row_len", "token_index")
    for n_min, n_max in ((1, 1), (1, 3), (2, 3), (0, 0)):
        host = {f: a.copy() for f, a in {**state, **chunk}.items()}
        dev = {f: cp.asarray(a) for f, a in host.items()}
        scalars = (width, block_size, n_ctx, T, n_min, n_max)
        propose_np(*(host[f] for f in ("history", "length", "remaining", "token_base", "ndraft")),
                   *(host[f] for f in order), tables, *scalars)
        be.launch("ngram_propose", (B,), (128,), (*(dev[f] for f in ("history", "length", "remaining", "token_base",
                                                                   "ndraft")), *(dev[f] for f in order),
                                                  cp.asarray(tables), *map(np.int32, scalars)))
        for f in host:
            assert (cp.asnumpy(dev[f]) == host[f]).all(), (f, n_min, n_max)
        assert (host["ndraft"] > 0).sum() > B // 4, host["ndraft"]  # drafts were made
        # sampled: each row keeps a random prefix of its draft, then a token unlike the next draft token
        keep = rng.integers(0, T, B)
        tokens = host["input_ids"].reshape(B, T)[:, 1:].copy()
        tokens = np.concatenate([tokens, np.zeros((B, 1), np.int32)], axis=1)
        tokens[np.arange(B), np.minimum(keep, T - 1)] = 9  # no draft token is 9
        tokens = tokens.ravel().astype(np.int32)
        ring = np.full((16, B, T + 2), -7, np.int32)
        step = rng.integers(0, 15, B).astype(np.int32)
        host_ring, dev_ring, host_step, dev_step = ring.copy(), cp.asarray(ring), step.copy(), cp.asarray(step)
        accept_np(tokens, host["input_ids"], host["ndraft"], host["history"], host["length"], host["remaining"],
                  host["token_base"], host_step, host_ring, B, T, n_ctx)
        be.launch("spec_accept", (1,), (128,), (cp.asarray(tokens), dev["input_ids"], dev["ndraft"], dev["history"],
                                                dev["length"], dev["remaining"], dev["token_base"], dev_step,
                                                dev_ring, np.int32(B), np.int32(T), np.int32(n_ctx)))
        for f in ("history", "length", "remaining", "token_base"):
            assert (cp.asnumpy(dev[f]) == host[f]).all(), f
        assert (cp.asnumpy(dev_step) == host_step).all() and (cp.asnumpy(dev_ring) == host_ring).all()
    host = {f: a.copy() for f, a in {**state, **chunk}.items()}
    dev = {f: cp.asarray(a) for f, a in host.items()}
    names = ("history", "length", "remaining", "token_base", *order[:4], "row_len", "token_index")
    for j in range(T):  # the draft model's forwards 0 .. k - 1 (2 queries a row, then 1), then the last store
        tokens, Q = rng.integers(0, 50, B).astype(np.int32), 0 if j == T - 1 else 2 if j == 0 else 1
        scalars = (width, block_size, n_ctx, T, j, Q, B)
        speculation.draft_inputs(tokens, *(host[f] for f in names), tables, *scalars)
        be.launch("draft_inputs", (1,), (128,), (cp.asarray(tokens), *(dev[f] for f in names), cp.asarray(tables),
                                                 *map(np.int32, scalars)))
        for f in host:
            assert (cp.asnumpy(dev[f]) == host[f]).all(), (f, j)
