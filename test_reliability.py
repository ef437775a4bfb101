"""Nothing wedges the engine: bad input and arguments are refused alone, a fault at any call of a step is undone,
aborts, streams left early, nested streams, threads sharing an engine, a real Ctrl-C, the size of the KV pool, two
engines on one GPU.

The reference is the engine itself: after whatever went wrong nothing is left queued, every block is free, and every
request that was not refused or aborted finishes with its solo output (the tokens it gets run alone).
"""
import json
import os
import select
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import graph_runner
import nanoinfer as ni
from conftest import (CPU, EOT, EXACT_DEVICES, HERE, NO_GPU, Fault, assert_idle,
                      check_undone, finish_by_steps, greedy, inject, make_llm, random_ids, solo, tokens,
                      write_checkpoint)
from nanoinfer import LLM, SamplingParams
from paged_kv import PagedKVCache
from scheduler import Sequence


# -----------------------------------------------------------------------------
# bad input and arguments: refused, naming what is wrong, and the rest run on

def test_too_long_prompt_refused_alone(tiny):
    """A prompt of n_ctx tokens is refused with an error about the context, where README says: its RequestOutput's
    `error`, its one sample's text empty; the requests beside it finish. Each output gives back its prompt's text, a
    string's or a {"prompt": ...} dict's, as vLLM's does (None for token ids)."""
    llm = make_llm(tiny, CPU)
    long = "a " * tiny.n_ctx
    outs = llm.generate(["Hello world", random_ids(tiny.n_ctx, 5), {"prompt": "I"}, {"prompt": long}], greedy(5))
    assert outs[1].outputs[0].finish_reason == "error" and "context" in outs[1].error
    assert (outs[1].outputs[0].text, outs[1].outputs[0].stop_reason) == ("", None)
    assert [o.prompt for o in outs] == ["Hello world", None, "I", long] and outs[3].error
    assert [o.outputs[0].finish_reason for o in (outs[0], outs[2])] == ["length"] * 2
    assert outs[0].outputs[0].token_ids == solo(tiny, CPU, outs[0].prompt_token_ids, greedy(5))
    with pytest.raises(ValueError, match="context"):
        llm.add_request(random_ids(tiny.n_ctx + 3, 5), greedy(5))
    with pytest.raises(ValueError):  # a token id outside the vocabulary
        llm.add_request([15496, EOT + 1], greedy(5))
    assert not llm.has_unfinished() and llm.kv.allocator.num_free() == llm.kv.num_blocks


def test_prompt_forms(tiny):
    """A prompt's token ids come as a list, a tuple, a numpy array or vLLM's {"prompt_token_ids": ...}, all the same
    ids; ids outside the vocabulary, floats, bools, nested or ragged lists are refused, naming the accepted forms."""
    tok = make_llm(tiny, CPU).tokenizer
    ids = [15496, 0, EOT]
    for form in (ids, tuple(ids), np.array(ids), np.array(ids, np.int32), [np.int64(i) for i in ids],
                 {"prompt_token_ids": ids}):
        got = tok.prompt_ids(form)
        assert got == ids and all(type(i) is int for i in got), form
    assert tok.prompt_ids([]) == [EOT]  # unconditional: from the end-of-text token
    for bad in ([15496, EOT + 1], [-1], [1.0, 2.0], [True, False], [[1, 2], [3, 4]], [1, [2]], ["a"], [2 ** 70]):
        with pytest.raises(ValueError, match="a prompt is a string"):
            tok.prompt_ids(bad)


def test_request_that_never_fits_the_pool_is_refused(tiny):
    """With a 32-token pool, a request that may need 50 tokens is refused; a small one beside it finishes."""
    llm = make_llm(tiny, CPU, num_kv_tokens=32, block_size=16)
    small, big = random_ids(5, 6), random_ids(10, 7)
    outs = llm.generate([small, big], [greedy(10), greedy(40)])
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].error
    assert outs[0].outputs[0].finish_reason == "length" and tokens(outs[0]) == solo(tiny, CPU, small, greedy(10))
    with pytest.raises(ValueError):
        llm.add_request(big, greedy(40))
    assert not llm.has_unfinished() and llm.kv.allocator.num_free() == llm.kv.num_blocks


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("top_k", 2.0), ("top_k", True), ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", None), ("logprobs", -1),
    ("logprobs", 21),
    ("seed", -3), ("seed", 2 ** 64), ("stop", [""]), ("stop", 5), ("ignore_eos", 1), ("temperature", float("inf")),
    ("min_p", -0.1), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 17), ("repetition_penalty", 0),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("stop_token_ids", [-1]), ("stop_token_ids", "a"),
    ("include_stop_str_in_output", 1), ("n", 0), ("n", 257), ("n", 2.0), ("n", True)])
def test_bad_sampling_values_raise(field, value):
    """Each bad sampling value raises ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("name,value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("block_size", 0), ("block_size", -4), ("block_size", 2.0),
    ("num_kv_tokens", 0), ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5), ("seed", -1),
    ("num_scheduler_steps", 0), ("cuda_graphs", "yes"), ("dtype", "int8"), ("device", "tpu"),
    ("batch_invariant", 1), ("tensor_parallel_size", 0), ("tensor_parallel_size", 2.0)])
def test_bad_engine_arguments_raise(tiny, name, value):
    """Each bad constructor argument raises ValueError naming it, before anything loads (max_num_seqs=0 once
    made generate spin forever; block_size=0 divided by zero)."""
    with pytest.raises(ValueError, match=name):
        LLM(str(tiny.path), **{"device": "cpu", name: value})


def test_bad_params_in_a_list_refuse_that_prompt_only(tiny):
    """params=[ok, {}]: the second prompt is refused with an error naming SamplingParams, the first finishes."""
    llm = make_llm(tiny, CPU)
    outs = llm.generate(["Hello", "world"], [greedy(3), {}])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error"] and "SamplingParams" in outs[1].error
    assert_idle(llm)


def test_huge_top_k_is_off(tiny):
    """top_k past the vocabulary (even past int32) means off; it once raised OverflowError inside every later step."""
    llm = make_llm(tiny, CPU)
    out = llm.generate(["Hello"], SamplingParams(top_k=2 ** 31, max_tokens=4, seed=3))[0]
    assert out.outputs[0].finish_reason == "length"
    assert tokens(out) == tokens(llm.generate(["Hello"], SamplingParams(top_k=0, max_tokens=4, seed=3))[0])
    assert llm.generate(["Hello"], greedy(4))[0].outputs[0].finish_reason == "length"
    assert_idle(llm)


# -----------------------------------------------------------------------------
# faults: a step that fails is undone

FAULT_POINTS = {  # a step's calls, in order; the last four exist only in CUDA-graph runs
    "schedule": lambda llm: (type(llm.scheduler), "schedule"), "grow": lambda llm: (PagedKVCache, "grow"),
    "make_batch": lambda llm: (ni, "make_batch"), "forward": lambda llm: (ni.GPT, "forward_on_device"),
    "sample": lambda llm: (type(llm.backend), "sample"), "postprocess": lambda llm: (LLM, "_postprocess"),
    "append": lambda llm: (Sequence, "append"), "token_bytes": lambda llm: (type(llm.tokenizer), "token_bytes"),
    "finish": lambda llm: (type(llm.scheduler), "remove"),
    "plan_run": lambda llm: (graph_runner, "plan_run"), "launch": lambda llm: (graph_runner.DecodeGraph, "launch"),
    "carry_on": lambda llm: (graph_runner.DecodeGraph, "carry_on"),
    "tokens": lambda llm: (graph_runner.GraphRun, "tokens"),
}
GRAPH_ONLY = ("plan_run", "launch", "carry_on", "tokens")
FAULT_CASES = [pytest.param(d.values[0], point, marks=d.marks, id=f"{point}-{d.id}") for d in EXACT_DEVICES
               for point in FAULT_POINTS if d.values[0].device == "cuda" or point not in GRAPH_ONLY]


@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("error", [Fault, KeyboardInterrupt], ids=["error", "interrupt"])
@pytest.mark.parametrize("dev,point", FAULT_CASES)
def test_a_failed_step_is_undone(tiny, dev, point, error, at, monkeypatch):
    """An exception at any call of a step (prefill and decode; eager and CUDA-graph runs), on its 1st or 3rd call,
    with chunked prefill, a pool tight enough to preempt and prompts that share cached blocks: a Ctrl-C goes on to the
    caller, and the requests of others that the step touched go back to waiting intact (they finish with their solo
    output); an error ends the requests it touched with finish_reason 'error' (the rest finish as solo). Afterwards
    nothing is left, every block is free, and the same requests give a fresh engine's output (so no block whose KV
    the failed step left unfinished is found in the prefix cache)."""
    llm = make_llm(tiny, dev, num_kv_tokens=64, block_size=4, max_num_batched_tokens=16, num_scheduler_steps=2)
    error = error("injected")
    check_undone(tiny, dev, llm, error, lambda: inject(monkeypatch, *FAULT_POINTS[point](llm), error, at), at,
                 monkeypatch, point)


def test_a_failing_sequence_append_leaves_none_stuck(tiny, monkeypatch):
    """The reproducer: Sequence.append raising once (between the KV write and the new token) left a sequence that
    was never scheduled again, holding its seat; with max_num_seqs=2 the next generate hung."""
    llm = make_llm(tiny, CPU, max_num_seqs=2)
    inject(monkeypatch, Sequence, "append", KeyboardInterrupt(), 1)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], greedy(4))
    assert_idle(llm)
    assert tokens(llm.generate(["c"], greedy(4))[0]) == solo(tiny, CPU, llm.tokenizer.encode("c"), greedy(4))


# -----------------------------------------------------------------------------
# aborts, streams, threads and Ctrl-C

@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_abort_request(tiny, dev):
    """abort_request stops a running and a waiting request at once (blocks freed before the next step), each with
    a last event, finish_reason 'abort', its tokens a prefix of its solo output; the others finish as solo; an
    unknown id is ignored."""
    llm = make_llm(tiny, dev, max_num_seqs=2)
    prompts = [random_ids(6 + i, 20 + i) for i in range(4)]
    ids = [llm.add_request(p, greedy(100)) for p in prompts]
    done = {}
    for _ in range(2):  # a prefill, and a decode step (or a run of up to 16)
        done.update((rid, out) for rid, _, _, out in llm.step() if out is not None)
    free_before = llm.kv.allocator.num_free()
    llm.abort_request([ids[0], ids[3], 12345])  # running; waiting (max_num_seqs=2); unknown
    assert llm.kv.allocator.num_free() > free_before
    done.update(finish_by_steps(llm))
    assert set(done) == set(ids)
    for rid, p in zip(ids, prompts):
        want = solo(tiny, dev, p, greedy(100))
        if rid in (ids[0], ids[3]):
            got = tokens(done[rid])
            assert done[rid].outputs[0].finish_reason == "abort" and got == want[:len(got)]
        else:
            assert done[rid].outputs[0].finish_reason == "length" and done[rid].outputs[0].token_ids == want
    assert done[ids[3]].outputs[0].token_ids == []
    assert_idle(llm)


@pytest.mark.parametrize("how", ["break", "close", "consumer raises"])
@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_a_stream_left_early_aborts_its_requests(tiny, dev, how):
    """Breaking out of a stream, closing it, or an exception in its consumer aborts its requests at once: no block
    stays taken, nothing is computed for them later."""
    llm = make_llm(tiny, dev)
    prompts = [random_ids(8, 30), random_ids(9, 31), random_ids(3, 32)]
    if how == "break":
        for _ in llm.stream(prompts, greedy(40)):
            break  # the loop drops the generator: CPython closes it at once
    elif how == "close":
        stream = llm.stream(prompts, greedy(40))
        next(stream)
        stream.close()
    else:
        with pytest.raises(ZeroDivisionError):
            for _ in llm.stream(prompts, greedy(40)):
                1 / 0
    assert_idle(llm)
    assert tokens(llm.generate(["Hi"], greedy(5))[0]) == solo(tiny, dev, llm.tokenizer.encode("Hi"), greedy(5))


def run_with_timeout(fn, timeout=120):
    """fn() in a thread; a hang fails the test after `timeout` s instead of hanging it (no assertion about speed)."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s: hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_streams_inside_a_stream(tiny, dev):
    """A generate and a second stream run inside a stream's loop: every call gets its own requests' events, and all
    finish with their solo outputs (a stream once dropped the events of others' requests and never ended)."""
    llm, prompts = make_llm(tiny, dev), [random_ids(5 + i, 40 + i) for i in range(5)]

    def nested():
        outer, inner = {}, {}
        for k, (i, _, _, out) in enumerate(llm.stream(prompts[:2], greedy(10))):
            if k == 0:
                inner["generate"] = llm.generate(prompts[2:4], greedy(6))
                inner["stream"] = [o for *_, o in llm.stream(prompts[4:], greedy(7)) if o is not None]
            if out is not None:
                outer[i] = out
        return outer, inner
    outer, inner = run_with_timeout(nested)
    got = [outer[0], outer[1]] + inner["generate"] + inner["stream"]
    lengths = [10, 10, 6, 6, 7]
    assert [o.outputs[0].token_ids for o in got] == [solo(tiny, dev, p, greedy(n)) for p, n in zip(prompts, lengths)]
    assert_idle(llm)


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_threads_share_one_engine(tiny, dev):
    """Four threads call generate on one LLM at once, three times each: every output equals its solo run, nothing
    hangs (a thread once raised ValueError from list.remove, and others hung), no block leaks."""
    llm = make_llm(tiny, dev)
    prompts = {t: [random_ids(4 + t + j, 50 + 10 * t + j) for j in range(3)] for t in range(4)}

    def worker(t):
        return [[o.outputs[0].token_ids for o in llm.generate(prompts[t], greedy(8 + t))] for _ in range(3)]
    results = {}
    threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, worker(t)), daemon=True) for t in range(4)]
    run_with_timeout(lambda: [th.start() for th in threads] and [th.join() for th in threads])
    for t in range(4):
        want = [solo(tiny, dev, p, greedy(8 + t)) for p in prompts[t]]
        assert results[t] == [want] * 3
    assert_idle(llm)


REAL_CTRL_C = """
import json, random, select, signal, sys
import nanoinfer
llm = nanoinfer.LLM(sys.argv[1], device="cpu", num_kv_tokens=512, block_size=4, max_num_batched_tokens=24)
prompts = [list(range(100 + i, 130 + 7 * i)) for i in range(4)]
params = nanoinfer.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print("ready", flush=True)
runs = interrupted = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        outs = llm.generate(prompts, params)
    except KeyboardInterrupt:
        outs = None
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    runs, interrupted = runs + 1, interrupted + (outs is None)
    if outs is None:
        print("interrupted", flush=True)  # the parent's next signal waits for this: no two merge into one
    assert outs is None or [o.outputs[0].token_ids for o in outs] == want, "wrong tokens after an interrupt"
    assert not llm.has_unfinished() and llm.kv.allocator.num_free() == llm.kv.num_blocks, "left over after Ctrl-C"
assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
print(json.dumps(dict(runs=runs, interrupted=interrupted)))
"""


def test_real_ctrl_c_never_leaves_the_engine_broken(tiny, tmp_path):
    """30 real SIGINTs at random moments of generate (most inside a step): each raises KeyboardInterrupt from
    generate, after which nothing is left queued, every block is free, and the next generate is right (a real
    Ctrl-C once left a sequence that never finished, 1 time in 60). Each signal waits for the last one's
    KeyboardInterrupt: two sent close together could arrive as one (on a loaded machine 10 of 30 once did)."""
    child = subprocess.Popen([sys.executable, "-c", REAL_CTRL_C, str(tiny.path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                             env={**os.environ, "PYTHONPATH": str(HERE)})

    def next_line():  # the child's next line, or its stderr after 60 s without one (never a hang)
        assert select.select([child.stdout], [], [], 60)[0], child.kill() or child.stderr.read()
        return child.stdout.readline().strip()
    try:
        assert next_line() == "ready"
        rng = np.random.default_rng()
        for _ in range(30):
            threading.Event().wait(rng.uniform(0.02, 0.15))
            child.send_signal(signal.SIGINT)
            assert next_line() == "interrupted"
        out, err = child.communicate("stop\n", timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["interrupted"] == 30


# -----------------------------------------------------------------------------
# memory: the KV pool's size, two engines on one GPU

def test_kv_pool_is_never_larger_than_usable(tiny, capsys):
    """The pool holds at most max_num_seqs full contexts (rounded up to blocks), whatever memory or num_kv_tokens
    would allow, and one startup line says its tokens and GiB."""
    llm = LLM(str(tiny.path), device="cpu", max_num_seqs=3, block_size=48)
    assert llm.kv.num_blocks == 3 * -(-tiny.n_ctx // 48)
    assert "KV cache: 432 tokens (0.00 GiB)" in capsys.readouterr().err
    assert LLM(str(tiny.path), device="cpu", max_num_seqs=2, num_kv_tokens=10 ** 6).kv.num_blocks == 2 * 8
    assert LLM(str(tiny.path), device="cpu", max_num_seqs=2, num_kv_tokens=20).kv.num_blocks == 2


TWO_ENGINES = """
import sys
import nanoinfer
llm = nanoinfer.LLM(sys.argv[1], device="cuda")
print("ready", flush=True)
sys.stdin.readline()
print(llm.generate(["Hello"], nanoinfer.SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].finish_reason, flush=True)
"""


@NO_GPU
def test_two_engines_share_a_gpu(tmp_path):
    """Two processes each start an engine with default settings on one GPU, at once, and both generate: the pool is
    sized by what max_num_seqs can use (n_ctx 1024 here), not by 90 % of the GPU."""
    ckpt = write_checkpoint(tmp_path / "ctx1024", seed=3, n_positions=1024)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_ENGINES, str(ckpt.path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        for p in procs:  # both engines are up at the same time
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)[1]
        results = [p.communicate("go\n", timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0] and [r[0].strip() for r in results] == ["length"] * 2, results
