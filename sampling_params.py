"""What a request asks for and what it gets back, with vLLM's names, defaults and meanings (SamplingParams,
RequestOutput, CompletionOutput, Logprob), and what the sampler gets from them. Every SamplingParams field and LLM
argument is checked when given: a bad one raises ValueError naming the field and what it must be."""
import math
from collections import Counter, namedtuple
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    n: int = 1  # samples of the prompt: they share its KV blocks, and each draws its own tokens
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) is off, as is any k >= the vocabulary
    min_p: float = 0.0  # keep the tokens at least min_p times as likely as the most likely one (0 is off)
    seed: int = None  # fixes the random draws, whatever else is in the batch (None: one from the engine's seed)
    stop: list = None  # strings that end the request (not included in the text)
    stop_token_ids: list = None  # token ids that end the request, as EOS does
    include_stop_str_in_output: bool = False  # keep the stop string, or the stop token's text
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled, nor stop strings end it, before this many
    repetition_penalty: float = 1.0  # > 1 discourages every token seen (prompt and output): logit / r if > 0, else * r
    presence_penalty: float = 0.0  # subtracted from the logit of each token already in the output
    frequency_penalty: float = 0.0  # subtracted once per time a token is already in the output
    logprobs: int = None  # k: the chosen token's log-probability and the k most likely, at every token
    prompt_logprobs: int = None  # k: each prompt token's log-probability given those before, and the k most likely
    logit_bias: dict = None  # {token id: bias in [-100, 100]} added to its logit (after the penalties), as OpenAI's

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        stop_ok = isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop)
        ids_ok = isinstance(self.stop_token_ids, (list, tuple)) and all(is_int(t, 0) for t in self.stop_token_ids)
        bias_ok = isinstance(self.logit_bias, dict) and all(is_int(t, 0) and is_number(b, -100, 100)
                                                            for t, b in self.logit_bias.items())
        max_ok = is_int(self.max_tokens, 1)  # (if not, its check fails before min_tokens' is read)
        refuse_bad("SamplingParams", self, (
            ("n", is_int(self.n, 1, 256), "an integer in [1, 256]"),
            ("max_tokens", max_ok, "an integer >= 1"),
            ("temperature", is_number(self.temperature, 0), "a number >= 0 (0 is greedy)"),
            ("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", is_int(self.top_k, -1), "an integer >= -1 (0 or -1 is off)"),
            ("min_p", is_number(self.min_p, 0, 1), "a number in [0, 1] (0 is off)"),
            ("seed", self.seed is None or is_int(self.seed, 0, 2 ** 64 - 1), "None or an integer in [0, 2**64)"),
            ("stop", self.stop is None or stop_ok, "None, a string, or a list of non-empty strings"),
            ("stop_token_ids", ids_ok, "None or a list of token ids"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "True or False"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("min_tokens", is_int(self.min_tokens, 0, self.max_tokens if max_ok else 0),
             "an integer in [0, max_tokens]"),
            ("repetition_penalty", is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "a number > 0 (1 is off)"),
            ("presence_penalty", is_number(self.presence_penalty, -2, 2), "a number in [-2, 2]"),
            ("frequency_penalty", is_number(self.frequency_penalty, -2, 2), "a number in [-2, 2]"),
            ("logprobs", self.logprobs is None or is_int(self.logprobs, 0, 20), "None or an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or is_int(self.prompt_logprobs, 0, 20),
             "None or an integer in [0, 20]"),
            ("logit_bias", self.logit_bias is None or bias_ok, "None or a dict {token id: bias in [-100, 100]}")))


class TextDelta(str):
    """A sample's new text in an event (a str), with the tokens sampled since its last event: token_ids and, with
    logprobs, their logprobs (the text may lag them: what could start a stop string waits)."""
    def __new__(cls, text, token_ids=(), logprobs=None):
        delta = super().__new__(cls, text)
        delta.token_ids, delta.logprobs = list(token_ids), logprobs
        return delta  # (pickled whole, across the server's pipe: its attributes are its __dict__)


@dataclass
class Logprob:  # vLLM's: a token's log-probability under the model, its rank there (1: the most likely), its text
    logprob: float
    rank: int = None
    decoded_token: str = None


@dataclass
class CompletionOutput:  # one sample of a request, as vLLM's
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: float = None  # with logprobs: the sum over the sampled tokens
    logprobs: list = None  # with logprobs=k: per token, {token id: Logprob} for the sampled one and the k most likely
    finish_reason: str = None  # 'stop' (EOS, stop string or token), 'length' (max_tokens, context), 'abort', 'error'
    stop_reason: object = None  # the stop string or stop token id that ended it (None for EOS and length)


@dataclass
class RequestOutput:  # as vLLM's, and `error`: why a request failed or was refused
    request_id: int
    prompt: str
    prompt_token_ids: list
    outputs: list  # a CompletionOutput per sample (SamplingParams.n)
    finished: bool = True
    error: str = None
    prompt_logprobs: list = None  # with prompt_logprobs=k: None for the first prompt token, then as logprobs
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_draft_tokens: int = 0  # speculative decoding: draft tokens the target verified (its samples' sum)
    num_accepted_tokens: int = 0  # ... and kept

    @staticmethod
    def prompt_text(prompt):
        """RequestOutput.prompt, as vLLM's: the prompt's text (a string, or vLLM's {"prompt": ...}); None for ids."""
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        return text if isinstance(text, str) else None

    @classmethod
    def refused(cls, prompt, error):
        return cls(None, cls.prompt_text(prompt), [], [CompletionOutput(0, finish_reason="error")], error=str(error))


@dataclass
class EngineConfig:
    """The engine's settings, LLM's keyword arguments (vLLM's names where it has them), checked before any loading."""
    device: str = "auto"  # "cuda" (the kernels), "cpu" (numpy), or "auto": the GPU if there is a usable one
    dtype: object = None  # float16 (the GPU's default) or float32 (the CPU's only)
    block_size: int = 16  # tokens a KV block holds
    max_num_seqs: int = 256  # sequences a step runs at most
    max_num_batched_tokens: int = 16384  # tokens a step computes at most (prompts are chunked to fit)
    num_kv_tokens: int = None  # the KV pool's size in tokens (None: what gpu_memory_utilization leaves)
    gpu_memory_utilization: float = 0.9  # the fraction of the GPU's memory the engine may hold
    seed: int = 0  # the seeds of requests that bring none are drawn from this one
    cuda_graphs: bool = True  # decode steps (and a lone prompt's prefill) replayed from CUDA graphs
    fused: bool = True  # layernorms, bias, GELU and residual adds inside the matmuls (False: kernels of their own)
    kernels: str = "fast"  # "simple": matmul, layernorm, attention on the kernel ladder's first rungs (kernels.cu, L)
    num_scheduler_steps: int = 16  # decode steps a CUDA graph run may take (multi-step decoding)
    dependent_launches: bool = True  # a kernel in a graph starts while the one before finishes
    batch_invariant: bool = False  # no row's sums depend on the rest of the batch (bitwise the same solo and batched)
    enable_prefix_caching: bool = True  # full KV blocks found again by prompts that start the same way
    quantization: str = None  # "int8": weight-only int8 (W8A16)
    speculative_config: dict = None  # speculative decoding (speculation.py): n-gram drafts, or a draft model's
    tensor_parallel_size: int = 1  # ranks each layer is split over (parallel.py)
    distributed_executor_backend: str = None  # "uni" (ranks as threads) or "mp" (a process a rank; GPUs' default)

    def __post_init__(self):
        positive = [(name, is_int(getattr(self, name), 1), "an integer >= 1") for name in (
            "block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "tensor_parallel_size")]
        switches = [(name, isinstance(getattr(self, name), bool), "True or False") for name in (
            "cuda_graphs", "fused", "dependent_launches", "batch_invariant", "enable_prefix_caching")]
        refuse_bad("LLM", self, positive + switches + [
            ("device", self.device in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'"),
            ("dtype", self.dtype in (None, "float16", "float32", np.float16, np.float32), "float16 or float32"),
            ("num_kv_tokens", self.num_kv_tokens is None or is_int(self.num_kv_tokens, 1), "None or >= 1"),
            ("gpu_memory_utilization", is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
             "a fraction in (0, 1]"),
            ("seed", is_int(self.seed, 0), "an integer >= 0"),
            ("quantization", self.quantization in (None, "int8"), "None or 'int8'"),
            ("kernels", self.kernels in ("fast", "simple"), "'fast' or 'simple' (the kernel ladder's first rungs)"),
            ("distributed_executor_backend", self.distributed_executor_backend in (None, "uni", "mp"),
             "'uni' (ranks as threads of this process) or 'mp' (a process a rank)")])


def is_int(v, lo, hi=math.inf):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and lo <= v <= hi


def is_number(v, lo=-math.inf, hi=math.inf):  # finite
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v) and \
        lo <= v <= hi


def refuse_bad(owner, obj, checks):
    """ValueError naming the first of obj's (field, ok, rule) checks that is not ok, its value, and what it must be."""
    for name, ok, rule in checks:
        if not ok:
            raise ValueError(f"{owner}.{name}={getattr(obj, name)!r}: must be {rule}")


def log_softmax(logits):
    """log p over the last axis, in float64."""
    logp = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return logp - np.log(np.exp(logp).sum(-1, keepdims=True))


def logprobs_of(logits_row, token, k, tokenizer):
    """{token id: Logprob} for the sampled token and the k most likely, under the model's own distribution (before
    penalties, temperature, top-k and top-p), ranks counted from 1."""
    logp = log_softmax(logits_row)
    ties = np.flatnonzero(logp >= np.partition(logp, -k)[-k]) if k else np.zeros(0, int)  # the k largest, and ties
    ranks = {int(t): r + 1 for r, t in enumerate(ties[np.argsort(-logp[ties], kind="stable")][:k])}
    ranks.setdefault(token, int((logp > logp[token]).sum()) + 1)
    return {t: Logprob(float(logp[t]), r, tokenizer.decode([t])) for t, r in ranks.items()}


def refuse_request(ids, params, n_ctx, n_vocab, kv):
    """ValueError, saying what to do, for a request that can never run: token ids past the vocabulary, a prompt
    that leaves no room to generate, or more KV cache than the whole pool holds."""
    for name in ("stop_token_ids", "logit_bias"):
        if any(t >= n_vocab for t in getattr(params, name) or ()):
            raise ValueError(f"SamplingParams.{name} has token ids past the vocabulary: they must be < {n_vocab}")
    if len(ids) >= n_ctx:
        raise ValueError(f"the prompt is {len(ids)} tokens, and this model's context is {n_ctx} tokens with at least "
                         f"one to generate: shorten the prompt to at most {n_ctx - 1} tokens")
    most_tokens = min(len(ids) + params.max_tokens, n_ctx)
    if kv.blocks_needed(most_tokens) > kv.num_blocks:
        raise ValueError(f"the whole KV cache pool holds {kv.num_blocks * kv.block_size} tokens, the request may need "
                         f"{most_tokens}: lower max_tokens, or raise num_kv_tokens or gpu_memory_utilization")


def as_lists(prompts, params):
    """generate() and stream()'s arguments as two lists of one length: a prompt alone, or a SamplingParams for all."""
    single = isinstance(prompts, (str, dict)) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
    prompts = [prompts] if single else list(prompts)
    params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
    return prompts, params


Penalties = namedtuple("Penalties", "rows ids output_counts banned repetition presence frequency bias")


def penalties(rows):
    """The logits a step edits before sampling, an entry per (row, token): each token a row has seen (its repetition
    penalty), times in the output (presence, frequency), logit bias, ban until min_tokens; None if no row edits. A row
    (sequence, j) samples the token j past the sequence's next, the j drafted before it (speculation.py) its output."""
    if not any(s.edits_logits for s, _ in rows):
        return None
    entries = []  # (row, token, times in the output, banned, repetition penalty, bias)
    for row, (s, j) in enumerate(rows):
        p, ban, bias, history = s.params, s.banned_tokens(ahead=j), s.params.logit_bias or {}, s.history(j)
        output = history[len(s.prompt_token_ids):]
        in_output = Counter(output) if p.presence_penalty or p.frequency_penalty else {}
        seen = set(history) if p.repetition_penalty != 1 else set(in_output)
        entries += [(row, t, in_output.get(t, 0), t in ban, p.repetition_penalty if t in seen else 1, bias.get(t, 0))
                    for t in sorted(seen | ban | set(bias))]
    row_of, ids, counts, banned = np.array([e[:4] for e in entries], np.int32).reshape(-1, 4).T.copy()  # (4, E)
    repetition, bias = np.array([e[4:] for e in entries], np.float32).reshape(-1, 2).T.copy()
    per_row = lambda name: np.array([getattr(s.params, name) for s, _ in rows], np.float32)
    return Penalties(row_of, ids, counts, banned.astype(bool), repetition, per_row("presence_penalty"),
                     per_row("frequency_penalty"), bias)


def sample_seed(seed, index):
    """The seed of a request's index-th sample: the request's own for the first, a different stream for each other."""
    return seed if index == 0 else (seed ^ (index * 0xD1B54A32D192ED03)) % 2 ** 64
