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

Two ways to run the ranks (vLLM's distributed_executor_backend): "uni", threads of one process (the numpy twin, so
the CPU tests prove the split exact), and "mp", a process a rank (one a GPU), each running the whole engine over its
shard. On GPUs NCCL carries the collectives on the step's stream, inside the CUDA graphs; on the CPU, barriers or pipes.
"""
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from functools import partial, reduce

import numpy as np

from checkpoint import Int8Weight


def shard(weights, config, n_vocab, rank, size):
    """Rank's weights, split as above (w is (out, in): an output column is a row of w; c_proj's biases whole: rank 0
    adds them); layernorms and embeddings whole."""
    def part(n):  # rank's indices of n things in size equal parts (the vocabulary need not divide: the last is shorter)
        step = -(-n // size)
        return np.arange(rank * step, min((rank + 1) * step, n))

    def take(w, index, axis=0):  # w's entries at index along axis (an Int8Weight's scale follows its rows)
        if isinstance(w, Int8Weight):
            return Int8Weight(np.take(w.q, index, axis), w.scale if axis == 1 else w.scale[index])
        return np.take(w, index, axis)

    C = config.n_embd
    heads = part(C)  # this rank's columns of q (of k, of v): whole heads, as size divides n_head
    out = {}
    for name, w in weights.items():
        if ".attn.c_attn." in name:
            out[name] = take(w, np.concatenate([j * C + heads for j in range(3)]))
        elif ".mlp.c_fc." in name:
            out[name] = take(w, part(config.n_inner))
        elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
            out[name] = take(w, part(C if "attn" in name else config.n_inner), axis=1)
        elif name != "lm_head.weight":
            out[name] = w
    head = weights.get("lm_head.weight", weights["wte.weight"])
    head = head if isinstance(head, Int8Weight) else head[:n_vocab]
    out["lm_head.weight"] = take(head, part(n_vocab))
    return out


class Comm:
    """NCCL's two collectives over `exchange(x, combine)`, every rank's x combined (barriers or pipes): the all-reduce
    sums in rank order (the same bits on every rank), the all-gather concatenates (the lm_head's n vocabulary ids)."""
    def __init__(self, rank=0, size=1, exchange=None):
        self.rank, self.size, self.exchange = rank, size, exchange

    def all_reduce(self, x):
        return x if self.size == 1 else self.exchange(x, lambda xs: reduce(np.add, xs))

    def all_gather(self, x, n=None):
        return x if self.size == 1 else self.exchange(x, lambda xs: np.concatenate(xs, axis=-1))


Single = Comm  # Single(): one rank, the model's forward as it reads with no parallelism


# -----------------------------------------------------------------------------
# the ranks of an engine: the model each runs, its KV pool, and ("mp") each call relayed

THIS_PROCESS = None  # in a spawned rank: (rank, size, pipe to rank 0, NCCL id), set before it makes its LLM


def start(llm_class, llm_args, engine, config, backend):
    """This process's place among the ranks: Rank (the only one), Threads ("uni"), the Leader (rank 0 of "mp": it spawns
    the others, llm_class(**llm_args) each) or a Worker (one spawned). ValueError for what cannot run."""
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
    any rank's, and, where ranks run in other processes (comm.size > 1), its runner a RankRunner."""
    rank, size, comm, failed = 0, 1, Single(), None

    def model(self, gpt, config, weights, backend, n_vocab):
        if self.size > 1:
            weights = shard(weights, config, n_vocab, self.rank, self.size)
        return gpt(config, weights, backend, n_vocab, self.comm)

    def fewest(self, n, backend):
        """The least of every rank's n (each sizes its KV pool from its own GPU's free memory)."""
        mine = backend.asarray(np.full((1, 1), n, np.float32), np.float32)  # (1, 1); fp16 would overflow
        fewest = int(backend.tohost(self.comm.all_gather(mine, self.size)).min())
        self.raise_if_failed()  # a rank lost while the engines are made: the LLM is not made
        return fewest

    def runner(self, runner):
        return runner if self.comm.size == 1 else RankRunner(runner, self)

    def relay(self, call, *args):
        pass

    def raise_if_failed(self):  # (Leader's: a rank lost is an error; the step's, when one runs, is over)
        self.busy_since = None
        if self.failed:
            raise RuntimeError(self.failed)


class Threads(Rank):
    """"uni": every rank a thread of this process, their GPTs one model (this object), so the engine sees one rank:
    rank 0's K/V in the engine's cache, the others' in tensors of their own in its blocks, rank 0's logits out."""
    def __init__(self, size):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def model(self, gpt, config, weights, backend, n_vocab):
        self.gpts = [gpt(config, shard(weights, config, n_vocab, r, self.size), backend, n_vocab,
                         Comm(r, self.size, partial(self.exchange, r))) for r in range(self.size)]
        self.config, self.backend, self.rank_kv = config, backend, None
        return self

    def exchange(self, rank, x, combine):
        """Each rank leaves its array, all wait, each combines them, all wait again (before the next one writes)."""
        self.slots[rank] = x
        self.barrier.wait()
        out = combine(self.slots)
        self.barrier.wait()
        return out

    def forward(self, batch, kv):
        c, results, errors = self.config, [None] * self.size, []
        if self.rank_kv is None:
            self.rank_kv = [kv] + [kv.with_tensors(self.backend, c.n_layer, c.n_head // self.size, c.head_dim)
                                   for _ in self.gpts[1:]]

        def run(r):
            try:
                results[r] = self.gpts[r].forward(batch, self.rank_kv[r])
            except BaseException as e:  # noqa: B902 (a Ctrl-C too): it breaks the barriers, so no rank waits for it
                errors.append(e)
                self.barrier.abort()
        threads = [threading.Thread(target=run, args=(r,), name=f"rank {r}") for r in range(1, self.size)]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            self.barrier.reset()  # for the next step
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return results[0]


class RankRunner:
    """A rank's runner ("mp"): rank 0 relays each step to the others before it runs its batch (every rank's engine
    then makes the same batch), a rank lost meanwhile makes the results untrusted, and a failed step ends the engine
    (NCCL cannot undo half a step, and a rank cannot tell whether the others wait for it)."""
    def __init__(self, runner, ranks):
        self.runner, self.ranks = runner, ranks

    def __getattr__(self, name):  # the rest (running_ahead, wait) is the runner's
        return getattr(self.runner, name)

    def run(self, batch):
        self.ranks.relay("step")
        out = self.runner.run(batch)
        self.ranks.raise_if_failed()
        return out

    def step_failed(self, error):
        self.runner.step_failed(error)
        self.ranks.fail(error)


class Leader(Rank):
    """Rank 0 of "mp". Every rank runs the whole engine (as SGLang's schedulers do), nothing mirrored: rank 0 relays
    each call that changes it (a request added, its seed resolved; an abort; a step; a prefix-cache reset), and the
    same calls to a deterministic engine, logits gathered to every rank, make the same batches, graphs, samples and
    blocks. A worker that fails, dies or gives no answer in `timeout` s ends the engine: every later step raises."""
    def __init__(self, llm_class, llm_args, size, backend, timeout=300.0):
        self.size, self.timeout, self.busy_since, self.nccl = size, timeout, None, None
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
        if backend.name == "cuda":  # a GPU waiting in a collective for a lost rank blocks this thread: another watches
            self.nccl = backend.communicator(comm_id, 0, size)
            threading.Thread(target=watch, args=(weakref.ref(self),), name="nanoinfer rank watch", daemon=True).start()

    @property
    def comm(self):  # (the CPU's made anew: held here, it would hold the Leader, its workers alive until a GC)
        return self.nccl or Comm(0, self.size, self.exchange)

    def relay(self, call, *args):
        """Each other rank makes the call next. A rank lost is the next step's error (its requests end with it)."""
        self.send((call, args))
        self.busy_since = time.monotonic() if call == "step" else None
        if self.failed and call == "step":
            raise RuntimeError(self.failed)

    def fail(self, error):
        self.stop(f"tensor-parallel rank 0's step failed ({type(error).__name__}: {error}), so the ranks disagree")

    def exchange(self, x, combine):  # (the CPU's collectives) every rank's share in rank order, combined, sent back
        out = combine([x] + [self.receive(r, "share") for r in range(1, self.size)])
        self.send(("result", out))
        return out

    def send(self, message):  # to each worker, while none is lost
        for r, conn in enumerate(self.conns, 1):
            if self.failed:
                return
            try:
                conn.send(message)
            except OSError:  # a broken pipe: its process is gone
                self.lose(r)

    def receive(self, r, want):  # worker r's next message: `want` ("ready"; "share": its part of a collective)
        conn = self.conns[r - 1]
        if not conn.poll(self.timeout):  # (a process that ends closes its end: the pipe reads as ended, at once)
            self.lose(r, f"gave no answer in {self.timeout:g} s")
        else:
            kind, value = next_message(conn)  # ("error", None): it died
            if kind == "error":
                self.lose(r, value and f"failed ({value})")
        if self.failed:
            raise RuntimeError(self.failed)
        assert kind == want, (kind, want)
        return value

    def lose(self, r, why=None):
        """Worker r failed or hangs (why says which; None: it died): the engine ends, with an error naming it."""
        proc = self.procs[r - 1]
        proc.join(0.1)
        why = why or "died" + (f" (exit code {proc.exitcode})" if proc.exitcode is not None else "")
        self.stop(f"tensor-parallel rank {r} {why}")

    def stop(self, why):
        if not self.failed:
            self.failed = f"{why}: the engine cannot go on; make a new LLM"
            stop_workers(self.conns, self.procs)
            if self.nccl:
                self.nccl.abort()  # kernels waiting for a lost rank return


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
            leader.lose(r, f"failed ({why})" if kind == "error" and why else None)
        elif leader.busy_since and time.monotonic() - leader.busy_since > leader.timeout:
            leader.stop(f"a step gave no answer in {leader.timeout:g} s (a tensor-parallel rank hangs)")


def next_message(conn):
    """A worker's next (kind, value) down its pipe; ("error", None) if it died (a pipe reset by the kill raises)."""
    try:
        return conn.recv() if conn.poll() else ("error", None)
    except (EOFError, OSError):
        return "error", None


def stop_workers(conns, procs):
    for conn, proc in zip(conns, procs):
        proc.kill()  # (nothing, if it has ended)
        proc.join(5)
        conn.close()


class Worker(Rank):
    """A spawned rank: rank 0's calls come down its pipe (run_worker); a failure of its own is sent up it, and the
    process exits (rank 0 then ends the engine)."""
    def __init__(self, backend, rank, size, conn, comm_id):
        self.rank, self.size, self.conn = rank, size, conn
        conn.send(("ready", None))
        cpu = backend.name == "cpu"
        self.comm = Comm(rank, size, self.exchange) if cpu else backend.communicator(comm_id, rank, size)

    def exchange(self, x, combine):  # (the CPU's collectives) its share to rank 0, which sends back the result
        self.conn.send(("share", x))
        return self.conn.recv()[1]

    def fail(self, error):  # its step's error goes on, out of the engine, to run_worker: this process ends
        raise error


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
    except BaseException as e:  # noqa: B902 (its engine could not be made, a call raised, or rank 0 is gone)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        finally:
            os._exit(1)  # at once: its engine is out of step
