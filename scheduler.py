"""Continuous batching: which sequences run in the next engine step, and how many tokens each. A Sequence is one
sample of a Request (its n samples share the prompt's blocks).

Static batching runs a batch until its longest request is done, so the GPU idles on finished rows. Here a
request joins when there is room and leaves the moment it finishes; every step is one flat run of tokens
mixing decodes (one token each) and chunks of prompts (prefill), so every GEMM sees all of them.

Each step, under a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
  1. running sequences that decode get their one token first, oldest first, so a long prompt never stalls them;
  2. running sequences still in their prompt get a chunk of it (chunked prefill);
  3. waiting requests come in, in arrival order, while their first chunk fits, once `admission_group` seats are free (or
     as many as wait): 1 lets each in as soon as a seat frees; an engine whose admissions are dear (each ends a run
     of CUDA-graph steps) lets them in by groups.
When the KV pool has no block for a running sequence, the newest running one is preempted: its blocks are freed and it
waits first in line, to be recomputed from its tokens (prompt + output so far): the same tokens as if never stopped.
"""
import codecs
from collections import deque

from sampling_params import CompletionOutput, RequestOutput, TextDelta


class Sequence:
    """One sample of a request: its tokens, how many of them the KV cache holds, and its text so far."""
    def __init__(self, seq_id, prompt_token_ids, params, seed, tokenizer, request_id=None, index=0):
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id
        self.index = index  # which of the request's n samples
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params, self.seed = params, seed  # the seed makes its samples independent of the rest of the batch
        self.num_computed = 0  # tokens whose K/V are in the cache
        # why it ended: 'stop' (with the stop string or token id, or None for EOS), 'length', 'abort' or 'error' (why)
        self.finish_reason = self.stop_reason = self.error = None
        self.num_cached_tokens = None  # at its first admission: the tokens whose KV the prefix cache held
        self.draft = []  # tokens it computes after its last this step, guesses of what comes next (speculation.py)
        self.num_draft_tokens = self.num_accepted_tokens = 0  # draft tokens it had verified, and kept
        self.logprobs = [] if params.logprobs is not None else None
        # the first sample computes the prompt's log-probs (the others share its KV): None for its first token
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None and index == 0 else None
        self.text, self.num_streamed, self.num_tokens_streamed = "", 0, 0  # the characters, tokens stream() handed out
        self._tokenizer = tokenizer
        # bytes of one character can be split across tokens: the decoder holds them back until complete
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def output_token_ids(self):
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output(self):
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self):
        return len(self.token_ids) - self.num_computed

    def tokens_to_compute(self, n):
        """Its next n tokens to compute: its own from num_computed on, then, past its last, those it computes ahead."""
        ids = self.token_ids[self.num_computed:self.num_computed + n]
        return ids + self.draft[:n - len(ids)]

    def history(self, j):
        """What a row j tokens past its last token sees before it: its tokens, then the first j it computes ahead."""
        return self.token_ids + self.draft[:j] if j else self.token_ids

    def append(self, token, n_ctx):
        """Add a sampled token, grow the text, and decide whether the request is finished."""
        p, eot = self.params, self._tokenizer.eot_token
        self.token_ids.append(token)
        stop_token = token in p.stop_token_ids or (token == eot and not p.ignore_eos)  # banned before min_tokens
        text_before = len(self.text)
        if token != eot and (not stop_token or p.include_stop_str_in_output):
            self.text += self._utf8.decode(self._tokenizer.token_bytes(token))
        stop_string = p.stop and self.num_output >= p.min_tokens and self._cut_at_stop(text_before)
        if stop_token or stop_string:
            self.finish("stop", stop_reason=stop_string or (token if token in p.stop_token_ids else None))
        elif self.num_output >= p.max_tokens or len(self.token_ids) >= n_ctx:
            self.finish("length")

    @property
    def wants_prompt_logprobs(self):  # some still to compute: it computes its whole prompt (no prefix cache)
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def prompt_logprob_span(self, n):
        """The positions, of the n this step computes, whose next token is a prompt token not yet given a log-prob:
        range(a, b); empty unless it wants prompt log-probs (a preempted one recomputes them, and skips those)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(self.num_computed, len(self.prompt_logprobs) - 1),
                     min(self.num_computed + n, len(self.prompt_token_ids) - 1))

    def banned_tokens(self, ahead=0):
        """The tokens it may not sample now (ahead: after that many more): its stop tokens (EOS too, unless ignored)
        until min_tokens are out."""
        p = self.params
        if self.num_output + ahead >= p.min_tokens:
            return set()
        return set(p.stop_token_ids) | (set() if p.ignore_eos else {self._tokenizer.eot_token})

    @property
    def edits_logits(self):
        """Whether its logits change before sampling: penalties, a logit bias, or tokens banned until min_tokens."""
        p = self.params
        return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0 or \
            bool(p.logit_bias) or self.num_output < p.min_tokens

    def finish(self, reason, error=None, stop_reason=None):
        self.finish_reason, self.error, self.stop_reason = reason, error, stop_reason
        self.text += self._utf8.decode(b"", final=True)  # bytes held back for a character's rest, as U+FFFD

    def _cut_at_stop(self, text_before):
        """The stop string the new text completed (the text cut there), or None."""
        start = max(0, text_before - max(map(len, self.params.stop)) + 1)  # it starts at most len - 1 characters back
        hits = sorted((i, s) for i, s in ((self.text.find(s, start), s) for s in self.params.stop) if i >= 0)
        if not hits:
            return None
        at, stop = hits[0]
        self.text = self.text[:at + len(stop) if self.params.include_stop_str_in_output else at]
        self._utf8.reset()  # bytes held back are past the stop string: dropped with the rest
        return stop

    def checkpoint(self):
        """Everything a step changes in a sequence, to undo the step if it fails midway (see LLM._undo)."""
        return (len(self.token_ids), self.num_computed, self.finish_reason, self.stop_reason, self.error, self.text,
                (self.num_streamed, self.num_tokens_streamed), None if self.logprobs is None else len(self.logprobs),
                None if self.prompt_logprobs is None else len(self.prompt_logprobs), self._utf8.getstate())

    def restore(self, state):
        n, self.num_computed, self.finish_reason, self.stop_reason, self.error, self.text, \
            (self.num_streamed, self.num_tokens_streamed), n_logprobs, n_prompt_logprobs, utf8 = state
        del self.token_ids[n:]
        if n_logprobs is not None:
            del self.logprobs[n_logprobs:]
        if n_prompt_logprobs is not None:
            del self.prompt_logprobs[n_prompt_logprobs:]
        self._utf8.setstate(utf8)
        self.draft = []

    def new_text(self):
        """Text not yet streamed (while running, what could still become the start of a stop string waits), as a
        TextDelta holding the tokens sampled since the last call."""
        end = len(self.text)
        if self.finish_reason is None and self.params.stop:
            end -= max(map(len, self.params.stop)) - 1
        end = max(end, self.num_streamed)
        text, self.num_streamed = self.text[self.num_streamed:end], end
        first, self.num_tokens_streamed = self.num_tokens_streamed, self.num_output
        return TextDelta(text, self.token_ids[len(self.prompt_token_ids) + first:],
                         None if self.logprobs is None else self.logprobs[first:])


class Request:
    """A prompt and its SamplingParams: n sequences (samples), the outbox their events go to. The first sequence
    prefills the prompt; the others start once it is in the KV cache, sharing its full blocks (fork)."""
    def __init__(self, request_id, prompt, seqs, outbox):
        self.request_id, self.prompt, self.seqs, self.outbox = request_id, prompt, seqs, outbox
        self.unforked = seqs[1:]  # samples waiting for the first one's prompt

    def fork(self, kv, scheduler):
        """Once the first sequence has its prompt in the cache (it samples now), the other samples start: each shares
        the prompt's full blocks, and computes again only the last, partial one (at least the prompt's last token,
        whose logits it samples from), so n samples cost one prompt's KV and one prefill."""
        first = self.seqs[0]
        shared = (len(first.prompt_token_ids) - 1) // kv.block_size
        for sample in self.unforked:
            kv.share(first.seq_id, sample.seq_id, shared)
            sample.num_computed = shared * kv.block_size
            scheduler.add(sample)
        self.unforked = []

    def finish(self, reason, error, scheduler, seq=None):
        """End seq (None: every unfinished sample); if it is the first sample, those still waiting for its prompt too
        (they would never start). Returns the sequences it ended."""
        ended = [s for s in self.seqs if not s.finish_reason and
                 (seq is None or s is seq or seq.index == 0 and s in self.unforked)]
        if seq is None or seq.index == 0:
            self.unforked = []
        for s in ended:
            scheduler.remove(s)
            s.finish(reason, error)
        return ended

    @property
    def finished(self):
        return all(seq.finish_reason for seq in self.seqs)

    def output(self):
        def completion(s):
            total = None if s.logprobs is None else sum(lp[t].logprob for lp, t in zip(s.logprobs, s.output_token_ids))
            return CompletionOutput(s.index, s.text, s.output_token_ids, total, s.logprobs, s.finish_reason,
                                    s.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.seqs[0].prompt_token_ids,
                             [completion(s) for s in self.seqs], self.finished,
                             next((s.error for s in self.seqs if s.error), None), self.seqs[0].prompt_logprobs,
                             self.seqs[0].num_cached_tokens or 0, sum(s.num_draft_tokens for s in self.seqs),
                             sum(s.num_accepted_tokens for s in self.seqs))


class Scheduler:
    def __init__(self, kv, max_num_seqs, max_num_batched_tokens):
        self.kv, self.max_num_seqs, self.max_num_batched_tokens = kv, max_num_seqs, max_num_batched_tokens
        self.admission_group = 1  # seats to free before a request comes in (the graph runner raises it: step 3 above)
        self.waiting, self.running = deque(), []  # running: in admission order, the last one the newest
        self.num_preemptions = 0

    def add(self, seq):
        self.waiting.append(seq)

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def wants_admission(self):
        """Whether waiting requests would come in now: admission_group seats are free, or as many as wait."""
        free = self.max_num_seqs - len(self.running)
        return bool(self.waiting) and free >= min(len(self.waiting), self.admission_group)

    def schedule(self, admit=True):
        """Pick this step's work: a list of (sequence, number of its tokens to compute now). admit=False: no waiting
        request comes in this step (the engine's GPU still runs decode steps it launched ahead)."""
        budget, scheduled, preempted = self.max_num_batched_tokens, {}, set()
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            n = min(seq.num_uncomputed, budget)
            while seq not in preempted and not self._fits(seq, seq.num_computed + n):  # seq may be the one preempted
                victim = next(s for s in reversed(self.running) if s not in scheduled)
                self.requeue(victim)
                self.num_preemptions += 1
                preempted.add(victim)
            if seq not in preempted:
                self.kv.grow(seq.seq_id, seq.num_computed + n)
                scheduled[seq] = n
                budget -= n
        # admit new requests only when nothing had to make room this step, or they would thrash
        admit = admit and self.wants_admission() and not preempted
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # its num_computed is 0, or a prompt's blocks it shares (Request.fork)
            if seq.num_computed == 0 and not seq.wants_prompt_logprobs:  # its first blocks, from the prefix cache
                seq.num_computed = self.kv.take_cached(seq.seq_id, seq.token_ids)
                seq.num_cached_tokens = seq.num_computed if seq.num_cached_tokens is None else seq.num_cached_tokens
            n = min(seq.num_uncomputed, budget)
            if not self._fits(seq, seq.num_computed + n):
                break
            self.running.append(self.waiting.popleft())
            self.kv.grow(seq.seq_id, seq.num_computed + n)
            scheduled[seq] = n
            budget -= n
        return list(scheduled.items())

    def _fits(self, seq, num_tokens):
        """Whether seq can hold num_tokens tokens, after taking back, newest first, the blocks that waiting sequences
        hold (a sample's share of its prompt, Request.fork): a waiting sequence then computes its prompt itself."""
        while not self.kv.can_fit(seq.seq_id, num_tokens):
            holder = next((s for s in reversed(self.waiting) if s is not seq and s.seq_id in self.kv.block_tables),
                          None)
            if holder is None:
                return False
            self.kv.free(holder.seq_id)
            holder.num_computed = 0
        return True

    def requeue(self, seq):
        """Recompute later: free its blocks, forget its cache, and put it first in line."""
        self.remove(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)

    def remove(self, seq):
        """Take a sequence out of the queues (finished, aborted or failed) and free its blocks, those it computed
        full staying findable in the prefix cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.name_computed(seq.seq_id, seq.token_ids, seq.num_computed)
        self.kv.free(seq.seq_id)
