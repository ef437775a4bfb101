"""Tensor parallelism (parallel.py): Megatron's split, its ranks threads of this process ("uni", the numpy twin) or a
process each ("mp", as on GPUs), against one rank: logits within the fp32 tolerance (and transformers'), greedy
tokens, log-probs and seeded samples the same; NCCL's collectives inside the CUDA graphs; and a rank that fails, dies,
hangs or cannot start ends the engine with an error naming it, never hangs it.
"""
import os
import signal
import threading

import pytest

import nanoinfer as ni
from conftest import (CPU, FAULT_PARAMS, FAULT_PROMPTS, NO_GPU, TOL, TWO_GPUS, Dev, Driver, Fault, check_undone,
                      hf_logits, inject, make_llm, random_ids, rel_err, solo)
from nanoinfer import LLM, SamplingParams


@pytest.mark.parametrize("size,executor", [(2, "uni"), (4, "uni"), (2, "mp")])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_tensor_parallel_changes_no_token(wide, size, executor, quantization):
    """tensor_parallel_size over Megatron's shards, its ranks threads of this process (the numpy twin: the all-reduces
    and the lm_head's gather as barriers) or processes (distributed_executor_backend="mp": each runs the engine, rank
    0 relaying its calls), against one rank, fp32: a prompt's logits within the fp32 tolerance (and transformers' too,
    unquantized), greedy tokens equal, log-probs within tolerance, seeded samples equal, with chunked prefill and a
    pool tight enough to preempt; each rank's KV tensors hold its heads only. A size that does not divide the heads,
    or an unknown executor, is refused."""
    reqs = [(random_ids(int(n), seed), SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, **kw))
            for seed, (n, kw) in enumerate([(30, dict(temperature=0)), (7, dict(temperature=0)),
                                            (50, dict(temperature=0.9, top_k=40, seed=3)),
                                            (19, dict(temperature=1.2, top_p=0.9, seed=4))])]
    one, ranks = (make_llm(wide, CPU, quantization=quantization, tensor_parallel_size=tp, num_kv_tokens=160,
                           max_num_batched_tokens=32, distributed_executor_backend=executor) for tp in (1, size))
    if executor == "uni":  # (the driver calls rank 0's forward alone: "mp" ranks forward only in the engine's steps)
        ids = random_ids(40, 9)
        want, got = (Driver(llm).step([(0, ids)])[0] for llm in (one, ranks))
        for llm in (one, ranks):
            llm.kv.free(0)  # the driver's blocks, before the engine's sequence 0
        assert rel_err(got, want) < TOL["float32"]
        if quantization is None:
            assert rel_err(got, hf_logits(wide, ids)) < TOL["float32"]
    outs = {tp: llm.generate([p for p, _ in reqs], [q for _, q in reqs], use_tqdm=False)
            for tp, llm in ((1, one), (size, ranks))}
    assert ranks.scheduler.num_preemptions > 0, "the pool did not force a preemption"
    for a, b in zip(outs[1], outs[size]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert ranks.kv.k[0].shape[2] == 4 // size
    if executor == "uni":
        assert all(kv.k[0].shape[2] == 4 // size for kv in ranks.model.rank_kv[1:])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(wide, CPU, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        make_llm(wide, CPU, tensor_parallel_size=2, distributed_executor_backend="ray")


TP_REQUESTS = [(30, dict(temperature=0)), (7, dict(temperature=0)), (50, dict(temperature=0.9, top_k=40, seed=3)),
               (19, dict(temperature=1.2, top_p=0.9, seed=4))]


def tp_outputs(llm):
    reqs = [(random_ids(n, seed), SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2, **kw))
            for seed, (n, kw) in enumerate(TP_REQUESTS)]
    return llm.generate([p for p, _ in reqs], [q for _, q in reqs], use_tqdm=False)


def assert_same_outputs(outs, want):
    for a, b in zip(outs, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


@NO_GPU
def test_nccl_collectives_run_inside_the_graphs(wide, monkeypatch):
    """Tensor parallelism's GPU path on one GPU: GPT's two all-reduces a layer and the lm_head's gather through NCCL
    (a communicator of one rank), in eager steps and captured in the CUDA graphs (decode runs, prefill graphs), fp32:
    greedy tokens, log-probs and seeded samples those of the engine without it."""
    import parallel
    from cupy.cuda import nccl
    from cuda_backend import NcclComm
    dev = Dev("cuda", "float32")
    want = tp_outputs(make_llm(wide, dev))
    comm = NcclComm(nccl.get_unique_id(), 0, 1)
    monkeypatch.setattr(parallel.Rank, "comm", comm)  # every engine's rank, made after this
    calls = []
    monkeypatch.setattr(NcclComm, "all_reduce", lambda self, x, f=NcclComm.all_reduce: calls.append(1) or f(self, x))
    for graphs in (True, False):
        llm = make_llm(wide, dev, cuda_graphs=graphs)
        assert llm.model.comm is comm and (llm.runner.graphs is not None) == graphs
        assert_same_outputs(tp_outputs(llm), want)
    assert len(calls) > 0


@TWO_GPUS
def test_tensor_parallel_on_two_gpus(wide):
    """tensor_parallel_size=2 on two GPUs (a process each, NCCL inside the graphs), fp32, against one GPU: greedy tokens
    equal, log-probs within 1e-4, seeded samples equal, each rank's KV holding its heads; a rank killed ends the engine
    (every request then finishes with an error naming it), never hangs it."""
    import os
    import signal
    dev = Dev("cuda", "float32")
    want = tp_outputs(make_llm(wide, dev))
    llm = make_llm(wide, dev, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert llm.kv.k[0].shape[2] == 2
    assert_same_outputs(tp_outputs(llm), want)
    llm.ranks.timeout = 10
    os.kill(llm.ranks.procs[0].pid, signal.SIGKILL)
    for _ in range(2):
        assert all(o.outputs[0].finish_reason == "error" and "rank 1" in o.error for o in tp_outputs(llm))
    assert not llm.has_unfinished() and llm.kv.allocator.num_free() == llm.kv.num_blocks


@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt], ids=["error", "interrupt"])
def test_a_failed_rank_is_undone(tiny, error, monkeypatch):
    """tensor_parallel_size=2 (the numpy twin): an exception in rank 1's forward, on its 3rd call, breaks the ranks'
    barriers, so rank 0 does not wait for it, and the step is undone as any step is (a Ctrl-C goes on, an error ends
    the requests it touched); afterwards the ranks run the same requests to one rank's outputs."""
    llm = make_llm(tiny, CPU, num_kv_tokens=64, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2)
    original, calls, error = ni.GPT.forward_on_device, [0], error("injected")

    def rank_1_fails(self, *args):
        if self.comm.rank == 1:
            calls[0] += 1
            if calls[0] == 3:
                raise error
        return original(self, *args)

    def arm():
        monkeypatch.setattr(ni.GPT, "forward_on_device", rank_1_fails)
        return calls
    check_undone(tiny, CPU, llm, error, arm, 3, monkeypatch, "rank 1's forward")


class RankOneFails(LLM):
    """An engine whose rank 1, in its own (spawned) process, raises Fault in its 30th forward: "mp" makes every rank
    with the LLM's class (it pickles: it is defined at module level)."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ranks.rank == 1:  # (the test's first requests take 24 forwards)
            inject(pytest.MonkeyPatch(), self.model, "forward", Fault("injected"), 30)


class RankOneCannotStart(LLM):
    """An engine whose rank 1 fails while it is made (in its own process, as "no memory left" would)."""
    def __init__(self, *args, **kwargs):
        import parallel
        if parallel.THIS_PROCESS is not None:
            raise MemoryError("no room for the weights")
        super().__init__(*args, **kwargs)


def test_a_rank_that_cannot_start_fails_the_llm(tiny):
    """distributed_executor_backend="mp": a rank whose engine cannot be made fails LLM() with an error naming it (and
    what it said), leaving no process behind."""
    import multiprocessing
    with pytest.raises(RuntimeError, match=r"rank 1 failed \(MemoryError: no room for the weights\)"):
        RankOneCannotStart(str(tiny.path), device="cpu", num_kv_tokens=64, tensor_parallel_size=2,
                           distributed_executor_backend="mp")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanoinfer rank")]


def test_the_watch_ends_an_engine_whose_rank_dies_not_an_idle_one(tiny):
    """parallel.watch, the thread that on GPUs ends an engine whose rank is lost while rank 0 may be waiting on its GPU,
    here over a CPU "mp" engine with a 1-second timeout: an engine idle past the timeout goes on; a rank killed
    ends it within seconds, with no step running."""
    import time
    import weakref
    import parallel
    llm = LLM(str(tiny.path), device="cpu", num_kv_tokens=64, tensor_parallel_size=2, distributed_executor_backend="mp")
    llm.ranks.timeout = 1
    llm.generate(FAULT_PROMPTS[:1], FAULT_PARAMS[:1], use_tqdm=False)
    threading.Thread(target=parallel.watch, args=(weakref.ref(llm.ranks),), daemon=True).start()
    time.sleep(2.5)
    assert llm.ranks.failed is None
    assert llm.generate(FAULT_PROMPTS[:1], FAULT_PARAMS[:1], use_tqdm=False)[0].outputs[0].finish_reason == "length"
    os.kill(llm.ranks.procs[0].pid, signal.SIGKILL)
    for _ in range(50):
        if llm.ranks.failed:
            break
        time.sleep(0.1)
    assert "rank 1 died" in (llm.ranks.failed or "")


@pytest.mark.parametrize("how", ["rank 1's error", "rank 0's error", "SIGKILL", "SIGSTOP"])
def test_rank_processes_a_lost_rank_ends_the_engine(tiny, how, monkeypatch):
    """distributed_executor_backend="mp" (a process a rank, each running the engine, rank 0 relaying its calls): a
    step that fails on one rank (an error in rank 1's process, or in rank 0's forward), a rank whose process dies, or
    one that stops answering (SIGSTOP, a 2-second timeout) ends the engine, never hangs it: each request, then and
    later, finishes at once with an error (naming the rank), every block free, no worker left; before, the ranks give
    one rank's outputs."""
    want = [solo(tiny, CPU, p, q) for p, q in zip(FAULT_PROMPTS, FAULT_PARAMS)]
    make = RankOneFails if how == "rank 1's error" else LLM
    llm = make(str(tiny.path), device="cpu", num_kv_tokens=64, tensor_parallel_size=2,
               distributed_executor_backend="mp")
    llm.ranks.timeout = 2
    first = llm.generate(FAULT_PROMPTS[:1], FAULT_PARAMS[:1], use_tqdm=False)[0]
    assert first.outputs[0].token_ids == want[0]
    why = {"rank 1's error": "rank 1 failed (Fault: injected)", "rank 0's error": "rank 0's step failed (Fault",
           "SIGKILL": "rank 1 died", "SIGSTOP": "rank 1 gave no answer in 2 s"}[how]
    if how.startswith("SIG"):
        os.kill(llm.ranks.procs[0].pid, getattr(signal, how))
    elif how == "rank 0's error":
        inject(monkeypatch, llm.model, "forward", Fault("injected"), 3)
    for again in (False, True):  # (the requests of the step that failed in rank 0 end with its own error)
        outs = llm.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "error" and (why in o.error or not again and "Fault: injected" in
                                                              o.error) for o in outs), [o.error for o in outs]
    assert not llm.has_unfinished() and llm.kv.allocator.num_free() == llm.kv.num_blocks
    assert not any(p.is_alive() for p in llm.ranks.procs)
