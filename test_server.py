"""The OpenAI-compatible server (serve.py), through OpenAI's official openai client and raw httpx requests.

serve.py runs in a subprocess on the tiny checkpoint (CPU, fp32) on a free port of 127.0.0.1. The reference is the
engine in this process: each completion's text is what LLM.generate gives for the same prompt and settings; and after
every test the server's engine holds no request and every KV block is free (its /metrics).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import HERE, _free_port, greedy, write_checkpoint
from nanoinfer import LLM, SamplingParams


def start_server(tiny, *flags, port=None):
    """serve.py on the tiny checkpoint (CPU, fp32) on a free port, up: (process, base URL)."""
    import httpx
    port = port or _free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "serve.py"), "--model", str(tiny.path), "--device", "cpu",
                             "--port", str(port), "--served-model-name", "tiny", *flags], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            assert proc.poll() is None, proc.stderr.read().decode()
            threading.Event().wait(0.1)
    proc.kill()
    raise AssertionError("serve.py did not come up in 60 s")


@pytest.fixture(scope="module")
def server(tiny):
    """serve.py on the tiny checkpoint; yields (base URL, an LLM like it for solo runs)."""
    proc, url = start_server(tiny)
    yield url, LLM(str(tiny.path), device="cpu")
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def children(pid):
    """The processes pid has started and that are still its children (Linux's /proc)."""
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def wait_gone(pids):
    """Those of pids still alive after 10 s (multiprocessing's resource tracker leaves once its pipe closes)."""
    alive = lambda: [k for k in pids if os.path.exists(f"/proc/{k}") and  # noqa: E731
                     "zombie" not in open(f"/proc/{k}/status").read()]
    for _ in range(100):
        if not alive():
            break
        threading.Event().wait(0.1)
    return alive()


def server_metrics(url):
    import httpx
    return {k: float(v) for k, v in (line.split() for line in httpx.get(url + "/metrics").text.splitlines())}


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
    long = "The quick brown fox jumps over the lazy dog. " * 4  # 41 tokens: 2 full blocks of 16 to find again
    before = server_metrics(url)
    first, again = (client.completions.create(model="tiny", prompt=long, max_tokens=2) for _ in range(2))
    assert (first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens) == (0, 32)
    after = server_metrics(url)
    assert after["nanoinfer_prefix_cache_hits_total"] - before["nanoinfer_prefix_cache_hits_total"] == 32
    assert after["nanoinfer_prefix_cache_queries_total"] - before["nanoinfer_prefix_cache_queries_total"] == \
        2 * first.usage.prompt_tokens
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
    for k in (0, 2):  # OpenAI's shape: up to k + 1 entries, the sampled token's always among them
        got = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.9, seed=5, logprobs=k,
                                        extra_body={"ignore_eos": True}).choices[0].logprobs
        want = llm.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0.9, seed=5, logprobs=k,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert got.tokens == [want.logprobs[i][t].decoded_token for i, t in enumerate(want.token_ids)]
        assert got.token_logprobs == pytest.approx([lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)])
        assert all(tok in top and k <= len(top) <= k + 1 for tok, top in zip(got.tokens, got.top_logprobs))
        streamed = [c.choices[0].logprobs for c in client.completions.create(
            model="tiny", prompt="Hi", max_tokens=3, temperature=0.9, seed=5, logprobs=k, stream=True,
            extra_body={"ignore_eos": True}) if c.choices[0].logprobs]  # the same, a chunk's tokens each
        assert sum((lp.tokens for lp in streamed), []) == got.tokens
        assert sum((lp.token_logprobs for lp in streamed), []) == pytest.approx(got.token_logprobs)
        assert sum((lp.text_offset for lp in streamed), []) == got.text_offset
    wait_idle(url)


def streamed_at_once(url, prompts, max_tokens):
    """The texts of greedy completions of `prompts`, each streamed to a client thread of its own (the official openai
    client) at once."""
    from openai import OpenAI
    got = [None] * len(prompts)

    def client(i):
        stream = OpenAI(base_url=url + "/v1", api_key="none").completions.create(
            model="tiny", prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        got[i] = "".join(c.choices[0].text for c in stream)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return got


def test_server_32_streams_join_one_batch(server):
    """32 clients stream at once, each its own prompt: each text is its solo run's (greedy), and afterwards nothing
    is left in the engine and every block is free."""
    url, llm = server
    prompts = [f"Story number {i}:" for i in range(32)]
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy(20), use_tqdm=False)]
    assert streamed_at_once(url, prompts, 20) == want
    wait_idle(url)


def test_server_with_two_http_processes(tiny):
    """--api-server-count 2: two HTTP server processes accept on one socket and share one engine process, whose two
    tensor-parallel ranks are processes (--tensor-parallel-size 2 --distributed-executor-backend mp): 24 clients at
    once, on connections of their own, stream their solo texts; /metrics answers for the whole engine (every finished
    sample, from either process); a client gone mid-stream is aborted; SIGTERM exits 0, leaving no child or
    grandchild."""
    import httpx
    proc, url = start_server(tiny, "--api-server-count", "2", "--tensor-parallel-size", "2",
                             "--distributed-executor-backend", "mp")
    ranks = []
    try:
        spawned = [k for k in children(proc.pid) if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
        assert len(spawned) == 2  # the engine, the second HTTP server (and multiprocessing's resource tracker)
        ranks = [k for e in spawned for k in children(e) if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
        assert len(ranks) == 1  # the engine's rank 1
        llm = LLM(str(tiny.path), device="cpu")
        prompts = [f"Tale {i}:" for i in range(24)]
        want = [o.outputs[0].text for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
        assert streamed_at_once(url, prompts, 12) == want
        with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "prompt": "Gone", "max_tokens": 100,
                                                                 "stream": True, "ignore_eos": True}) as r:
            next(r.iter_lines())  # its first event, then the client goes
        wait_idle(url)
        assert all(server_metrics(url)['nanoinfer_samples_finished{reason="length"}'] >= 24 for _ in range(4))
    finally:
        kids = children(proc.pid) + ranks
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    assert not wait_gone(kids)


def test_server_ctrl_c(tmp_path):
    """Ctrl-C, a SIGINT to serve.py's pid, with two HTTP server processes and a stream in flight that would run on for
    many seconds: the stream goes on for serve.py's grace, then each sample ends as aborted, then [DONE]; serve.py
    exits 130 a few seconds after the signal, saying so in one line, no traceback, no process it started left. A
    second Ctrl-C quits at once, leaving none either; so does one while the second HTTP process is still starting."""
    import httpx

    import serve
    long = write_checkpoint(tmp_path / "long", seed=0, n_positions=1024)  # room for a long stream
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "n": 32, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for presses in (1, 2):
        proc, url = start_server(long, *(("--api-server-count", "2") if presses == 1 else ()))
        kids, rest = children(proc.pid), []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # under way
            start = time.monotonic()
            for _ in range(presses):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.5)  # two signals at once would be taken as one
            try:
                rest = list(lines)
            except httpx.TransportError:  # quit at once: the connection breaks off
                assert presses == 2
        code, took = proc.wait(timeout=60), time.monotonic() - start
        err = proc.stderr.read().decode()
        assert code == 130 and "Traceback" not in err and "Warning" not in err and err.count("interrupted") == 1, err
        assert took < (serve.GRACE_S + 8 if presses == 1 else 3), took
        assert not wait_gone(kids)
        if presses == 1:
            aborted = sum(line.count('"finish_reason": "abort"') for line in rest)
            assert aborted == 32 and rest[-2:] == ["data: [DONE]", ""], rest[-3:]
    proc, _ = start_server(long, "--api-server-count", "2")  # the second HTTP process is still starting
    kids, start = children(proc.pid), time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, took, err = proc.wait(timeout=60), time.monotonic() - start, proc.stderr.read().decode()
    assert code == 130 and took < 5 and "Traceback" not in err, (took, err)
    assert not wait_gone(kids)


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
    """Bad JSON, a bad value (named), an unknown model (404), a prompt past the context, an unsupported field, a
    wrong method (405): each gets OpenAI's error body, a client's error typed as one, while a stream beside them
    finishes as alone."""
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
    with pytest.raises(BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="a", suffix="b")
    with pytest.raises(BadRequestError, match=r"maximum context length is 128 tokens.*\(1 in the prompt, 200 in"):
        client.completions.create(model="tiny", prompt="a", max_tokens=200)
    with pytest.raises(BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="a", best_of=3, n=1)
    with pytest.raises(BadRequestError, match=r"token ids in \[0, 50257\)") as e:
        client.completions.create(model="tiny", prompt=[99999])
    assert "dict" not in str(e.value)
    defaults = client.completions.create(model="tiny", prompt="a", max_tokens=2, best_of=1, n=1, logit_bias={})
    assert defaults.usage.completion_tokens <= 2
    assert httpx.post(url + "/v1/completions", json=["a"]).status_code == 400
    for method, route, status, kind in (("GET", "/v1/nowhere", 404, "not_found_error"),
                                        ("GET", "/v1/completions", 405, "invalid_request_error")):  # the client's fault
        r = httpx.request(method, url + route)
        assert r.status_code == status and r.json()["error"]["message"].startswith(f"{method} {route}")
        assert r.json()["error"]["type"] == kind
    assert client.models.retrieve("tiny").max_model_len == 128
    with pytest.raises(NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-5")
    assert "".join(c.choices[0].text for c in beside) == want
    wait_idle(url)


def lm_eval_loglikelihood(url, context, continuation, max_tokens=1):
    """A loglikelihood request as lm-evaluation-harness's local-completions sends it (token ids, echo, logprobs=1,
    temperature 0, seed 1234), and its answer read as lm-eval reads it: (sum of the continuation's log-probs,
    whether each continuation token is the most likely one)."""
    import httpx
    body = {"model": "tiny", "prompt": context + continuation, "max_tokens": max_tokens, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp, end = choice["logprobs"], len(context) + len(continuation)
    assert len(lp["token_logprobs"]) == end + max_tokens and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    tokens, tops = lp["token_logprobs"][len(context):end], lp["top_logprobs"][len(context):end]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))


def test_server_echo_scores_like_lm_eval(server, tiny):
    """lm-eval's loglikelihood requests (echo, logprobs=1, max_tokens 1 and 0): the continuation's log-likelihood
    equals transformers' on the same tokens (fp32, within 1e-4), and the greedy flag equals transformers' argmax;
    echo's text is the prompt's then the completion's."""
    import httpx
    import torch
    url, llm = server
    for text, cont in (("The capital of France is", " Paris"), ("Once upon a", " time there was a dragon")):
        ctx, cont = llm.tokenizer.encode(text), llm.tokenizer.encode(cont)
        with torch.no_grad():
            logp = torch.log_softmax(tiny.hf(torch.tensor([ctx + cont])).logits[0], -1).numpy()
        want = sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))
        greedy_ref = all(logp[len(ctx) - 1 + i].argmax() == t for i, t in enumerate(cont))
        for max_tokens in (1, 0):
            got, is_greedy = lm_eval_loglikelihood(url, ctx, cont, max_tokens)
            assert abs(got - want) < 1e-4 and is_greedy == greedy_ref, (text, got, want)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "echo": True,
                                                  "temperature": 0, "ignore_eos": True}).json()
    want = llm.generate(["Hello"], greedy(3), use_tqdm=False)[0].outputs[0].text
    assert r["choices"][0]["text"] == "Hello" + want and r["usage"]["completion_tokens"] == 3
    wait_idle(url)


def test_server_chat_completions(server):
    """chat.completions through the openai client, whole and streamed (sync and async): the answer is the engine's
    completion of the messages rendered by the default template; a stream with include_usage ends with the usage
    chunk; logprobs come in the chat shape with the sampled token among top_logprobs."""
    import asyncio

    from openai import AsyncOpenAI, OpenAI
    url, llm = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    rendered = "system: You are terse.\n\nuser: Say hi.\n\nassistant:"
    want = llm.generate([rendered], greedy(10), use_tqdm=False)[0].outputs[0]
    client = OpenAI(base_url=url + "/v1", api_key="none")
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(llm.tokenizer.encode(rendered)) and got.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    lp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.7, seed=2,
                                        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    for entry in lp.choices[0].logprobs.content:
        assert entry.token in [t.token for t in entry.top_logprobs] and 2 <= len(entry.top_logprobs) <= 3
    streamed = sum((c.choices[0].logprobs.content for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0.7, seed=2, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs), [])
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == \
        [(e.token, round(e.logprob, 6)) for e in lp.choices[0].logprobs.content]

    async def streamed():
        stream = await AsyncOpenAI(base_url=url + "/v1", api_key="none").completions.create(
            model="tiny", prompt=rendered, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])
    assert asyncio.run(streamed()) == want.text
    wait_idle(url)


def test_langchain_chat_openai(server):
    """LangChain's ChatOpenAI, pointed at the server, gets the engine's completion of the rendered messages, whole
    and streamed."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    url, llm = server
    rendered = "system: Be brief.\n\nuser: Name a colour.\n\nassistant:"
    want = llm.generate([rendered], greedy(8), use_tqdm=False)[0].outputs[0].text
    chat = ChatOpenAI(base_url=url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=8,
                      extra_body={"ignore_eos": True})
    messages = [SystemMessage("Be brief."), HumanMessage("Name a colour.")]
    assert chat.invoke(messages).content == want
    assert "".join(chunk.content for chunk in chat.stream(messages)) == want
    wait_idle(url)


def test_chat_template_sources(tiny, tmp_path):
    """The chat template: a file given wins, else the model directory's own (tokenizer_config.json), else the plain
    default; a template's raise_exception refuses the messages with a 400."""
    import shutil

    import serve
    messages = [{"role": "user", "content": "hi"}]
    assert serve.load_chat_template(None, tiny.path).render(messages=messages, add_generation_prompt=True) == \
        "user: hi\n\nassistant:"
    model = tmp_path / "model"
    shutil.copytree(tiny.path, model)
    (model / "tokenizer_config.json").write_text('{"chat_template": "{% for m in messages %}<{{ m.role }}>'
                                                 '{{ m.content }}{% endfor %}"}')
    assert serve.load_chat_template(None, model).render(messages=messages) == "<user>hi"
    (tmp_path / "t.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(serve.BadRequest, match="no system role"):
        serve.load_chat_template(tmp_path / "t.jinja", model).render(messages=messages)


def test_server_api_key_and_port_in_use(tiny):
    """--api-key: /v1 routes answer 401 in OpenAI's shape without the bearer token (or with another), 200 with it;
    /health stays open; --no-enable-prefix-caching: no prompt token comes from the cache; --speculative-config:
    drafts are counted in /metrics and the text is plain decoding's. A second server on the same port exits at once with 1, saying to pick another --port."""
    import httpx
    proc, url = start_server(tiny, "--api-key", "sekrit", "--no-enable-prefix-caching", "--speculative-config",
                             '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer sekrit"}).status_code == 200
        body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 2}
        for _ in range(2):  # --no-enable-prefix-caching: the second computes its prompt again
            r = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer sekrit"}).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prompt = [11, 22, 33, 44, 55] * 6  # repeats itself: n-gram drafts, counted in /metrics
        want = LLM(str(tiny.path), device="cpu").generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0].text
        r = httpx.post(url + "/v1/completions", headers={"authorization": "Bearer sekrit"}, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()
        m = server_metrics(url)
        assert r["choices"][0]["text"] == want and m["nanoinfer_spec_decode_num_draft_tokens_total"] > 0
        assert m["nanoinfer_spec_decode_acceptance_rate"] == pytest.approx(
            m["nanoinfer_spec_decode_num_accepted_tokens_total"] / m["nanoinfer_spec_decode_num_draft_tokens_total"])
        assert httpx.get(url + "/health").status_code == 200
        second = subprocess.run([sys.executable, str(HERE / "serve.py"), "--model", str(tiny.path), "--device", "cpu",
                                 "--port", url.rsplit(":", 1)[1]], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "pick another --port" in second.stderr and "serving" not in second.stderr
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_server_slow_reader_holds_up_no_one(server):
    """A client that leaves its stream unread while 8 others run (16 samples of 100 tokens wait in the buffers): the 8
    finish with their solo texts meanwhile; then it reads on and gets all of its own."""
    import socket as socket_

    import httpx
    url, llm = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 100, "n": 16, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    slow = socket_.create_connection((host, int(port)))
    slow.setsockopt(socket_.SOL_SOCKET, socket_.SO_RCVBUF, 4096)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    first = slow.recv(64)
    assert first.startswith(b"HTTP/1.1 200")
    prompts = [f"Beside {i}:" for i in range(8)]
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy(20), use_tqdm=False)]
    got = [httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()[
        "choices"][0]["text"] for p in prompts]
    assert got == want
    rest = first
    while b"data: [DONE]" not in rest:
        chunk = slow.recv(65536)
        assert chunk, "the slow reader's stream ended early"
        rest += chunk
    slow.close()
    assert rest.count(b'"finish_reason": "length"') == 16
    wait_idle(url)


def engine_child(proc):
    """The engine process serve.py started (its child spawned by multiprocessing, beside the resource tracker)."""
    children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    engines = [int(c) for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(engines) == 1, children
    return engines[0]


def test_server_under_abuse(tiny):
    """200 clients that vanish after their first chunk, a body past the limit (413), 8 requests at once against
    --max-num-seqs 2 (they wait their turn: each gets its solo text): the server answers on, every sample is counted
    (aborted, or finished if its tokens were done before the server saw its client go), every block is free. Then the engine process dies (SIGKILL): /health and completions answer 503 at once,
    a stream in flight ends, nothing hangs; SIGTERM still exits 0."""
    import os
    import signal as sig

    import httpx
    proc, url = start_server(tiny, "--max-num-seqs", "2")
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}

        def vanish(_):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                next(r.iter_lines())
        threads = [threading.Thread(target=vanish, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        wait_idle(url)  # each was aborted, unless its 100 tokens were done before the server saw the client go
        m = server_metrics(url)
        assert m['nanoinfer_samples_finished{reason="abort"}'] + \
            m.get('nanoinfer_samples_finished{reason="length"}', 0) == 200
        assert m['nanoinfer_samples_finished{reason="abort"}'] >= 100
        r = httpx.post(url + "/v1/completions", content=b"[" + b"1," * (9 << 20) + b"1]",
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "larger than 16 MiB" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"  # the client's fault, not the server's
        llm = LLM(str(tiny.path), device="cpu")
        prompts = [f"Turn {i}:" for i in range(8)]
        want = [o.outputs[0].text for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
        got = [None] * 8

        def ask(i):
            got[i] = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompts[i], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}).json()["choices"][0]["text"]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == want
        wait_idle(url)
        with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 120}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine_child(proc), sig.SIGKILL)
            rest = list(lines)  # ends: the reader thread tells the stream its engine is gone
        assert any("engine process has exited" in line for line in rest) and rest[-2:] == ["data: [DONE]", ""]
        for _ in range(50):
            if httpx.get(url + "/health").status_code == 503:
                break
            threading.Event().wait(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "engine process has exited" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


LL_DOCS = [("The capital of France is", " Paris"), ("Once upon a", " time there was"), ("1, 2, 3,", " 4, 5")]
GEN_DOCS = ["Question: what comes after one?\nAnswer:", "The weather today is"]


def test_lm_eval_harness_against_the_server(server, tiny, tmp_path, monkeypatch):
    """lm-evaluation-harness itself (local-completions, tokenized requests), on two tasks defined over local JSON
    files: its loglikelihood answers equal transformers' log-likelihood of each continuation (fp32, within 1e-4) and
    its greedy flag transformers' argmax; its generate_until answers are the engine's greedy texts up to the stop;
    with the server's own tokenizer (lm-eval's remote backend) the same answers."""
    import json as json_
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url, llm = server
    (tmp_path / "ll.jsonl").write_text("".join(json_.dumps({"context": c, "continuation": t}) + "\n"
                                               for c, t in LL_DOCS))
    (tmp_path / "gen.jsonl").write_text("".join(json_.dumps({"prompt": p, "answer": ""}) + "\n" for p in GEN_DOCS))
    for task, kind, extra in (("nanoinfer_ll", "loglikelihood", 'doc_to_text: "{{context}}"\n'
                               'doc_to_target: "{{continuation}}"\nmetric_list:\n  - metric: acc\n'),
                              ("nanoinfer_gen", "generate_until", 'doc_to_text: "{{prompt}}"\ndoc_to_target: '
                               '"{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n'
                               '  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: bypass\n')):
        data = tmp_path / ("ll.jsonl" if kind == "loglikelihood" else "gen.jsonl")
        (tmp_path / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {kind}\n{extra}")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["nanoinfer_ll", "nanoinfer_gen"], task_manager=TaskManager(
            include_path=str(tmp_path)), log_samples=True, model_args=(
            f"model=tiny,base_url={url}/v1/completions,tokenizer={tiny.path},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=128"))
    tok = AutoTokenizer.from_pretrained(tiny.path)
    for sample in results["samples"]["nanoinfer_ll"]:
        context, continuation = sample["doc"]["context"], sample["doc"]["continuation"]
        ctx, whole = tok(context).input_ids, tok(context + continuation).input_ids
        with torch.no_grad():
            logp = torch.log_softmax(tiny.hf(torch.tensor([whole])).logits[0], -1).numpy()
        want = sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole)))
        greedy_ref = all(logp[i - 1].argmax() == whole[i] for i in range(len(ctx), len(whole)))
        ll, is_greedy = sample["resps"][0][0]
        assert abs(ll - want) < 1e-4 and is_greedy == greedy_ref, (context, ll, want)
    for sample in results["samples"]["nanoinfer_gen"]:
        ids = tok(sample["doc"]["prompt"]).input_ids
        want = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, stop=["\n"]), use_tqdm=False)
        assert sample["resps"][0][0] == want[0].outputs[0].text
    remote = lm_eval.simple_evaluate(  # the server's own tokenizer (/tokenizer_info, /tokenize, /detokenize)
        model="local-completions", tasks=["nanoinfer_ll"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, model_args=f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=remote,"
                                     "tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=128")
    assert [s["resps"] for s in remote["samples"]["nanoinfer_ll"]] == \
        [s["resps"] for s in results["samples"]["nanoinfer_ll"]]
    wait_idle(url)
