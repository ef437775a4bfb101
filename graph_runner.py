"""CUDA graphs: decode steps replayed many per run, and steps of padded chunks replayed from one graph. A first reading
can skip it, as it can cuda_backend.py: nanoinfer.ModelRunner hands in `decode_step`, the eager step on device arrays,
and a graph records exactly that. What runs later than it reads: every graph is captured at start-up (GraphRunner);
a decode step's last kernel makes the next step's inputs on the GPU (decode_advance), so a run of up to 16 steps needs
the host once; and the next run is launched before the host reads this one (GraphRunner.run). plan_run reserves a
run's blocks; DecodeGraph is a decode step, ChunkGraph a step of padded chunks (a lone prompt's prefill, or drafts to
verify), SpecGraph n-gram speculation's draft-verify-accept step; GraphRunner picks among them.
"""
import contextlib
import types
from dataclasses import dataclass

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


def bucket(rows):  # the smallest decode batch size with a graph that holds `rows`
    return next(b for b in GRAPH_BUCKETS if b >= rows)


class Buffers:
    """A graph's inputs: named arrays in one host buffer and its device copy (cuda_backend.layout), one copy a replay.
    host[name] and dev[name] are the views."""
    def __init__(self, fields, stream):
        self.where, size = layout(fields)
        self.host_buffer = np.zeros(size, np.int32)
        with stream:
            self.dev_buffer = cp.asarray(self.host_buffer)
        self.host, self.dev = views(self.host_buffer, self.where), views(self.dev_buffer, self.where)

    def set(self, name, values):  # a field's first rows (a table's: its corner), padding (or zeros) after them
        field, values = self.host[name], np.asarray(values)
        field[...] = PADDING.get(name, 0)
        field[tuple(slice(n) for n in values.shape)] = values

    def upload(self, stream, first=None):  # the host buffer copied over: all of it, or from field `first` on
        start = 0 if first is None else self.where[first][0]
        self.dev_buffer[start:].set(self.host_buffer[start:], stream=stream)


def capture(backend, stream, pool, step):
    """`step`'s kernels as a CUDA graph (after a warm-up run), its activations from the pool the graphs share: on one
    stream they never run at once, so what one leaves free the next may take."""
    with cp.cuda.using_allocator(pool.malloc):
        step()
        stream.synchronize()
        graph = backend.capture(stream, step)
    graph.upload(stream)
    return graph


def steps_left(seqs, ahead, n_ctx):  # (S,) the decode steps each may still take, `ahead` past the host's tokens
    return np.array([0 if s.finish_reason else min(s.params.max_tokens - s.num_output, n_ctx - len(s.token_ids))
                     - ahead for s in seqs]).clip(0)


@dataclass
class RunPlan:
    """A graph run of `num_steps` decode steps, and each row's inputs to its first step."""
    num_steps: int
    token_index: np.ndarray  # the sampler's counter: the index in its output of the token the row samples
    remaining: np.ndarray  # the steps it may take (after the last it is padding)
    positions: np.ndarray  # the position it computes
    slot_mapping: np.ndarray  # that token's cache slot (-1: padding)
    block_tables: np.ndarray


def plan_run(kv, seqs, ahead, max_steps, n_ctx, tokens_per_step=1):
    """Decode steps from `ahead` past the host's tokens, their KV blocks reserved here: max_steps at most, no more than
    the longest sequence may still take, halved until the free blocks cover them (None: not one step; the scheduler
    then preempts). A sequence that stops early (EOS, a stop string) wastes the steps after; it never emits them.
    tokens_per_step: the most tokens a step may compute a sequence (speculating: k + 1)."""
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
    return RunPlan(steps, np.array([s.num_output + ahead for s in seqs]), left, positions, slots, tables)


@dataclass
class GraphRun:
    """Launched decode steps: their graph, rows (sequences), sampling parameters and plan; `done` follows the last."""
    graph: "DecodeGraph"
    seqs: list
    sampling: tuple  # the rows' SamplingArrays (host)
    plan: RunPlan
    first_positions: dict  # seq_id -> the position its first step computes
    first_ring_row: int
    done: object

    def tokens(self):  # {sequence: its tokens}, once the run is done: a token a step, as many as it was allowed
        self.done.synchronize()
        ring = self.graph.token_ring.get()
        steps = ring[(self.first_ring_row + np.arange(self.plan.num_steps)) % len(ring)]  # (num_steps, B)
        return {s: steps[:n, row].tolist() for row, (s, n) in enumerate(zip(self.seqs, self.plan.remaining))}


class DecodeGraph:
    """A decode step of up to B sequences as one CUDA graph: ~65 kernels, one launch. A graph freezes the pointers and
    scalars it was captured with, so the inputs live in one fixed buffer, attention is planned for the longest context
    (kernels stop at each row's length) and unused rows are padding (cache slot -1). The step ends by making its tokens
    the next step's inputs (decode_advance), each step's kept in a ring: it replays many times in a row."""
    def __init__(self, decode_step, backend, kv, n_ctx, B, stream, pool):
        self.B, self.stream, max_blocks = B, stream, kv.blocks_needed(n_ctx)
        fields = {f: ((B,), t) for f, t in SAMPLING.items() if f != "token_index"}
        fields.update(input_ids=((B,), np.int32), ring_row=((1,), np.int32))  # the GPU's own once a run goes on
        fields.update({f: ((B,), np.int32) for f in ("token_index", "remaining", "positions", "context_lens",
                                                     "slot_mapping")}, block_tables=((B, max_blocks), np.int32))
        cp.cuda.Device().synchronize()  # the weights and the cache were made on the default stream, which ours skips
        self.buf = Buffers(fields, stream)
        d = self.buf.dev
        with stream:
            self.token_ring = cp.zeros((2 * MAX_STEPS_PER_RUN, B), np.int32)  # one run's tokens while the next runs
            ids = cp.arange(B + 1, dtype=np.int32)
            # CudaBackend.to_device's fields for B decode rows: attention_decode's rows, or one-query tiles (tile_min_q)
            attention = dict(row_q=ids[:B], row_seq=ids[:B], row_len=d["context_lens"], tile_seq=ids[:0],
                             tile_q0=ids[:0]) if backend.tile_min_q != 1 else dict(
                row_q=ids[:0], row_seq=ids[:0], row_len=ids[:0], tile_seq=ids[:B], tile_q0=cp.zeros_like(ids[:B]))
            # kept here: the graph holds the pointers of these arrays, not the arrays (freed, their memory is reused)
            self.batch = batch = device_batch(
                **{f: d[f] for f in ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")},
                cu_seqlens_q=ids, logits_idx=None, max_row_len=n_ctx, **attention)
            sampling = {f: d[f] for f in SAMPLING}
            self.start(np.zeros(0, np.int32), {f: [] for f in SAMPLING}, RunPlan(0, *([],) * 4, np.zeros((0, 1))))

            def step():  # what each replay runs: the engine's decode step, then the next step's inputs on the GPU
                tokens = decode_step(batch, sampling)
                backend.launch("decode_advance", (1,), (B,), (
                    tokens, d["input_ids"], d["positions"], d["context_lens"], d["slot_mapping"], d["token_index"],
                    d["remaining"], d["block_tables"], np.int32(max_blocks), np.int32(kv.block_size), self.token_ring,
                    np.int32(len(self.token_ring)), d["ring_row"], np.int32(B)))
            self.graph = capture(backend, stream, pool, step)

    def start(self, input_ids, sampling, plan):  # n <= B rows (last tokens, sampling, plan) loaded, padding after
        for name, values in {**sampling, "input_ids": input_ids}.items():  # (token_index: the plan's, below)
            self.buf.set(name, values)
        self.buf.host["ring_row"][0] = self.ring_row = 0  # the ring row the next step writes (the GPU counts its own)
        self._write_rows(plan)
        self.buf.upload(self.stream)

    def carry_on(self, plan):
        """Let the next run go on where the launched ones stop: the GPU has input tokens; the host writes the rest."""
        self._write_rows(plan)
        self.buf.upload(self.stream, first="token_index")

    def _write_rows(self, plan):
        for name in ("token_index", "remaining", "positions", "slot_mapping", "block_tables"):
            self.buf.set(name, getattr(plan, name))
        self.buf.host["context_lens"][:] = self.buf.host["positions"] + 1  # position p sees p + 1 keys; padding sees 1

    def launch(self, seqs, sampling, plan):  # the step replayed plan.num_steps times for these sequences (its rows)
        first = self.ring_row
        self.ring_row += plan.num_steps
        for _ in range(plan.num_steps):
            self.graph.launch(self.stream)
        done = cp.cuda.Event()
        done.record(self.stream)
        starts = {s.seq_id: int(p) for s, p, n in zip(seqs, plan.positions, plan.remaining) if n}
        return GraphRun(self, seqs, sampling, plan, starts, first, done)


class ChunkGraph:
    """Up to B sequences' chunks of up to T tokens, sampling up to `samples` rows of each, as one CUDA graph: a lone
    prompt's prefill (B 1, samples 1), or decodes' drafts to verify (samples T). Eager, such a step launches ~100
    kernels from Python, which costs more than GPT-2's GPU work. A chunk is padded to T tokens: a pad computes at its
    sequence's last real position and writes no cache slot; each sequence is declared T queries long, so each real
    query keeps its position and sees only real keys."""
    def __init__(self, chunk_step, backend, kv, n_ctx, T, samples, stream, pool, B=1):
        self.T, self.samples, self.B, self.stream, self.min_q = T, samples, B, stream, backend.tile_min_q
        self.chunk_step, self.width = chunk_step, kv.blocks_needed(n_ctx + T)  # pads may look past the context
        # the inputs: a padded batch's fields (their sizes never change), then each sampled row's sampling parameters
        template = batch_fields(self.padded(types.SimpleNamespace(
            input_ids=[0], positions=[0], slot_mapping=[-1], context_lens=[1], block_tables=np.zeros((B, self.width)),
            logits_idx=[0], cu_seqlens_q=[0, 1]))[0], self.min_q)
        self.buf = Buffers({**{f: (a.shape, np.int32) for f, a in template.items()},
                            **{f: ((B * samples,), t) for f, t in SAMPLING.items()}}, stream)
        for f, a in template.items():
            self.buf.set(f, a)
        self.buf.upload(stream)
        with stream:
            self.batch = device_batch(**{"logits_idx": None, **{f: self.buf.dev[f] for f in template}},
                                      max_row_len=n_ctx + T)
            self.sampling = {f: self.buf.dev[f] for f in SAMPLING}
            self.tokens = cp.zeros(B * samples, np.int32)  # where every replay leaves the sampled tokens (no pool)
            self.graph = capture(backend, stream, pool, self.step)

    def step(self):  # what each replay runs (SpecGraph adds kernels before and after)
        self.tokens[...] = self.chunk_step(self.batch, self.sampling)

    def padded(self, batch):
        """The host fields of this batch of at most B sequences, padded to B chunks of T tokens; and `slots`, where
        each row that samples (batch.logits_idx, in order) goes among the B * samples sampled rows."""
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
            self.buf.set(f, a)  # (block tables: zeros past the sequences' entries, never read)
        for f in SAMPLING:
            values, field = np.asarray(getattr(sampling, f)), self.buf.host[f]
            field[:] = values[-1]  # rows no one samples: anything
            field[slots] = values
        self.buf.upload(self.stream)
        self.graph.launch(self.stream)
        tokens, rows = self.tokens.get(stream=self.stream)[slots], np.cumsum([0] + list(batch.num_sampled))
        return {s: tokens[a:b].tolist() for s, a, b in zip(batch.seqs, rows[:-1], rows[1:]) if b > a}


class SpecGraph(ChunkGraph):
    """n-gram speculation chained on the GPU, many steps a run as DecodeGraph's: a replay is propose -> verify ->
    accept. ngram_propose makes each row's draft from its token history (speculation.py's rule) and its chunk of T =
    k + 1 queries; the chunk's forward samples a token at each; spec_accept keeps the draft to its first miss, and
    the token sampled there, appended to the history and to a ring (per step and row: tokens kept, drafts verified,
    the tokens). A row that has made all it may turns to padding. The host pays once a run, not once a step."""
    def __init__(self, chunk_step, backend, kv, n_ctx, proposer, stream, pool, B):
        self.n_ctx, self.backend, self.kv, self.proposer, T = n_ctx, backend, kv, proposer, proposer.k + 1
        state = dict(history=(B * n_ctx,), length=(B,), remaining=(B,), token_base=(B,), ndraft=(B,), step=(B,))
        self.state = Buffers({f: (shape, np.int32) for f, shape in state.items()}, stream)
        with stream:
            self.ring = cp.zeros((MAX_STEPS_PER_RUN, B, T + 2), np.int32)
            self.scratch = cp.zeros(B * T, np.int32)  # row lengths no kernel reads (a tiled chunk's)
        super().__init__(chunk_step, backend, kv, n_ctx, T, T, stream, pool, B)
        self.buf.host["logits_idx"][:] = np.arange(B * T)  # every query samples

    def step(self):
        s, b = self.state.dev, self.batch
        self.backend.launch("ngram_propose", (self.B,), (128,), (
            s["history"], s["length"], s["remaining"], s["token_base"], s["ndraft"], b.input_ids, b.positions,
            b.slot_mapping, b.context_lens, b.row_len if b.n_rows else self.scratch, self.sampling["token_index"],
            b.block_tables, np.int32(self.width), np.int32(self.kv.block_size), np.int32(self.n_ctx),
            np.int32(self.T), np.int32(self.proposer.n_min), np.int32(self.proposer.n_max)))
        super().step()
        self.backend.launch("spec_accept", (-(-self.B // 128),), (128,), (
            self.tokens, b.input_ids, s["ndraft"], s["history"], s["length"], s["remaining"], s["token_base"],
            s["step"], self.ring, np.int32(self.B), np.int32(self.T), np.int32(self.n_ctx)))

    def run(self, seqs, sampling, plan):
        """{sequence: the tokens it kept, in order}: the sequences loaded (their tokens, the plan's blocks and steps,
        their sampling parameters on each of their T queries), plan.num_steps replays; vLLM's counters counted."""
        for row, seq in enumerate(seqs):  # history: (B, n_ctx), each row's token ids (past its length: not read)
            self.state.host["history"][row * self.n_ctx:row * self.n_ctx + len(seq.token_ids)] = seq.token_ids
        for f, values in dict(length=[len(seq.token_ids) for seq in seqs], remaining=plan.remaining,
                              token_base=plan.token_index, ndraft=[], step=[]).items():
            self.state.set(f, values)
        self.buf.set("block_tables", plan.block_tables)
        for f in SAMPLING:  # a row's parameters on each of its T queries (padding: a padding row's)
            self.buf.set(f, np.repeat(getattr(sampling, f), self.T))
        self.buf.upload(self.stream)
        self.state.upload(self.stream)
        for _ in range(plan.num_steps):
            self.graph.launch(self.stream)
        ring, kept = self.ring[:plan.num_steps].get(stream=self.stream), {seq: [] for seq in seqs}
        for row, seq in enumerate(seqs):
            for n, verified, *tokens in ring[:, row].tolist():  # a step's tokens kept (0: the row had made all it
                if n:  # may), drafts verified, the tokens
                    kept[seq] += tokens[:n]
                    self.proposer.count(seq, verified, n - 1)
        return kept


class GraphRunner:
    """The batches CUDA graphs replay: decode steps, in runs of up to MAX_STEPS_PER_RUN; a lone prompt's prefill;
    drafts to verify, or n-gram speculation's chained steps (SpecGraph). One stream: the engine's eager steps run on
    it too (eager()), so a run ends before later work reuses its blocks."""
    def __init__(self, decode_step, backend, kv, n_ctx, engine, scheduler=None, proposer=None):
        self.kv, self.n_ctx, self.scheduler, self.proposer = kv, n_ctx, scheduler, proposer
        self.num_scheduler_steps = min(engine.num_scheduler_steps, MAX_STEPS_PER_RUN)
        if scheduler is not None:  # an admission is an eager step that ends the runs of graph steps: a full engine
            scheduler.admission_group = max(1, engine.max_num_seqs // ADMIT_GROUP)  # lets requests in by groups
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.in_flight = None  # a run launched and not yet read
        # a graph a bucket up to max_num_seqs, the largest first: the smaller reuse its activations (one shared pool)
        top, pool = bucket(min(engine.max_num_seqs, GRAPH_BUCKETS[-1])), cp.cuda.MemoryPool()
        buckets, ngram = [b for b in reversed(GRAPH_BUCKETS) if b <= top], getattr(proposer, "method", None) == "ngram"
        self.graphs = {B: DecodeGraph(decode_step, backend, kv, n_ctx, B, self.stream, pool) for B in buckets}
        self.prefills = {T: ChunkGraph(decode_step, backend, kv, n_ctx, T, 1, self.stream, pool)
                         for T in reversed(PREFILL_BUCKETS) if T <= n_ctx}
        self.spec = {B: SpecGraph(decode_step, backend, kv, n_ctx, proposer, self.stream, pool, B)
                     for B in buckets if ngram}  # (speculation.py's proposers)
        self.verify = {B: ChunkGraph(decode_step, backend, kv, n_ctx, proposer.k + 1, proposer.k + 1, self.stream,
                                     pool, B) for B in buckets if proposer and not ngram}
        self.description = f"{len(self.graphs) + len(self.prefills) + len(self.spec) + len(self.verify)} CUDA " \
            f"graphs (decode batches of 1 to {top} rows, prefills of up to {max(self.prefills)} tokens)"

    def takes(self, batch):
        """Whether the graphs run this batch, each sequence sampling as they do (no log-probs or edited logits): a
        decode token each; one sequence's last prompt chunk; or decodes and their drafts, every token sampled."""
        if batch.num_scoring.any() or any(s.logprobs is not None or s.edits_logits for s in batch.seqs):
            return False
        S, T, R = len(batch.seqs), len(batch.input_ids), int(batch.num_sampled.sum())
        if T == S:
            return R == S <= max(self.graphs)
        if T == R:  # drafts to verify
            return bool(self.verify) and S <= max(self.verify) and max(np.diff(batch.cu_seqlens_q)) <= self.verify[1].T
        return S == R == 1 and T <= max(self.prefills, default=0)

    def running_ahead(self):  # whether a run launched ahead computes running sequences (an admission ends it unread)
        return self.in_flight is not None and any(not s.finish_reason for s in self.in_flight.seqs)

    def run(self, batch, sampling):
        """{sequence: its new tokens} (sampling: the batch's SamplingArrays). Chunks: one replay of the smallest graph
        that holds them. Decodes: while n-gram speculation drafts, a SpecGraph run; else the run in flight, if it
        computes them, or one launched now; and before their tokens are read, the next run is launched, if it can go
        on alone and the scheduler lets it (no request waits to come in, no draft to verify next)."""
        S, drafting = len(batch.seqs), self.proposer is not None and self.proposer.active(len(batch.seqs))
        if len(batch.input_ids) > S:
            self.in_flight = None
            chunks = self.verify[bucket(S)] if batch.num_sampled.sum() > 1 else \
                self.prefills[min(T for T in self.prefills if T >= len(batch.input_ids))]
            return chunks.run(batch, sampling)
        if drafting and self.spec:
            graph = self.spec[bucket(S)]
            plan = plan_run(self.kv, batch.seqs, 0, self.num_scheduler_steps, self.n_ctx, graph.T)
            if plan is not None:  # else too few free blocks for a whole chunk: a plain step
                self.in_flight = None
                return graph.run(batch.seqs, sampling, plan)
        run = self.in_flight  # it computes these sequences if its first step computes each one's last token
        if not (run and all(run.first_positions.get(s.seq_id) == len(s.token_ids) - 1 for s in batch.seqs)):
            # one step when the host drafts next (a draft model's): more would run past tokens a draft could make
            plan = plan_run(self.kv, batch.seqs, 0, 1 if drafting else self.num_scheduler_steps, self.n_ctx)
            graph = self.graphs[bucket(S)]
            graph.start(np.array([s.token_ids[-1] for s in batch.seqs], np.int32), sampling._asdict(), plan)
            run = graph.launch(batch.seqs, sampling, plan)
        ahead = self.scheduler is not None and not (drafting or self.scheduler.wants_admission())
        self.in_flight = self._next_run(run, batch.seqs) if ahead else None
        tokens = run.tokens()
        return {s: tokens[s] for s in batch.seqs}

    def _next_run(self, run, seqs):
        """The run after `run`, launched now if it can go on without the scheduler (this step reads every unfinished
        row of `run`, and some have steps left): its rows keep their graph, or move to a smaller one that fits."""
        live = np.flatnonzero(steps_left(run.seqs, run.plan.num_steps, self.n_ctx))
        if self.num_scheduler_steps == 1 or len(seqs) != sum(not s.finish_reason for s in run.seqs) or not len(live):
            return None
        graph, seqs, sampling = self.graphs[bucket(len(live))], run.seqs, run.sampling
        if graph is not run.graph:
            seqs, sampling = [run.seqs[i] for i in live], type(run.sampling)(*(a[live] for a in run.sampling))
        plan = plan_run(self.kv, seqs, run.plan.num_steps, self.num_scheduler_steps, self.n_ctx)
        if plan is None:
            return None
        if graph is run.graph:
            graph.carry_on(plan)
        else:
            graph.start(np.zeros(len(seqs), np.int32), sampling._asdict(), plan)
            with self.stream:  # row i's input token is the run's row live[i], gathered on the GPU: no wait for it
                graph.buf.dev["input_ids"][:len(live)] = run.graph.buf.dev["input_ids"][cp.asarray(live)]
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
