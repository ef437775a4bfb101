"""Speculative decoding: fewer target steps, no token changed. A lever of its own: the core step knows nothing of it;
LLM.__init__ plugs in its scheduler and its runner.

A decode step reads every weight to make one token per sequence. A sequence that can guess what comes next (a draft
of up to k tokens) computes its last token and the draft as one chunk of k + 1 queries, samples a token at each, and
keeps the draft up to the first drafted token that differs from the token sampled in its place, and that sampled
token: 1 to k + 1 tokens for the weights read once. Two ways to guess, vLLM's:
- "ngram" (prompt lookup): if the sequence's last n tokens occurred earlier in it, what followed them then;
- a draft model ({"model": ..., "num_speculative_tokens": k}): a smaller GPT-2 of the same vocabulary samples k tokens
  one after another, each with the target's own keyed race (same seed, same token index).

The seams are vLLM v1's: DraftingScheduler gives a decode's draft room as tokens to compute (Sequence.draft: make_batch
samples at each), and Verifier turns the sampled rows into the tokens kept. Those are plain decoding's tokens: each is
drawn by the same race keyed by (seed, token index, token id), at the same index, from logits over the same tokens
before it, with the penalties, bias and bans plain decoding gives that position (sampling_params.penalties). A
rejected position's KV is never read: the next step writes that slot again. So a draft changes only the speed.

On the GPU, both ways chain their steps without the host, many a run (SpecGraph, DraftGraph: graph_runner replays
them; their kernels' numpy definitions close this file); the host drafts only for the requests the graphs do not take.
"""
import dataclasses
import types

import numpy as np

from checkpoint import Tokenizer, load_config, load_weights, resolve_model
from cuda_backend import batch_fields
from graph_runner import MAX_STEPS_PER_RUN, SAMPLING, BatchInputs, ChunkGraph
from nanoinfer import GPT, ModelRunner, make_batch
from scheduler import Scheduler, Sequence

try:
    import cupy as cp  # (this file imports without CuPy: the chained graphs are built only on a GPU)
except ImportError:
    cp = None

FORMS = ('{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or '
         '{"model": a GPT-2 name or directory, "num_speculative_tokens": k}, either with "disable_by_batch_size": N')


def make_proposer(config, llm):
    """The proposer speculative_config asks for (its settings checked: ValueError naming what is wrong)."""
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config={config!r}: a dict, vLLM's: {FORMS}")
    return DraftModelProposer(config, llm) if "model" in config else NgramProposer(config, llm.config.n_ctx)


class Proposer:
    """What both ways share: k, a sequence's room for a draft, when to draft, the seams, vLLM's counters."""
    draft_config = None  # a draft model's GPT-2 config (its K/V share the pool's slots)
    on_device = False  # the GPU drafts for the decodes its graphs take (chained_graph)
    n_min = n_max = 0  # the n-gram sizes ngram_propose matches (0: none, the drafts are a draft model's)

    def __init__(self, config, n_ctx):
        self.k, self.max_batch = config.get("num_speculative_tokens"), config.get("disable_by_batch_size")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"speculative_config={config!r}: num_speculative_tokens is an integer >= 1")
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ValueError(f"speculative_config={config!r}: disable_by_batch_size is an integer >= 1 (or absent)")
        self.n_ctx, self.proposed, self.accepted = n_ctx, 0, 0

    def scheduler(self, kv, engine):
        return DraftingScheduler(self, kv, engine.max_num_seqs, engine.max_num_batched_tokens)

    def runner(self, runner):
        return Verifier(runner, self)

    def active(self, batch):
        """Whether a step of `batch` sequences drafts (vLLM's disable_by_batch_size): a large batch's step already
        reads each weight for many tokens, and its verification chunks cost more than drafts save."""
        return self.max_batch is None or batch <= self.max_batch

    def room(self, seq, budget):
        """Tokens seq may draft on the host: k, the step's budget, and the tokens it may still make (max_tokens,
        context) less 1; none where the GPU drafts (a decode the graphs take: no log-probs, logits unedited)."""
        if self.on_device and seq.logprobs is None and not seq.edits_logits:
            return 0
        p = seq.params
        return max(0, min(self.k, budget, min(p.max_tokens - seq.num_output, self.n_ctx - len(seq.token_ids)) - 1))

    def fill(self, seqs):
        """Make the drafts of these sequences (each has room for its draft): the n-gram's are made."""

    def count(self, seq, verified, kept):  # vLLM's counters, the engine's and the request's
        self.proposed, self.accepted = self.proposed + verified, self.accepted + kept
        seq.num_draft_tokens += verified
        seq.num_accepted_tokens += kept


class DraftingScheduler(Scheduler):
    """The scheduler, then drafts for its decodes, within the step's token budget and free blocks (never preempting)."""
    def __init__(self, proposer, kv, max_num_seqs, max_num_batched_tokens):
        super().__init__(kv, max_num_seqs, max_num_batched_tokens)
        self.proposer = proposer

    def schedule(self, admit=True):
        drafting = self.proposer.active(len(self.running))  # (as many run as before any comes in or is preempted)
        scheduled = super().schedule(admit)
        budget = self.max_num_batched_tokens - sum(n for _, n in scheduled) if drafting else 0  # tokens left for drafts
        for i, (seq, n) in enumerate(scheduled):
            if seq.num_uncomputed != 1 or budget == 0:  # a prompt's chunk, or no room left in the step
                continue
            draft = self.proposer.propose(seq, budget)
            while draft and not self.kv.can_fit(seq.seq_id, len(seq.token_ids) + len(draft)):
                draft.pop()
            if draft:
                self.kv.grow(seq.seq_id, len(seq.token_ids) + len(draft))
                seq.draft, scheduled[i], budget = draft, (seq, 1 + len(draft)), budget - len(draft)
        self.proposer.fill([seq for seq, _ in scheduled if seq.draft])
        return scheduled


class Verifier:
    """The runner, then the judgement: a draft kept up to its first token sampled otherwise, and that sampled token."""
    def __init__(self, runner, proposer):
        self.runner, self.proposer = runner, proposer
        self.running_ahead, self.wait, self.step_failed = runner.running_ahead, runner.wait, runner.step_failed
        proposer.on_device = runner.graphs is not None

    def run(self, batch):
        sampled = self.runner.run(batch)
        for seq in [s for s in batch.seqs if s.draft]:
            got = sampled[seq]
            kept = next((i for i, token in enumerate(got.token_ids[:-1]) if token != seq.draft[i]),
                        len(got.token_ids) - 1)  # draft tokens kept: the rows after them sampled them
            logits = None if got.logits is None else got.logits[:kept + 1]
            sampled[seq] = dataclasses.replace(got, token_ids=got.token_ids[:kept + 1], logits=logits)
            self.proposer.count(seq, len(got.token_ids) - 1, kept)
            seq.draft = []
        return sampled


class NgramProposer(Proposer):
    """Drafts by prompt lookup (vLLM's "ngram")."""

    def __init__(self, config, n_ctx):
        super().__init__(config, n_ctx)
        if config.get("method") != "ngram":
            raise ValueError(f"speculative_config={config!r}: this engine drafts by {FORMS}")
        self.n_max, self.n_min = config.get("prompt_lookup_max", 4), config.get("prompt_lookup_min", 1)
        if not all(isinstance(v, int) and v >= 1 for v in (self.n_max, self.n_min)) or self.n_min > self.n_max:
            raise ValueError(f"speculative_config={config!r}: prompt_lookup_max and prompt_lookup_min are integers "
                             ">= 1, prompt_lookup_min <= prompt_lookup_max")

    def chained_graph(self, common, B):  # graph_runner.GraphRunner's graph of B rows drafting on the GPU
        return SpecGraph(*common, self, B)

    def propose(self, seq, budget):
        """seq's draft: after the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down), what
        came next, as much as its room holds. Copied as LZ77 copies: a token at a time, so that an occurrence close
        to the end runs on into the draft itself (d tokens back: the last d tokens repeated, as in a loop of d)."""
        room = self.room(seq, budget)
        if room <= 0:
            return []
        ids = np.asarray(seq.token_ids)
        ends, found = np.arange(len(ids) - 1), None  # where earlier occurrences of the last n tokens end, n = 1, 2, ...
        for n in range(1, min(self.n_max, len(ids) - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[ids[ends - n + 1] == ids[-n]]
            if not len(ends):
                break
            if n >= self.n_min:
                found = ends[-1]  # the latest of the longest so far
        if found is None:
            return []
        loop = len(ids) - 1 - found  # what followed it, to the end: the draft repeats it
        return [seq.token_ids[found + 1 + i % loop] for i in range(room)]


class DraftModelProposer(Proposer):
    """Drafts by a smaller GPT-2 of the target's vocabulary and context, on its backend, its K/V in the target's blocks
    (tensors of its own), run over sequence views (view()) by a ModelRunner of its own (on the GPU, graphs too). Per
    sequence it remembers how many tokens have their draft K/V written and in which blocks (`computed`), and the draft
    tokens it was fed (`fed`): those the target kept have right K/V."""
    def __init__(self, config, llm):
        super().__init__(config, llm.config.n_ctx)
        if config.get("method", "draft_model") != "draft_model":
            raise ValueError(f"speculative_config={config!r}: this engine drafts by {FORMS}")
        path = resolve_model(config["model"])
        self.draft_config = c = load_config(path)
        tokenizer = Tokenizer(path, c.vocab_size)
        llm.backend.check_model(c)
        if not tokenizer.same_vocabulary(llm.tokenizer) or c.n_ctx < llm.config.n_ctx:
            raise ValueError(f"speculative_config={config!r}: a draft model needs the target's vocabulary (ids meaning "
                             f"the same bytes) and context ({llm.config.n_ctx}); {path} has " + (
                                 f"a context of {c.n_ctx}" if c.n_ctx < llm.config.n_ctx else "another vocabulary"))
        self.draft_model = GPT(c, load_weights(path, c), llm.backend, tokenizer.n_vocab)
        self.computed = {}  # seq_id -> (tokens with draft K/V written, the blocks they lie in)
        self.fed = {}  # seq_id -> (position, the draft tokens fed to the draft model from there)

    def scheduler(self, kv, engine):
        """The target's blocks, the draft model's K/V tensors in them, and its runner."""
        c = self.draft_config
        self.kv, self.draft_kv = kv, kv.with_tensors(self.draft_model.backend, c.n_layer, c.n_head, c.head_dim)
        self.draft_runner = ModelRunner(self.draft_model, self.draft_kv, engine)
        return super().scheduler(kv, engine)

    def chained_graph(self, common, B):  # graph_runner.GraphRunner's graph of B rows drafting on the GPU
        return DraftGraph(*common, self, B)

    def propose(self, seq, budget):
        """Room for the draft: its tokens are fill's, made once the step's drafting sequences are known."""
        return [0] * self.room(seq, budget)

    def catch_up(self, seqs):
        """Before a run of DraftGraph steps, whose first computes each sequence's last two tokens: the draft K/V of
        all tokens before them, computed now where missing (a new prompt, a preemption, host drafts not kept)."""
        self._forget_gone()
        behind = [view(seq, seen, 0, end=len(seq.token_ids) - 2) for seq in seqs
                  if (seen := self._seen(seq)) < len(seq.token_ids) - 2]
        if behind:  # (the token each samples is not needed)
            self.draft_runner.run(make_batch([(v, v.num_uncomputed) for v in behind], self.draft_kv))

    def ran(self, kept):
        """After a DraftGraph run: the draft K/V of each sequence right for all but the last two of its tokens."""
        for seq, tokens in kept.items():
            self._computed(seq, len(seq.token_ids) + len(tokens) - 2)

    def fill(self, seqs):
        """Each sequence's draft: a forward over its tokens the draft model has not seen, then one a draft token."""
        if not seqs:  # most steps of most workloads
            return
        self._forget_gone()
        made, start = {seq: 0 for seq in seqs}, {seq: self._seen(seq) for seq in seqs}
        while views := {view(seq, start[seq] if j == 0 else len(seq.token_ids) + j - 1, j): seq
                        for seq, j in made.items() if j < len(seq.draft)}:
            batch = make_batch([(v, v.num_uncomputed) for v in views], self.draft_kv)
            for v, got in self.draft_runner.run(batch).items():  # a graph run may make several tokens at once
                seq, tokens = views[v], got.token_ids
                n = min(len(tokens), len(seq.draft) - made[seq])
                seq.draft[made[seq]:made[seq] + n] = tokens[:n]
                made[seq] += n
        for s in seqs:  # the last draft token is never fed
            n = len(s.token_ids) + len(s.draft) - 1
            self._computed(s, n)
            self.fed[s.seq_id] = (len(s.token_ids), s.draft[:-1])

    def _computed(self, seq, n):  # seq's first n tokens have right draft K/V, in these blocks
        self.computed[seq.seq_id] = (n, tuple(self.kv.block_tables[seq.seq_id][:self.kv.blocks_needed(n)]))

    def _forget_gone(self):
        tables = self.kv.block_tables
        self.computed, self.fed = ({i: c for i, c in d.items() if i in tables} for d in (self.computed, self.fed))

    def _seen(self, seq):
        """How many of seq's first tokens have right draft K/V, all but its last at most (fed now): those written, up
        to the first draft token fed that the sequence did not keep; none if its blocks changed (a preemption)."""
        n, blocks = self.computed.get(seq.seq_id, (0, ()))
        if tuple(self.kv.block_tables[seq.seq_id][:len(blocks)]) != blocks:
            n = 0
        position, fed = self.fed.pop(seq.seq_id, (n, []))
        after = seq.token_ids[position:]
        kept = next((i for i, (a, b) in enumerate(zip(fed, after)) if a != b), min(len(fed), len(after)))
        return min(n, position + kept, len(seq.token_ids) - 1)


def view(seq, start, j, end=None):
    """seq as the draft model sees it at draft token j: its tokens and first j drafts (or its first `end` tokens, a
    prompt of their own), computing from `start`, sampling with its seed, temperature and filters, its logits unedited
    (the target applies the request's penalties, bias and bans), making no more than the draft's tokens."""
    params = dataclasses.replace(seq.params, max_tokens=max(1, seq.num_output + len(seq.draft)), min_tokens=0,
                                 logprobs=None, prompt_logprobs=None, repetition_penalty=1.0, presence_penalty=0.0,
                                 frequency_penalty=0.0, logit_bias=None)
    prompt = seq.prompt_token_ids if end is None else seq.token_ids[:end]
    v = Sequence(seq.seq_id, prompt, params, seq.seed, None)
    if end is None:
        v.token_ids = seq.token_ids + seq.draft[:j]
    v.num_computed = start
    return v

# -----------------------------------------------------------------------------
# on the GPU: speculation's steps chained in CUDA graphs, many a run (graph_runner.GraphRunner's, from chained_graph)

class SpecGraph(ChunkGraph):
    """n-gram speculation chained on the GPU, many steps a run (the host pays once a run, not once a step). A replay
    drafts (ngram_propose: each row's T = k + 1 queries from its token history, NgramProposer's rule), verifies (the
    forward samples each query) and keeps (spec_accept: the draft to its first miss, then the token sampled there, into
    the history and a ring). A row that has made all it may is padding."""
    def __init__(self, chunk_step, backend, kv, n_ctx, stream, pool, proposer, B):
        self.n_ctx, self.backend, self.kv, self.proposer, T = n_ctx, backend, kv, proposer, proposer.k + 1
        with stream:
            self.ring = cp.zeros((MAX_STEPS_PER_RUN, B, T + 2), np.int32)  # per step and row: kept, verified, tokens
            self.scratch = cp.zeros(B * T, np.int32)  # row lengths no kernel reads (a tiled chunk's)
        state = dict(history=(B * n_ctx,), length=(B,), remaining=(B,), token_base=(B,), ndraft=(B,), step=(B,))
        super().__init__(chunk_step, backend, kv, n_ctx, stream, pool, T, T, B,
                         state={f: (shape, np.int32) for f, shape in state.items()})
        self.host["logits_idx"][:] = np.arange(B * T)  # every query samples

    def step(self):
        self.propose()
        super().step()
        d, b = self.dev, self.batch
        self.backend.launch("spec_accept", (-(-self.B // 128),), (128,), (
            self.tokens, b.input_ids, d["ndraft"], d["history"], d["length"], d["remaining"], d["token_base"],
            d["step"], self.ring, np.int32(self.B), np.int32(self.T), np.int32(self.n_ctx)))

    def propose(self):  # each row's draft, then its verification chunk
        d, b, p = self.dev, self.batch, self.proposer
        self.backend.launch("ngram_propose", (self.B,), (128,), (
            d["history"], d["length"], d["remaining"], d["token_base"], d["ndraft"], b.input_ids, b.positions,
            b.slot_mapping, b.context_lens, b.row_len if b.n_rows else self.scratch, d["token_index"],
            b.block_tables, np.int32(self.width), np.int32(self.kv.block_size), np.int32(self.n_ctx),
            np.int32(self.T), np.int32(p.n_min), np.int32(p.n_max)))

    def run(self, seqs, sampling, plan):
        """{sequence: the tokens it kept, in order}: rows loaded, plan.num_steps replays; vLLM's counters counted."""
        for row, seq in enumerate(seqs):  # history: (B, n_ctx), each row's token ids (past its length: not read)
            self.host["history"][row * self.n_ctx:row * self.n_ctx + len(seq.token_ids)] = seq.token_ids
        for f, values in dict(length=[len(seq.token_ids) for seq in seqs], remaining=plan.remaining,
                              token_base=plan.token_index, ndraft=[], step=[], block_tables=plan.block_tables).items():
            self.set(f, values)
        for f in SAMPLING:  # a row's parameters on each of its T queries (padding: a padding row's)
            self.set(f, np.repeat(getattr(sampling, f), self.T))
        self.upload()
        for _ in range(plan.num_steps):
            self.graph.launch(self.stream)
        ring, kept = self.ring[:plan.num_steps].get(stream=self.stream), {seq: [] for seq in seqs}
        for row, seq in enumerate(seqs):
            for n, verified, *tokens in ring[:, row].tolist():  # a step's tokens kept (0: the row had made all it
                if n:  # may), drafts verified, the tokens
                    kept[seq] += tokens[:n]
                    self.proposer.count(seq, verified, n - 1)
        return kept


def draft_forward_inputs(B, Q, width, min_q, n_ctx, stream):
    """The inputs of a draft model's forward over B rows of Q queries each, sampling each row's last (DraftGraph): their
    layout and attention plan fixed; tokens, positions and slots written on the GPU (draft_inputs)."""
    return BatchInputs(batch_fields(types.SimpleNamespace(
        input_ids=np.zeros(B * Q), positions=np.zeros(B * Q), slot_mapping=np.full(B * Q, -1),
        cu_seqlens_q=np.arange(0, B * Q + 1, Q), context_lens=np.full(B, Q), block_tables=np.zeros((B, width)),
        logits_idx=np.arange(Q - 1, B * Q, Q)), min_q), B, n_ctx, stream)


class DraftGraph(SpecGraph):
    """A draft model's speculation chained on the GPU, as SpecGraph chains n-gram's. A replay's drafts: the draft model
    computes each row's last two tokens and samples draft 0, then one forward a draft token, each forward's inputs
    made from the one before by draft_inputs, which keeps the drafts in the rows' histories; ngram_propose (n_max 0)
    makes the verification chunk of them. Before a run, the host brings the draft model's K/V up to each row's last
    two tokens (DraftModelProposer.catch_up); after it, it notes how far they are right (ran)."""
    def __init__(self, chunk_step, backend, kv, n_ctx, stream, pool, proposer, B):
        width, self.draft_step = kv.blocks_needed(n_ctx + proposer.k + 1), proposer.draft_runner.decode_step
        self.forward_inputs = {Q: draft_forward_inputs(B, Q, width, backend.tile_min_q, n_ctx, stream) for Q in (2, 1)}
        super().__init__(chunk_step, backend, kv, n_ctx, stream, pool, proposer, B)

    def propose(self):
        tokens = self.tokens  # (what the first call would store: nothing)
        for j, Q in enumerate([2] + [1] * (self.T - 2) + [0]):  # forwards 0 .. k - 1, then the last draft stored
            inputs = self.forward_inputs[max(Q, 1)]  # (Q 0: only the store, no inputs written)
            d, b = self.dev, inputs.batch
            self.backend.launch("draft_inputs", (-(-self.B // 128),), (128,), (
                tokens, d["history"], d["length"], d["remaining"], d["token_base"], b.input_ids, b.positions,
                b.slot_mapping, b.context_lens, b.row_len if b.n_rows else self.scratch, inputs.dev["token_index"],
                b.block_tables, np.int32(self.width), np.int32(self.kv.block_size), np.int32(self.n_ctx),
                np.int32(self.T), np.int32(j), np.int32(Q), np.int32(self.B)))
            if Q:
                tokens = self.draft_step(b, inputs.dev)
        super().propose()  # its verification chunk (n_max 0: the draft is the history's next tokens)

    def run(self, seqs, sampling, plan):
        self.proposer.catch_up(seqs)
        for inputs in self.forward_inputs.values():  # the run's rows (token_index: the GPU's)
            for f in SAMPLING:
                inputs.set(f, getattr(sampling, f))
            inputs.set("block_tables", plan.block_tables)
            inputs.upload()
        kept = super().run(seqs, sampling, plan)
        self.proposer.ran(kept)
        return kept


# -----------------------------------------------------------------------------
# the numpy definitions of the graph helpers that chain speculation steps on the GPU (kernels.cu, sections 13-15)

def ngram_propose(history, length, remaining, token_base, ndraft, input_ids, positions, slot_mapping, context_lens,
                  row_len, token_index, block_tables, width, block_size, n_ctx, T, n_min, n_max):
    """kernels.cu's ngram_propose, a row at a time: the row's draft by NgramProposer.propose's rule (n_max 0: the
    draft model's, in the history after the row's tokens), then its chunk of T queries: last token, draft, pads at the
    last real position; a finished row is padding."""
    j, tables, drafted = np.arange(T), block_tables.reshape(-1, width), n_max == 0  # (drafted: a draft model's draft)
    for b in range(len(length)):
        L, left, rows = int(length[b]), int(remaining[b]), slice(b * T, (b + 1) * T)
        ids = history[b * n_ctx:(b + 1) * n_ctx]
        room = max(0, min(T - 1, left - 1))
        # (m, e): the m tokens ending at an earlier e match the last m (n_max at most); the longest, then the latest
        m, e = max(((next(i for i in range(n_max + 1) if i == n_max or i > e or ids[e - i] != ids[L - 1 - i]), e)
                    for e in range(L - 1 if room and not drafted else 0)), default=(0, 0))
        nd = room if drafted or m >= n_min else 0
        draft = list(ids[L:L + nd]) if drafted else [ids[e + 1 + i % (L - 1 - e)] for i in range(nd)]
        n = L if left > 0 else 1  # what the row's first query attends to (a finished row: one token of padding)
        pos = np.where(left > 0, L - 1 + np.minimum(j, nd), 0)
        input_ids[rows] = ([ids[L - 1]] + draft + [0] * (T - 1 - nd)) if left > 0 else 0
        positions[rows], token_index[rows], row_len[rows] = pos, token_base[b] + j, n + j
        slot_mapping[rows] = np.where((left > 0) & (j <= nd), tables[b, pos // block_size] * block_size +
                                      pos % block_size, -1)
        ndraft[b], context_lens[b] = (nd if left > 0 else -1), n + T - 1


def spec_accept(tokens, input_ids, ndraft, history, length, remaining, token_base, step, ring, B, T, n_ctx):
    """kernels.cu's spec_accept: each live row keeps its draft up to the first token sampled otherwise, and that
    token, appended to its history; the step's ring entry [a + 1, drafts verified, the kept tokens]."""
    for b in range(B):
        nd, L, entry = int(ndraft[b]), int(length[b]), ring[step[b], b]
        step[b] += 1
        if nd < 0:
            entry[:2] = 0
            continue
        a = next(i for i in range(nd + 1) if i == nd or tokens[b * T + i] != input_ids[b * T + i + 1])
        entry[:2], entry[2:3 + a] = (a + 1, nd), tokens[b * T:b * T + a + 1]
        history[b * n_ctx + L:b * n_ctx + L + a + 1] = tokens[b * T:b * T + a + 1]
        length[b], remaining[b], token_base[b] = L + a + 1, remaining[b] - a - 1, token_base[b] + a + 1


def draft_inputs(tokens, history, length, remaining, token_base, input_ids, positions, slot_mapping, context_lens,
                 row_len, token_index, block_tables, width, block_size, n_ctx, T, j, Q, B):
    """kernels.cu's draft_inputs, a row at a time: the last draft token stored in the history, then the inputs of
    the draft model's forward j (Q queries a row: its last two tokens at j 0, draft j - 1 after)."""
    tables = block_tables.reshape(-1, width)
    for b in range(B):
        L, left = int(length[b]), int(remaining[b])
        room = max(0, min(T - 1, left - 1))
        if 0 < j <= room:
            history[b * n_ctx + L + j - 1] = tokens[b]
        if Q == 0:
            continue
        for q in range(Q):
            i, pos = b * Q + q, L - Q + j + q
            real = j < room and pos >= 0
            input_ids[i] = history[b * n_ctx + pos] if real else 0
            positions[i] = pos if real else 0
            slot_mapping[i] = tables[b, pos // block_size] * block_size + pos % block_size if real else -1
            row_len[i] = pos + 1 if real else q + 1
        token_index[b], context_lens[b] = token_base[b] + j, L + j if j < room else Q
