"""The CUDA-graph runner's host logic (graph_runner.py) on the CPU, the GPU emulated (conftest.emulated_gpu): CuPy's
arrays are numpy arrays, a captured graph is its step function called again at each replay, and the graph helpers'
kernels are their numpy twins (nanoinfer.decode_advance; speculation.py's). So what the runner decides runs in CI
against the eager engine's tokens: which batches a graph takes, the blocks plan_run reserves, runs of 16 steps with the
next launched ahead, rows moving to a smaller graph, padded prefill and verification chunks, a draft model's graphs.
The kernels and the capture itself are held to numpy on the GPU (test_kernels.py); the stress test runs on the
emulated GPU too (test_kv_scheduler.py).
"""
import graph_runner
import speculation
from conftest import greedy, random_ids
from nanoinfer import LLM, SamplingParams


def test_graph_runner_gives_the_eager_tokens(tiny, emulated_gpu, monkeypatch):
    """The engine with the graph runner against the same engine eager: greedy, seeded sampling and n = 2 requests of
    mixed lengths in one batch (runs of 16 steps, the next launched ahead, rows moving to smaller graphs as requests
    finish), then lone requests (padded prefill graphs); with a pool small enough to preempt; plain, with n-gram
    drafts and with a draft model (each one's steps chained on the GPU: SpecGraph and DraftGraph runs of up to 16
    steps, graphs of 1 and 8 rows among them). Each kind of graph is replayed, and every block is free after."""
    decodes, chunks, spec_runs = [], [], []
    launch, run, spec_run = graph_runner.DecodeGraph.launch, graph_runner.ChunkGraph.run, speculation.SpecGraph.run
    monkeypatch.setattr(graph_runner.DecodeGraph, "launch",
                        lambda g, seqs, s, plan: decodes.append((g.B, plan.num_steps, g)) or launch(g, seqs, s, plan))
    monkeypatch.setattr(graph_runner.ChunkGraph, "run",
                        lambda g, b, s: chunks.append((g.T, g.samples, g.B)) or run(g, b, s))
    monkeypatch.setattr(speculation.SpecGraph, "run",
                        lambda g, seqs, s, plan: spec_runs.append((type(g).__name__, g.B, plan.num_steps)) or
                        spec_run(g, seqs, s, plan))
    prompts = [random_ids(n, n) for n in (3, 17, 40, 64, 80)] + [random_ids(6, 2) * 5]
    params = [greedy(30), SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True), greedy(5),
              greedy(12, n=2), greedy(40), greedy(16)]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3},
                 {"model": str(tiny.path), "num_speculative_tokens": 3}):
        for pool in (4096, 160):
            graphed, eager = (LLM(str(tiny.path), device=d, num_kv_tokens=pool, speculative_config=spec)
                              for d in ("cuda", "cpu"))
            for batch in [slice(None)] + [slice(i, i + 1) for i in (0, 1, 5)]:
                before = [(llm.proposer.proposed, llm.proposer.accepted) for llm in (eager, graphed) if spec]
                want, got = ([[c.token_ids for c in o.outputs] for o in llm.generate(
                    prompts[batch], params[batch], use_tqdm=False)] for llm in (eager, graphed))
                assert got == want, (spec, pool, batch)
                if spec and "model" not in spec and batch.stop and pool > 160:  # alone (no eager steps beside),
                    # the GPU's n-gram drafts are the host's: as many verified, as many kept
                    (p0, a0), (p1, a1) = before
                    assert (graphed.proposer.proposed - p1, graphed.proposer.accepted - a1) == (
                        eager.proposer.proposed - p0, eager.proposer.accepted - a0), (spec, batch)
            assert graphed.kv.allocator.num_free() == graphed.kv.num_blocks
            assert not spec or graphed.proposer.accepted > 0
    assert {1, 2, 4, 8} <= {B for B, _, _ in decodes} and max(n for _, n, _ in decodes) == 16
    assert (64, 1, 1) in chunks, sorted(set(chunks))  # a lone prompt's prefill
    for kind in ("SpecGraph", "DraftGraph"):  # speculation chained on the GPU
        runs = [(B, n) for k, B, n in spec_runs if k == kind]
        assert {1, 8} <= {B for B, _ in runs} and max(n for _, n in runs) == 16, (kind, runs)


