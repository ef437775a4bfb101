"""Tensor parallelism, Megatron's split of each layer across tensor_parallel_size ranks (vLLM's LLM argument).

A layer's two matmul pairs split so that each pair needs one all-reduce:
- QKV and the MLP's up-projection by output columns: rank r computes its heads' q, k, v and its quarter of the MLP's
  hidden units from the whole (replicated) residual stream, with no communication;
- the attention projection and the MLP's down-projection by input rows: each rank multiplies what it holds by its rows
  of w, and an all-reduce sums the partial results into the next residual stream on every rank. Rank 0 adds the bias
  and the residual in its matmul's epilogue, the others add nothing, so the sum holds each once;
- attention needs no communication: each rank's heads attend over its heads' K and V, so each rank's paged KV cache
  holds its heads only (the block tables, one allocator's, are the same on every rank);
- the lm_head splits over the vocabulary; its logits are gathered where the sampler runs.

Two ways to run the ranks (vLLM's distributed_executor_backend): "uni", simulated in one process (the numpy twin):
each a thread running GPT.forward over its shard, the all-reduce and the gather as barriers, so the CPU tests prove
the partitioning exact; and "mp", a process a rank, as on GPUs (one process a GPU): rank 0 runs the scheduler and the
sampler and drives the others, sending each step's batch down a pipe; here on the CPU the collectives go through rank
0 over those pipes (on GPUs, NCCL carries them). It imports nothing from nanoinfer.py: the model a rank runs is handed
in.
"""
import multiprocessing
import multiprocessing.connection
import signal
import threading
import weakref
from functools import reduce

import numpy as np

from checkpoint import Int8Weight
from paged_kv import PagedKVCache


def part(n, rank, size):
    """Rank's indices of n things in size equal parts (the vocabulary need not divide: the last part is the shorter)."""
    step = -(-n // size)
    return np.arange(rank * step, min((rank + 1) * step, n))


def take(w, index, axis=0):
    """w's entries at index along axis (an Int8Weight's scale follows its rows)."""
    if isinstance(w, Int8Weight):
        return Int8Weight(np.take(w.q, index, axis), w.scale if axis == 1 else w.scale[index])
    return np.take(w, index, axis)


def shard(weights, config, n_vocab, rank, size):
    """Rank's weights: QKV (each of q, k, v by heads) and the MLP's up-projection by output rows of w, their biases
    likewise; the attention projection and the down-projection by input columns of w (their biases whole: rank 0
    adds them); the lm_head by vocabulary rows; layernorms and embeddings whole."""
    C = config.n_embd
    heads = part(C, rank, size)  # this rank's columns of q (of k, of v): whole heads, as size divides n_head
    out = {}
    for name, w in weights.items():
        if ".attn.c_attn." in name:
            out[name] = take(w, np.concatenate([j * C + heads for j in range(3)]))
        elif ".mlp.c_fc." in name:
            out[name] = take(w, part(config.n_inner, rank, size))
        elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
            out[name] = take(w, part(C if "attn" in name else config.n_inner, rank, size), axis=1)
        elif name != "lm_head.weight":
            out[name] = w
    head = weights.get("lm_head.weight", weights["wte.weight"])
    head = head if isinstance(head, Int8Weight) else head[:n_vocab]
    out["lm_head.weight"] = take(head, part(n_vocab, rank, size))
    return out


class Single:
    """One rank: the collectives do nothing (the model's forward as it reads with no parallelism)."""
    rank, size = 0, 1

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x


class Collectives:
    """NCCL's two collectives over an exchange of each rank's array (`_exchange(x, combine)`, the transport's): the
    all-reduce sums them in rank order (the same bits on every rank), the all-gather concatenates them."""
    def all_reduce(self, x):
        return self._exchange(x, lambda xs: reduce(np.add, xs))

    def all_gather(self, x):  # along the last axis (the lm_head's vocabulary)
        return self._exchange(x, lambda xs: np.concatenate(xs, axis=-1))


class ThreadComm(Collectives):
    """Rank `rank` of `size` threads of this process, the exchange through barriers: each rank leaves its array, all
    wait, each combines them, all wait again."""
    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, len(group["slots"])

    def _exchange(self, x, combine):
        slots, barrier = self.group["slots"], self.group["barrier"]
        slots[self.rank] = x
        barrier.wait()
        out = combine(slots)
        barrier.wait()  # everyone has read the slots before the next collective writes them
        return out


def check(size, config, backend, executor):
    if size > 1 and (backend.name != "cpu" or config.n_head % size):
        raise ValueError(f"tensor_parallel_size={size}: runs, for now, on device='cpu' only, and must divide the "
                         f"model's {config.n_head} heads")
    if executor not in ("uni", "mp"):
        raise ValueError(f"distributed_executor_backend={executor!r}: 'uni' (ranks as threads of this process) or "
                         "'mp' (a process a rank)")


class SimulatedRanks:
    """tensor_parallel_size ranks in one process: make_model(rank's weights, comm) is each rank's model (a GPT), kv
    the engine's KV cache, with rank 0's heads; the other ranks' heads get K/V tensors of their own in its blocks.
    forward(batch, kv) runs the batch on every rank, each in a thread, and gives rank 0's logits, gathered over the
    whole vocabulary. A rank that raises breaks the barriers, so no rank waits for it; its error is raised here."""
    def __init__(self, make_model, weights, config, n_vocab, size, kv):
        self.group = dict(slots=[None] * size, barrier=threading.Barrier(size))
        self.ranks = [make_model(shard(weights, config, n_vocab, r, size), comm=ThreadComm(self.group, r))
                      for r in range(size)]
        self.config, self.backend = config, self.ranks[0].backend
        self.rank_kv = [None] + [PagedKVCache(self.backend, config.n_layer, config.n_head // size, config.head_dim,
                                              kv.num_blocks, kv.block_size, False) for _ in range(1, size)]

    def forward(self, batch, kv):
        results, errors = [None] * len(self.ranks), []

        def run(r):
            try:
                results[r] = self.ranks[r].forward(batch, self.rank_kv[r] or kv)
            except BaseException as e:  # noqa: B902 (a rank's Ctrl-C too: the step must not wait for it)
                errors.append(e)
                self.group["barrier"].abort()
        threads = [threading.Thread(target=run, args=(r,), name=f"rank {r}") for r in range(1, len(self.ranks))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            self.group["barrier"].reset()  # for the next step
            first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            raise first
        return results[0]


class StepAborted(Exception):
    """A worker's step given up: rank 0 failed (or another rank did) before the step's collectives were done."""


class PipeComm(Collectives):
    """A worker rank's collectives: its share goes to rank 0 (StarComm), which combines them and sends every rank the
    result."""
    def __init__(self, conn, rank, size):
        self.conn, self.rank, self.size = conn, rank, size

    def _exchange(self, x, combine):  # (rank 0 combines)
        self.conn.send(("share", x))
        kind, result = self.conn.recv()
        if kind == "abort":
            raise StepAborted
        return result


def worker(make_model, weights, kv_shape, conn, rank, size):
    """A worker rank's process: its model over its shard, its heads' K/V, then each batch rank 0 sends: forward, and
    "done", or the error. Ctrl-C is rank 0's to handle (the terminal sends it to every process of the group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    model = make_model(weights, comm=PipeComm(conn, rank, size))
    kv = PagedKVCache(model.backend, *kv_shape, enable_prefix_caching=False)
    while True:
        try:
            kind, batch = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if kind == "stop":
            return
        if kind == "abort":  # a step rank 0 gave up after this rank had finished it
            conn.send(("aborted", None))
            continue
        try:
            model.forward(batch, kv)
            conn.send(("done", None))
        except StepAborted:
            conn.send(("aborted", None))
        except BaseException as e:  # noqa: B902 (sent whole: rank 0 raises it as the step's error)
            try:
                conn.send(("error", e))
            except Exception:  # an error that does not pickle: its words
                conn.send(("error", RuntimeError(f"tensor-parallel rank {rank}: {e!r}")))


class RankProcesses:
    """tensor_parallel_size ranks, a process each (the "mp" executor): rank 0 is this process's model, the others are
    spawned, each making its model from its shard (make_model must pickle: a class or a functools.partial).
    forward(batch, kv) sends the workers the batch, runs rank 0's forward (whose collectives gather the workers'
    shares here and send back the result), and waits for each worker's "done". A worker's error is raised here, after
    every worker has given up the step (the engine then undoes it and goes on); a worker that dies, or gives no answer
    for `timeout` seconds, ends the engine: this and every later forward raise a RuntimeError naming it."""
    def __init__(self, make_model, weights, config, n_vocab, size, kv, timeout=300.0):
        self.config, self.size, self.timeout, self.failed = config, size, timeout, None
        kv_shape = (config.n_layer, config.n_head // size, config.head_dim, kv.num_blocks, kv.block_size)
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads (or, on GPUs, a context)
        self.conns, self.procs = [], []
        for r in range(1, size):
            mine, theirs = ctx.Pipe()
            self.procs.append(ctx.Process(target=worker, name=f"nanoinfer rank {r}", daemon=True, args=(
                make_model, shard(weights, config, n_vocab, r, size), kv_shape, theirs, r, size)))
            self.procs[-1].start()
            theirs.close()
            self.conns.append(mine)
        weakref.finalize(self, stop_workers, self.conns, self.procs)  # when the engine goes, its workers go
        self.rank0 = make_model(shard(weights, config, n_vocab, 0, size), comm=StarComm(self))
        self.backend = self.rank0.backend

    def forward(self, batch, kv):
        if self.failed:
            raise RuntimeError(self.failed)
        try:
            for r in range(1, self.size):
                self.send(r, ("forward", batch))
            logits = self.rank0.forward(batch, kv)
            for r in range(1, self.size):
                self.receive(r, "done")
            return logits
        except BaseException:
            self.give_up_step()
            raise

    def send(self, r, message):
        try:
            self.conns[r - 1].send(message)
        except OSError:  # a broken pipe: its process is gone
            self.lost(r, "died")

    def receive(self, r, want):
        """Worker r's next message, which should be `want` ("share": its result; "done"); its error is raised."""
        conn, proc = self.conns[r - 1], self.procs[r - 1]
        ready = multiprocessing.connection.wait([conn, proc.sentinel], self.timeout)
        if conn not in ready:  # its process ended, or it stays silent
            self.lost(r, "died" if proc.sentinel in ready else f"gave no answer in {self.timeout:g} s")
        kind, value = conn.recv()
        if kind == "error":
            raise value
        assert kind == want, (kind, want)
        return value

    def give_up_step(self):
        """After a failed step: every worker told to give it up, and its messages read up to its "aborted" (a worker
        that had finished or failed answers it from its loop), so that the next step starts clean."""
        if self.failed:
            return
        for r in range(1, self.size):
            self.send(r, ("abort", None))
        for r, conn in enumerate(self.conns, 1):
            while True:
                if not multiprocessing.connection.wait([conn, self.procs[r - 1].sentinel], self.timeout) or \
                        not conn.poll():
                    return self.stop(f"tensor-parallel rank {r} did not give up a failed step: the engine cannot go "
                                     "on; make a new LLM")
                if conn.recv()[0] == "aborted":
                    break

    def lost(self, r, what):
        """Worker r died or hangs: the engine stopped, with a RuntimeError that says so."""
        proc = self.procs[r - 1]
        proc.join(0.1)
        code = f" (exit code {proc.exitcode})" if what == "died" and proc.exitcode is not None else ""
        self.stop(f"tensor-parallel rank {r} {what}{code}: the engine cannot go on; make a new LLM")
        raise RuntimeError(self.failed)

    def stop(self, why):
        self.failed = self.failed or why
        stop_workers(self.conns, self.procs)


def stop_workers(conns, procs):
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            proc.kill()
        conn.close()


class StarComm(Collectives):
    """Rank 0's collectives among processes: each worker's share received (in rank order), combined, and sent back to
    every worker."""
    rank = 0

    def __init__(self, ranks):
        self.ranks, self.size = ranks, ranks.size

    def _exchange(self, x, combine):
        shares = [x] + [self.ranks.receive(r, "share") for r in range(1, self.size)]
        out = combine(shares)
        for r in range(1, self.size):
            self.ranks.send(r, ("result", out))
        return out
