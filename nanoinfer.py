"""nanoinfer: GPT-2 inference, fast, in a few files. This one is the whole engine on numpy, readable alone.

Read top to bottom: the op set (numpy: the definition of every kernel), the sampler, GPT-2's forward over one flat
batch of tokens, and the LLM engine: step() is schedule -> batch -> run -> postprocess over the paged KV cache
(paged_kv.py) and the continuous-batching scheduler (scheduler.py). checkpoint.py reads a model directory;
sampling_params.py holds what a request asks for. On a GPU, cuda_backend.py supplies the op set as kernels
(kernels.cu) and a runner replaying decode steps from CUDA graphs: every speed trick.
"""
import contextlib
import functools
import itertools
import math
import signal
import sys
import threading
import time
import traceback
from collections import deque, namedtuple
from dataclasses import dataclass, replace

import numpy as np

import parallel
from checkpoint import Int8Weight, Tokenizer, load_config, load_weights, quantize_weights, resolve_model
from paged_kv import PagedKVCache
from sampling_params import (CompletionOutput, Logprob, Penalties, RequestOutput, SamplingParams, as_lists,  # noqa
                             add_prompt_logprobs, check_engine_arguments, logprobs_of, penalties, refuse_request,
                             sample_seed, token_indices)  # (API)
from scheduler import Request, Scheduler, Sequence
from speculation import DraftModelProposer, NgramProposer, count_drafts, draft_row

# -----------------------------------------------------------------------------
# the numpy backend: the readable definition of every op, the reference in tests, and a CPU engine


def gelu_tanh(x):
    """GPT-2's GELU, the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def sample_key(seed, token_index):
    """The random key of a sequence's token_index-th output token: splitmix64 of seed + (token_index + 1) * the golden
    ratio (uint64)."""
    seed, token_index = np.asarray(seed, np.uint64), np.asarray(token_index, np.uint64)
    z = seed + (token_index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel(key, n):
    """Gumbel noise -log(-log(u)) for tokens 0..n-1 under one key: u from 23 bits of murmur3's finalizer of (token,
    key), so a token's noise depends on nothing but its seed, token index and id (float32, as the kernel computes it)."""
    key = int(key)
    h = np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B1) + np.uint32(key & 0xFFFFFFFF)
    h ^= np.uint32(key >> 32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    u = ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)  # in (0, 1), exactly
    return -np.log(-np.log(u))


def sampling_probs(logits, temperature, top_k, top_p, min_p=0.0):
    """The distribution a row samples from, unnormalized (the largest p is 1): temperature, then top-k, top-p and
    min-p (transformers' order), each as a threshold on p."""
    p = np.exp((logits - logits.max()) / np.float32(temperature))
    if 0 < top_k < len(p):
        p[p < np.partition(p, -top_k)[-top_k]] = 0  # keep the k largest (and any ties with the k-th)
    if top_p < 1:
        desc = np.sort(p)[::-1]
        mass = np.cumsum(desc)
        p[p < desc[np.searchsorted(mass, np.float32(top_p) * mass[-1])]] = 0  # smallest head holding top_p
    if min_p > 0:
        p[p < np.float32(min_p)] = 0  # at least min_p times the most likely token's probability
    return p


def race_scores(logits, temperature, top_k, top_p, key, min_p=0.0):
    """Each token's score in the exponential race (Gumbel-max): logit / temperature + gumbel(key) where the filters
    keep it, -inf elsewhere (float32, as on the GPU)."""
    kept = sampling_probs(logits.astype(np.float64), temperature, top_k, top_p, min_p) > 0
    score = logits.astype(np.float32) * (np.float32(1) / np.float32(temperature)) + gumbel(key, len(logits))
    return np.where(kept, score, -np.inf)


def sample_row(logits, temperature, top_k, top_p, key, min_p=0.0):
    """One token from one row of fp32 logits: greedy's argmax, or the race's winner: the kept token with the largest
    score. That draws token i with probability p_i / sum(p), and, like greedy, a last-bit change in a logit can change
    the token only where two scores are within rounding (a pick by running sum, u * total, moves across a whole token
    on a flat row when the sum's last bits move)."""
    if temperature == 0:
        return int(np.argmax(logits))
    return int(np.argmax(race_scores(logits, temperature, top_k, top_p, key, min_p)))


class NumpyBackend:
    """Every op of the forward pass, in numpy: short enough to read as the definition of what the kernels do."""
    name = "cpu"
    batch_invariant = False  # True: no row's reductions depend on the other rows of the batch (LLM's switch)

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)

    def asarray(self, a, dtype=None):  # floating arrays take the backend's dtype; integers stay integers
        a = np.asarray(a)
        return np.ascontiguousarray(a, dtype=dtype or (self.dtype if a.dtype.kind == "f" else a.dtype))

    def tohost(self, a):
        return a

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype or self.dtype)

    def to_device(self, batch):
        return batch

    def check_model(self, config):
        pass  # numpy runs any shape

    def kv_cache_budget(self, fraction):
        return 2 ** 30  # bytes for the KV cache when num_kv_tokens is not given: 1 GiB of host memory

    def embed(self, wte, wpe, input_ids, positions):
        return wte[input_ids] + wpe[positions]  # (T, C)

    def layernorm(self, x, w, b, eps):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * w + b

    def matmul(self, x, w, bias=None, gelu=False, residual=None, ln=None, out_dtype=None):
        """epilogue(layernorm(x) @ w.T), ln: (weight, bias, eps) or None; the epilogue: + bias, GELU, + residual. An
        Int8Weight's int8 rows are multiplied as they are, each output then scaled once (W8A16)."""
        if ln is not None:
            x = self.layernorm(x, *ln)
        q, scale = (w.q.astype(x.dtype), w.scale) if isinstance(w, Int8Weight) else (w, 1)
        # (M, K) @ (K, N) -> (M, N); batch-invariant as M matmuls of one row: BLAS blocks rows by M, which would let
        # the batch decide how a row's sums are grouped
        y = ((x[:, None] @ q.T)[:, 0] if self.batch_invariant else x @ q.T) * scale
        if bias is not None:
            y += bias
        if gelu:
            y = gelu_tanh(y)
        if residual is not None:
            y += residual
        return y.astype(out_dtype or y.dtype, copy=False)

    def cache_write(self, k, v, k_cache, v_cache, slot_mapping):
        H, D = k.shape[1:]
        k_cache.reshape(-1, H, D)[slot_mapping] = k  # a slot is one token's K for all heads
        v_cache.reshape(-1, H, D)[slot_mapping] = v

    def attention(self, q, k, v, k_cache, v_cache, batch, scale):
        """Causal attention over each sequence's cache, this step's k, v written first (a query sees its own token)."""
        self.cache_write(k, v, k_cache, v_cache, batch.slot_mapping)
        out = np.empty_like(q)  # (T, H, D)
        _, block_size, H, D = k_cache.shape
        for s, n_ctx in enumerate(batch.context_lens):
            q0, q1 = batch.cu_seqlens_q[s], batch.cu_seqlens_q[s + 1]
            blocks = batch.block_tables[s, :-(-n_ctx // block_size)]
            k = k_cache[blocks].reshape(-1, H, D)[:n_ctx].transpose(1, 2, 0)  # (H, D, L) gathered by block table
            v = v_cache[blocks].reshape(-1, H, D)[:n_ctx].transpose(1, 0, 2)  # (H, L, D)
            # the queries are the last n_q tokens; batch-invariant, one at a time over exactly the keys it sees (how a
            # sum rounds depends on its length, so a chunk's or the batch's longest context must not enter it)
            for a, b in [(j, j + 1) for j in range(q0, q1)] if self.batch_invariant else [(q0, q1)]:
                end = n_ctx - (q1 - b)  # the keys the span's last query sees
                att = (q[a:b].transpose(1, 0, 2) @ k[:, :, :end]) * scale  # (H, n_q, L)
                q_pos = np.arange(end - (b - a), end)
                att = np.where(np.arange(end) <= q_pos[:, None], att, -np.inf)  # causal
                att = np.exp(att - att.max(-1, keepdims=True))
                out[a:b] = ((att / att.sum(-1, keepdims=True)) @ v[:, :end]).transpose(1, 0, 2)  # (n_q, H, D)
        return out

    def penalize(self, logits, e):
        """The logits processors, before sampling: for each (row, token) of e (a Penalties), the repetition penalty
        (a positive logit divided by it, a negative one multiplied), then the presence and frequency penalties
        (subtracted, the second once per time the token is in the output), then the logit bias (added); a token
        banned gets -inf."""
        logits = logits.copy()
        x, r, n = logits[e.rows, e.ids], e.repetition, e.output_counts
        x = np.where(x > 0, x / r, x * r) - e.frequency[e.rows] * n - e.presence[e.rows] * (n > 0) + e.bias
        logits[e.rows, e.ids] = np.where(e.banned, -np.inf, x)
        return logits

    def sample(self, logits, temperature, top_k, top_p, seed, token_index, min_p):
        keys, logits = sample_key(seed, token_index), logits.astype(np.float32)
        return np.array([sample_row(logits[r], temperature[r], top_k[r], top_p[r], keys[r], min_p[r])
                         for r in range(len(logits))], dtype=np.int64)


def make_backend(device, dtype):
    """The op set to run on: numpy (fp32), or cuda_backend's kernels (fp16 by default) on a Hopper GPU."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'")
    if device != "cpu":
        import cuda_backend
        why = cuda_backend.find_gpu()  # None: a Hopper GPU is there
        if why is None:
            backend = cuda_backend.CudaBackend(np.dtype(dtype or np.float16))
            log(backend.loaded)
            return backend
        if device == "cuda":
            raise RuntimeError(f"device='cuda' needs CuPy and an NVIDIA Hopper GPU ({why}): "
                               "pip install cupy-cuda13x on an H100 or H200, or use device='cpu'")
        log(f"no usable GPU ({why}); running on the CPU with numpy")
    if dtype is not None and np.dtype(dtype) != np.float32:
        raise ValueError(f"dtype={np.dtype(dtype).name} on the CPU: numpy has no fast fp16 matmul; use float32")
    return NumpyBackend(np.float32)

# -----------------------------------------------------------------------------
# GPT-2 over one flat batch of tokens


@dataclass
class Batch:
    """One engine step's tokens, every sequence's side by side, and where their K/V live."""
    input_ids: np.ndarray  # (T,) int32
    positions: np.ndarray  # (T,) int32
    slot_mapping: np.ndarray  # (T,) int32, the cache slot each new token's K/V goes to
    cu_seqlens_q: np.ndarray  # (S+1,) int32, sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1]
    context_lens: np.ndarray  # (S,) int32, tokens in each sequence's cache after this step
    block_tables: np.ndarray  # (S, max_blocks) int32
    logits_idx: np.ndarray  # (R,) int32, rows whose next-token logits are wanted (None: every row)


class GPT:
    """GPT-2's forward pass, written once against the backend's op set; comm: this rank's place among tensor-parallel
    ranks (parallel.py: its weights are its shard, and two all-reduces a layer join the ranks), Single() for none."""
    def __init__(self, config, weights, backend, n_vocab=None, comm=parallel.Single()):
        self.config, self.backend, self.comm, self.n_vocab = config, backend, comm, n_vocab or config.vocab_size
        self.w = {name: Int8Weight(backend.asarray(a.q), backend.asarray(a.scale, np.float32))
                  if isinstance(a, Int8Weight) else backend.asarray(a) for name, a in weights.items()}
        # the lm_head is the embedding (tied) unless the checkpoint has its own (or int8 made one); an embedding
        # padded past the tokenizer's n_vocab tokens (nanoGPT's 50304) keeps its padding rows out of the logits
        head = self.w.get("lm_head.weight", self.w["wte.weight"])
        self.lm_head = head if isinstance(head, Int8Weight) else head[:self.n_vocab]  # (V, C), or a rank's part

    def forward(self, batch, kv):
        """Logits (R, V), float32, for the rows batch.logits_idx; writes every token's K/V into the cache."""
        return self.forward_on_device(self.backend.to_device(batch), kv)

    def forward_on_device(self, d, kv):
        """forward() on a batch already on the backend (what backend.to_device made of it)."""
        be, w, c, comm = self.backend, self.w, self.config, self.comm
        T, D = len(d.input_ids), c.head_dim
        H, C = c.n_head // comm.size, c.n_embd // comm.size  # this rank's heads, and their width (all of them: 1 rank)
        lead = comm.rank == 0  # adds the biases and residuals the all-reduces sum (each once)
        h = be.embed(w["wte.weight"], w["wpe.weight"], d.input_ids, d.positions)  # (T, n_embd) the residual stream
        for i in range(c.n_layer):
            p = f"h.{i}."
            # each residual add rides in a matmul's epilogue; in one stream's decode, each layernorm in its prologue
            ln_1, ln_2 = ((w[p + f"ln_{j}.weight"], w[p + f"ln_{j}.bias"], c.eps) for j in (1, 2))
            qkv = be.matmul(h, w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"], ln=ln_1)  # (T, 3C)
            q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(T, H, D) for j in range(3))  # (T, H, D) each
            att = be.attention(q, k, v, kv.k[i], kv.v[i], d, c.attention_scale(i)).reshape(T, C)  # caches k, v
            h = comm.all_reduce(be.matmul(att, w[p + "attn.c_proj.weight"], w[p + "attn.c_proj.bias"] if lead else None,
                                          residual=h if lead else None))
            f = be.matmul(h, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"], gelu=True, ln=ln_2)  # (T, 4C)
            h = comm.all_reduce(be.matmul(f, w[p + "mlp.c_proj.weight"], w[p + "mlp.c_proj.bias"] if lead else None,
                                          residual=h if lead else None))
        # only the rows that sample need the last layernorm and the 50257-wide lm_head (gathered over the ranks)
        rows = h if d.logits_idx is None else h[d.logits_idx]  # (R, n_embd)
        ln_f = (w["ln_f.weight"], w["ln_f.bias"], c.eps)
        return comm.all_gather(be.matmul(rows, self.lm_head, ln=ln_f, out_dtype=np.float32), self.n_vocab)  # (R, V)

# -----------------------------------------------------------------------------
# the engine: schedule -> batch -> run -> postprocess

# the sampler's parameters, one per row that samples; token_index: how many tokens the sequence has sampled before
SamplingArrays = namedtuple("SamplingArrays", "temperature top_k top_p seed token_index min_p")


def sampling_arrays(seqs):
    params = [s.params for s in seqs]
    return SamplingArrays(np.array([p.temperature for p in params], np.float32),
                          np.array([min(max(p.top_k, 0), 2 ** 31 - 1) for p in params], np.int32),  # k > V: off
                          np.array([p.top_p for p in params], np.float32),
                          np.array([s.seed for s in seqs], np.uint64),
                          np.array(token_indices(seqs), np.int32),
                          np.array([p.min_p for p in params], np.float32))


def make_batch(scheduled, kv):
    """Flatten this step's work, [(sequence, tokens to compute now)], into one Batch; list the sequences whose last
    token it holds (they sample, a row each, a drafting one a row a draft token more), and [(sequence, positions)]
    whose logits give prompt log-probs, after the samplers'. Python loops over sequences, numpy over tokens."""
    seqs = [seq for seq, _ in scheduled]
    counts = np.array([n for _, n in scheduled], np.int32)
    starts = np.array([seq.num_computed for seq in seqs], np.int32)
    cu_seqlens_q = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)  # (S+1,)
    row = np.repeat(np.arange(len(seqs)), counts)  # (T,) the sequence of each token
    positions = (np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[row] + starts[row]).astype(np.int32)  # (T,)
    block_tables = kv.block_table_array([seq.seq_id for seq in seqs])  # (S, max_blocks)
    samples = starts + counts == np.array([len(seq.token_ids) + len(seq.draft) for seq in seqs])  # (and its draft)
    input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids[a:a + n] + s.draft[:a + n - len(s.token_ids)]
                                                          for s, a, n in zip(seqs, starts.tolist(), counts.tolist())),
                            np.int32, len(row))
    spans = [(i, span) for i, span in ((i, seq.prompt_logprob_span(n)) for i, (seq, n) in enumerate(scheduled)) if span]
    sampling = [i for i in range(len(seqs)) if samples[i]]  # each samples at its last token (and its draft's)
    logits_idx = np.concatenate([np.zeros(0, int)] + [  # the rows that sample, then the prompt's
        np.arange(cu_seqlens_q[i + 1] - 1 - len(seqs[i].draft), cu_seqlens_q[i + 1]) for i in sampling] +
        [cu_seqlens_q[i] - starts[i] + np.arange(span.start, span.stop) for i, span in spans])
    return Batch(input_ids, positions, kv.slot_mapping(block_tables, row, positions), cu_seqlens_q, starts + counts,
                 block_tables, logits_idx.astype(np.int32)), [seqs[i] for i in sampling for _ in seqs[i].draft + [0]], \
        [(seqs[i], span) for i, span in spans]


class ModelRunner:
    """Runs a step's batch: the model's forward over it, then the sampler on the rows that sample. On CUDA, decode
    batches replay CUDA graphs instead (graph_runner.GraphRunner), each recording decode_step, which mirrors eager():
    the graphs are captured here, at start-up, one per batch size, and each graph run is launched while the host still
    reads the run before it, so the tokens of a decode step may come from a run launched a step earlier."""
    def __init__(self, model, kv, cuda_graphs=True, num_scheduler_steps=16, max_num_seqs=256, verify_tokens=0,
                 ngram=None):
        self.model, self.kv, self.graphs, self.admission_group = model, kv, None, 1
        if cuda_graphs and model.backend.name == "cuda":
            from graph_runner import GraphRunner
            t0 = time.perf_counter()
            self.graphs = GraphRunner(self.decode_step, model.backend, kv, model.config.n_ctx, max_num_seqs,
                                      num_scheduler_steps, verify_tokens, ngram)
            self.admission_group = self.graphs.admission_group  # admissions end graph runs: let requests in by groups
            b = self.graphs.buckets
            log(f"captured {len(b) + len(self.graphs.prefills) + len(self.graphs.verify)} CUDA graphs (decode batches "
                f"of {b[0]} to {b[-1]} rows, lone prefills of up to {max(self.graphs.prefills, default=0)} tokens" +
                (f", as many of {'n-gram steps' if ngram else 'verification chunks'} of {verify_tokens}"
                 if verify_tokens else "") +
                f") in {time.perf_counter() - t0:.1f} s")

    def run(self, batch, seqs, launch_next=True, speculate=False):
        """(steps, R) sampled tokens of the rows that sample (seqs); (R, V) host logits if any wants logprobs; and, of
        a graph run of n-gram speculation, the drafts it verified (GraphRunner.run), else None. launch_next: a graph
        run may launch the next one before its tokens are read; speculate: decodes may run n-gram speculation."""
        if self.graphs is None:
            return *self.eager(batch, seqs), None
        if self.graphs.takes(batch, seqs):  # decode steps, and a lone prompt's prefill (not ~100 launches)
            tokens, drafts = self.graphs.run(batch, seqs, sampling_arrays(seqs), launch_next, speculate)
            return tokens, None, drafts
        with self.graphs.eager():  # on the graphs' stream, after everything they launched
            return *self.eager(batch, seqs), None

    def eager(self, batch, seqs):
        """The step as it reads: op by op, then the sampler: (1, R) tokens, and the logits for log-probs (the R rows
        that sample, then the prompt log-probs' rows)."""
        be, R = self.model.backend, len(seqs)
        logits = self.model.forward(batch, self.kv)  # (R + prompt rows, V)
        wants_logits = len(logits) > R or any(s.logprobs is not None for s in seqs)
        host_logits = be.tohost(logits) if wants_logits else None  # log-probabilities are the model's own
        logits = logits[:R]
        edits = penalties(seqs)
        if edits is not None:
            logits = be.penalize(logits, edits)
        return be.sample(logits, *sampling_arrays(seqs))[None], host_logits  # (1, R) tokens

    def decode_step(self, batch, sampling):
        """What each CUDA graph records: eager()'s forward and sampler for one decode step, on the GPU alone (batch and
        sampling, SamplingArrays' fields by name, already there); the (R,) tokens stay there."""
        logits = self.model.forward_on_device(batch, self.kv)
        return self.model.backend.sample_device(logits, *(sampling[f] for f in SamplingArrays._fields))

    def running_ahead(self):
        return self.graphs is not None and self.graphs.running_ahead()

    def wait(self):  # until no GPU work is left (a run launched ahead included)
        if self.graphs is not None:
            self.graphs.wait()

    def reset(self):  # forget a run launched ahead (a failed step's)
        if self.graphs is not None:
            self.graphs.reset()


class DraftModel:
    """The draft of vLLM's draft-model speculation ({"model": ..., "num_speculative_tokens": k}): a smaller GPT-2 of
    the same vocabulary and at least the target's context, on the target's backend. Its K/V sit in the target's
    blocks, in tensors of its own; step() runs it over sequence views (speculation.view) with a ModelRunner of its
    own: on the GPU its one-token steps and lone chunks replay CUDA graphs, as the target's do."""
    def __init__(self, spec, llm):
        path = resolve_model(spec["model"])
        self.config = c = load_config(path)
        tokenizer = Tokenizer(path, c.vocab_size)
        llm.backend.check_model(c)
        if not tokenizer.same_vocabulary(llm.tokenizer) or c.n_ctx < llm.config.n_ctx:
            raise ValueError(f"speculative_config={spec!r}: a draft model needs the target's vocabulary (ids meaning "
                             f"the same bytes) and context ({llm.config.n_ctx}); {path} has " + (
                                 f"a context of {c.n_ctx}" if c.n_ctx < llm.config.n_ctx else "another vocabulary"))
        self.model = GPT(c, load_weights(path, c), llm.backend, tokenizer.n_vocab)

    def attach(self, kv, cuda_graphs, max_num_seqs):
        """Its K/V tensors in the target's blocks, and its runner (on the GPU, a graph run makes a view's draft tokens
        after its first at once); its step function."""
        c = self.config
        self.kv = kv.with_tensors(self.model.backend, c.n_layer, c.n_head, c.head_dim)
        self.runner = ModelRunner(self.model, self.kv, cuda_graphs, max_num_seqs=max_num_seqs)
        return self.step

    def step(self, views):
        """(steps, R) tokens: each view's next tokens, sampled by the keyed race from the draft model's logits (one
        step, or a graph run's decode steps, as many as the views' drafts still want)."""
        batch, seqs, _ = make_batch([(v, len(v.token_ids) - v.num_computed) for v in views], self.kv)
        return self.runner.run(batch, seqs, launch_next=False)[0]


class LLM:
    """The engine. step() is the whole loop: the scheduler picks this step's tokens, they become one flat batch, the
    runner runs the model over it and samples, and the new tokens go to their sequences.

    A step is all or nothing (see _step). One LLM may serve several threads and nested streams: every call that changes
    the engine holds its lock (Exclusive), and each request's events go to the call that added it (its outbox)."""
    def __init__(self, model, device="auto", dtype=None, block_size=16, max_num_seqs=256,
                 max_num_batched_tokens=16384, num_kv_tokens=None, gpu_memory_utilization=0.9, seed=0,
                 cuda_graphs=True, fused=True, num_scheduler_steps=16, dependent_launches=True, batch_invariant=False,
                 enable_prefix_caching=True, quantization=None, speculative_config=None, tensor_parallel_size=1,
                 distributed_executor_backend=None):
        check_engine_arguments(args := {k: v for k, v in locals().items() if k != "self"})
        self.model_dir = path = resolve_model(model)
        self.config = c = load_config(path)
        self.tokenizer = Tokenizer(path, c.vocab_size)
        self.backend = make_backend(device, dtype)
        self.backend.check_model(c)
        # ranks, each with its share of the heads (and of every matmul): parallel.py. "mp" runs this engine in a
        # process a rank (rank 0 spawns them and relays its calls; GPUs' default); "uni" as threads (the CPU's)
        tp, executor = tensor_parallel_size, parallel.check(tensor_parallel_size, c, self.backend,
                                                            distributed_executor_backend)
        self.ranks = rank = parallel.start(type(self), dict(args, model=path), tp, executor, self.backend)
        # the lessons' switches: fusion, dependent launches; and outputs bitwise the same solo, batched, chunked or
        # preempted (every reduction row by row, in a fixed order)
        self.backend.fused, self.backend.dependent_launches, self.backend.batch_invariant = (
            fused, dependent_launches, batch_invariant)
        t0 = time.perf_counter()
        weights = load_weights(path, c)
        log(f"weights: {sum(w.size for w in weights.values()) / 1e6:,.0f}M parameters ({c.n_layer} layers, "
            f"{c.n_embd} wide) from {path} in {time.perf_counter() - t0:.1f} s")
        if quantization == "int8":  # weight-only int8 (W8A16), quantized here from the checkpoint's weights
            weights = quantize_weights(weights, self.tokenizer.n_vocab)
        if rank.size > 1:
            weights = parallel.shard(weights, c, self.tokenizer.n_vocab, rank.rank, rank.size)
        self.model = GPT(c, weights, self.backend, self.tokenizer.n_vocab, rank.comm) if rank.size == tp else None
        spec = speculative_config
        draft = DraftModel(spec, self) if isinstance(spec, dict) and "model" in spec else None  # else "ngram"
        blocks = rank.fewest(PagedKVCache.pool_blocks(c, self.backend, num_kv_tokens, gpu_memory_utilization,
                                                      max_num_seqs, block_size, draft and draft.config), self.backend)
        self.kv = PagedKVCache(self.backend, c.n_layer, c.n_head // tp, c.head_dim, blocks, block_size,
                               enable_prefix_caching)  # rank 0's heads: the others' K/V in their tensors, same blocks
        if self.model is None:  # "uni": a GPT a rank over its shard of the weights, threads of this process
            self.model = parallel.SimulatedRanks(functools.partial(GPT, c, backend=self.backend,
                                                                   n_vocab=self.tokenizer.n_vocab),
                                                 weights, c, self.tokenizer.n_vocab, tp, self.kv)
        log(f"KV cache: {blocks * block_size:,} tokens ({self.kv.nbytes / 2 ** 30:.2f} GiB), {blocks} blocks of "
            f"{block_size}; max_num_seqs={max_num_seqs} x n_ctx={c.n_ctx} is the most it can use")
        self.speculator = None if spec is None else NgramProposer(spec, c.n_ctx) if not draft else \
            DraftModelProposer(spec, c.n_ctx, draft.attach(self.kv, cuda_graphs, max_num_seqs), self.kv)
        ngram = isinstance(self.speculator, NgramProposer) and (self.speculator.n_min, self.speculator.n_max)
        self.runner = ModelRunner(self.model, self.kv, cuda_graphs, num_scheduler_steps, max_num_seqs,
                                  self.speculator and self.speculator.k + 1, ngram)  # graphs of verification chunks
        if ngram and self.runner.graphs:  # the GPU drafts for the decodes its graphs take (graph_runner.SpecGraph)
            self.speculator.on_device = True
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, self.runner.admission_group,
                                   self.speculator)
        self._rng = np.random.default_rng(seed)  # seeds for requests that bring none
        self._next_id = 0
        self._requests = {}  # request id -> Request, until its last event
        self._step_outbox = []  # the outbox of requests from add_request: step() returns its events
        self._exclusive = Exclusive()
        self._stepping, self._aborts_after_step = False, []

    def add_request(self, prompt, params=None, outbox=None):
        """Queue a request; its events go to outbox.append (None: step() returns them). A bad one raises ValueError
        here and the others go on."""
        return self._add(prompt, params, self._step_outbox if outbox is None else outbox)

    def _add(self, prompt, params, outbox):
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling parameters are a SamplingParams or None, not {type(params).__name__}")
        ids = self.tokenizer.prompt_ids(prompt)
        refuse_request(ids, params, self.config.n_ctx, self.tokenizer.n_vocab, self.kv)
        with self._exclusive():
            seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
            rid = self._next_id  # the request's id, and its first sequence's; its samples take the next ones
            seqs = [Sequence(rid + i, ids, params, sample_seed(seed, i), self.tokenizer, rid, i)
                    for i in range(params.n)]
            self._next_id += params.n
            self._requests[rid] = Request(rid, RequestOutput.prompt_text(prompt), seqs, outbox)
            self.scheduler.add(seqs[0])
            self.ranks.relay("add_request", ids, replace(params, seed=seed))
        return rid

    def abort_request(self, request_id):
        """Stop requests (an id, or several) now, wherever they are: their blocks are freed at once, and each gets a
        last event, finish_reason 'abort'. An id unknown or already finished is ignored, as in vLLM."""
        ids = [request_id] if isinstance(request_id, (int, np.integer, str)) else list(request_id)
        with self._exclusive():
            if self._stepping:  # called from inside a step (a stream's cleanup run by the garbage collector)
                self._aborts_after_step += ids
                return
            for req in [self._requests[rid] for rid in ids if rid in self._requests]:
                req.finish("abort", None, self.scheduler)
                self._deliver(self._events(req.seqs))
            self.ranks.relay("abort_request", ids)

    def reset_prefix_cache(self):
        """Forget the KV the prefix cache holds (vLLM's method): requests compute their prompts afresh."""
        with self._exclusive():
            self.kv.reset_prefix_cache()
            self.ranks.relay("reset_prefix_cache")
        return True

    def has_unfinished(self):
        """Whether requests wait or run, or step() has events to hand out (of requests another call's step finished)."""
        return self.scheduler.has_unfinished() or bool(self._step_outbox)

    def step(self):
        """One step: (request id, sample index, new text, RequestOutput once the request finished else None) for each
        sample of add_request's requests that got tokens or finished (a stream()'s requests are its own)."""
        with self._exclusive():
            self._step()
            events, self._step_outbox[:] = self._step_outbox[:], []
            return events

    def _step(self):
        """schedule -> batch -> run -> postprocess, all or nothing: if anything raises, _undo puts the sequences it
        scheduled back as they were. After an interrupt (Ctrl-C) they wait in line and the interrupt goes on; after an
        error they finish with it (it would come back), and the engine goes on serving every other request."""
        saved = {}  # sequence -> its state before this step
        self._stepping = True
        try:
            # no request comes in while the GPU runs decode steps launched ahead: it would end them unread
            scheduled = self.scheduler.schedule(admit=not self.runner.running_ahead())
            saved.update((seq, seq.checkpoint()) for seq, _ in scheduled)
            self.ranks.relay("step")  # after the schedule, so that a lost rank ends the requests it would have run
            events = []
            if self.speculator:  # the drafts of the decodes given room for one (speculation.py)
                self.speculator.fill([seq for seq, _ in scheduled])
            if scheduled:
                batch, seqs, prompt_rows = make_batch(scheduled, self.kv)  # the flat batch; who samples; prompt rows
                # (steps, R) new tokens; (R, V) logits for logprobs. A graph run launches the next one before its
                # tokens are read, unless a request waits to come in (the next step admits it, eagerly) or the next
                # step may verify a draft (it would drop that run: a draft is made from the tokens the host has)
                drafts_next = bool(self.speculator) and self.speculator.active(len(self.scheduler.running))
                tokens, logits, drafts = self.runner.run(batch, seqs, not (self.scheduler.wants_admission() or
                                                                           drafts_next), drafts_next)
                for seq, n in scheduled:
                    seq.num_computed += n  # their K/V are in the cache now
                add_prompt_logprobs(prompt_rows, logits, len(seqs), self.tokenizer)
                events = self._postprocess(seqs, tokens, logits, drafts)
                for seq, _ in scheduled:  # their full blocks, findable now (those that finished: when freed)
                    self.kv.name_computed(seq.seq_id, seq.token_ids, seq.num_computed)
            self.ranks.check()  # a rank lost meanwhile: the step's results are not to be trusted (it is undone)
        except BaseException as e:
            self.ranks.fail(e)  # the other ranks ran on, or wait for this one: the engine ends
            self._undo(saved)
            if not isinstance(e, Exception) or not saved:  # an interrupt, or an error no request can be blamed for
                raise
            events = self._fail(saved, e)
        finally:
            self._stepping = False
        self._deliver(events)
        if self._aborts_after_step:
            ids, self._aborts_after_step = self._aborts_after_step, []
            self.abort_request(ids)

    def _undo(self, saved):
        """Put each sequence a failed step scheduled back as it was before the step, first in line, its blocks freed (as
        after a preemption: it is recomputed, so no half-written KV is trusted), and forget runs launched ahead."""
        self.runner.reset()
        for seq, state in reversed(saved.items()):
            seq.restore(state)
            self.scheduler.requeue(seq)

    def _fail(self, saved, error):
        log(f"a step failed; its {len(saved)} sequence(s) end with finish_reason 'error':")
        traceback.print_exception(error)
        message = f"the engine step running this request failed: {type(error).__name__}: {error}"
        return self._events([ended for seq in saved
                             for ended in self._requests[seq.request_id].finish("error", message, self.scheduler, seq)])

    def _postprocess(self, seqs, tokens, logits, drafts=None):
        """Hand each sequence its tokens until one finishes it (the rest dropped, blocks freed): an event each. drafts:
        a speculating graph run's (its rows' tokens end at -1)."""
        drafted = {}  # speculation.py's: a drafting sequence's output count before this step
        for row, seq in enumerate(seqs):
            if seq.index == 0 and seq.num_output == 0:  # a request's first sample, at its first token
                self._requests[seq.request_id].fork(self.kv, self.scheduler)
            j = draft_row(seqs, row, drafted, self.speculator) if self.speculator and drafts is None else 0
            if j is None:  # a row of its sequence's draft after the first token sampled otherwise
                continue
            for i, token in enumerate(tokens[:, row]):
                if token < 0:
                    break
                if drafts is not None:
                    count_drafts(seq, drafts[i, row], self.speculator)
                if i > 0 or j > 0:  # a later step of a run, or a kept draft token, computed the token before
                    seq.num_computed += 1
                if logits is not None and seq.logprobs is not None:
                    seq.logprobs.append(logprobs_of(logits[row], int(token), seq.params.logprobs, self.tokenizer))
                seq.append(int(token), self.config.n_ctx)
                if seq.finish_reason:
                    self.scheduler.remove(seq)
                    break
        return self._events(list(dict.fromkeys(seqs)))

    def _events(self, seqs):
        """(request id, sample index, new text, None) per sequence; a request's last one here carries its
        RequestOutput when all its samples are finished."""
        events = [[seq.request_id, seq.index, seq.new_text(), None] for seq in seqs]
        for rid, event in {event[0]: event for event in events}.items():
            if self._requests[rid].finished:
                event[3] = self._requests[rid].output()
        return [tuple(event) for event in events]

    def _deliver(self, events):
        """Each event to the outbox of the call that added its request; a request's last event lets it go."""
        for event in events:
            request_id, _, _, out = event
            self._requests[request_id].outbox.append(event)
            if out is not None:
                del self._requests[request_id]

    def stream(self, prompts, sampling_params=None):
        """Yield (prompt index, sample index, new text, RequestOutput once the request finished else None); a refused
        prompt yields its error. A stream left early (break, close(), an exception in its consumer) aborts its
        unfinished requests at once."""
        prompts, params = as_lists(prompts, sampling_params)
        outbox, index = deque(), {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    index[self._add(prompt, p, outbox)] = i
                except ValueError as e:
                    yield i, 0, "", RequestOutput.refused(prompt, e)
            remaining = len(index)
            while remaining:
                with self._exclusive():
                    if not outbox:  # whichever call steps, every request's events go to its own outbox
                        self._step()
                    events = [outbox.popleft() for _ in range(len(outbox))]
                for request_id, sample, delta, out in events:
                    remaining -= out is not None
                    yield index[request_id], sample, delta, out
            self.runner.wait()  # no GPU work outlives this call (a run launched ahead of the last tokens included)
        finally:
            with self._exclusive():
                self.abort_request([rid for rid, req in self._requests.items() if req.outbox is outbox])

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        """Run prompts to completion, continuously batched: one RequestOutput per prompt, in order. use_tqdm: a
        progress bar on stderr, requests done and output tokens/s, as vLLM's."""
        from tqdm.auto import tqdm
        prompts, sampling_params = as_lists(prompts, sampling_params)
        outputs, tokens, t0 = {}, 0, time.perf_counter()
        with tqdm(total=len(prompts), desc="Processed prompts", unit="req", disable=not use_tqdm, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            for i, _, _, out in self.stream(prompts, sampling_params):
                if out is not None:
                    outputs[i] = out
                    tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.set_postfix_str(f"output {tokens / (time.perf_counter() - t0):,.0f} tok/s", refresh=False)
                    bar.update()
        return [outputs[i] for i in range(len(outputs))]

# -----------------------------------------------------------------------------
# the engine's small pieces, which a first reading can skip


class Exclusive:
    """`with exclusive():` holds the engine for one thread at a time (re-entrant: a stream inside a stream). In the main
    thread, a Ctrl-C meanwhile waits until the engine is consistent again and is raised on leaving (a second Ctrl-C
    breaks in at once; the step is then undone)."""
    def __init__(self):
        self._lock, self._depth = threading.RLock(), 0

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            defer = self._depth == 0 and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler
            interrupted = []

            def hold(signum, frame):
                if interrupted:
                    raise KeyboardInterrupt
                interrupted.append(signum)
            if defer:
                signal.signal(signal.SIGINT, hold)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if defer:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
            if interrupted:
                raise KeyboardInterrupt


def log(message):
    print(f"nanoinfer: {message}", file=sys.stderr, flush=True)
