"""nanoinfer: GPT-2 inference, fast, in a few files. This one is the whole engine on numpy, readable alone.

Read top to bottom: the op set (numpy: the definition of every kernel), the sampler, GPT-2's forward over one flat
batch of tokens, and the LLM engine: step() is schedule -> batch -> run -> postprocess over the paged KV cache
(paged_kv.py) and the continuous-batching scheduler (scheduler.py). On a GPU, cuda_backend.py supplies the op set as
kernels (kernels.cu), and graph_runner.py replays steps from CUDA graphs: every speed trick, behind one door.
"""
import contextlib
import itertools
import math
import signal
import sys
import threading
import time
import traceback
import types
from collections import deque, namedtuple
from dataclasses import dataclass, replace

import numpy as np

import parallel
from checkpoint import Int8Weight, Tokenizer, load_config, load_weights, quantize_weights, resolve_model
from paged_kv import PagedKVCache
from sampling_params import (CompletionOutput, EngineConfig, Logprob, Penalties, RequestOutput,  # noqa (the API)
                             SamplingParams, as_lists, logprobs_of, penalties, refuse_request, sample_seed)
from scheduler import Request, Scheduler, Sequence

# -----------------------------------------------------------------------------
# the numpy backend: the readable definition of every op, the reference in tests, and a CPU engine


def gelu_tanh(x):
    """GPT-2's GELU, the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def sample_key(seed, token_index):
    """A sequence's token_index-th output token's random key: splitmix64 of seed + (token_index + 1) * golden ratio."""
    seed, token_index = np.asarray(seed, np.uint64), np.asarray(token_index, np.uint64)
    z = seed + (token_index + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel(key, n):
    """Gumbel noise -log(-log(u)) for tokens 0..n-1 under one key: u from 23 bits of murmur3's finalizer of (token,
    key), so a token's noise depends on nothing but its seed, token index and id (float32, as the kernel has it)."""
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
        """The logits processors, for each (row, token) of e (a Penalties): the repetition penalty (a positive logit
        / r, a negative one * r), presence and frequency (subtracted, the second per time in the output), bias (added);
        a token banned gets -inf."""
        logits = logits.copy()
        x, r, n = logits[e.rows, e.ids], e.repetition, e.output_counts
        x = np.where(x > 0, x / r, x * r) - e.frequency[e.rows] * n - e.presence[e.rows] * (n > 0) + e.bias
        logits[e.rows, e.ids] = np.where(e.banned, -np.inf, x)
        return logits

    def sample(self, logits, temperature, top_k, top_p, seed, token_index, min_p):
        keys, logits = sample_key(seed, token_index), logits.astype(np.float32)
        return np.array([sample_row(logits[r], temperature[r], top_k[r], top_p[r], keys[r], min_p[r])
                         for r in range(len(logits))], dtype=np.int64)


def make_backend(device, dtype, fused=True, dependent_launches=True, batch_invariant=False, kernels="fast"):
    """The op set to run on, with the lessons' switches (EngineConfig): numpy (fp32), or the CUDA kernels (fp16)."""
    backend = None
    if device != "cpu":
        import cuda_backend
        why = cuda_backend.find_gpu()  # None: a Hopper GPU is there
        if why is None:
            backend = cuda_backend.CudaBackend(np.dtype(dtype or np.float16))
            log(backend.loaded)
        elif device == "cuda":
            raise RuntimeError(f"device='cuda' needs CuPy and an NVIDIA Hopper GPU ({why}): "
                               "pip install cupy-cuda13x on an H100 or H200, or use device='cpu'")
        else:
            log(f"no usable GPU ({why}); running on the CPU with numpy")
    if backend is None:
        if dtype is not None and np.dtype(dtype) != np.float32:
            raise ValueError(f"dtype={np.dtype(dtype).name} on the CPU: numpy has no fast fp16 matmul; use float32")
        if kernels == "simple":
            raise ValueError("kernels='simple' runs the kernel ladder's first CUDA kernels; device='cpu' runs numpy's")
        backend = NumpyBackend(np.float32)
    backend.simple = kernels == "simple"  # the ladder's first rungs fuse nothing
    backend.fused, backend.dependent_launches = fused and not backend.simple, dependent_launches
    backend.batch_invariant = batch_invariant  # every reduction row by row, in a fixed order
    return backend


def decode_advance(tokens, input_ids, positions, context_lens, slot_mapping, token_index, remaining, block_tables,
                   max_blocks, block_size, ring, ring_len, ring_row, B):
    """kernels.cu's decode_advance, the last kernel of a CUDA graph's decode step (graph_runner.DecodeGraph): each
    row's sampled token into the ring of the run's tokens; a live row moves on (its token becomes its input, its
    position, context and sampling counter step, its slot comes from its block table) or, after its last allowed
    step, becomes padding (slot -1). In place, on the graph's input arrays."""
    row = int(ring_row[0])
    ring_row[0] = row + 1
    ring[row % ring_len, :B] = tokens[:B]
    live = np.flatnonzero(slot_mapping[:B] >= 0)
    remaining[live] -= 1
    slot_mapping[live[remaining[live] == 0]] = -1
    go = live[remaining[live] > 0]
    pos = positions[go] + 1
    input_ids[go], positions[go], context_lens[go], token_index[go] = tokens[go], pos, pos + 1, token_index[go] + 1
    blk, tables = pos // block_size, block_tables.reshape(B, max_blocks)
    slot_mapping[go] = np.where(blk < max_blocks, tables[go, np.minimum(blk, max_blocks - 1)] * block_size +
                                pos % block_size, -1)

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
    logits_idx: np.ndarray  # (R + P,) int32, rows whose logits are wanted: those that sample, then the prompt's P
    seqs: list = ()  # (S,) the sequences (host only)
    num_sampled: np.ndarray = None  # (S,) rows each samples at: its last token and each token it computes after it
    num_scoring: np.ndarray = None  # (S,) rows whose logits score its prompt's next tokens (prompt log-probs)


@dataclass
class Sampled:
    """What a sequence gets back from a step: its new tokens, in order (one from a plain decode step; several from a
    CUDA graph run of many steps, or from guesses kept, speculation.py), and for log-probs the logits of each and
    those scoring its next prompt tokens."""
    token_ids: list
    logits: np.ndarray = None  # (len(token_ids), V) float32 on the host, when it wants log-probs
    prompt_logits: np.ndarray = None  # (rows, V): row i scores its i-th prompt token not yet scored


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

def make_batch(scheduled, kv):
    """Flatten this step's work, [(sequence, tokens to compute now)], into one Batch. A sequence samples at its last
    token, and at each token it computes after it (guesses of what comes next); while a chunk of its prompt ends
    before that, nowhere. Rows that score prompt tokens (prompt log-probs) come after every sampled row. Python loops
    over sequences, numpy over tokens."""
    seqs = [seq for seq, _ in scheduled]
    counts = np.array([n for _, n in scheduled], np.int32)  # (S,)
    starts = np.array([seq.num_computed for seq in seqs], np.int32)  # (S,)
    lasts = np.array([len(seq.token_ids) - 1 for seq in seqs], np.int32)  # (S,) the position of each one's last token
    cu_seqlens_q = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)  # (S+1,)
    row = np.repeat(np.arange(len(seqs)), counts)  # (T,) the sequence of each token
    positions = (np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[row] + starts[row]).astype(np.int32)  # (T,)
    block_tables = kv.block_table_array([seq.seq_id for seq in seqs])  # (S, max_blocks)
    input_ids = np.fromiter(itertools.chain.from_iterable(seq.tokens_to_compute(n) for seq, n in scheduled), np.int32,
                            len(row))  # (T,)
    num_sampled = np.maximum(starts + counts - lasts, 0)  # (S,)
    spans = [seq.prompt_logprob_span(n) for seq, n in scheduled]  # positions whose logits score a prompt token
    logits_idx = np.concatenate([np.zeros(0, np.int32)] + [
        np.arange(cu_seqlens_q[i + 1] - n, cu_seqlens_q[i + 1]) for i, n in enumerate(num_sampled) if n] + [
        cu_seqlens_q[i] - starts[i] + np.arange(span.start, span.stop) for i, span in enumerate(spans) if span])
    return Batch(input_ids, positions, kv.slot_mapping(block_tables, row, positions), cu_seqlens_q, starts + counts,
                 block_tables, logits_idx.astype(np.int32), seqs, num_sampled, np.array([len(s) for s in spans]))


def sampled_rows(batch):
    """[(sequence, j)] for each row that samples, in order: it samples the token j places after the sequence's next."""
    return [(seq, j) for seq, n in zip(batch.seqs, batch.num_sampled.tolist()) for j in range(n)]


# the sampler's parameters, one per row that samples; token_index: the index in its output of the token it samples
SamplingArrays = namedtuple("SamplingArrays", "temperature top_k top_p seed token_index min_p")


def sampling_arrays(rows):
    params = [s.params for s, _ in rows]
    return SamplingArrays(np.array([p.temperature for p in params], np.float32),
                          np.array([min(max(p.top_k, 0), 2 ** 31 - 1) for p in params], np.int32),  # k > V: off
                          np.array([p.top_p for p in params], np.float32),
                          np.array([s.seed for s, _ in rows], np.uint64),
                          np.array([s.num_output + j for s, j in rows], np.int32),
                          np.array([p.min_p for p in params], np.float32))


def per_sequence(batch, tokens, logits=None):
    """{sequence: Sampled} from the (R,) tokens of the rows that sample (in order) and, when some sequence wants
    log-probs, the host logits of those rows and then of the rows that score prompt tokens."""
    out, r, p = {}, 0, int(batch.num_sampled.sum())
    for seq, n, m in zip(batch.seqs, batch.num_sampled.tolist(), batch.num_scoring.tolist()):
        if n or m:
            own = logits is not None and seq.logprobs is not None
            out[seq] = Sampled([int(t) for t in tokens[r:r + n]], logits[r:r + n] if own else None,
                               logits[p:p + m] if m else None)
        r, p = r + n, p + m
    return out


class ModelRunner:
    """Runs a step's batch: the model's forward over it, then the sampler on the rows that sample. On CUDA, decode
    batches replay CUDA graphs instead (graph_runner.GraphRunner), each recording decode_step, which mirrors eager().
    Two effects come later than they read: the graphs are captured here, at start-up; and a graph run of decode steps
    is launched before the host reads the run before it (so a step's tokens may come from a run launched a step
    earlier; while it runs, the scheduler lets no request in: LLM._step)."""
    def __init__(self, model, kv, engine, scheduler=None, proposer=None):
        self.model, self.kv, self.graphs = model, kv, None
        if engine.cuda_graphs and model.backend.name == "cuda":
            from graph_runner import GraphRunner
            t0 = time.perf_counter()
            self.graphs = GraphRunner(self.decode_step, model.backend, kv, model.config.n_ctx, engine, scheduler,
                                      proposer)
            log(f"captured {self.graphs.description} in {time.perf_counter() - t0:.1f} s")

    def run(self, batch):
        """{sequence: Sampled} for each sequence that samples or scores prompt tokens."""
        if not batch.seqs:
            return {}
        if self.graphs is None:
            return self.eager(batch)
        if self.graphs.takes(batch):  # decodes (chained speculation too), a lone prompt's prefill
            sampled = self.graphs.run(batch, sampling_arrays(sampled_rows(batch)))
            return {seq: Sampled(tokens) for seq, tokens in sampled.items()}
        with self.graphs.eager():  # on the graphs' stream, after everything they launched
            return self.eager(batch)

    def eager(self, batch):
        """The step as it reads: op by op, then the sampler."""
        be, rows = self.model.backend, sampled_rows(batch)
        logits = self.model.forward(batch, self.kv)  # (R + P, V)
        wants_logits = len(logits) > len(rows) or any(s.logprobs is not None for s, _ in rows)
        host_logits = be.tohost(logits) if wants_logits else None  # log-probabilities are the model's own
        edits = penalties(rows)
        logits = logits[:len(rows)] if edits is None else be.penalize(logits[:len(rows)], edits)
        return per_sequence(batch, be.sample(logits, *sampling_arrays(rows)), host_logits)

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

    def step_failed(self, error):  # forget a run launched ahead by the step
        if self.graphs is not None:
            self.graphs.forget()


class LLM:
    """The engine. step() is the whole loop: the scheduler picks this step's tokens, they become one flat batch, the
    runner runs the model over it and samples, and the new tokens go to their sequences.

    A step is all or nothing (_all_or_nothing). One LLM may serve several threads and nested streams: every call that
    changes the engine holds its lock (Exclusive), and each request's events go to the call that added it (its outbox).
    Two levers plug in at seams named in __init__: tensor parallelism (parallel.py: behind the model and the runner)
    and speculative decoding (speculation.py: a scheduler and a runner that know drafts)."""
    def __init__(self, model, **engine_args):
        """model: a GPT-2 name, a directory or random:<size> (checkpoint.py); engine_args: EngineConfig's settings
        (sampling_params.py), vLLM's names, each checked before anything loads."""
        self.engine_config = e = EngineConfig(**engine_args)
        self.model_dir = path = resolve_model(model)
        self.config = c = load_config(path)
        self.tokenizer = Tokenizer(path, c.vocab_size)
        self.backend = make_backend(e.device, e.dtype, e.fused, e.dependent_launches, e.batch_invariant, e.kernels)
        self.backend.check_model(c)
        # tensor parallelism's seams (parallel.py): the ranks make the model (a shard each) and wrap the runner
        self.ranks = parallel.start(type(self), dict(engine_args, model=path), e, c, self.backend)
        self.model = self.ranks.model(GPT, c, self._load_weights(path, e.quantization), self.backend,
                                      self.tokenizer.n_vocab)
        self.proposer = None  # speculative decoding's (speculation.py), which may load a draft model
        if e.speculative_config is not None:
            from speculation import make_proposer
            self.proposer = make_proposer(e.speculative_config, self)
        self.kv = self._make_kv_cache(e)  # in the memory the weights leave
        # speculation's seams: its scheduler gives drafts room as tokens to compute, its runner keeps those right
        self.scheduler = Scheduler(self.kv, e.max_num_seqs, e.max_num_batched_tokens) if self.proposer is None else \
            self.proposer.scheduler(self.kv, e)
        self.runner = ModelRunner(self.model, self.kv, e, self.scheduler, self.proposer)
        if self.proposer is not None:
            self.runner = self.proposer.runner(self.runner)
        self.runner = self.ranks.runner(self.runner)  # ("mp") rank 0's relays each step to the other ranks
        self._rng = np.random.default_rng(e.seed)  # seeds for requests that bring none
        self._next_id = 0
        self._requests = {}  # request id -> Request, until its last event
        self._step_outbox = []  # the outbox of requests from add_request: step() returns its events
        self._exclusive = Exclusive()
        self._stepping, self._aborts_after_step = False, []

    def _load_weights(self, path, quantization):
        t0, c = time.perf_counter(), self.config
        weights = load_weights(path, c)
        log(f"weights: {sum(w.size for w in weights.values()) / 1e6:,.0f}M parameters ({c.n_layer} layers, "
            f"{c.n_embd} wide) from {path} in {time.perf_counter() - t0:.1f} s")
        if quantization == "int8":  # weight-only int8 (W8A16), quantized here from the checkpoint's weights
            weights = quantize_weights(weights, self.tokenizer.n_vocab)
        return weights

    def _make_kv_cache(self, e):
        """The KV pool: as many blocks as asked for or as fit (the fewest of any rank's), each rank with K/V of its
        heads (in the same blocks), a draft model's K/V beside the target's."""
        c, draft = self.config, self.proposer and self.proposer.draft_config
        blocks = self.ranks.fewest(PagedKVCache.pool_blocks(c, self.backend, e.num_kv_tokens, e.gpu_memory_utilization,
                                                            e.max_num_seqs, e.block_size, draft), self.backend)
        kv = PagedKVCache(self.backend, c.n_layer, c.n_head // self.ranks.size, c.head_dim, blocks, e.block_size,
                          e.enable_prefix_caching)
        log(f"KV cache: {blocks * e.block_size:,} tokens ({kv.nbytes / 2 ** 30:.2f} GiB), {blocks} blocks of "
            f"{e.block_size}; max_num_seqs={e.max_num_seqs} x n_ctx={c.n_ctx} is the most it can use")
        return kv

    def add_request(self, prompt, params=None, outbox=None):
        """Queue a request; its events go to outbox.append (None: step() returns them). A bad one raises ValueError."""
        outbox = self._step_outbox if outbox is None else outbox
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
        """schedule -> batch -> run -> postprocess, all or nothing (_all_or_nothing); then each event to its caller."""
        with self._all_or_nothing() as step:
            # no request comes in while the GPU computes the running sequences' next steps, launched ahead (by
            # ModelRunner.run, a step earlier): it would end that run unread
            scheduled = self.scheduler.schedule(admit=not self.runner.running_ahead())
            step.saved = {seq: seq.checkpoint() for seq, _ in scheduled}
            batch = make_batch(scheduled, self.kv)
            step.events = self._postprocess(scheduled, self.runner.run(batch))
        self._deliver(step.events)
        if self._aborts_after_step:  # the aborts asked for during the step, now that it is over
            ids, self._aborts_after_step = self._aborts_after_step, []
            self.abort_request(ids)

    def _postprocess(self, scheduled, sampled):
        """The scheduled tokens' K/V are in the cache now; each sequence takes what it got back (_take), its full blocks
        then findable (prefix caching). An event for each sequence that got tokens."""
        for seq, n in scheduled:
            seq.num_computed += n
            if seq in sampled:
                self._take(seq, sampled[seq])
            self.kv.name_computed(seq.seq_id, seq.token_ids, seq.num_computed)  # (a finished one's: when freed)
        return self._events([seq for seq, got in sampled.items() if got.token_ids])

    def _take(self, seq, sampled):
        """Hand seq the log-probs of its prompt tokens it scored, then its new tokens in order until one finishes it
        (the rest dropped, its blocks freed), with their log-probs if it asked for them."""
        for logits in [] if sampled.prompt_logits is None else sampled.prompt_logits:
            seq.prompt_logprobs.append(logprobs_of(logits, seq.prompt_token_ids[len(seq.prompt_logprobs)],
                                                   seq.params.prompt_logprobs, self.tokenizer))
        if sampled.token_ids and seq.index == 0 and seq.num_output == 0:  # a request's first sample, at its first token
            self._requests[seq.request_id].fork(self.kv, self.scheduler)
        for i, token in enumerate(sampled.token_ids):
            # every token before the new one has its K/V now (a run's later steps computed them, or guesses kept)
            seq.num_computed = len(seq.token_ids)
            if sampled.logits is not None:
                seq.logprobs.append(logprobs_of(sampled.logits[i], token, seq.params.logprobs, self.tokenizer))
            seq.append(token, self.config.n_ctx)
            if seq.finish_reason:
                self.scheduler.remove(seq)
                return

    @contextlib.contextmanager
    def _all_or_nothing(self):
        """A step, undone if anything in it raises: the runner forgets what it launched, and each sequence the step
        scheduled goes back as it was, first in line, its blocks freed (recomputed: no half-written KV is trusted).
        After an interrupt (Ctrl-C) they wait and the interrupt goes on; after an error they end with it."""
        step = types.SimpleNamespace(saved={}, events=[])  # sequence -> its state before the step; the step's events
        self._stepping = True
        try:
            yield step
        except BaseException as e:
            self.runner.step_failed(e)
            for seq, state in reversed(step.saved.items()):
                seq.restore(state)
                self.scheduler.requeue(seq)
            if not isinstance(e, Exception) or not step.saved:  # an interrupt, or an error no request can be blamed for
                raise
            step.events = self._fail(step.saved, e)
        finally:
            self._stepping = False

    def _fail(self, saved, error):
        log(f"a step failed; its {len(saved)} sequence(s) end with finish_reason 'error':")
        traceback.print_exception(error)
        message = f"the engine step running this request failed: {type(error).__name__}: {error}"
        return self._events([ended for seq in saved
                             for ended in self._requests[seq.request_id].finish("error", message, self.scheduler, seq)])

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
                    index[self.add_request(prompt, p, outbox)] = i
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
