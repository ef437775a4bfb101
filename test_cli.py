"""The command line and packaging: sample.py's flags and exit codes (never a traceback), vLLM's offline quickstart run
unchanged but for its import, pip install of the checkout, and bench.py without a GPU.

Each runs as a subprocess from the repo root (HERE) or from outside it, as a user would; the references are the
documented outputs and exit statuses (0, 1 for a refused prompt or a bad model, 2 for a bad flag, 130 on Ctrl-C, 141
on a closed pipe).
"""
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BAD_CONFIGS, HERE, _corrupt, _edit_config
from nanoinfer import LLM, SamplingParams


def run_sample(args, patch="", timeout=120, **popen):
    """sample.py in a subprocess (after `patch`, Python run first in it); returns the Popen."""
    code = ("import runpy, sys, time\nimport nanoinfer\n" + patch +
            f"\nsys.argv = ['sample.py'] + {list(args)!r}\nrunpy.run_path({str(HERE / 'sample.py')!r}, "
            "run_name='__main__')")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE,
                            env={**os.environ, "PYTHONPATH": str(HERE)}, **popen)


SLOW_STEPS = """
step = nanoinfer.LLM._step
def slow_step(self):
    time.sleep(0.02)
    return step(self)
nanoinfer.LLM._step = slow_step
"""


VLLM_QUICKSTART = """
from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="facebook/opt-125m")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


def test_vllm_quickstart_runs_unchanged(tiny):
    """vLLM's offline-inference quickstart (docs.vllm.ai, Quickstart), changed only in its import line and model
    path, prints each prompt and a generated text; as a subprocess, from outside the checkout."""
    code = VLLM_QUICKSTART.replace("from vllm import", "from nanoinfer import").replace(
        '"facebook/opt-125m"', repr(str(tiny.path)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tiny.path,
                       env={**os.environ, "PYTHONPATH": str(HERE)})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split(", Generated text: ")[0] for line in lines] == \
        [f"Prompt: {s!r}" for s in ("Hello, my name is", "The president of the United States is",
                                      "The capital of France is", "The future of AI is")]
    assert all(len(ast.literal_eval(line.split(", Generated text: ")[1])) > 0 for line in lines)


def test_readme_api_example(tiny):
    """README's API example as it stands, on the tiny checkpoint on the CPU: each prompt printed with its text, a
    {"prompt": ...} dict's too (vLLM's RequestOutput.prompt; not None), then a text streamed."""
    code = re.search(r"## The API.*?```python\n(.*?)```", (HERE / "README.md").read_text(), re.S).group(1)
    assert code.count('LLM("gpt2")') == 1
    code = code.replace('LLM("gpt2")', f"LLM({str(tiny.path)!r}, device='cpu')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tiny.path,
                       env={**os.environ, "PYTHONPATH": str(HERE)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Hello, my name is ") and "\nThe capital of France is " in p.stdout, p.stdout
    assert not re.search("^None ", p.stdout, re.M), p.stdout


def test_cli_flags(tiny, tmp_path):
    """--help shows every default and what 0 means; --num-samples prints each text under its own header, saying why
    it stopped; --seed repeats a run and no seed does not; vLLM's names for the flags (--n, --max-tokens) do the
    same; a prompt comes from stdin or a file, less its final newline; --stop ends at a stop string and says so;
    --logprobs prints a line per token; --quantization int8 prints the int8 engine's text."""
    run = lambda *args, stdin=None: subprocess.run(
        [sys.executable, str(HERE / "sample.py"), "--model", str(tiny.path), "--device", "cpu", *args],
        input=stdin, capture_output=True, text=True, timeout=120, cwd=HERE)
    h = " ".join(run("--help").stdout.split())
    assert all(w in h for w in ("(default: 0.8)", "(default: 100)", "0 is greedy", "0 is off", "1 is off",
                                "--num-samples", "--prompt-file", "--stop", "--ignore-eos", "--logprobs"))
    two = run("--prompt", "Hi", "--num-samples", "2", "--max-new-tokens", "4", "--ignore-eos", "--seed", "5")
    assert two.returncode == 0 and "--- [prompt 1/1, sample 1/2] ---\nHi" in two.stdout
    assert "--- [prompt 1/1, sample 2/2] ---\nHi" in two.stdout
    assert two.stderr.count("[stopped: max tokens (4; --max-new-tokens)]") == 2
    again = run("--prompt", "Hi", "--num-samples", "2", "--max-new-tokens", "4", "--ignore-eos", "--seed", "5")
    vllm = run("--prompt", "Hi", "--n", "2", "--max-tokens", "4", "--ignore-eos", "--seed", "5")  # vLLM's names
    assert vllm.returncode == 0 and vllm.stdout == two.stdout, vllm.stderr
    fresh = [run("--prompt", "Hi", "--max-new-tokens", "8", "--ignore-eos").stdout for _ in range(2)]
    assert again.stdout == two.stdout and fresh[0] != fresh[1]
    typed = run("--prompt", "Hello from stdin", "--max-new-tokens", "3", "--temperature", "0").stdout
    (tmp_path / "prompt.txt").write_text("Hello from stdin\n")
    for name in ("-", str(tmp_path / "prompt.txt")):  # the final newline, as echo and editors end a text, is dropped
        got = run("--prompt-file", name, "--max-new-tokens", "3", "--temperature", "0", stdin="Hello from stdin\n")
        assert got.stdout == typed and typed.startswith("Hello from stdin"), (got.stdout, typed)
    greedy_text = run("--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "12", "--ignore-eos").stdout
    stop = greedy_text[len("Hi"):].strip()[3:6]
    cut = run("--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "12", "--ignore-eos", "--stop", stop)
    assert f"[stopped: stop string {stop!r}]" in cut.stderr and stop not in cut.stdout[len("Hi"):]
    lp = run("--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "3", "--ignore-eos", "--logprobs", "2")
    assert len([line for line in lp.stderr.splitlines() if line.startswith("  ")]) == 3
    q = run("--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "6", "--ignore-eos", "--quantization", "int8")
    want = LLM(str(tiny.path), device="cpu", quantization="int8").generate(["Hi"], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert q.returncode == 0 and q.stdout.startswith("Hi" + want), q.stdout


def test_cli_refused_prompt_exits_1(tiny):
    p = run_sample(["--model", str(tiny.path), "--device", "cpu", "--prompt", "Hi", "--prompt", "a " * 200,
                    "--max-new-tokens", "5"])
    out, err = (s.decode() for s in p.communicate(timeout=120))
    assert p.returncode == 1 and "prompt 2 refused" in err and "context" in err and "Traceback" not in err
    assert out.startswith("--- [1/2] ---\nHi") and "refused" not in out and "a a a" not in out  # not echoed
    alone = run_sample(["--model", str(tiny.path), "--device", "cpu", "--prompt", "a " * 200])
    out, err = (s.decode() for s in alone.communicate(timeout=120))
    assert alone.returncode == 1 and err.rstrip().splitlines()[-1].startswith("error: prompt 1 refused: "), err
    assert out.strip() == "" and "tokens/s" not in err  # nothing ran: no speed line (0 tokens in 0.00 s) either
    bad = run_sample(["--model", str(tiny.path), "--device", "cpu", "--num-samples", "0"])
    _, err = (s.decode() for s in bad.communicate(timeout=120))
    assert bad.returncode == 2 and "--num-samples 0: must be an integer in [1, 256]" in err and "SamplingParams" not in err


def test_cli_ctrl_c_exits_130_with_the_text_so_far(tiny):
    p = run_sample(["--model", str(tiny.path), "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "120",
                    "--temperature", "0"], SLOW_STEPS)
    first = p.stdout.read1(1000).decode()  # some text is on screen: generation is under way
    p.send_signal(signal.SIGINT)
    out, err = (s.decode() for s in p.communicate(timeout=120))
    assert p.returncode == 130 and "Traceback" not in err, err
    assert (first + out).startswith("Hello") and "[interrupted]" in out
    printed = (first + out).split("\n[interrupted]")[0][len("Hello"):]  # the closing line counts these tokens
    count = int(re.search(r"(\d+) tokens in", err).group(1))
    llm = LLM(str(tiny.path), device="cpu")
    want = llm.generate(["Hello"], SamplingParams(max_tokens=120, temperature=0), use_tqdm=False)[0].outputs[0]
    assert 0 < count < 120 and llm.tokenizer.decode(want.token_ids[:count]).startswith(printed), (count, printed)


def test_cli_ctrl_c_while_loading(tiny):
    patch = "def slow(*a):\n    print('LOADING', file=sys.stderr, flush=True)\n    time.sleep(60)\n" \
            "nanoinfer.load_weights = slow"
    p = run_sample(["--model", str(tiny.path), "--device", "cpu"], patch)
    assert p.stderr.readline().decode().strip().endswith("LOADING")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and b"Traceback" not in err, err


def test_cli_closed_pipe(tiny):
    """`python sample.py ... | head -c 20`: the reader leaves early; sample.py stops without a traceback."""
    p = run_sample(["--model", str(tiny.path), "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "120"],
                   SLOW_STEPS)
    assert len(p.stdout.read(20)) == 20
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("how", ["missing weights", "not gpt2", "truncated", "n_head 3", "a JSON list"])
def test_cli_bad_model_or_flag_never_a_traceback(tiny, tmp_path, how):
    if how in BAD_CONFIGS:
        path = _edit_config(tiny, tmp_path, BAD_CONFIGS[how][0])
    else:
        path, _ = _corrupt(tiny, tmp_path, how)
    p = run_sample(["--model", str(path), "--device", "cpu"])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and err.decode().startswith("error: ") and b"Traceback" not in err, err
    p = run_sample(["--model", str(tiny.path), "--top-p", "1.5"])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and b"--top-p 1.5: must be a number in (0, 1]" in err and b"Traceback" not in err, err
    p = run_sample(["--model", str(tiny.path), "--device", "cpu", "--top-k", "2147483648", "--max-new-tokens", "3"])
    p.communicate(timeout=120)
    assert p.returncode == 0  # a k past the vocabulary is off


IMPORT_ANYWHERE = """
import sys
from pathlib import Path
import nanoinfer, cuda_backend, graph_runner, engine_process
checkouts = [Path(c) for c in sys.argv[1:]]
print(nanoinfer.__file__, cuda_backend.KERNELS_CU.is_file())
# by path components: as strings, every path in ~/nanoinfer-venv starts with ~/nanoinfer
inside = lambda file: any(Path(file).is_relative_to(c) for c in checkouts)
print([m for m, v in list(sys.modules.items()) if inside(getattr(v, "__file__", None) or "")])  # (CuPy imports more)
"""


def test_pip_install_gives_import_anywhere(tmp_path):
    """pip install of a checkout (what `pip install git+URL` builds, here without the network) into site-packages
    beside it, named as a user names the two (~/nanoinfer, ~/nanoinfer-venv: one path a prefix of the other): the
    engine's modules and kernels.cu land flat there, and import nanoinfer works from any directory, the CUDA source
    beside cuda_backend.py, no module coming from a checkout (an editable install puts one on sys.path too, which
    would hide a module the wheel left out). By --target, with this interpreter, whose packages (pip and hatchling
    too) it needs: a venv made from within a venv sees the base interpreter's packages, not this one's."""
    checkout, site = tmp_path / "nanoinfer", tmp_path / "nanoinfer-venv" / "site-packages"  # a copy: nothing is
    checkout.mkdir()  # written beside HERE
    for f in [*HERE.glob("*.py"), *HERE.glob("*.cu"), HERE / "pyproject.toml", HERE / "README.md"]:
        shutil.copy(f, checkout)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--target", str(site), str(checkout)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != HERE]
    r = subprocess.run([sys.executable, "-c", IMPORT_ANYWHERE, str(HERE), str(checkout)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site)] + others)})
    assert r.returncode == 0, r.stderr
    loaded, from_checkouts = r.stdout.splitlines()
    assert loaded == f"{site / 'nanoinfer.py'} True", r.stdout
    assert from_checkouts == "[]", from_checkouts
    assert sorted(p.name for p in site.iterdir() if p.suffix in (".py", ".cu")) == [
        "checkpoint.py", "cuda_backend.py", "engine_process.py", "graph_runner.py", "kernels.cu", "nanoinfer.py",
        "paged_kv.py", "parallel.py", "sample.py", "sampling_params.py", "scheduler.py", "serve.py", "speculation.py"]


def test_bench_without_a_gpu_says_so():
    """bench.py --device cuda where CuPy cannot load: exit 1 with what to install and the CPU alternative, no
    traceback; --device auto would measure the CPU instead."""
    code = ("import sys, runpy; sys.modules['cupy'] = None; sys.argv = ['bench.py', '--device', 'cuda']; "
            f"runpy.run_path({str(HERE / 'bench.py')!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cupy-cuda13x" in r.stderr and "--device cpu" in r.stderr, r.stderr
