"""Speculative decoding: fewer target steps, no token changed.

A decode step reads every weight to make one token per sequence. A sequence that can guess what comes next (a draft
of up to k tokens) computes its last token and the draft as one chunk of k + 1 queries (as a chunked prefill would),
samples a token at each position, and keeps the draft up to the first drafted token that differs from the token
sampled in its place, and that sampled token: 1 to k + 1 tokens for the weights read once. Two ways to guess, vLLM's:
- "ngram" (prompt lookup): if the sequence's last n tokens occurred earlier in it, what followed them then;
- a draft model ({"model": ..., "num_speculative_tokens": k}): a smaller GPT-2 of the same vocabulary samples k tokens
  one after another, each with the target's own keyed race (same seed, same token index), so that where the two
  models agree on the distribution they agree on the token.

The tokens kept are the tokens plain decoding makes: each is drawn by the same race keyed by (seed, token index,
token id), at the same index, from logits over the same tokens before it (a kept draft token is the token plain
decoding sampled there), with the log-probs, penalties, bias and bans plain decoding gives that position (a row after
j draft tokens counts them as its output: sampling_params.penalties). A rejected position's KV is never read: the
next step writes that slot again. So whatever the draft, however wrong, only the speed changes.

This file is the rule, run by the host. On the GPU, n-gram steps chain without it (graph_runner.SpecGraph: kernels
make the same drafts from a token history kept there, and keep the same tokens, many steps a run); the host drafts
only for requests the graphs do not take (log-probs, logits edits), and a draft model always.
"""
import dataclasses
import types

import numpy as np

FORMS = ('{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or '
         '{"model": a GPT-2 name or directory, "num_speculative_tokens": k}, either with "disable_by_batch_size": N')


class Proposer:
    """What both ways share: k, the room a sequence has for a draft, when to draft at all, and vLLM's counters (draft
    tokens the target verified, and those it kept)."""
    def __init__(self, config, n_ctx):
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config={config!r}: a dict, vLLM's: {FORMS}")
        self.k, self.max_batch = config.get("num_speculative_tokens"), config.get("disable_by_batch_size")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"speculative_config={config!r}: num_speculative_tokens is an integer >= 1")
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ValueError(f"speculative_config={config!r}: disable_by_batch_size is an integer >= 1 (or absent)")
        self.n_ctx, self.proposed, self.accepted = n_ctx, 0, 0
        self.on_device = False  # the GPU drafts for the decodes its graphs take (n-gram: graph_runner.SpecGraph)

    def active(self, batch):
        """Whether a step of `batch` running sequences drafts (vLLM's disable_by_batch_size): a large batch's step
        already reads each weight for many tokens, and its verification chunks cost more than drafts save."""
        return self.max_batch is None or batch <= self.max_batch

    def room(self, seq, budget):
        """How many tokens seq may draft: at most k, the tokens it may still make (by max_tokens and the context) but
        one, and the step's token budget."""
        p = seq.params
        return max(0, min(self.k, budget, min(p.max_tokens - seq.num_output, self.n_ctx - len(seq.token_ids)) - 1))

    def fill(self, seqs):
        """Make the drafts of this step's sequences (those the scheduler gave room to): the n-gram's are made."""


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

    def propose(self, seq, budget):
        """seq's draft: after the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down), what
        came next, as much as its room holds. Copied as LZ77 copies: a token at a time, so that an occurrence close
        to the end runs on into the draft itself (d tokens back: the last d tokens repeated, as in a loop of d)."""
        room = self.room(seq, budget)
        if room <= 0 or self.on_device and seq.logprobs is None and not seq.edits_logits:
            return []
        ids = np.asarray(seq.token_ids)
        ends, found = np.flatnonzero(ids[:-1] == ids[-1]), None  # where earlier occurrences of the last token end
        for n in range(1, min(self.n_max, len(ids) - 1) + 1):  # those that match the last n tokens, n = 1, 2, ...
            if n > 1:
                ends = ends[ends >= n - 1]
                ends = ends[ids[ends - n + 1] == ids[-n]]
            if not len(ends):
                break
            if n >= self.n_min:
                found = ends[-1]  # the latest of the longest so far
        if found is None:
            return []
        source = ids[found + 1:].tolist()  # from what followed it to the end, then the draft so far
        for i in range(room):
            source.append(source[i])
        return source[len(source) - room:]


class DraftModelProposer(Proposer):
    """Drafts by a smaller model. `draft_step(views)`: the draft model's forward over sequence views (view()) and the
    keyed sampler at each one's last token (nanoinfer.DraftModel). Its K/V live in the target's blocks, in tensors of
    its own, so the target's block tables serve it too. Per sequence it remembers how many tokens have their draft
    K/V written and in which blocks (`computed`), and the draft tokens it was fed (`fed`): after the target's step,
    those the sequence kept have right K/V too."""
    def __init__(self, config, n_ctx, draft_step, kv):
        super().__init__(config, n_ctx)
        if config.get("method", "draft_model") != "draft_model":
            raise ValueError(f"speculative_config={config!r}: this engine drafts by {FORMS}")
        self.draft_step, self.kv = draft_step, kv
        self.computed = {}  # seq_id -> (tokens with draft K/V written, the blocks they lie in)
        self.fed = {}  # seq_id -> (position, the draft tokens fed to the draft model from there)

    def propose(self, seq, budget):
        """Room for the draft: its tokens are fill's, made once the step's drafting sequences are known."""
        return [0] * self.room(seq, budget)

    def fill(self, seqs):
        """Draft for every sequence given room: one forward over its tokens the draft model has not seen (its prompt,
        the first time) and one a draft token, each draft token sampled with the target's keyed race."""
        drafting = [s for s in dict.fromkeys(seqs) if s.draft]
        if not drafting:  # most steps of most workloads
            return
        tables = self.kv.block_tables  # forget the sequences gone
        self.computed, self.fed = ({i: c for i, c in d.items() if i in tables} for d in (self.computed, self.fed))
        starts, j = [self._seen(s) for s in drafting], 0
        # each asks for as many tokens as its draft has (a graph run of decode steps makes no more)
        params = [dataclasses.replace(s.params, max_tokens=s.num_output + len(s.draft), min_tokens=0) for s in drafting]
        while rows := [r for r, s in enumerate(drafting) if j < len(s.draft)]:  # those with draft tokens j, j + 1, ...
            views = [view(drafting[r], params[r], starts[r] if j == 0 else len(drafting[r].token_ids) + j - 1, j)
                     for r in rows]
            tokens = self.draft_step(views)  # (steps, rows): a graph run of decode steps makes several at once
            for i, r in enumerate(rows):
                for t, token in enumerate(tokens[:len(drafting[r].draft) - j, i]):
                    drafting[r].draft[j + t] = int(token)
            j += len(tokens)
        for s in drafting:  # the last draft token is never fed
            n = len(s.token_ids) + len(s.draft) - 1
            self.computed[s.seq_id] = (n, tuple(self.kv.block_tables[s.seq_id][:self.kv.blocks_needed(n)]))
            self.fed[s.seq_id] = (len(s.token_ids), s.draft[:-1])

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


def view(seq, params, start, j):
    """A sequence as the draft model sees it at draft token j: its tokens and its first j drafts (the draft model's
    input), computing from `start`, sampling at token index num_output + j, with `params`. What nanoinfer.make_batch,
    sampling_arrays and the runner read of a sequence (the draft model's logits, unedited: no log-probs, penalties or
    bias; the target's verification applies the request's own)."""
    return types.SimpleNamespace(seq_id=seq.seq_id, token_ids=seq.token_ids + seq.draft[:j], num_computed=start,
                                 draft=[], params=params, seed=seq.seed, num_output=seq.num_output + j,
                                 prompt_logprob_span=lambda n: None, logprobs=None, edits_logits=False,
                                 finish_reason=None)


def draft_row(seqs, row, drafted, proposer):
    """Which row of its sequence's draft `row` is, j (0: its last token's, or a sequence without a draft), or None
    when the token sampled there does not count: a draft token before it was not the token sampled in its place (or
    the sequence finished). On a drafting sequence's first row, its num_computed drops by the draft's length: the
    postprocess counts each kept draft token's position again."""
    j = row - next(r for r in range(row, -1, -1) if r == 0 or seqs[r - 1] is not seqs[row])
    seq = seqs[row]
    if seq.draft and j == 0:
        drafted[seq], seq.num_computed = seq.num_output, seq.num_computed - len(seq.draft)
        count_drafts(seq, len(seq.draft), proposer)
    elif j > 0:
        if seq.finish_reason or seq.num_output != drafted[seq] + j or seq.token_ids[-1] != seq.draft[j - 1]:
            return None
        count_drafts(seq, -1, proposer)
    return j


def count_drafts(seq, drafts, proposer):
    """vLLM's counters, for one of seq's tokens: the first of a step counts the draft tokens that step verified
    (`drafts`), each kept draft token after it (-1) one accepted. draft_row's, and a speculating graph run's (its
    drafts beside its tokens: SpecGraph.run)."""
    if drafts >= 0:
        proposer.proposed += drafts
        seq.num_draft_tokens += drafts
    else:
        proposer.accepted += 1
        seq.num_accepted_tokens += 1
