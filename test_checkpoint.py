"""Model directories (checkpoint.py): the tokenizer, config.json and the safetensors weights, loading by name through
the Hugging Face cache, and the GPU check at start.

The references: HF tokenizers' byte-level BPE over the same vocab files, transformers' own save_pretrained and its
greedy tokens, and for every broken directory or setting an error that names the file and what to do. No network:
the Hub is a closed port or a stand-in on 127.0.0.1.
"""
import hashlib
import json
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import nanoinfer as ni
from conftest import (BAD_CONFIGS, CPU, EOT, HERE, _corrupt, _edit_config, _free_port, _run_py, greedy, hf_greedy,
                      make_llm, tokens)
from nanoinfer import LLM, SamplingParams
from scheduler import Sequence


# -----------------------------------------------------------------------------
# the tokenizer, and UTF-8 streaming

TEXTS = ["Hello world", "😀 你好世界 🎉", "naïve café — déjà vu", "  leading spaces\n\ttabs", "It's 3.14159, isn't it?",
         "Здравствуй, мир! 日本語のテキスト"]


def test_tokenizer(tiny, ref_tok):
    """GPT-2 ids ("Hello world" -> [15496, 995], <|endoftext|> = 50256), equal to HF tokenizers' byte-level BPE
    on the same files, and a lossless round trip through decode."""
    tok = make_llm(tiny, CPU, num_kv_tokens=128).tokenizer
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eot_token == EOT and tok.encode("<|endoftext|>") == [EOT]
    for text in TEXTS:
        assert tok.encode(text) == ref_tok.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("stop", [None, ["zzz"]])
def test_utf8_streaming_never_splits_a_character(tiny, stop):
    """Feeding the tokens of emoji and Chinese text one by one through a Sequence (the engine's incremental
    detokenizer): no delta holds U+FFFD, and the deltas concatenate to the text."""
    tok = make_llm(tiny, CPU, num_kv_tokens=128).tokenizer
    text = "😀 你好世界 🎉 ok"
    ids = tok.encode(text)
    assert any(not _is_utf8(tok.token_bytes(t)) for t in ids), "the text splits no character across tokens"
    seq = Sequence(0, [EOT], SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop), 0, tok)
    deltas = []
    for t in ids:
        seq.append(t, n_ctx=1024)
        deltas.append(seq.new_text())
    assert seq.finish_reason == "length"
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text
    assert "" in deltas  # something was held back mid-character


def _is_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_tokenizer_json_alone_loads(tiny, tmp_path):
    """A directory whose tokenizer is only tokenizer.json, written by transformers' save_pretrained (as transformers 5
    saves GPT-2): the same token ids both ways as with vocab.json + merges.txt, and the same greedy output."""
    from transformers import GPT2TokenizerFast
    d = tmp_path / "model"
    shutil.copytree(tiny.path, d)
    GPT2TokenizerFast.from_pretrained(d).save_pretrained(d)
    for name in ("vocab.json", "merges.txt"):
        (d / name).unlink()
    assert json.loads((d / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    text = "Hello, world! Ünïcode and   spaces\n<|endoftext|> done"
    ours, ref = LLM(str(d), device="cpu", num_kv_tokens=256), LLM(str(tiny.path), device="cpu", num_kv_tokens=256)
    assert ours.tokenizer.encode(text) == ref.tokenizer.encode(text) and ours.tokenizer.eot_token == 50256
    assert ours.tokenizer.decode(ref.tokenizer.encode(text)) == text
    assert tokens(ours.generate(text, greedy(6))[0]) == tokens(ref.generate(text, greedy(6))[0])


def test_vocab_without_endoftext_refused(tiny, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny.path, d)
    vocab = json.loads((d / "vocab.json").read_text())
    del vocab["<|endoftext|>"]
    (d / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=r"vocab\.json.*<\|endoftext\|>"):
        LLM(str(d), device="cpu", num_kv_tokens=256)


# -----------------------------------------------------------------------------
# weights and configs: refused at load, naming the file

@pytest.mark.parametrize("how", ["missing weights", "missing vocab", "not gpt2", "wrong shape", "truncated",
                                 "corrupt header"])
def test_weights_errors_name_the_file(tiny, tmp_path, how):
    """A broken model directory gives a clear error that names the offending file."""
    path, name = _corrupt(tiny, tmp_path, how)
    with pytest.raises(Exception) as e:
        LLM(str(path), device="cpu", num_kv_tokens=256)
    assert name in str(e.value), str(e.value)
    if how == "wrong shape":
        assert "c_proj" in str(e.value)


@pytest.mark.parametrize("how", list(BAD_CONFIGS))
def test_bad_configs_refused_naming_the_file(tiny, tmp_path, how):
    """Each config that would load and then compute wrong logits, or crash later, is refused at load with an error
    naming the file and the setting (these once gave silently wrong logits, a reshape error or a KeyError)."""
    edit, words = BAD_CONFIGS[how]
    with pytest.raises(ValueError) as e:
        LLM(str(_edit_config(tiny, tmp_path, edit)), device="cpu", num_kv_tokens=256)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_unknown_model_name():
    """A model that is neither a directory nor a GPT-2 name: an error naming it, before any download; an unknown
    random size lists the sizes."""
    with pytest.raises(Exception, match="gpt-17"):
        LLM("gpt-17", device="cpu")
    with pytest.raises(FileNotFoundError, match="random:<size> for a size of gpt2, gpt2-medium"):
        LLM("random:gpt5", device="cpu")


def test_random_model_runs_with_no_network(tmp_path, monkeypatch, capsys):
    """`random:gpt2`: GPT-2 124M's shapes with random weights, written once to the cache (HF_HUB_OFFLINE set, no
    network needed), saying where and how large, with a progress bar while it makes them; then read again from it,
    silently; the engine loads it and generates; its logits are those of transformers on the same files (the
    weights are what was written)."""
    import torch
    from transformers import GPT2LMHeadModel
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = ni.resolve_model("random:gpt2")
    assert path == tmp_path / "nanoinfer" / "random-gpt2" and ni.load_config(path).n_layer == 12
    err = capsys.readouterr().err
    assert f"nanoinfer: making random:gpt2 (249 MB) once, in {path}" in err and "100%" in err, err
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ni.resolve_model("random:gpt2") == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert capsys.readouterr().err == ""
    llm = LLM("random:gpt2", device="cpu", num_kv_tokens=256)
    out = llm.generate(["Hello"], greedy(4), use_tqdm=False)[0]
    with torch.no_grad():
        ref = GPT2LMHeadModel.from_pretrained(path).float()(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    assert out.outputs[0].token_ids[0] == int(ref.argmax()) and len(out.outputs[0].token_ids) == 4


def test_cuda_on_a_gpu_before_hopper(monkeypatch, capsys):
    """The kernels need Hopper: on an older GPU (a stand-in CuPy that reports an A100), device='cuda' says so and
    what to do, and device='auto' runs on the CPU, saying why."""
    gpu = SimpleNamespace(attributes={"ComputeCapabilityMajor": 8, "ComputeCapabilityMinor": 0})
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=lambda: 1), Device=lambda: gpu))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0.*H100.*device='cpu'"):
        ni.make_backend("cuda", None)
    assert isinstance(ni.make_backend("auto", None), ni.NumpyBackend)
    assert "compute capability 8.0" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# the download path, without network: a closed port, and a loopback stand-in for the Hub

def test_offline_error_says_what_to_do(tmp_path):
    """--model gpt2 with nothing cached: with the Hub unreachable, at once (no retries with backoff: they took 23 s),
    an error saying to connect once, download it with `hf download`, or pass a directory, and naming HF_HUB_OFFLINE;
    with HF_HUB_OFFLINE=1, without trying the network, an error naming it. Either names what runs with no Hub and no
    model at all, --model random:gpt2 (random:gpt2-medium for gpt2-medium); sample.py and serve.py say the same."""
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "home")}
    closed = {"HF_ENDPOINT": f"http://127.0.0.1:{_free_port()}"}
    for model, extra, words in (("gpt2", closed, ("network", "HF_HUB_OFFLINE=1")),
                                ("gpt2", {"HF_HUB_OFFLINE": "1"}, ("HF_HUB_OFFLINE=1", "forbids")),
                                ("gpt2-medium", {"HF_HUB_OFFLINE": "1"}, ("HF_HUB_OFFLINE=1", "forbids"))):
        r = _run_py(f"import nanoinfer; nanoinfer.LLM({model!r}, device='cpu')", {**env, **extra}, tmp_path)
        assert r.returncode != 0
        msg = r.stderr.strip().splitlines()[-1]
        assert f"hf download openai-community/{model} " in msg and "directory" in msg, r.stderr
        assert f"--model random:{model} " in msg and all(w in msg for w in words), msg
    for script in (["sample.py", "--prompt", "Hi"], ["serve.py", "--port", str(_free_port())]):
        r = _run_py(f"import runpy, sys; sys.argv = {script!r}; runpy.run_path({script[0]!r}, run_name='__main__')",
                    {**env, **closed}, HERE)
        assert r.returncode == 1 and "--model random:gpt2 " in r.stderr and "Traceback" not in r.stderr, r.stderr


class _Hub(BaseHTTPRequestHandler):
    """Serves one directory as every repo at every revision: /{repo}/resolve/{revision}/{filename}."""
    files, gets, commit = {}, [], "0123456789abcdef0123456789abcdef01234567"

    def _head(self):
        name = self.path.rsplit("/", 1)[-1]
        if "/resolve/" not in self.path or name not in self.files:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        body = self.files[name]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
        self.send_header("X-Repo-Commit", self.commit)
        self.end_headers()
        return body

    def do_HEAD(self):
        self._head()

    def do_GET(self):
        body = self._head()
        if body is not None:
            self.gets.append(self.path)
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_download_through_a_loopback_hub(tiny, tmp_path):
    """--model gpt2 through a stand-in Hub on 127.0.0.1 (HF_ENDPOINT): the files land in the HF cache, the engine
    runs on them (greedy equal to transformers on the served weights), and a second start, with the Hub gone,
    loads from the cache."""
    _Hub.files = {p.name: p.read_bytes() for p in tiny.path.iterdir() if p.is_file()}
    _Hub.gets = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_HOME": str(tmp_path / "home"), "HF_HUB_DISABLE_XET": "1"}
    code = ("import json, nanoinfer as ni; llm = ni.LLM('gpt2', device='cpu', num_kv_tokens=256); "
            "print(json.dumps(llm.generate('Hello world', ni.SamplingParams(temperature=0, max_tokens=5, "
            "ignore_eos=True))[0].outputs[0].token_ids))")
    try:
        first = _run_py(code, env, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert first.returncode == 0, first.stderr
    assert sorted(g.rsplit("/", 1)[-1] for g in _Hub.gets) == ["config.json", "merges.txt", "model.safetensors",
                                                               "vocab.json"]
    ref, _ = hf_greedy(tiny, [15496, 995], 5)
    assert json.loads(first.stdout.strip().splitlines()[-1]) == ref
    cached = list((tmp_path / "cache").glob("models--*gpt2/snapshots/*/model.safetensors"))
    assert len(cached) == 1 and cached[0].read_bytes() == _Hub.files["model.safetensors"]
    second = _run_py(code, env, tmp_path)  # the server is gone now
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1]) == ref
