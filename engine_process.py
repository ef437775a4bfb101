"""The engine in a process of its own, as vLLM runs it behind its server: the HTTP servers' event loops, their JSON and
their server-sent events never share a GIL with the loop that keeps the GPU busy.

A pipe joins the engine to each HTTP server process (one, or serve.py --api-server-count of them). A server sends
("add", key, prompt ids, SamplingParams), ("abort", keys) and ("stop",); the engine process steps while any request
is unfinished and sends each server, once per step (a graph run: up to 16 tokens of each sequence), one message: the
step's events of that server's requests, keyed by its keys, and the counts /metrics reports. In a server, a reader
thread hands each HTTP request its events, one call into its event loop per step.
"""
import contextlib
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
import types
from collections import Counter
from pathlib import Path

from checkpoint import Tokenizer, load_config
from sampling_params import RequestOutput


def engine_main(engine_args, conns):
    """The engine process (run_engine). A SIGTERM ends it as an exit would, so that what it holds is released and
    multiprocessing's resource tracker has no semaphore left to warn of (tqdm's lock); only while it runs, though: in
    the interpreter's own exit after it, an exception would break into an atexit callback, with its traceback."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        run_engine(engine_args, conns)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_engine(engine_args, conns):
    """Build the LLM, tell each server it is ready, then step it, reading the servers' messages between steps
    (waiting for one while idle). It ends when every server has said stop or gone away."""
    multiprocessing.current_process().daemon = False  # (here) so that it may start tensor-parallel ranks: they exit
    # with it; the servers still end it as a daemon
    from nanoinfer import LLM, log
    try:
        llm = LLM(**engine_args)
    except Exception as e:
        for conn in conns:
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    for conn in conns:
        conn.send(("ready", dict(model_dir=str(llm.model_dir), num_blocks=llm.kv.num_blocks,
                                 block_size=llm.kv.block_size)))
    key_of, rid_of, finished = {}, {}, Counter()  # the engine's request ids and (server, key), both ways
    live = dict(enumerate(conns))
    while live:
        events = []
        if not llm.has_unfinished():
            multiprocessing.connection.wait(list(live.values()))
        for server, conn in list(live.items()):
            try:
                while conn.poll():
                    message = conn.recv()
                    if message[0] == "stop":
                        raise EOFError
                    if message[0] == "abort":
                        llm.abort_request([rid_of[server, k] for k in message[1] if (server, k) in rid_of])
                        continue
                    _, key, ids, params = message
                    try:
                        rid_of[server, key] = rid = llm.add_request(ids, params)
                        key_of[rid] = server, key
                    except ValueError as e:  # refused: the server checked it already, so this is rare
                        events.append(((server, key), 0, "", RequestOutput.refused(ids, e)))
            except (EOFError, OSError):  # this server is gone: its requests with it
                del live[server]
                llm.abort_request([rid for (s, _), rid in rid_of.items() if s == server])
        try:
            events += [(key_of[rid], sample, delta, out) for rid, sample, delta, out in llm.step()]
        except Exception as e:  # no request can be blamed (scheduling): every request ends with it
            log(f"an engine step failed: {type(e).__name__}: {e}; every request in it ends")
            events += [(key, 0, "", RequestOutput.refused(None, f"the engine failed: {type(e).__name__}: {e}"))
                       for key in rid_of]
            llm.abort_request(list(key_of))
            llm.step()  # hands out the aborts' events, which nobody reads now
            key_of, rid_of = {}, {}
        for key, _, _, out in events:
            if out is not None:
                finished.update(c.finish_reason for c in out.outputs)
                if key in rid_of:
                    del key_of[rid_of.pop(key)]
        s = llm.scheduler
        stats = dict(free=llm.kv.allocator.num_free(), total=llm.kv.num_blocks, running=len(s.running),
                     waiting=len(s.waiting), prefix_queries=llm.kv.queries, prefix_hits=llm.kv.hits,
                     drafted=llm.proposer and llm.proposer.proposed or 0,
                     accepted=llm.proposer and llm.proposer.accepted or 0, finished=dict(finished))
        for server, conn in list(live.items()):
            try:
                conn.send(("events", [(k, *e) for (s, k), *e in events if s == server], stats))
            except (EOFError, OSError):
                del live[server]


def start_engine(engine_args, servers=1):
    """Start the engine process, with a pipe for each of `servers` HTTP server processes: (process, their ends)."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA does not survive a fork
    pipes = [ctx.Pipe() for _ in range(servers)]
    process = ctx.Process(target=engine_main, args=(engine_args, [child for _, child in pipes]), name="engine",
                          daemon=True)
    with sigint_ignored():  # Ctrl-C is the servers' to handle: they stop this process
        process.start()
    for _, child in pipes:
        child.close()
    return process, [conn for conn, _ in pipes]


@contextlib.contextmanager
def sigint_ignored():
    """Processes started in here ignore SIGINT from their first instruction on (an ignored signal stays ignored across
    exec): a terminal's Ctrl-C reaches every process of its group, and one still importing would die in a
    KeyboardInterrupt's traceback."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class EngineProcess:
    """A server's side of its pipe: waits until the engine is ready (or says why it failed), then adds and aborts
    requests. What the server needs to read requests, the tokenizer and the model's config, it loads itself. `stats`
    holds the engine's counts as of its last step; `dead` says why the engine process is gone. `process`: the engine
    process, in the server that started it (None in the others)."""
    def __init__(self, conn, process=None):
        self.conn, self.process = conn, process
        try:
            kind, info = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited ({process and process.exitcode}) before it was ready") \
                from None
        if kind == "failed":
            raise RuntimeError(info)
        self.model_dir = Path(info["model_dir"])
        self.config = load_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir, self.config.vocab_size)
        self.kv = types.SimpleNamespace(num_blocks=info["num_blocks"], block_size=info["block_size"],
                                        blocks_needed=lambda n: -(-n // info["block_size"]))  # for refuse_request
        self.stats = dict(free=info["num_blocks"], total=info["num_blocks"], running=0, waiting=0, prefix_queries=0,
                          prefix_hits=0, drafted=0, accepted=0, finished={})
        self.lock, self.queues, self.next_key, self.dead = threading.Lock(), {}, 0, None
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()

    def add(self, prompts, params, queue, loop):
        """Send the prompts (token ids) as requests whose events go, as (prompt index, sample index, new text,
        RequestOutput once finished), into this asyncio queue: their keys."""
        with self.lock:
            if self.dead:
                raise ConnectionError(self.dead)
            keys = list(range(self.next_key, self.next_key + len(prompts)))
            self.next_key += len(prompts)
            for i, (key, ids) in enumerate(zip(keys, prompts)):
                self.queues[key] = (queue, loop, i)
                self.conn.send(("add", key, ids, params))
        return keys

    def abort(self, keys):
        with self.lock:
            keys = [k for k in keys if self.queues.pop(k, None)]  # those unfinished
            if keys and not self.dead:
                self.conn.send(("abort", keys))

    def abort_all(self):
        """Abort every request in flight; unlike abort, their callers still hear how each ended ("abort")."""
        with self.lock:
            if self.queues and not self.dead:
                self.conn.send(("abort", list(self.queues)))

    def stop(self):
        with self.lock:
            if not self.dead:
                self.conn.send(("stop",))
        if self.process is not None:
            self.process.join(timeout=30)

    def _read(self):
        while True:
            try:
                _, events, self.stats = self.conn.recv()
            except (EOFError, OSError):
                break
            by_queue = {}
            with self.lock:
                for key, sample, delta, out in events:
                    if key in self.queues:
                        queue, loop, index = self.queues[key] if out is None else self.queues.pop(key)
                        by_queue.setdefault((queue, loop), []).append((index, sample, delta, out))
            for (queue, loop), items in by_queue.items():  # one call into each request's event loop a step
                loop.call_soon_threadsafe(lambda q=queue, items=items: [q.put_nowait(e) for e in items])
        code = f" (exit code {self.process.exitcode})" if self.process is not None else ""
        with self.lock:  # the engine process is gone: every request still waiting hears it
            self.dead = f"the engine process has exited{code}"
            waiting, self.queues = self.queues, {}
        for queue, loop, _ in waiting.values():
            loop.call_soon_threadsafe(queue.put_nowait, ConnectionError(self.dead))
