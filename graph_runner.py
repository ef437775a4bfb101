"""CUDA graphs: the engine's decode steps replayed many per run, and a lone prompt's prefill replayed from one graph. A
first reading can skip it, as it can cuda_backend.py: nanoinfer.ModelRunner hands in `decode_step`, the eager step on
device arrays, and a graph records exactly that. Only nanoinfer.py imports it (for device="cuda"); it uses the op set
(cuda_backend.py), and the KV cache and the sequences through their public methods.

- plan_run: a run of decode steps, its KV blocks reserved up front (the GPU moves each row on by itself).
- DecodeGraph: one decode step of up to B rows as one CUDA graph, replayed num_steps times a run.
- ChunkGraph: chunks of up to T tokens of up to B sequences as one CUDA graph: a lone prompt's prefill, or decodes'
  verification chunks (each its last token and its draft: speculation.py).
- SpecGraph: n-gram speculation's steps chained on the GPU: each replay drafts, verifies and keeps, many a run.
- GraphRunner: which batches the graphs take, and the run launched one step ahead of the host.
"""
import contextlib
import types
from dataclasses import dataclass

import numpy as np

from cuda_backend import device_batch, device_batch_of, pack_batch

cp = None  # cupy, imported when a GraphRunner is made (plan_run is plain Python, tested without a GPU)

GRAPH_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 257, 16))  # decode batch sizes with a graph each: pads <= 15 rows
MAX_STEPS_PER_RUN = 16  # decode steps one graph run may take (multi-step decoding), the size of the token ring
ADMIT_GROUP = 8  # a full engine lets waiting requests in once 1/8 of its seats are free
PREFILL_BUCKETS = (64, 128, 256, 512, 1024)  # a lone prompt's token counts with a graph each (up to the context)


def steps_left(seqs, ahead, n_ctx):
    """(S,) the decode steps each sequence may still take, `ahead` steps past the host's tokens (0: done)."""
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
    """Launched decode steps: their graph, its rows' sequences and sampling parameters, and `done`, an event recorded
    after the last step."""
    graph: "DecodeGraph"
    seqs: list
    sampling: tuple  # the rows' SamplingArrays (host)
    num_steps: int
    first_positions: dict  # seq_id -> the position its first step computes
    first_ring_row: int
    done: object

    def tokens(self):
        """(num_steps, rows) token ids, once the run is done."""
        self.done.synchronize()
        ring = self.graph.token_ring.get()
        return ring[(self.first_ring_row + np.arange(self.num_steps)) % len(ring), :len(self.seqs)].astype(np.int64)


class DecodeGraph:
    """A decode step of up to B sequences replayed from one CUDA graph: ~65 kernels, one launch. A graph freezes the
    pointers and scalars it was captured with, so the inputs live in one fixed buffer (one host-to-device copy),
    attention is planned for the longest context (kernels stop at each row's length), unused rows are padding (cache
    slot -1), and activations come from a pool only the graphs use (one stream: never two at once). The step ends by
    making its sampled tokens the next step's inputs on the GPU (decode_advance), keeping each step's tokens in a ring,
    so it can replay many times in a row: the host's work and its wait are paid once per run."""
    SAMPLING = ("temperature", "top_k", "top_p", "seed", "token_index", "min_p")  # SamplingArrays' fields
    # the step's inputs, in one int32 buffer; from `token_index` on, rewritten by carry_on for a run that goes on
    FIELDS = ("seed", "temperature", "top_p", "top_k", "min_p", "input_ids", "ring_row",
              "token_index", "remaining", "positions", "context_lens", "slot_mapping", "block_tables")
    PADDING = dict(seed=0, temperature=0, top_p=1, top_k=0, min_p=0, input_ids=0,  # a padding row: greedy, unwritten
                   token_index=0, remaining=0, positions=0, slot_mapping=-1)
    TYPES = dict(seed=np.uint64, temperature=np.float32, top_p=np.float32, min_p=np.float32)  # the others: int32

    def __init__(self, decode_step, backend, kv, n_ctx, B, stream, pool):
        self.B, self.stream, max_blocks = B, stream, kv.blocks_needed(n_ctx)
        sizes = dict.fromkeys(self.FIELDS, B) | dict(seed=2 * B, ring_row=1, block_tables=B * max_blocks)
        self.host_buffer = np.zeros(sum(sizes.values()), np.int32)
        starts = dict(zip(self.FIELDS, np.cumsum([0] + [sizes[f] for f in self.FIELDS])))
        self.carry_from = starts["token_index"]
        cp.cuda.Device().synchronize()  # the weights and the cache were made on the default stream, which ours skips
        with stream:
            self.dev_buffer = cp.zeros_like(self.host_buffer)
            self.host = {f: self.host_buffer[starts[f]:starts[f] + sizes[f]] for f in self.FIELDS}
            self.dev = {f: self.dev_buffer[starts[f]:starts[f] + sizes[f]] for f in self.FIELDS}
            self.token_ring = cp.zeros((2 * MAX_STEPS_PER_RUN, B), np.int32)  # one run's tokens while the next runs
            self.ring_row = 0  # the ring row the next step writes (the GPU keeps its own count in `ring_row`)
            rows, d = cp.arange(B + 1, dtype=np.int32), self.dev
            # CudaBackend.to_device's fields, for B decode rows: attention_decode's rows, or one-query tiles (tile_min_q)
            attention = dict(row_q=rows[:B], row_seq=rows[:B], row_len=d["context_lens"], tile_seq=rows[:0],
                             tile_q0=rows[:0]) if backend.tile_min_q != 1 else dict(
                row_q=rows[:0], row_seq=rows[:0], row_len=rows[:0], tile_seq=rows[:B], tile_q0=cp.zeros_like(rows[:B]))
            self.batch = batch = device_batch(
                input_ids=d["input_ids"], positions=d["positions"], slot_mapping=d["slot_mapping"],
                context_lens=d["context_lens"], block_tables=d["block_tables"].reshape(B, max_blocks),
                cu_seqlens_q=rows, logits_idx=None, max_row_len=n_ctx, **attention)
            sampling = {f: d[f].view(self.TYPES.get(f, np.int32)) for f in self.SAMPLING}
            self.start(np.zeros(0, np.int32), {f: [] for f in self.SAMPLING}, RunPlan(0, *([],) * 4, np.zeros((0, 1))))

            def step():  # what each replay runs: the engine's decode step, then the next step's inputs on the GPU
                tokens = decode_step(batch, sampling)
                backend.launch("decode_advance", (1,), (B,), (
                    tokens, d["input_ids"], d["positions"], d["context_lens"], d["slot_mapping"], d["token_index"],
                    d["remaining"], d["block_tables"], np.int32(max_blocks), np.int32(kv.block_size), self.token_ring,
                    np.int32(len(self.token_ring)), d["ring_row"], np.int32(B)))
            # the step's activations, and only they, come from the pool the graphs share: what one graph leaves free
            # there, the next one captured may take (a buffer kept from one step to the next, above, must not)
            with cp.cuda.using_allocator(pool.malloc):
                step()  # warm-up: the first launches and allocations stay out of the capture
                stream.synchronize()
                self.graph = backend.capture(stream, step)
        self.graph.upload(stream)

    def start(self, input_ids, sampling, plan):
        """Load n <= B sequences: last tokens, sampling parameters (by SamplingArrays' field names), plan rows; the rest
        are padding (greedy, unwritten)."""
        self.n = len(input_ids)
        for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
            self._write(name, sampling[name])
        self._write("input_ids", input_ids)
        self.host["ring_row"][0] = self.ring_row = 0
        self._write_rows(plan)
        self.dev_buffer.set(self.host_buffer, stream=self.stream)

    def carry_on(self, plan):
        """Let the next run go on where the launched ones stop: the GPU has input tokens; the host writes the rest."""
        self._write_rows(plan)
        self.dev_buffer[self.carry_from:].set(self.host_buffer[self.carry_from:], stream=self.stream)

    def _write(self, name, values):  # the first n rows of a field, and padding after them
        field = self.host[name].view(self.TYPES.get(name, np.int32))
        field[:self.n], field[self.n:] = values, self.PADDING[name]

    def _write_rows(self, plan):
        for name in ("token_index", "remaining", "positions", "slot_mapping"):
            self._write(name, getattr(plan, name))
        self.host["context_lens"][:] = self.host["positions"] + 1  # position p sees p + 1 keys; padding sees 1
        tables = self.host["block_tables"].reshape(self.B, -1)
        tables[:] = 0
        tables[:self.n, :plan.block_tables.shape[1]] = plan.block_tables

    def launch(self, seqs, sampling, plan):
        """Replay the step plan.num_steps times for these sequences (its rows)."""
        first = self.ring_row
        self.ring_row += plan.num_steps
        for _ in range(plan.num_steps):
            self.graph.launch(self.stream)
        done = cp.cuda.Event()
        done.record(self.stream)
        starts = {s.seq_id: int(p) for s, p, n in zip(seqs, plan.positions, plan.remaining) if n}
        return GraphRun(self, seqs, sampling, plan.num_steps, starts, first, done)


class ChunkGraph:
    """Up to B sequences' chunks of up to T tokens each, and the sampling of up to `samples` rows of each, replayed from
    one CUDA graph: a lone prompt's prefill (B 1, samples 1: its first token), or decodes' verification chunks, each
    its last token and its draft (samples T: a token at each). Eager, such a step launches ~100 kernels one by one from
    Python, which for GPT-2's sizes costs more than the GPU's work: a lone request's time to first token (what a
    prefix-cache hit shortens) and a speculating one's every step are the host's. Each chunk is padded to T tokens: a
    pad computes at its sequence's last real position and writes no cache slot (-1); each sequence is declared T
    queries long, so each real query keeps its position and sees only real keys; sequences past the batch's are
    padding too, and rows no one samples sample something unread."""
    def __init__(self, chunk_step, backend, kv, n_ctx, T, samples, stream, pool, B=1, around=None):
        self.T, self.samples, self.B, self.stream, self.min_q = T, samples, B, stream, backend.tile_min_q
        self.width = kv.blocks_needed(n_ctx + T)  # the pads' queries may look past the context: entries 0
        host, self.layout, _ = pack_batch(self.padded(types.SimpleNamespace(
            input_ids=[0], positions=[0], slot_mapping=[-1], context_lens=[1], block_tables=np.zeros((1, 1)),
            logits_idx=[0], cu_seqlens_q=[0, 1]))[0], self.min_q)
        # the inputs in one buffer (one copy a replay): the batch as pack_batch lays it out, then the sampling fields
        # (seed first: 8-byte aligned after pack_batch's 16-byte steps), a row each sampled row (seed two int32s)
        names = sorted(DecodeGraph.SAMPLING, key=lambda f: f != "seed")
        sizes = [B * samples * (2 if f == "seed" else 1) for f in names]
        starts = len(host) + np.cumsum([0] + sizes)
        self.host_buffer = np.concatenate([host, np.zeros(starts[-1] - len(host), np.int32)])
        self.sampling_at = {f: slice(a, a + n) for f, a, n in zip(names, starts.tolist(), sizes)}
        with stream:
            self.dev_buffer = cp.asarray(self.host_buffer)
            self.batch = batch = device_batch_of(self.dev_buffer[:len(host)], self.layout, n_ctx + T)
            self.sampling = {f: self.dev_buffer[at].view(DecodeGraph.TYPES.get(f, np.int32))
                             for f, at in self.sampling_at.items()}
            self.tokens = cp.zeros(B * samples, np.int32)  # where every replay leaves the sampled tokens (no pool)

            def step():  # `around` (SpecGraph) makes the inputs on the GPU before, and reads the tokens after
                around and around.before(self)
                self.tokens[...] = chunk_step(batch, self.sampling)
                around and around.after(self)
            with cp.cuda.using_allocator(pool.malloc):
                step()  # warm-up, out of the capture
                stream.synchronize()
                self.graph = backend.capture(stream, step)
        self.graph.upload(stream)

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
        tables = np.zeros((self.B, self.width), np.int32)
        tables[:S, :batch.block_tables.shape[1]] = batch.block_tables
        return types.SimpleNamespace(
            input_ids=np.where(real, np.asarray(batch.input_ids)[src], 0),
            positions=np.where(seq < S, np.asarray(batch.positions)[src], 0),
            slot_mapping=np.where(real, np.asarray(batch.slot_mapping)[src], -1),
            cu_seqlens_q=np.arange(0, self.B * T + 1, T), block_tables=tables, logits_idx=logits_idx,
            context_lens=np.concatenate([np.asarray(batch.context_lens) + T - n, np.full(self.B - S, T)])), slots

    def run(self, batch, sampling):
        """(1, rows that sample) tokens: the inputs copied in (one copy), a replay."""
        host_batch, slots = self.padded(batch)
        host = [pack_batch(host_batch, self.min_q)[0]]
        for f, a in self.sampling.items():
            values = np.asarray(getattr(sampling, f), a.dtype)
            field = np.full(len(a), values[-1], a.dtype)  # rows no one samples: anything
            field[slots] = values
            host.append(field.view(np.int32))
        self.dev_buffer.set(np.concatenate(host), stream=self.stream)
        self.graph.launch(self.stream)
        return self.tokens.get(stream=self.stream)[None, slots].astype(np.int64)


class SpecGraph:
    """n-gram speculation chained on the GPU: a step of up to B decoding sequences, each its last token and a draft of
    up to k tokens, replayed from one CUDA graph many times a run, as DecodeGraph replays plain steps. A replay is
    propose -> verify -> accept: ngram_propose makes each row's draft from its token history (speculation.py's rule)
    and its chunk of T = k + 1 queries; a ChunkGraph's forward samples a token at every query; spec_accept keeps the
    draft up to its first miss, and the token sampled there, appended to the history. A row's kept tokens vary from
    step to step, so each step leaves them in a ring with their count, read once a run; a row that has made all it
    may turns to padding. The host pays once a run, not once a step (its work for a step costs more than a GPT-2
    124M step's GPU time: NOTES.md)."""
    STATE = ("history", "length", "remaining", "token_base", "ndraft", "step")

    def __init__(self, chunk_step, backend, kv, n_ctx, k, n_min, n_max, stream, pool, B):
        self.B, self.T, self.n_ctx, self.stream, self.backend, self.kv = B, k + 1, n_ctx, stream, backend, kv
        self.n_min, self.n_max = n_min, n_max
        sizes = dict.fromkeys(self.STATE, B) | dict(history=B * n_ctx)  # history (B, n_ctx): each row's token ids
        starts = np.cumsum([0] + list(sizes.values()))
        self.host_state = np.zeros(starts[-1], np.int32)
        self.host = {f: self.host_state[a:a + sizes[f]] for f, a in zip(self.STATE, starts)}
        with stream:
            self.dev_state = cp.zeros_like(self.host_state)
            self.state = {f: self.dev_state[a:a + sizes[f]] for f, a in zip(self.STATE, starts)}
            self.ring = cp.zeros((MAX_STEPS_PER_RUN, B, self.T + 2), np.int32)  # per step and row: a + 1, k', tokens
            self.scratch = cp.zeros(B * self.T, np.int32)  # row lengths no kernel reads (a tiled chunk's)
        self.chunk = c = ChunkGraph(chunk_step, backend, kv, n_ctx, self.T, self.T, stream, pool, B, around=self)
        start, _ = c.layout["logits_idx"]
        c.host_buffer[start:start + B * self.T] = np.arange(B * self.T)  # every query samples

    def before(self, chunk):
        s, b = self.state, chunk.batch
        self.backend.launch("ngram_propose", (self.B,), (128,), (
            s["history"], s["length"], s["remaining"], s["token_base"], s["ndraft"], b.input_ids, b.positions,
            b.slot_mapping, b.context_lens, b.row_len if b.n_rows else self.scratch, chunk.sampling["token_index"],
            b.block_tables, np.int32(chunk.width), np.int32(self.kv.block_size), np.int32(self.n_ctx),
            np.int32(self.T), np.int32(self.n_min), np.int32(self.n_max)))

    def after(self, chunk):
        s = self.state
        self.backend.launch("spec_accept", (-(-self.B // 128),), (128,), (
            chunk.tokens, chunk.batch.input_ids, s["ndraft"], s["history"], s["length"], s["remaining"],
            s["token_base"], s["step"], self.ring, np.int32(self.B), np.int32(self.T), np.int32(self.n_ctx)))

    def run(self, seqs, sampling, plan):
        """Load the sequences (their tokens, the plan's blocks and steps, their sampling parameters, a row each of
        the chunk's T), replay plan.num_steps times; then (N, rows) tokens each row kept, in order, -1 after its
        last, and `drafts` beside them: a step's first kept token carries the draft tokens that step verified, each
        kept draft token after it -1."""
        n, T, c = len(seqs), self.T, self.chunk
        for f in self.STATE[1:]:  # the history past a row's length is never read: not cleared
            self.host[f][:] = 0
        history = self.host["history"].reshape(self.B, self.n_ctx)
        for row, seq in enumerate(seqs):
            history[row, :len(seq.token_ids)] = seq.token_ids
        self.host["length"][:n] = [len(seq.token_ids) for seq in seqs]
        self.host["remaining"][:n], self.host["token_base"][:n] = plan.remaining, plan.token_index
        host = c.host_buffer
        start, shape = c.layout["block_tables"]
        tables = host[start:start + shape[0] * shape[1]].reshape(shape)
        tables[:] = 0
        tables[:n, :plan.block_tables.shape[1]] = plan.block_tables
        for f, at in c.sampling_at.items():  # a row's parameters on each of its T queries (padding: DecodeGraph's)
            values = np.full(self.B, DecodeGraph.PADDING[f], DecodeGraph.TYPES.get(f, np.int32))
            values[:n] = getattr(sampling, f)
            host[at].view(values.dtype)[:] = np.repeat(values, T)
        c.dev_buffer.set(host, stream=self.stream)
        self.dev_state.set(self.host_state, stream=self.stream)
        for _ in range(plan.num_steps):
            c.graph.launch(self.stream)
        ring = self.ring[:plan.num_steps].get(stream=self.stream)[:, :n].transpose(1, 0, 2)  # (n, steps, T + 2)
        kept = np.arange(T) < ring[:, :, :1]  # (n, steps, T)
        order = np.cumsum(kept.reshape(n, -1), axis=1).reshape(kept.shape) - 1  # each kept token's place in its row
        rows = np.broadcast_to(np.arange(n)[:, None, None], kept.shape)
        tokens, drafts = np.full((2, plan.num_steps * T, n), -1, np.int64)
        tokens[order[kept], rows[kept]] = ring[:, :, 2:][kept]
        drafts[order[:, :, 0][kept[:, :, 0]], rows[:, :, 0][kept[:, :, 0]]] = ring[:, :, 1][kept[:, :, 0]]
        return tokens, drafts


class GraphRunner:
    """Decode batches (each sequence computes its last token and samples, none wants logprobs or edits its logits)
    replayed from CUDA graphs, in runs of up to MAX_STEPS_PER_RUN steps. `decode_step(batch, sampling)` is what a
    graph records: the engine's forward and sampler on device arrays (nanoinfer.ModelRunner.decode_step). Every
    graph is captured here, at start-up; and before the host reads a run's tokens, the next run is launched, going
    on where that one stops, so the GPU computes while the host turns tokens into text. A lone prompt's prefill replays
    a graph too, and so do decodes' verification chunks when speculating (ChunkGraph). One stream: the
    engine's eager steps run on it too (eager()), so a run ends before later work reuses its blocks."""
    def __init__(self, decode_step, backend, kv, n_ctx, max_num_seqs, num_scheduler_steps=MAX_STEPS_PER_RUN,
                 verify_tokens=0, ngram=None):
        global cp
        import cupy as cp
        self.backend, self.kv, self.n_ctx = backend, kv, n_ctx
        self.num_scheduler_steps = min(num_scheduler_steps, MAX_STEPS_PER_RUN)
        # an admission is an eager step (kernels launched one by one) that ends the runs of graph steps, so a full
        # engine lets waiting requests in by groups (TGI's waiting_served_ratio is the same trade)
        self.admission_group = max(1, max_num_seqs // ADMIT_GROUP)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.in_flight = None  # a run launched and not yet read
        # a graph per bucket up to max_num_seqs, as serving engines do, so that no request waits for one; the largest
        # first, whose activations the smaller ones then reuse (one stream: one shared pool)
        pool = cp.cuda.MemoryPool()
        self.buckets = [b for b in GRAPH_BUCKETS if b < max_num_seqs] + [b for b in GRAPH_BUCKETS if b >= max_num_seqs][:1]
        self.graphs = {B: DecodeGraph(decode_step, backend, kv, n_ctx, B, self.stream, pool)
                       for B in reversed(self.buckets)}
        self.prefills = {T: ChunkGraph(decode_step, backend, kv, n_ctx, T, 1, self.stream, pool)
                         for T in reversed(PREFILL_BUCKETS) if T <= n_ctx}
        # speculating (verify_tokens: 1 + the most draft tokens), a graph per bucket of sequences as for decode steps:
        # n-gram drafts (ngram: prompt_lookup_min and _max) made on the GPU, steps chained in runs (SpecGraph); a draft
        # model's drafts, from the host, each step's chunks verified by one replay (ChunkGraph)
        k1 = verify_tokens
        self.spec = {B: SpecGraph(decode_step, backend, kv, n_ctx, k1 - 1, *ngram, self.stream, pool, B)
                     for B in reversed(self.buckets)} if k1 and ngram else {}
        self.verify = {B: ChunkGraph(decode_step, backend, kv, n_ctx, k1, k1, self.stream, pool, B)
                       for B in reversed(self.buckets)} if k1 and not ngram else {}

    def takes(self, batch, seqs):
        """Whether the graphs run this batch: a decode token for each sequence; or one sequence's last prompt chunk
        (sampling at its last token); or, speculating, decodes only, each its last token and its draft (a row each):
        each sampling as the graphs do."""
        if any(s.logprobs is not None or s.edits_logits for s in seqs):
            return False
        decodes_only = len(batch.input_ids) == len(seqs) == len(batch.logits_idx)  # every token samples
        if any(s.draft for s in seqs):
            return bool(self.verify) and decodes_only and len(batch.cu_seqlens_q) - 1 <= max(self.verify) and \
                max(np.diff(batch.cu_seqlens_q)) <= self.verify[1].T
        lone_prefill = len(batch.cu_seqlens_q) == 2 and len(seqs) == len(batch.logits_idx) == 1 and \
            len(batch.input_ids) <= max(self.prefills, default=0)
        return len(batch.input_ids) == len(seqs) <= max(self.graphs) or lone_prefill

    def running_ahead(self):
        """Whether a run launched ahead computes running sequences (while it does, no request should come in: it
        would end the run unread)."""
        return self.in_flight is not None and any(not s.finish_reason for s in self.in_flight.seqs)

    def run(self, batch, seqs, sampling, launch_next, speculate=False):
        """(num_steps, R) sampled tokens of a batch the graphs take, and None (or a speculating run's drafts, below). A
        lone prompt's: the smallest prefill graph that holds it, one replay; verification chunks': the verification
        graph of their bucket, one replay. Decode rows', speculating with n-gram drafts: a SpecGraph run (tokens -1
        after a row's last, and the drafts it verified: SpecGraph.run). Else from the run in flight if it computes
        them, or from one launched now; before they are read, the next run is launched (if launch_next and it can go
        on alone)."""
        if len(batch.input_ids) != len(seqs):
            self.in_flight = None
            return self.prefills[min(T for T in self.prefills if T >= len(batch.input_ids))].run(batch, sampling), None
        if any(s.draft for s in seqs):
            self.in_flight = None
            return self.verify[min(B for B in self.verify if B >= len(batch.cu_seqlens_q) - 1)].run(batch, sampling), \
                None
        if speculate and self.spec:
            graph = self.spec[next(b for b in GRAPH_BUCKETS if b >= len(seqs))]
            plan = plan_run(self.kv, seqs, 0, self.num_scheduler_steps, self.n_ctx, graph.T)
            if plan is not None:  # else too few free blocks for a whole chunk: a plain step
                self.in_flight = None
                return graph.run(seqs, sampling, plan)
        run = self.in_flight
        if not (run and all(run.first_positions.get(s.seq_id) == len(s.token_ids) - 1 for s in seqs)):
            # one step when the host drafts next (a draft model's): more would run past tokens the draft could make
            steps = 1 if speculate else self.num_scheduler_steps
            plan = plan_run(self.kv, seqs, 0, steps, self.n_ctx)  # the scheduler reserved step 1
            graph = self._graph_for(len(seqs))
            graph.start(np.array([s.token_ids[-1] for s in seqs], np.int32), sampling._asdict(), plan)
            run = graph.launch(seqs, sampling, plan)
        self.in_flight = self._next_run(run, seqs) if launch_next else None
        row_of = {s.seq_id: row for row, s in enumerate(run.seqs)}
        return run.tokens()[:, [row_of[s.seq_id] for s in seqs]], None

    def _graph_for(self, rows):
        return self.graphs[next(b for b in GRAPH_BUCKETS if b >= rows)]

    def _next_run(self, run, seqs):
        """The run after `run`, launched now, if it can go on without the scheduler (else None): multi-step is on, this
        step reads every unfinished row of `run`, and some row has steps left. The rows that go on keep their graph
        (the rest pad) or move to a smaller one that fits, their input tokens gathered on the GPU."""
        unfinished = sum(not s.finish_reason for s in run.seqs)
        if self.num_scheduler_steps == 1 or len(seqs) != unfinished:
            return None
        live = np.flatnonzero(steps_left(run.seqs, run.num_steps, self.n_ctx))
        if not len(live):
            return None
        graph = self._graph_for(len(live))
        if graph is not run.graph:
            seqs, sampling = [run.seqs[i] for i in live], type(run.sampling)(*(a[live] for a in run.sampling))
        else:
            seqs, sampling = run.seqs, run.sampling
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
    def eager(self):
        """For a step the graphs do not take: on their stream, after what they launched; a run launched ahead that
        the step does not read is dropped (stream order keeps it safe)."""
        self.in_flight = None
        with self.stream:
            yield

    def wait(self):
        """Until the GPU has finished everything launched (a run launched ahead included)."""
        self.stream.synchronize()

    def reset(self):
        """Forget the run in flight (a failed step's): the next decode starts afresh from the host's tokens, and stream
        order keeps its writes before any later work."""
        self.in_flight = None
