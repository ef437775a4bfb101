"""CUDA graphs: decode steps replayed many per run, padded chunks replayed from one graph (a first reading can skip this
file, as cuda_backend.py). nanoinfer.ModelRunner hands in `decode_step`, the eager step on device arrays, and a graph
records exactly that. Later than it reads: every graph is captured at start-up (GraphRunner); a decode step's last
kernel makes the next step's inputs on the GPU (decode_advance), so a run of up to 16 steps needs the host once; and the
next run is launched before the host reads this one (GraphRunner.run). DecodeGraph: a decode step; ChunkGraph: padded
chunks (a lone prompt's prefill). Speculation's graphs, steps chained on the GPU, are speculation.py's."""
import contextlib
import types

import numpy as np

from cuda_backend import batch_fields, device_batch, layout, views

try:
    import cupy as cp  # (this file imports without CuPy: plan_run is plain Python, tested on the CPU)
except ImportError:
    cp = None

GRAPH_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 257, 16))  # decode batch sizes with a graph each: pads <= 15 rows
MAX_STEPS_PER_RUN = 16  # decode steps one graph run may take (multi-step decoding), the size of the token ring
ADMIT_GROUP = 8  # a full engine lets waiting requests in once 1/8 of its seats are free
PREFILL_BUCKETS = (64, 128, 256, 512, 1024)  # a lone prompt's token counts with a graph each (up to the context)
SAMPLING = dict(seed=np.uint64, temperature=np.float32, top_p=np.float32, top_k=np.int32, min_p=np.float32,
                token_index=np.int32)  # nanoinfer.SamplingArrays' fields
PADDING = dict(seed=0, temperature=0, top_p=1, top_k=0, min_p=0, input_ids=0,  # a padding row: greedy, unwritten
               token_index=0, remaining=0, positions=0, slot_mapping=-1)


class Graph:
    """A step captured as a CUDA graph, which holds the pointers it was captured with, not the arrays: each one stays
    referenced here. Its inputs: named arrays in one host buffer and its device copy (host[name], dev[name]); its
    activations: from the pool the graphs share (on one stream they never run at once: one frees, the next may use)."""
    def __init__(self, fields, stream):
        self.stream, (self.where, size) = stream, layout(fields)
        self.host_buffer = np.zeros(size, np.int32)
        with stream:
            self.dev_buffer = cp.asarray(self.host_buffer)
        self.host, self.dev = views(self.host_buffer, self.where), views(self.dev_buffer, self.where)

    def set(self, name, values):  # a field's first rows (a table's: its corner), padding (or zeros) after them
        field, values = self.host[name], np.asarray(values)
        field[...] = PADDING.get(name, 0)
        field[tuple(slice(n) for n in values.shape)] = values

    def upload(self, first=None):  # the host buffer copied over: all of it, or from field `first` on
        start = 0 if first is None else self.where[first][0]
        self.dev_buffer[start:].set(self.host_buffer[start:], stream=self.stream)

    def capture(self, backend, pool, step):  # after a warm-up run of `step`, its activations from `pool`
        with cp.cuda.using_allocator(pool.malloc):
            step()
            self.stream.synchronize()
            self.graph = backend.capture(self.stream, step)
        self.graph.upload(self.stream)


def smallest(graphs, n):  # of graphs by size (rows or tokens), the smallest that holds n
    return graphs[min(size for size in graphs if size >= n)]


def steps_left(seqs, ahead, n_ctx):  # (S,) the decode steps each may still take, `ahead` past the host's tokens
    return np.array([0 if s.finish_reason else min(s.params.max_tokens - s.num_output, n_ctx - len(s.token_ids))
                     - ahead for s in seqs]).clip(0)


def plan_run(kv, seqs, ahead, max_steps, n_ctx, tokens_per_step=1):
    """A GraphRun of decode steps from `ahead` past the host's tokens, their KV blocks reserved: max_steps at most, no
    more than the longest sequence may take, halved until the free blocks cover them (None: not one; the scheduler
    preempts). A sequence that stops early wastes the steps after, never emits them. tokens_per_step: k + 1 drafting."""
    left = steps_left(seqs, ahead, n_ctx)
    first = [len(s.token_ids) - 1 + ahead for s in seqs]  # the position each one's first step computes
    steps = int(min(max_steps, left.max(initial=0)))
    while steps > 0 and not kv.can_fit_all([(s.seq_id, p + min(steps * tokens_per_step, n))
                                            for s, p, n in zip(seqs, first, left) if n]):
        steps //= 2
    if steps == 0:
        return None
    for s, p, n in zip(seqs, first, left):
        if n:
            kv.grow(s.seq_id, p + min(steps * tokens_per_step, n))
    positions = np.where(left > 0, first, 0)
    tables = kv.block_table_array([s.seq_id for s in seqs])  # (S, max_blocks)
    slots = np.where(left > 0, kv.slot_mapping(tables, np.arange(len(seqs)), positions), -1)
    return GraphRun(num_steps=steps, token_index=np.array([s.num_output + ahead for s in seqs]), remaining=left,
                    positions=positions, slot_mapping=slots, block_tables=tables)


class GraphRun(types.SimpleNamespace):
    """A run of decode steps. Planned (plan_run): num_steps; each row's token_index (its output index: the sampler's
    counter), remaining (its steps; padding after), positions, slot_mapping (-1: padding), block_tables at its first
    step. Launched (DecodeGraph.launch): graph, seqs (rows), sampling (their SamplingArrays), first_ring_row, done."""
    def tokens(self):  # {sequence: its tokens}, once the run is done: a token a step, as many as it was allowed
        self.done.synchronize()
        ring = self.graph.token_ring.get()
        steps = ring[(self.first_ring_row + np.arange(self.num_steps)) % len(ring)]  # (num_steps, B)
        return {s: steps[:n, row].tolist() for row, (s, n) in enumerate(zip(self.seqs, self.remaining))}


class DecodeGraph(Graph):
    """A decode step of up to B rows as one CUDA graph (~65 kernels, one launch), its scalars frozen too: attention is
    planned for the longest context (kernels stop at each row's length), unused rows are padding (cache slot -1). Its
    last kernel makes its tokens the next step's inputs (decode_advance), kept in a ring: it replays many in a row."""
    def __init__(self, decode_step, backend, kv, n_ctx, stream, pool, B):
        self.B, max_blocks = B, kv.blocks_needed(n_ctx)
        fields = {f: ((B,), t) for f, t in SAMPLING.items() if f != "token_index"}
        fields.update(input_ids=((B,), np.int32), ring_row=((1,), np.int32))  # the GPU's own once a run goes on
        fields.update({f: ((B,), np.int32) for f in ("token_index", "remaining", "positions", "context_lens",
                                                     "slot_mapping")}, block_tables=((B, max_blocks), np.int32))
        cp.cuda.Device().synchronize()  # the weights and the cache were made on the default stream, which ours skips
        super().__init__(fields, stream)
        d = self.dev
        with stream:
            self.token_ring = cp.zeros((2 * MAX_STEPS_PER_RUN, B), np.int32)  # one run's tokens while the next runs
            ids = cp.arange(B + 1, dtype=np.int32)  # below: CudaBackend.to_device's attention rows, or one-query tiles
            attention = dict(row_q=ids[:B], row_seq=ids[:B], row_len=d["context_lens"], tile_seq=ids[:0],
                             tile_q0=ids[:0]) if backend.tile_min_q != 1 else dict(
                row_q=ids[:0], row_seq=ids[:0], row_len=ids[:0], tile_seq=ids[:B], tile_q0=cp.zeros_like(ids[:B]))
            self.batch = batch = device_batch(  # kept: the graph holds these arrays' pointers (Graph)
                **{f: d[f] for f in ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")},
                cu_seqlens_q=ids, logits_idx=None, max_row_len=n_ctx, **attention)
            rows = dict(token_index=[], remaining=[], positions=[], slot_mapping=[], block_tables=np.zeros((0, 1)))
            self.start(np.zeros(0, np.int32), {f: [] for f in SAMPLING}, GraphRun(num_steps=0, **rows))  # padding

            def step():  # what each replay runs: the engine's decode step, then the next step's inputs on the GPU
                tokens = decode_step(batch, d)  # (the sampling parameters: SamplingArrays' fields of d, by name)
                backend.launch("decode_advance", (1,), (B,), (
                    tokens, d["input_ids"], d["positions"], d["context_lens"], d["slot_mapping"], d["token_index"],
                    d["remaining"], d["block_tables"], np.int32(max_blocks), np.int32(kv.block_size), self.token_ring,
                    np.int32(len(self.token_ring)), d["ring_row"], np.int32(B)))
            self.capture(backend, pool, step)

    def start(self, input_ids, sampling, plan):  # n <= B rows (last tokens, sampling, plan) loaded, padding after
        for name, values in {**sampling, "input_ids": input_ids}.items():  # (token_index: the plan's, below)
            self.set(name, values)
        self.host["ring_row"][0] = self.ring_row = 0  # the ring row the next step writes (the GPU counts its own)
        self._write_rows(plan, first=None)

    def carry_on(self, plan):  # the next run goes on where the launched ones stop: the GPU has made its input tokens
        self._write_rows(plan, first="token_index")

    def _write_rows(self, plan, first):  # the plan's rows written, the buffer uploaded from field `first` on
        for name in ("token_index", "remaining", "positions", "slot_mapping", "block_tables"):
            self.set(name, getattr(plan, name))
        self.host["context_lens"][:] = self.host["positions"] + 1  # position p sees p + 1 keys; padding sees 1
        self.upload(first)

    def launch(self, seqs, sampling, run):  # plan_run's run: the step replayed run.num_steps times for these sequences
        run.graph, run.seqs, run.sampling, run.first_ring_row = self, seqs, sampling, self.ring_row
        self.ring_row += run.num_steps
        for _ in range(run.num_steps):
            self.graph.launch(self.stream)
        run.done = cp.cuda.Event()
        run.done.record(self.stream)
        return run


class BatchInputs(Graph):
    """A batch's inputs in one buffer: its fields (template: what they hold at first; their sizes never change), its
    `sampled` rows' sampling parameters, any state of the graph's own; `batch`, the device batch over them."""
    def __init__(self, template, sampled, max_row_len, stream, state=None):
        super().__init__({**{f: (a.shape, np.int32) for f, a in template.items()},
                          **{f: ((sampled,), t) for f, t in SAMPLING.items()}, **(state or {})}, stream)
        for f, a in template.items():
            self.set(f, a)
        self.upload()
        self.batch = device_batch(**{f: self.dev[f] for f in template}, max_row_len=max_row_len)


class ChunkGraph(BatchInputs):
    """Up to B sequences' chunks of up to T tokens, sampling up to `samples` rows of each, as one CUDA graph (eager,
    their ~100 launches from Python cost more than GPT-2's GPU work): a lone prompt's prefill (B 1, samples 1), or
    speculation's drafts to verify (samples T). A chunk is padded to T tokens: a pad computes at its sequence's last
    real position, writing no cache slot; each sequence is declared T queries long, so real queries keep their
    positions and keys."""
    def __init__(self, chunk_step, backend, kv, n_ctx, stream, pool, T, samples, B=1, state=None):
        self.T, self.samples, self.B, self.min_q = T, samples, B, backend.tile_min_q
        self.chunk_step, self.width = chunk_step, kv.blocks_needed(n_ctx + T)  # pads may look past the context
        template = batch_fields(self.padded(types.SimpleNamespace(  # a padded batch's fields: their sizes never change
            input_ids=[0], positions=[0], slot_mapping=[-1], context_lens=[1], block_tables=np.zeros((B, self.width)),
            logits_idx=[0], cu_seqlens_q=[0, 1]))[0], self.min_q)
        super().__init__(template, B * samples, n_ctx + T, stream, state)
        with stream:
            self.tokens = cp.zeros(B * samples, np.int32)  # where every replay leaves the sampled tokens (no pool)
            self.capture(backend, pool, self.step)

    def step(self):  # what each replay runs (speculation.SpecGraph adds kernels before and after)
        self.tokens[...] = self.chunk_step(self.batch, self.dev)  # (sampling: SamplingArrays' fields, by name)

    def padded(self, batch):
        """The batch's fields padded to B chunks of T tokens, and `slots`: each sampled row's place in B * samples."""
        cu, T = np.asarray(batch.cu_seqlens_q), self.T
        S, n = len(cu) - 1, np.diff(cu)  # sequences, and each one's tokens
        seq, j = np.divmod(np.arange(self.B * T), T)  # each padded row's sequence, and its place in it
        real, seq_ = (seq < S) & (j < n[np.minimum(seq, S - 1)]), np.minimum(seq, S - 1)
        src = np.where(seq < S, cu[seq_] + np.minimum(j, n[seq_] - 1), 0)  # the row each copies (pads: the last)
        sampled = np.asarray(batch.logits_idx)
        of = np.searchsorted(cu, sampled, side="right") - 1  # each sampled row's sequence, and its rank there
        slots = of * self.samples + np.arange(len(sampled)) - np.searchsorted(of, of)
        logits_idx = np.zeros(self.B * self.samples, np.int32)
        logits_idx[slots] = of * T + sampled - cu[of]
        return types.SimpleNamespace(
            input_ids=np.where(real, np.asarray(batch.input_ids)[src], 0),
            positions=np.where(seq < S, np.asarray(batch.positions)[src], 0),
            slot_mapping=np.where(real, np.asarray(batch.slot_mapping)[src], -1),
            cu_seqlens_q=np.arange(0, self.B * T + 1, T), block_tables=batch.block_tables, logits_idx=logits_idx,
            context_lens=np.concatenate([np.asarray(batch.context_lens) + T - n, np.full(self.B - S, T)])), slots

    def run(self, batch, sampling):  # {sequence: its sampled tokens}: the inputs copied in (one copy), a replay
        padded, slots = self.padded(batch)
        for f, a in batch_fields(padded, self.min_q).items():
            self.set(f, a)  # (block tables: zeros past the sequences' entries, never read)
        for f in SAMPLING:
            values, field = np.asarray(getattr(sampling, f)), self.host[f]
            field[:] = values[-1]  # rows no one samples: anything
            field[slots] = values
        self.upload()
        self.graph.launch(self.stream)
        tokens, rows = self.tokens.get(stream=self.stream)[slots], np.cumsum([0] + list(batch.num_sampled))
        return {s: tokens[a:b].tolist() for s, a, b in zip(batch.seqs, rows[:-1], rows[1:]) if b > a}


class GraphRunner:
    """The batches CUDA graphs replay (decode runs, a lone prompt's prefill, speculation's chained steps),
    on one stream with the engine's eager steps (eager()): a run ends before later work reuses its blocks."""
    def __init__(self, decode_step, backend, kv, n_ctx, engine, scheduler=None, proposer=None):
        self.kv, self.n_ctx, self.scheduler, self.proposer = kv, n_ctx, scheduler, proposer
        self.num_scheduler_steps = min(engine.num_scheduler_steps, MAX_STEPS_PER_RUN)
        if scheduler is not None:  # an admission is an eager step that ends the runs of graph steps: a full engine
            scheduler.admission_group = max(1, engine.max_num_seqs // ADMIT_GROUP)  # lets requests in by groups
        self.stream, self.in_flight = cp.cuda.Stream(non_blocking=True), None  # in_flight: launched, not yet read
        # a graph a bucket up to max_num_seqs, the largest first: the smaller reuse its activations (one shared pool)
        big = [b for b in GRAPH_BUCKETS if b >= engine.max_num_seqs][:1]
        buckets = big + [b for b in reversed(GRAPH_BUCKETS) if b < engine.max_num_seqs]
        common = (decode_step, backend, kv, n_ctx, self.stream, cp.cuda.MemoryPool())  # each graph's first arguments
        self.graphs = {B: DecodeGraph(*common, B) for B in buckets}
        self.prefills = {T: ChunkGraph(*common, T, 1) for T in reversed(PREFILL_BUCKETS) if T <= n_ctx}
        self.spec = {B: proposer.chained_graph(common, B) for B in buckets} if proposer else {}  # (speculation.py)
        self.description = f"{len(self.graphs) + len(self.prefills) + len(self.spec)} CUDA graphs (decode batches " \
            f"of 1 to {buckets[0]} rows, prefills of up to {max(self.prefills)} tokens)"

    def takes(self, batch):
        """Whether graphs run this batch (no log-probs or edited logits): decodes, a lone prompt."""
        if batch.num_scoring.any() or any(s.logprobs is not None or s.edits_logits for s in batch.seqs):
            return False
        S, T, R = len(batch.seqs), len(batch.input_ids), int(batch.num_sampled.sum())
        if T == S:
            return R == S <= max(self.graphs)
        return S == R == 1 and T <= max(self.prefills, default=0)

    def running_ahead(self):  # whether a run launched ahead computes running sequences (an admission ends it unread)
        return self.in_flight is not None and any(not s.finish_reason for s in self.in_flight.seqs)

    def run(self, batch, sampling):
        """{sequence: its new tokens}. A prompt's chunk: one replay of the smallest graph that holds it. Decodes: a
        run of chained speculation steps while drafting; else the run in flight if it computes them, or one launched
        now, and the next launched before their tokens are read if it can go on alone (no request waits to come in, no
        drafting)."""
        S, drafting = len(batch.seqs), self.proposer is not None and self.proposer.active(len(batch.seqs))
        run, self.in_flight = self.in_flight, None  # (a run in flight that computes other tokens is dropped unread)
        if len(batch.input_ids) > S:  # a lone prompt's chunk
            return smallest(self.prefills, len(batch.input_ids)).run(batch, sampling)
        if drafting and self.spec:
            graph = smallest(self.spec, S)
            plan = plan_run(self.kv, batch.seqs, 0, self.num_scheduler_steps, self.n_ctx, graph.T)
            if plan is not None:  # else too few free blocks for a whole chunk: a plain step
                return graph.run(batch.seqs, sampling, plan)
        starts = {s.seq_id: p for s, p, n in zip(run.seqs, run.positions, run.remaining) if n} if run else {}
        if not all(starts.get(s.seq_id) == len(s.token_ids) - 1 for s in batch.seqs):  # (each one's first step)
            # one step while drafting (too few blocks for a chained run): the next step may draft again
            plan = plan_run(self.kv, batch.seqs, 0, 1 if drafting else self.num_scheduler_steps, self.n_ctx)
            graph = smallest(self.graphs, S)
            graph.start(np.array([s.token_ids[-1] for s in batch.seqs], np.int32), sampling._asdict(), plan)
            run = graph.launch(batch.seqs, sampling, plan)
        if self.scheduler is not None and not (drafting or self.scheduler.wants_admission()):
            self.in_flight = self._next_run(run, batch.seqs)
        tokens = run.tokens()
        return {s: tokens[s] for s in batch.seqs}

    def _next_run(self, run, seqs):
        """The run after `run`, launched now if it needs no scheduler (this step reads every unfinished row of it)."""
        live = np.flatnonzero(steps_left(run.seqs, run.num_steps, self.n_ctx))
        if self.num_scheduler_steps == 1 or len(seqs) != sum(not s.finish_reason for s in run.seqs) or not len(live):
            return None
        graph, seqs, sampling = smallest(self.graphs, len(live)), run.seqs, run.sampling
        if graph is not run.graph:
            seqs, sampling = [run.seqs[i] for i in live], type(run.sampling)(*(a[live] for a in run.sampling))
        plan = plan_run(self.kv, seqs, run.num_steps, self.num_scheduler_steps, self.n_ctx)
        if plan is None:
            return None
        if graph is run.graph:
            graph.carry_on(plan)
        else:
            graph.start(np.zeros(len(seqs), np.int32), sampling._asdict(), plan)
            with self.stream:  # row i's input token is the run's row live[i], gathered on the GPU: no wait for it
                graph.dev["input_ids"][:len(live)] = run.graph.dev["input_ids"][cp.asarray(live)]
        return graph.launch(seqs, sampling, plan)

    @contextlib.contextmanager
    def eager(self):  # for a step the graphs do not take: on their stream, after what they launched (drops a run ahead)
        self.in_flight = None
        with self.stream:
            yield

    def wait(self):  # until the GPU has done everything launched
        self.stream.synchronize()

    def forget(self):  # a failed step's run in flight: the next decode starts afresh (stream order keeps it safe)
        self.in_flight = None
