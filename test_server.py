"""The OpenAI-compatible server (serve.py), through OpenAI's official openai client and raw httpx requests.

serve.py runs in a subprocess on the tiny checkpoint (CPU, fp32) on a free port of 127.0.0.1. The reference is the
engine in this process: each completion's text is what LLM.generate gives for the same prompt and settings; and after
every test the server's engine holds no request and every KV block is free (its /metrics).
"""
import subprocess
import sys
import threading

import pytest

from conftest import HERE, _free_port, greedy
from nanoinfer import LLM


@pytest.fixture(scope="module")
def server(tiny):
    """serve.py on the tiny checkpoint (CPU, fp32), on a free port; yields (base URL, an LLM like it for solo runs)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "serve.py"), "--model", str(tiny.path), "--device", "cpu",
                             "--port", str(port), "--served-model-name", "tiny"], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            assert proc.poll() is None, proc.stderr.read().decode()
            threading.Event().wait(0.1)
    else:
        proc.kill()
        raise AssertionError("serve.py did not come up in 60 s")
    yield url, LLM(str(tiny.path), device="cpu")
    proc.terminate()
    proc.wait(timeout=30)


def server_metrics(url):
    import httpx
    return {k: int(v) for k, v in (line.split() for line in httpx.get(url + "/metrics").text.splitlines())}


def wait_idle(url):
    """Until the server's engine holds no request and every KV block is free (10 s at most)."""
    for _ in range(100):
        m = server_metrics(url)
        if m["nanoinfer_requests_running"] == m["nanoinfer_requests_waiting"] == 0 and \
                m["nanoinfer_kv_blocks_free"] == m["nanoinfer_kv_blocks_total"]:
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"the server is not idle: {m}")


def test_server_completions_like_generate(server):
    """completions.create, whole and streamed, gives generate()'s greedy text; n=2 gives two choices; the model is
    listed; usage counts the tokens; logprobs come in OpenAI's shape."""
    from openai import OpenAI
    url, llm = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    want = llm.generate(["Hello, my name is"], greedy(12), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == len(llm.tokenizer.encode("Hello, my name is"))
    chunks = list(client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    two = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4, n=2, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    streamed = {}  # the same, streamed: each choice's chunks, by index, in order
    for chunk in client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4, n=2, temperature=1.0,
                                           seed=3, stream=True, extra_body={"ignore_eos": True}):
        streamed[chunk.choices[0].index] = streamed.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert streamed == {c.index: c.text for c in two.choices}
    lp = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3 and all(len(t) >= 1 for t in
                                                                                         lp.top_logprobs)
    wait_idle(url)


def test_server_32_streams_join_one_batch(server):
    """32 clients stream at once, each its own prompt: each text is its solo run's (greedy), and afterwards nothing
    is left in the engine and every block is free."""
    from openai import OpenAI
    url, llm = server
    prompts = [f"Story number {i}:" for i in range(32)]
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy(20), use_tqdm=False)]
    got = [None] * 32

    def client(i):
        stream = OpenAI(base_url=url + "/v1", api_key="none").completions.create(
            model="tiny", prompt=prompts[i], max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True})
        got[i] = "".join(c.choices[0].text for c in stream)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want
    wait_idle(url)


def test_server_client_gone_aborts(server):
    """A client that disconnects mid-stream (32 samples of 120 tokens), and one that gives up waiting for a whole
    response (128 of them): every sample ends as aborted, not run out; every block is free; the server answers on."""
    import httpx
    url, _ = server
    aborted = lambda: server_metrics(url).get('nanoinfer_samples_finished{reason="abort"}', 0)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 120, "n": 32, "temperature": 0, "ignore_eos": True}
    before = aborted()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: the request runs
    wait_idle(url)
    assert aborted() == before + 32
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "n": 128}, timeout=0.1)
    wait_idle(url)
    assert aborted() == before + 32 + 128
    assert httpx.post(url + "/v1/completions", json={**body, "n": 1, "max_tokens": 2}).json()["usage"][
        "completion_tokens"] == 2


def test_server_bad_requests_get_400(server):
    """Bad JSON, a bad value (named), an unknown model (404), a prompt past the context, an unsupported field: each
    gets OpenAI's error body, while a stream beside them finishes as alone."""
    import httpx
    from openai import BadRequestError, NotFoundError, OpenAI
    url, llm = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    want = llm.generate(["Beside"], greedy(30), use_tqdm=False)[0].outputs[0].text
    beside = client.completions.create(model="tiny", prompt="Beside", max_tokens=30, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="a", temperature=-1)
    with pytest.raises(NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="a")
    with pytest.raises(BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="a " * 300)
    with pytest.raises(BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="a", echo=True)
    assert httpx.post(url + "/v1/completions", json=["a"]).status_code == 400
    assert "".join(c.choices[0].text for c in beside) == want
    wait_idle(url)
