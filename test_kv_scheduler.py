"""The paged KV cache and the scheduler: the block allocator, block tables and slots, the CUDA-graph run plan (plain
Python), and a property-based stress test of continuous batching (hypothesis).

The references are the definitions themselves: token j of a sequence lives in slot block_table[j // bs] * bs + j % bs;
a block is free or in tables, never both, and its reference count is how many tables hold it (check_kv, conftest.py);
and whatever arrives, is preempted or aborted, every request ends with its solo output.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st, target

import graph_runner
import nanoinfer as ni
from conftest import (EXACT_DEVICES, SAMPLED, Dev, check_kv, greedy, make_llm, num_gpus, random_ids, solo,
                      solo_prompt_logprobs)
from nanoinfer import SamplingParams
from paged_kv import BlockAllocator, PagedKVCache, block_hashes
from scheduler import Sequence


# -----------------------------------------------------------------------------
# the block allocator, block tables and slots

def test_block_allocator():
    """Allocate all, run dry with an error, release, no double free, ref counts follow."""
    a = BlockAllocator(4)
    got = [a.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and a.num_free() == 0 and list(a.ref_count) == [1] * 4
    with pytest.raises(RuntimeError):
        a.allocate()
    a.release(got[2])
    assert a.num_free() == 1 and a.ref_count[got[2]] == 0
    with pytest.raises(RuntimeError):
        a.release(got[2])
    assert a.allocate() == got[2]


def test_prefix_cache_blocks():
    """The prefix cache's blocks: a full computed block is named by its hash chain and found again by another
    sequence with the same first tokens (not past the block holding its last token, nor a block still partial); a
    freed named block stays findable until handed out, the least recently freed first and, of one sequence, its last
    blocks first; a block found while free leaves the free list; reset forgets every name."""
    kv = PagedKVCache(ni.NumpyBackend(), n_layer=1, n_head=1, head_dim=4, num_blocks=8, block_size=4)
    a = list(range(100, 111))  # 11 tokens: blocks of 4, 4, 3
    kv.grow("a", 11)
    kv.name_computed("a", a, 11)  # the third block is partial: not named
    assert len(kv.allocator.cached) == 2 and kv.named["a"] == list(block_hashes(a[:8], 4))
    assert kv.take_cached("b", a[:8] + [7, 7]) == 8 and kv.block_tables["b"] == kv.block_tables["a"][:2]
    assert kv.take_cached("c", a[:8]) == 4  # its last token's block it computes itself
    assert kv.take_cached("d", [9] + a[1:8]) == 0 and "d" not in kv.block_tables  # the chain: block 2 needs block 1
    assert list(kv.allocator.ref_count[kv.block_tables["a"]]) == [3, 2, 1]
    for s in ("b", "c"):
        kv.free(s)
    table = kv.block_tables["a"]
    kv.free("a")
    check_kv(kv)
    assert kv.allocator.num_free() == 8 and list(kv.allocator.free)[-3:] == table[::-1]  # last block freed first
    assert kv.take_cached("e", a) == 8 and kv.allocator.num_free() == 6  # found while free: off the free list
    kv.free("e")
    got = [kv.allocator.allocate() for _ in range(6)]  # the never-used blocks first, then the last block freed
    assert table[0] not in got and table[1] not in got and len(kv.allocator.cached) == 2
    kv.allocator.allocate()  # now the oldest named block, a's second (freed before its first): it is forgotten
    assert kv.take_cached("f", a) == 4
    kv.reset_prefix_cache()
    assert kv.take_cached("g", a) == 0 and not kv.allocator.cached
    assert (kv.queries, kv.hits) == (10 + 8 + 8 + 11 + 11 + 11, 8 + 4 + 8 + 4)


def test_paged_kv_tables_and_slots():
    """Block tables grow block by block, slots follow block_table[j // bs] * bs + j % bs, free returns all."""
    kv = PagedKVCache(ni.NumpyBackend(), n_layer=1, n_head=2, head_dim=4, num_blocks=6, block_size=4)
    assert kv.k[0].shape == (6, 4, 2, 4)
    kv.grow("a", 5), kv.grow("b", 3), kv.grow("a", 9)
    check_kv(kv)
    ta = kv.block_tables["a"]
    assert len(ta) == 3 and len(kv.block_tables["b"]) == 1 and not kv.can_fit("b", 13) and kv.can_fit("b", 12)
    bt = kv.block_table_array(["b", "a"])
    pos = np.arange(3, 9)
    assert kv.slot_mapping(bt, np.ones(6, int), pos).tolist() == [ta[j // 4] * 4 + j % 4 for j in pos]
    assert bt.shape == (2, 3) and bt[1].tolist() == ta and bt[0, 0] == kv.block_tables["b"][0]
    kv.free("a"), kv.free("b")
    check_kv(kv)
    assert kv.allocator.num_free() == 6


def test_graph_run_plan_reserves_its_blocks_or_is_none():
    """graph_runner.plan_run (plain Python, no GPU): a run of decode steps takes the most steps (halving from the cap,
    and no more than any sequence may still take) whose blocks the free list holds, reserves them, and maps each
    row's first token to its slot; a sequence with fewer steps left is padding after them. When not even one more
    step fits there is no run, and no block is taken (the planner once mapped a slot past the block table)."""
    kv = PagedKVCache(ni.NumpyBackend(), n_layer=1, n_head=1, head_dim=4, num_blocks=14, block_size=1)
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(max_tokens=m), 0, None) for i, m in enumerate((16, 16, 2))]
    for s in seqs:  # each has sampled one token, whose block the scheduler reserved (position 3)
        s.token_ids.append(7)
        kv.grow(s.seq_id, 4)
    plan = graph_runner.plan_run(kv, seqs, 0, 16, n_ctx=128)  # 2 free: 15 steps need 28 more blocks, 3 need 4
    assert plan.num_steps == 1 and plan.remaining.tolist() == [15, 15, 1] and kv.allocator.num_free() == 2
    check_kv(kv)
    seqs[2].finish_reason = "length"  # done (its one step taken): a padding row from now on
    kv.free(2)
    plan = graph_runner.plan_run(kv, seqs, 0, 16, n_ctx=128)  # 6 free: 3 steps need 2 blocks each
    tables = [kv.block_tables[s] for s in (0, 1)]
    assert plan.num_steps == 3 and [len(t) for t in tables] == [6, 6] and kv.allocator.num_free() == 2
    assert plan.positions.tolist()[:2] == [3, 3] and plan.slot_mapping.tolist()[:2] == [tables[0][3], tables[1][3]]
    assert plan.slot_mapping[2] == -1 and plan.remaining[2] == 0 and 2 not in kv.block_tables
    assert graph_runner.plan_run(kv, seqs[:2], 3, 16, n_ctx=128).num_steps == 1  # 3 steps ahead: one more block each
    assert graph_runner.plan_run(kv, seqs[:2], 4, 16, n_ctx=128) is None  # 4 ahead: no free block left
    assert [len(kv.block_tables[s]) for s in (0, 1)] == [7, 7] and kv.allocator.num_free() == 0
    check_kv(kv)


# -----------------------------------------------------------------------------
# the property-based stress: continuous batching gives every request its solo output

# (prompt length, max_tokens, arrival step, sampled, seed, abort step or None, samples n)
REQUEST = st.tuples(st.integers(1, 40), st.integers(1, 16), st.integers(0, 8), st.booleans(), st.integers(0, 2 ** 20),
                    st.one_of(st.none(), st.none(), st.integers(0, 30)), st.sampled_from([1, 1, 1, 2, 3]))
STRESS_EXAMPLES = int(os.environ.get("NANOINFER_STRESS_EXAMPLES", 20))  # raised before resolving engine changes


stress = settings(max_examples=STRESS_EXAMPLES, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
stress_cases = given(reqs=st.lists(REQUEST, min_size=2, max_size=6), block_size=st.sampled_from([1, 4, 16, 32]),
                     slack=st.sampled_from([0, 0, 1, 16, 64]), max_batched=st.sampled_from([3, 8, 32, 2048]),
                     max_seqs=st.sampled_from([1, 2, 32]),  # 32: more than any run holds (6 x 3); 6 graph buckets
                     speculate=st.sampled_from([None, None, ("ngram", 1, None), ("ngram", 3, None), ("ngram", 3, 2),
                                                ("tiny", 2, None), ("wide", 3, None)]))


@pytest.mark.parametrize("dev", EXACT_DEVICES)
@stress
@stress_cases
def test_stress_every_request_gets_its_solo_output(tiny, wide, dev, reqs, block_size, slack, max_batched, max_seqs,
                                                   speculate):
    """See check_stress."""
    check_stress(tiny, wide, dev, reqs, block_size, slack, max_batched, max_seqs, speculate)


@stress
@stress_cases
def test_stress_on_the_emulated_gpu(tiny, wide, emulated_gpu, reqs, block_size, slack, max_batched, max_seqs,
                                    speculate):
    """check_stress with device="cuda" emulated (conftest.emulated_gpu): now through the graph runner's runs and
    chunks."""
    check_stress(tiny, wide, Dev("cuda", "float32"), reqs, block_size, slack, max_batched, max_seqs, speculate)


def check_stress(tiny, wide, dev, reqs, block_size, slack, max_batched, max_seqs, speculate):
    """Random requests (greedy or seeded sampling; a quarter with prompt log-probs, some with log-probs or penalties; a
    third opening alike, for the prefix cache; a fifth repeating themselves, for n-gram drafts; speculation on in 5 runs
    of 7: n-gram, k = 1 or 3 (once drafting only while at most 2 run), or a draft model, the target itself or another,
    k = 2 or 3; two tensor-parallel ranks when the first request's seed is odd, on the CPU as processes when it is 3
    mod 4, else threads, on GPUs (two or more) a process each) arriving while others run, some aborted at a random
    step, on random pools (down to the smallest that fits the largest request), block sizes and budgets: every request
    finishes with its solo output (alone, no speculation, one rank; an aborted one: a prefix of it) and its prompt
    log-probs (each prompt token's once, within 1e-4 of solo's), the allocator invariants hold after every step, and no
    block leaks."""
    work = []
    for length, max_tokens, arrival, sampled, seed, abort, n in reqs:
        extra = dict(n=n, prompt_logprobs=1 if seed % 4 == 0 else None, logprobs=1 if seed % 7 == 3 else None)
        if seed % 6 == 5:  # penalties: a draft's rows count the draft tokens before them as output
            extra.update(repetition_penalty=1.3, frequency_penalty=0.2)
        params = SamplingParams(seed=seed, **extra, **{**SAMPLED, "max_tokens": max_tokens}) if sampled else \
            greedy(max_tokens, **extra)
        ids = random_ids(length, seed)
        if seed % 3 == 1:  # a third open with the same 24 tokens: the prefix cache shares their blocks
            ids = (random_ids(24, 7) + ids)[:length]
        if seed % 5 == 2:  # a fifth repeat themselves: n-gram drafts find what came next
            ids = (ids[:max(1, length // 3)] * 3)[:length]
        work.append((arrival, ids, params, abort))
    biggest = max(-(-(len(p) + q.max_tokens) // block_size) for _, p, q, _ in work) * block_size
    method, k, max_batch = speculate or (None, 0, None)
    spec = None if not k else {"method": "ngram", "num_speculative_tokens": k} if method == "ngram" else \
        {"model": str({"tiny": tiny, "wide": wide}[method].path), "num_speculative_tokens": k}
    if max_batch:
        spec["disable_by_batch_size"] = max_batch
    llm = make_llm(tiny, dev, block_size=block_size, num_kv_tokens=biggest + slack,
                   max_num_batched_tokens=max_batched, max_num_seqs=max_seqs, speculative_config=spec,
                   tensor_parallel_size=1 + reqs[0][4] % 2 if dev.device == "cpu" or num_gpus() > 1 else 1,
                   distributed_executor_backend="mp" if reqs[0][4] % 4 == 3 else None)  # None: GPUs' "mp"
    pending, ids, done, aborts, t, idle = sorted(work, key=lambda w: w[0]), {}, {}, {}, 0, 0
    while pending or llm.has_unfinished():
        while pending and (pending[0][0] <= t or not llm.has_unfinished()):
            _, prompt, params, abort = pending.pop(0)
            rid = llm.add_request(prompt, params)
            ids[rid] = (prompt, params)
            if abort is not None:
                aborts.setdefault(t + abort, []).append(rid)
        llm.abort_request(aborts.pop(t, []))
        events = llm.step()
        for rid, _, _, out in events:
            if out is not None:
                done[rid] = out
        check_kv(llm.kv)
        t, idle = t + 1, 0 if events else idle + 1
        assert idle < 200, "200 steps without a new token: the engine is stuck"
    assert set(done) == set(ids)
    for rid, (prompt, params) in ids.items():
        want = solo(tiny, dev, prompt, params)
        for sample, w in zip(done[rid].outputs, want if params.n > 1 else [want]):
            if sample.finish_reason == "abort":
                assert sample.token_ids == w[:len(sample.token_ids)]
            else:
                assert sample.token_ids == w and sample.finish_reason == "length"
        if params.prompt_logprobs is not None and done[rid].outputs[0].finish_reason != "abort":
            got, want = done[rid].prompt_logprobs, solo_prompt_logprobs(tiny, dev, prompt)
            assert len(got) == len(prompt) and got[0] is None
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for g, w, t in zip(got[1:], want[1:], prompt[1:]))
    assert llm.kv.allocator.num_free() == llm.kv.num_blocks
    target(float(llm.scheduler.num_preemptions), label="preemptions")  # steer the search toward pressure
    target(float(llm.kv.hits), label="prefix cache hits")  # and toward shared blocks
    target(float(llm.proposer.accepted if llm.proposer else 0), label="accepted drafts")
