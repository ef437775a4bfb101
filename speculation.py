"""Speculative decoding with n-gram drafts (vLLM's "ngram", prompt lookup): fewer target steps, no token changed.

A decode step reads every weight to make one token per sequence. A sequence whose last n tokens occurred earlier in
it guesses that what followed them then follows now: a draft of up to k tokens. The step computes its last token and
the draft as one chunk of k + 1 queries (as a chunked prefill would), samples a token at each position, and keeps the
draft up to the first drafted token that differs from the token sampled in its place, and that sampled token: 1 to
k + 1 tokens for the weights read once.

The tokens kept are the tokens plain decoding makes: each is drawn by the same race keyed by (seed, token index,
token id), at the same index, from logits over the same tokens before it (a kept draft token is the token plain
decoding sampled there). A rejected position's KV is never read: the next step writes that slot again.
"""
import numpy as np


class NgramProposer:
    """Drafts for decoding sequences, and how many of them were proposed and accepted (vLLM's counters)."""
    def __init__(self, config, n_ctx):
        if not isinstance(config, dict) or config.get("method") != "ngram":
            raise ValueError(f"speculative_config={config!r}: this engine drafts by n-gram only: "
                             '{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, '
                             '"prompt_lookup_min": 1}')
        self.k = config.get("num_speculative_tokens")
        self.n_max, self.n_min = config.get("prompt_lookup_max", 4), config.get("prompt_lookup_min", 1)
        if not all(isinstance(v, int) and v >= 1 for v in (self.k, self.n_max, self.n_min)) or self.n_min > self.n_max:
            raise ValueError(f"speculative_config={config!r}: num_speculative_tokens, prompt_lookup_max and "
                             "prompt_lookup_min are integers >= 1, prompt_lookup_min <= prompt_lookup_max")
        self.n_ctx, self.proposed, self.accepted = n_ctx, 0, 0

    def propose(self, seq, budget):
        """seq's draft: after the latest earlier occurrence of its last n tokens (n from prompt_lookup_max down),
        what came next, at most k tokens, the tokens it may still make but one, what fits the context, and the
        step's token budget. None for a sequence that edits its logits or wants log-probs (kept exact and simple)."""
        p = seq.params
        room = min(self.k, budget, p.max_tokens - seq.num_output - 1, self.n_ctx - len(seq.token_ids))
        if room <= 0 or seq.edits_logits or p.logprobs is not None:
            return []
        ids = np.asarray(seq.token_ids)
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n tokens
            starts = np.flatnonzero((windows == ids[-n:]).all(1))
            if len(starts):
                draft = ids[starts[-1] + n:starts[-1] + n + room].tolist()
                self.proposed += len(draft)
                return draft
        return []


def token_indices(seqs):
    """The sampler's token index for each row (seqs: a sequence per row): its output count, and on the rows of its
    draft, one more each, the indices plain decoding would sample those positions at."""
    out = [s.num_output for s in seqs]
    for r in range(1, len(seqs)):
        out[r] = out[r - 1] + 1 if seqs[r] is seqs[r - 1] else out[r]
    return out


def draft_row(seqs, row, drafted, proposer):
    """Which row of its sequence's draft `row` is, j (0: its last token's, or a sequence without a draft), or None
    when the token sampled there does not count: a draft token before it was not the token sampled in its place (or
    the sequence finished). On a drafting sequence's first row, its num_computed drops by the draft's length: the
    postprocess counts each kept draft token's position again."""
    j = row - next(r for r in range(row, -1, -1) if r == 0 or seqs[r - 1] is not seqs[row])
    seq = seqs[row]
    if seq.draft and j == 0:
        drafted[seq], seq.num_computed = seq.num_output, seq.num_computed - len(seq.draft)
    elif j > 0:
        if seq.finish_reason or seq.num_output != drafted[seq] + j or seq.token_ids[-1] != seq.draft[j - 1]:
            return None
        proposer.accepted += 1
    return j
