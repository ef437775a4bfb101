"""The CUDA-graph runner's host logic (graph_runner.py) on the CPU, the GPU emulated: CuPy's arrays are numpy arrays, a
captured graph is its step function called again at each replay, and decode_advance is its numpy twin (below). So what
the runner decides runs in CI against the eager engine's tokens: which batches a graph takes, the blocks plan_run
reserves, runs of 16 steps with the next launched ahead, rows moving to a smaller graph, padded prefill and
verification chunks, a draft model's graphs. The kernels and the capture itself are held to numpy on the GPU
(test_kernels.py).
"""
import contextlib
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import conftest
import graph_runner
import nanoinfer
from conftest import Dev, greedy, random_ids
from nanoinfer import LLM, NumpyBackend, SamplingParams
from test_kv_scheduler import test_stress_every_request_gets_its_solo_output as stress_test


class DeviceArray(np.ndarray):
    """A CuPy array's host side: set (copy in) and get (copy out)."""
    def set(self, a, stream=None):
        self[...] = a

    def get(self, stream=None):
        return np.array(self)


def device(a):
    return np.asarray(a).view(DeviceArray)


class Nothing:  # a stream, an event, a device, a memory pool: ordering, waiting and pools are nothing on one thread
    malloc = None

    def __init__(self, *args, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    synchronize = record = __init__


FAKE_CUPY = types.SimpleNamespace(
    zeros=lambda *a, **k: device(np.zeros(*a, **k)), zeros_like=lambda *a, **k: device(np.zeros_like(*a, **k)),
    arange=lambda *a, **k: device(np.arange(*a, **k)), asarray=lambda a, dtype=None: device(np.array(a, dtype)),
    cuda=types.SimpleNamespace(Stream=Nothing, Event=Nothing, Device=Nothing, MemoryPool=Nothing,
                               using_allocator=lambda malloc: contextlib.nullcontext()))


def decode_advance(tokens, input_ids, positions, context_lens, slot_mapping, token_index, remaining, block_tables,
                   max_blocks, block_size, history, ring, ring_row, B):
    """kernels.cu's decode_advance in numpy: each row's token into the history ring; a live row moves on (its token
    becomes its input, its position, context and sampling counter step, its slot comes from its block table) or, after
    its last allowed step, becomes padding (slot -1)."""
    row = int(ring_row[0])
    ring_row[0] = row + 1
    history[row % ring, :B] = tokens[:B]
    live = np.flatnonzero(slot_mapping[:B] >= 0)
    remaining[live] -= 1
    slot_mapping[live[remaining[live] == 0]] = -1
    go = live[remaining[live] > 0]
    pos = positions[go] + 1
    input_ids[go], positions[go], context_lens[go], token_index[go] = tokens[go], pos, pos + 1, token_index[go] + 1
    blk = pos // block_size
    tables = block_tables.reshape(B, max_blocks)
    slot_mapping[go] = np.where(blk < max_blocks, tables[go, np.minimum(blk, max_blocks - 1)] * block_size +
                                pos % block_size, -1)


def ngram_propose(history, length, remaining, token_base, ndraft, input_ids, positions, slot_mapping, context_lens,
                  row_len, token_index, block_tables, width, block_size, n_ctx, T, n_min, n_max):
    """kernels.cu's ngram_propose in numpy, a row at a time: the row's draft by speculation.NgramProposer.propose's
    rule (the latest end of the longest match of its last n_min..n_max tokens, copied LZ77-style), then its chunk of T
    queries: last token, draft, pads at the last real position; a finished row is padding."""
    for b in range(len(length)):
        L, left, ids = int(length[b]), int(remaining[b]), history[b * n_ctx:(b + 1) * n_ctx]
        room = min(T - 1, left - 1) if left > 0 else 0
        best = max(((m, e) for e in range(L - 1) for m in [next((i for i in range(n_max + 1) if i == n_max or i > e or
                                                                  ids[e - i] != ids[L - 1 - i]))] if m >= n_min),
                   default=None) if room > 0 else None
        nd, rows = (room if best else 0), slice(b * T, (b + 1) * T)
        draft = [ids[best[1] + 1 + i % (L - 1 - best[1])] for i in range(nd)] if best else []
        j = np.arange(T)
        pos = np.where(left > 0, L - 1 + np.minimum(j, nd), 0)
        input_ids[rows] = ([ids[L - 1]] + draft + [0] * (T - 1 - nd)) if left > 0 else 0
        positions[rows] = pos
        tables = block_tables.reshape(-1, width)
        slot_mapping[rows] = np.where((left > 0) & (j <= nd), tables[b, pos // block_size] * block_size +
                                      pos % block_size, -1)
        token_index[rows] = token_base[b] + j
        row_len[rows] = (L if left > 0 else 1) + j
        ndraft[b], context_lens[b] = (nd if left > 0 else -1), (L if left > 0 else 1) + T - 1


def spec_accept(tokens, input_ids, ndraft, history, length, remaining, token_base, step, ring, B, T, n_ctx):
    """kernels.cu's spec_accept in numpy: each live row keeps its draft up to the first token sampled otherwise, and
    that token, appended to its history; the step's ring entry [a + 1, drafts verified, the kept tokens]."""
    for b in range(B):
        nd, L, entry = int(ndraft[b]), int(length[b]), ring[step[b], b]
        step[b] += 1
        if nd < 0:
            entry[:2] = 0
            continue
        a = next(i for i in range(nd + 1) if i == nd or tokens[b * T + i] != input_ids[b * T + i + 1])
        entry[:2], entry[2:3 + a] = (a + 1, nd), tokens[b * T:b * T + a + 1]
        history[b * n_ctx + L:b * n_ctx + L + a + 1] = tokens[b * T:b * T + a + 1]
        length[b], remaining[b], token_base[b] = L + a + 1, remaining[b] - a - 1, token_base[b] + a + 1


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
    ngram_propose(history, length, remaining, [0], ndraft, input_ids, *chunk, np.zeros(4, np.int32), 4, 16, n_ctx, T,
                  *n)
    assert ndraft[0] == len(want) and input_ids[0] == ids[-1] and input_ids[1:1 + len(want)].tolist() == want


class EmulatedGPU(NumpyBackend):
    """The numpy op set under the CUDA backend's name, with what the graph runner asks of it besides."""
    name, tile_min_q = "cuda", None  # fp32's attention plan: every query a row

    def sample_device(self, logits, *sampling):
        return device(self.sample(logits, *map(np.asarray, sampling)).astype(np.int32))

    def capture(self, stream, step):
        return types.SimpleNamespace(launch=lambda stream: step(), upload=lambda stream: None)

    def launch(self, name, grid, block, args):
        twin = {"decode_advance": decode_advance, "ngram_propose": ngram_propose, "spec_accept": spec_accept}[name]
        twin(*[a if isinstance(a, np.ndarray) and a.ndim else int(a) for a in args])

    def cache_write(self, k, v, k_cache, v_cache, slot_mapping):  # padding (slot -1) writes nothing, as the kernel
        keep = np.asarray(slot_mapping) >= 0
        super().cache_write(k[keep], v[keep], k_cache, v_cache, np.asarray(slot_mapping)[keep])


@pytest.fixture
def emulated_gpu(monkeypatch):
    """device="cuda" makes an EmulatedGPU; graph_runner imports the fake CuPy; solo runs are its own (all undone after
    the test)."""
    monkeypatch.setitem(sys.modules, "cupy", FAKE_CUPY)
    monkeypatch.setattr(conftest, "_solo_cache", {})
    monkeypatch.setattr(graph_runner, "cp", graph_runner.cp)
    make = nanoinfer.make_backend
    monkeypatch.setattr(nanoinfer, "make_backend", lambda d, t: EmulatedGPU() if d == "cuda" else make(d, t))


def test_graph_runner_gives_the_eager_tokens(tiny, emulated_gpu, monkeypatch):
    """The engine with the graph runner against the same engine eager: greedy, seeded sampling and n = 2 requests of
    mixed lengths in one batch (runs of 16 steps, the next launched ahead, rows moving to smaller graphs as requests
    finish), then lone requests (padded prefill graphs); with a pool small enough to preempt; plain, with n-gram
    drafts and with a draft model (decodes' verification chunks: one padded graph a bucket of sequences, 1 and 8
    among them; the draft model's steps: its own graphs, a run making a draft's tokens after its first at once). Each
    kind of graph is replayed, and every block is free after."""
    decodes, chunks, spec_runs = [], [], []
    launch, run, spec_run = graph_runner.DecodeGraph.launch, graph_runner.ChunkGraph.run, graph_runner.SpecGraph.run
    monkeypatch.setattr(graph_runner.DecodeGraph, "launch",
                        lambda g, seqs, s, plan: decodes.append((g.B, plan.num_steps, g)) or launch(g, seqs, s, plan))
    monkeypatch.setattr(graph_runner.ChunkGraph, "run",
                        lambda g, b, s: chunks.append((g.T, g.samples, g.B)) or run(g, b, s))
    monkeypatch.setattr(graph_runner.SpecGraph, "run",
                        lambda g, seqs, s, plan: spec_runs.append((g.B, plan.num_steps)) or spec_run(g, seqs, s, plan))
    prompts = [random_ids(n, n) for n in (3, 17, 40, 64, 80)] + [random_ids(6, 2) * 5]
    params = [greedy(30), SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True), greedy(5),
              greedy(12, n=2), greedy(40), greedy(16)]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3},
                 {"model": str(tiny.path), "num_speculative_tokens": 3}):
        for pool in (4096, 160):
            graphed, eager = (LLM(str(tiny.path), device=d, num_kv_tokens=pool, speculative_config=spec)
                              for d in ("cuda", "cpu"))
            for batch in [slice(None)] + [slice(i, i + 1) for i in (0, 1, 5)]:
                before = [(llm.speculator.proposed, llm.speculator.accepted) for llm in (eager, graphed) if spec]
                want, got = ([[c.token_ids for c in o.outputs] for o in llm.generate(
                    prompts[batch], params[batch], use_tqdm=False)] for llm in (eager, graphed))
                assert got == want, (spec, pool, batch)
                if spec and "model" not in spec and batch.stop and pool > 160:  # alone (no eager steps beside),
                    # the GPU's n-gram drafts are the host's: as many verified, as many kept
                    (p0, a0), (p1, a1) = before
                    assert (graphed.speculator.proposed - p1, graphed.speculator.accepted - a1) == (
                        eager.speculator.proposed - p0, eager.speculator.accepted - a0), (spec, batch)
            assert graphed.kv.allocator.num_free() == graphed.kv.num_blocks
            assert not spec or graphed.speculator.accepted > 0
            if spec and "model" in spec:  # the draft model's runs make its tokens after the first at once
                drafts = graphed.speculator.draft_step.__self__.runner.graphs.graphs.values()
                assert any(g in drafts and n == 2 for _, n, g in decodes)
    assert {1, 2, 4, 8} <= {B for B, _, _ in decodes} and max(n for _, n, _ in decodes) == 16
    assert {(64, 1, 1), (128, 1, 1), (4, 4, 1), (4, 4, 8)} <= set(chunks), sorted(set(chunks))  # draft model, k = 3
    assert {1, 8} <= {B for B, _ in spec_runs} and max(n for _, n in spec_runs) == 16  # n-gram: chained on the GPU


def test_a_prompt_found_whole_in_the_prefix_cache_drafts_at_once(tiny, emulated_gpu):
    """A prompt found in the prefix cache up to its last token computes that token alone, a step shaped like a decode:
    with a draft model (drafts made on the host) it runs one graph step, not a run of 16, so the next step verifies
    drafts. Its tokens are the eager engine's."""
    prompt = random_ids(2 * 16 + 1, 7)  # two full blocks cached, then its last token
    spec = {"model": str(tiny.path), "num_speculative_tokens": 3}
    graphed, eager = (LLM(str(tiny.path), device=d, num_kv_tokens=1024, speculative_config=spec) for d in ("cuda", "cpu"))
    for llm in (graphed, eager):
        llm.generate([prompt], greedy(2), use_tqdm=False)
    want, got = (llm.generate([prompt], greedy(8), use_tqdm=False)[0] for llm in (eager, graphed))
    assert got.num_cached_tokens == 32 and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_draft_tokens > 0, "the first decode step ran a plain 16-step run, no drafts"


def test_stress_on_the_emulated_gpu(tiny, wide, emulated_gpu):
    """test_kv_scheduler's hypothesis stress test with device="cuda" emulated: random requests arriving, aborted,
    preempted, speculating, each ending with its solo output, now through the graph runner's runs and chunks."""
    stress_test(tiny=tiny, wide=wide, dev=Dev("cuda", "float32"))


@pytest.mark.parametrize("error", ["error", "interrupt"])
@pytest.mark.parametrize("point", ["spec_run", "append"])
def test_a_failed_speculating_run_is_undone_on_the_emulated_gpu(tiny, emulated_gpu, point, error):
    """test_reliability's fault in a verification step, through the graph runner's chained n-gram runs (SpecGraph)
    with the GPU emulated: an error or a Ctrl-C while a run's tokens are read, or while they are appended, is undone;
    every request then gets plain decoding's tokens and every block is free. (The fault's own monkeypatch: undoing
    it must leave the emulation in place.)"""
    import test_reliability
    with pytest.MonkeyPatch.context() as faults:
        test_reliability.test_a_failed_verification_step_is_undone(
            tiny=tiny, dev=Dev("cuda", "float32"), point=point, monkeypatch=faults,
            error={"error": test_reliability.Fault, "interrupt": KeyboardInterrupt}[error])
