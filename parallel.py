"""Tensor parallelism, Megatron's split of each layer across tensor_parallel_size ranks (vLLM's LLM argument). A lever
of its own: the engine's core step does not know how many ranks there are (the ranks make the model, and wrap the
runner: nanoinfer.LLM.__init__). It imports nothing from nanoinfer.py.

A layer's two matmul pairs split so that each pair needs one all-reduce:
- QKV and the MLP's up-projection by output columns: rank r computes its heads' q, k, v and its quarter of the MLP's
  hidden units from the whole (replicated) residual stream, with no communication;
- the attention projection and the MLP's down-projection by input rows: each rank multiplies what it holds by its rows
  of w, and an all-reduce sums the partial results into the next residual stream on every rank. Rank 0 adds the bias
  and the residual in its matmul's epilogue, the others add nothing, so the sum holds each once;
- attention needs no communication: each rank's heads attend over its heads' K and V, so each rank's paged KV cache
  holds its heads only (the block tables, one allocator's, are the same on every rank);
- the lm_head splits over the vocabulary; its logits are gathered where the sampler runs.

Two ways to run the ranks (vLLM's distributed_executor_backend): "uni", threads of one process (the numpy twin: the
collectives as barriers), so the CPU tests prove the partitioning exact; and "mp", a process a rank (one a GPU), each
running the whole engine over its shard, rank 0 relaying every call that changes it. On GPUs NCCL carries the
collectives on the step's stream, inside the CUDA graphs; on the CPU they go through rank 0 over pipes.
"""
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from functools import reduce

import numpy as np

from checkpoint import Int8Weight


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

    def all_gather(self, x, n=None):
        return x


class Collectives:
    """NCCL's two collectives over an exchange of each rank's array (`_exchange(x, combine)`, the transport's): the
    all-reduce sums them in rank order (the same bits on every rank), the all-gather concatenates them."""
    def all_reduce(self, x):
        return self._exchange(x, lambda xs: reduce(np.add, xs))

    def all_gather(self, x, n=None):  # along the last axis (the lm_head's vocabulary, n entries in all)
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


class SimulatedRanks:
    """"uni": the ranks' models (make_model(shard, comm): a GPT each) as one. forward(batch, kv) runs each in a
    thread, rank 0's heads' K/V in the engine's cache and the others' in tensors of their own in its blocks, and gives
    rank 0's logits. A rank that raises breaks the barriers, so no rank waits for it; its error is raised here."""
    def __init__(self, make_model, weights, config, n_vocab, size):
        self.group = dict(slots=[None] * size, barrier=threading.Barrier(size))
        self.ranks = [make_model(shard(weights, config, n_vocab, r, size), comm=ThreadComm(self.group, r))
                      for r in range(size)]
        self.config, self.backend, self.rank_kv = config, self.ranks[0].backend, None

    def forward(self, batch, kv):
        c, results, errors = self.config, [None] * len(self.ranks), []
        if self.rank_kv is None:
            self.rank_kv = [kv] + [kv.with_tensors(self.backend, c.n_layer, c.n_head // len(self.ranks), c.head_dim)
                                   for _ in self.ranks[1:]]

        def run(r):
            try:
                results[r] = self.ranks[r].forward(batch, self.rank_kv[r])
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


# -----------------------------------------------------------------------------
# the ranks of an engine: the model each runs, its KV pool, and ("mp") each call relayed

THIS_PROCESS = None  # in a spawned rank: (rank, size, pipe to rank 0, NCCL id), set before it makes its LLM


def start(llm_class, llm_args, engine, config, backend):
    """This process's place among engine.tensor_parallel_size ranks: Rank (the only one), Threads ("uni"), the Leader
    (rank 0 of "mp": it spawns the others, llm_class(**llm_args) each) or a Worker (one spawned). ValueError for what
    cannot run. distributed_executor_backend None: "mp" on GPUs, "uni" elsewhere."""
    size, executor = engine.tensor_parallel_size, engine.distributed_executor_backend
    executor = executor or ("mp" if backend.name == "cuda" else "uni")
    if size > 1 and config.n_head % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {config.n_head} heads")
    if size > 1 and backend.name == "cuda" and (executor != "mp" or size > backend.num_gpus):
        raise ValueError(f"tensor_parallel_size={size} on GPUs: one process a GPU (distributed_executor_backend='mp'), "
                         f"and this machine has {backend.num_gpus}")
    if size == 1:
        return Rank()
    if executor == "uni":
        return Threads(size)
    if THIS_PROCESS is not None:
        return Worker(backend, *THIS_PROCESS)
    return Leader(llm_class, llm_args, size, backend)


class Rank:
    """One rank of `size` (the only one, by default): a GPT over its shard of the weights, a KV pool no larger than
    any rank's, its runner the engine's (RankRunner, with others), and nothing to relay."""
    rank, size, comm = 0, 1, Single()

    def model(self, gpt, config, weights, backend, n_vocab):
        if self.size > 1:
            weights = shard(weights, config, n_vocab, self.rank, self.size)
        return gpt(config, weights, backend, n_vocab, self.comm)

    def fewest(self, n, backend):
        """The least of every rank's n (each sizes its KV pool from its own GPU's free memory)."""
        if self.size == 1:
            return n
        mine = backend.asarray(np.full((1, 1), n, np.float32), np.float32)  # (1, 1); fp16 would overflow
        fewest = int(backend.tohost(self.comm.all_gather(mine, self.size)).min())
        self.raise_if_failed()  # a rank lost while the engines are made: the LLM is not made
        return fewest

    def runner(self, runner):
        return runner if self.size == 1 else RankRunner(runner, self)

    def relay(self, call, *args):
        pass

    def raise_if_failed(self):
        pass

    def fail(self, error):
        pass


class Threads(Rank):
    """"uni": every rank in this process, their models one (SimulatedRanks): the engine sees one rank."""
    def __init__(self, size):
        self.size = size

    def model(self, gpt, config, weights, backend, n_vocab):
        return SimulatedRanks(lambda w, comm: gpt(config, w, backend, n_vocab, comm), weights, config, n_vocab,
                              self.size)

    def fewest(self, n, backend):
        return n

    def runner(self, runner):
        return runner


class RankRunner:
    """A rank's runner ("mp"): rank 0 relays each step to the others before it runs its batch (every rank's engine
    then makes the same batch), a rank lost meanwhile makes the results untrusted, and a failed step ends the engine
    (NCCL cannot undo half a step, and a rank cannot tell whether the others wait for it)."""
    def __init__(self, runner, ranks):
        self.runner, self.ranks = runner, ranks

    def run(self, batch):
        self.ranks.relay("step")
        out = self.runner.run(batch)
        self.ranks.raise_if_failed()
        return out

    def step_failed(self, error):
        self.runner.step_failed(error)
        self.ranks.fail(error)

    def running_ahead(self):
        return self.runner.running_ahead()

    def wait(self):
        self.runner.wait()


class Leader(Rank):
    """Rank 0 of "mp". Every rank runs the whole engine (as SGLang's schedulers do): rank 0 relays each call that
    changes it (a request added, with its seed resolved; an abort; a step; a prefix-cache reset), and the same calls,
    a deterministic engine and logits gathered to every rank make the same batches, graphs, samples and blocks
    everywhere, with nothing mirrored. A worker that raises sends its error and exits; one that dies, or gives no
    answer for `timeout` seconds, ends the engine too: this and every later step raise an error naming the rank."""
    def __init__(self, llm_class, llm_args, size, backend, timeout=300.0):
        self.size, self.timeout, self.failed, self.busy_since = size, timeout, None, None
        comm_id = backend.new_comm_id() if backend.name == "cuda" else None
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads or a CUDA context
        self.conns, self.procs = [], []
        for r in range(1, size):
            mine, theirs = ctx.Pipe()
            self.procs.append(ctx.Process(target=run_worker, name=f"nanoinfer rank {r}", daemon=True,
                                          args=(llm_class, llm_args, (r, size, theirs, comm_id))))
            self.procs[-1].start()
            theirs.close()
            self.conns.append(mine)
        weakref.finalize(self, stop_workers, self.conns, self.procs)  # when the engine goes, its workers go
        for r in range(1, size):
            self.receive(r, "ready")  # its backend is up: the communicator can be set up
        self.comm = StarComm(self) if backend.name == "cpu" else backend.communicator(comm_id, 0, size)
        if backend.name == "cuda":  # a GPU waiting in a collective for a lost rank blocks this thread: another watches
            threading.Thread(target=watch, args=(weakref.ref(self),), name="nanoinfer rank watch", daemon=True).start()

    def relay(self, call, *args):
        """Each other rank makes the call next. A rank lost is the next step's error (its requests end with it)."""
        for r in range(1, self.size):
            if not self.failed:
                self.send(r, (call, args))
        self.busy_since = time.monotonic() if call == "step" else None
        if self.failed and call == "step":
            raise RuntimeError(self.failed)

    def raise_if_failed(self):
        self.busy_since = None
        if self.failed:
            raise RuntimeError(self.failed)

    def fail(self, error):
        self.stop(f"tensor-parallel rank 0's step failed ({type(error).__name__}: {error}), so the ranks no longer "
                  "agree: the engine cannot go on; make a new LLM")

    def send(self, r, message):
        try:
            self.conns[r - 1].send(message)
        except OSError:  # a broken pipe: its process is gone
            self.stop(self.lost(r, "died"))

    def receive(self, r, want):  # worker r's next message: `want` ("ready"; "share": its part of a collective)
        conn, proc = self.conns[r - 1], self.procs[r - 1]
        ready = multiprocessing.connection.wait([conn, proc.sentinel], self.timeout)
        if conn not in ready:  # its process ended, or it stays silent
            self.stop(self.lost(r, "died" if proc.sentinel in ready else f"gave no answer in {self.timeout:g} s"))
        else:
            kind, value = next_message(conn)
            if kind == "error":
                self.stop(self.lost(r, f"failed ({value})" if value else "died"))
        if self.failed:
            raise RuntimeError(self.failed)
        assert kind == want, (kind, want)
        return value

    def lost(self, r, what):  # why the engine ends: worker r died, hangs or failed
        proc = self.procs[r - 1]
        proc.join(0.1)
        code = f" (exit code {proc.exitcode})" if what == "died" and proc.exitcode is not None else ""
        return f"tensor-parallel rank {r} {what}{code}: the engine cannot go on; make a new LLM"

    def stop(self, why):
        if not self.failed:
            self.failed = why
            stop_workers(self.conns, self.procs)
            if hasattr(self.comm, "abort"):  # NCCL's: kernels waiting for a lost rank return
                self.comm.abort()


def watch(leader_ref):
    """(A thread on GPUs.) A rank that dies, or a step that outlasts the timeout, ends the engine; NCCL's abort frees
    rank 0's GPU, and the engine's thread if it waits on it. It holds the Leader only while it looks."""
    while (leader := leader_ref()) is not None and not leader.failed:
        sentinels = [p.sentinel for p in leader.procs]
        del leader
        dead = multiprocessing.connection.wait(sentinels, 1.0)
        if (leader := leader_ref()) is None:
            return
        if dead:
            r = 1 + sentinels.index(dead[0])
            kind, why = next_message(leader.conns[r - 1])  # its last words, if it sent any
            leader.stop(leader.lost(r, f"failed ({why})" if kind == "error" and why else "died"))
        elif leader.busy_since and time.monotonic() - leader.busy_since > leader.timeout:
            leader.stop(f"a step gave no answer in {leader.timeout:g} s (a tensor-parallel rank hangs): the engine "
                        "cannot go on; make a new LLM")


def next_message(conn):
    """A worker's next (kind, value) down its pipe; ("error", None) if it died (a pipe reset by the kill raises)."""
    try:
        return conn.recv() if conn.poll() else ("error", None)
    except (EOFError, OSError):
        return "error", None


def stop_workers(conns, procs):
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        conn.close()


class Worker(Rank):
    """A spawned rank: rank 0's calls come down its pipe (run_worker); a failure of its own is sent up it, and the
    process exits (rank 0 then ends the engine)."""
    def __init__(self, backend, rank, size, conn, comm_id):
        self.rank, self.size, self.conn = rank, size, conn
        conn.send(("ready", None))
        self.comm = PipeComm(conn, rank, size) if backend.name == "cpu" else backend.communicator(comm_id, rank, size)

    def fail(self, error):
        exit_with(self.conn, error)


def exit_with(conn, error):
    """A worker's end: its error sent to rank 0, then the process gone (at once: its engine is out of step)."""
    try:
        conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        os._exit(1)


def run_worker(llm_class, llm_args, place):
    """A spawned rank's process: its GPU (device `rank`), its engine, then rank 0's calls in order until rank 0 is
    gone. Ctrl-C is rank 0's to handle (the terminal sends it to every process of the group)."""
    global THIS_PROCESS
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, conn = place[0], place[2]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # before CUDA starts here: this rank sees its GPU as device 0
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank] if visible else str(rank)
    parent = multiprocessing.parent_process().sentinel  # a lost rank 0 (or one killed) takes this process with it
    threading.Thread(target=lambda: multiprocessing.connection.wait([parent]) and os._exit(1), daemon=True).start()
    THIS_PROCESS = place
    try:
        llm = llm_class(**llm_args)
        while True:
            call, args = conn.recv()
            getattr(llm, call)(*args)
    except EOFError:  # rank 0 is gone
        return
    except BaseException as e:  # noqa: B902 (its engine could not be made, or a call raised)
        exit_with(conn, e)


class PipeComm(Collectives):
    """A worker's collectives on the CPU: its share to rank 0 (StarComm), which sends back the combined result."""
    def __init__(self, conn, rank, size):
        self.conn, self.rank, self.size = conn, rank, size

    def _exchange(self, x, combine):  # (rank 0 combines)
        self.conn.send(("share", x))
        return self.conn.recv()[1]


class StarComm(Collectives):
    """Rank 0's collectives among processes on the CPU: the workers' shares in rank order, combined, sent back."""
    rank = 0

    def __init__(self, ranks):
        self.ranks, self.size = ranks, ranks.size

    def _exchange(self, x, combine):
        shares = [x] + [self.ranks.receive(r, "share") for r in range(1, self.size)]
        out = combine(shares)
        for r in range(1, self.size):
            self.ranks.send(r, ("result", out))
        return out
