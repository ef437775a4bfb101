"""An OpenAI-compatible HTTP server, vLLM's routes and wire format: `python serve.py --model gpt2` serves on
127.0.0.1:8000 (`--model random:gpt2` needs no network).

  POST /v1/completions        completions, whole or streamed (server-sent events); echo with prompt log-probs
  POST /v1/chat/completions   chat: the messages rendered by a chat template (--chat-template, the model's own, or
                              the plain default below), then a completion; whole or streamed
  GET  /v1/models[/{id}]      the one model served
  POST /tokenize, /detokenize vLLM's: a prompt's token ids, and back (GET /tokenizer_info: its special tokens)
  GET  /health, /metrics      200 while the engine runs; KV blocks and requests (Prometheus text)

The engine runs in a process of its own (engine_process.py), stepping while any request is unfinished; each HTTP
request sends its prompts there and reads their events from its own queue. So requests from many sockets join one
running batch, as continuous batching means to; a client that goes away aborts its requests, and their blocks are
free at once.
"""
import argparse
import asyncio
import contextlib
import hmac
import json
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections import Counter

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from engine_process import EngineProcess, sigint_ignored, start_engine
from nanoinfer import log
from sampling_params import SamplingParams, refuse_request
from sample import json_object

# OpenAI's fields, and vLLM's extra sampling fields, as SamplingParams takes them
SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
                   "frequency_penalty", "logprobs", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop_token_ids", "include_stop_str_in_output")
MAX_BODY = 16 << 20  # bytes of a request body at most (a whole context of token ids is ~10 KB)
GRACE_S = 3  # after a Ctrl-C, seconds that requests in flight may run on before they are aborted
# GPT-2 has no chat template: each message on its own lines as "role: content", then "assistant:" to answer
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(message, param=None, status=400):
    """OpenAI's error body; its type says whose fault it is: a 4xx the client's (invalid_request_error unless named
    here), a 5xx the server's."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


# -----------------------------------------------------------------------------
# requests: what a body asks for, as prompts and SamplingParams

class Asked:
    """One request's parsed body: its prompts (token id lists), SamplingParams, and how to answer."""
    def __init__(self, prompts, params, stream=False, echo=False, drop_output=False, include_usage=False, k=None):
        self.prompts, self.params, self.stream, self.echo = prompts, params, stream, echo
        self.drop_output = drop_output  # max_tokens 0 (with echo): one token runs, none is returned
        self.include_usage, self.k = include_usage, k  # stream_options.include_usage; log-probs asked for, or None


def check_common(body, model_name):
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("model", model_name) != model_name:
        raise BadRequest(f"the model `{body['model']}` does not exist; this server serves `{model_name}`", "model", 404)
    if body.get("suffix") is not None:
        raise BadRequest("`suffix` is not supported by this server (nor by vLLM)", "suffix")
    for flag in ("stream", "echo"):
        if not isinstance(body.get(flag, False), bool):
            raise BadRequest(f"`{flag}` must be true or false", flag)
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and body.get("stream")):
        raise BadRequest("`stream_options` is an object, and only with `stream`: true", "stream_options")
    return bool((options or {}).get("include_usage"))


def sampling_params(kw, body, prompts, n_ctx):
    """SamplingParams from the fields in kw, with logit_bias and best_of checked; max_tokens past the context is
    refused as vLLM refuses it, naming both lengths."""
    n = kw.get("n", 1)
    if body.get("best_of") not in (None, n):
        raise BadRequest(f"`best_of` ({body['best_of']}) must equal `n` ({n}): the best of more samples than are "
                         "returned is not supported", "best_of")
    bias = body.get("logit_bias")
    if bias:
        try:
            kw["logit_bias"] = {int(t): b for t, b in bias.items()}
        except (AttributeError, ValueError):
            raise BadRequest("`logit_bias` maps token ids (as strings) to biases in [-100, 100]", "logit_bias") from None
    longest = max(len(p) for p in prompts)
    if longest + kw["max_tokens"] > n_ctx:
        raise BadRequest(f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                         f"{longest + kw['max_tokens']} tokens ({longest} in the prompt, {kw['max_tokens']} in the "
                         "completion). Please reduce the length of the prompt or of max_tokens.", "max_tokens")
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # "SamplingParams.<field>=<value>: must be ..."
        raise BadRequest(str(e), (re.match(r"SamplingParams\.(\w+)", str(e)) or [None, None])[1]) from None


def check_prompts(engine, asked):
    """What the engine would refuse, refused here (the engine checks again): a prompt too long, too big a request."""
    for ids in asked.prompts:
        try:
            refuse_request(ids, asked.params, engine.config.n_ctx, engine.tokenizer.n_vocab, engine.kv)
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from None
    return asked


def prompt_ids(engine, prompt, field="prompt"):
    try:
        return engine.tokenizer.prompt_ids(prompt)
    except ValueError:
        raise BadRequest(f"`{field}` must be a string, a list of token ids in [0, {engine.tokenizer.n_vocab}), or a "
                         "list of those", field) from None


def parse_completion(body, model_name, engine):
    """An Asked from a completions body, or BadRequest saying what is wrong."""
    include_usage = check_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)):
        raise BadRequest("`prompt` must be a string, a list of strings, a list of token ids, or a list of those",
                         "prompt")
    prompts = [prompt_ids(engine, p) for p in prompt]
    kw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    kw.setdefault("max_tokens", 16)  # OpenAI's default
    echo, drop = body.get("echo", False), kw["max_tokens"] == 0 and body.get("echo", False)
    if drop:  # lm-eval's scoring requests: the prompt's log-probs alone; one token runs and is dropped
        kw["max_tokens"] = 1
    if echo and kw.get("logprobs") is not None:
        kw["prompt_logprobs"] = kw["logprobs"]
    params = sampling_params(kw, body, prompts, engine.config.n_ctx)
    if body.get("stream") and echo:
        raise BadRequest("`echo` is supported without `stream` only", "echo")
    return Asked(prompts, params, body.get("stream", False), echo, drop, include_usage, params.logprobs)


def message_text(content):
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest("a message's `content` is a string or a list of text parts", "messages")


def parse_chat(body, model_name, engine, template):
    """An Asked from a chat completions body: the messages rendered by the chat template into one prompt."""
    include_usage = check_common(body, model_name)
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                            for m in messages)):
        raise BadRequest("`messages` must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tools and functions are not supported by this server", "tools")
    messages = [{**m, "content": message_text(m.get("content", ""))} for m in messages]
    text = template.render(messages=messages, add_generation_prompt=body.get("add_generation_prompt", True),
                           bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    prompts = [prompt_ids(engine, text)]
    kw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None and k != "logprobs"}
    kw["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens") or \
        engine.config.n_ctx - len(prompts[0])  # vLLM's default: the rest of the context
    if body.get("logprobs"):
        kw["logprobs"] = body.get("top_logprobs") or 0
    params = sampling_params(kw, body, prompts, engine.config.n_ctx)
    return Asked(prompts, params, body.get("stream", False), include_usage=include_usage, k=params.logprobs)


def load_chat_template(path, model_dir):
    """The Jinja chat template, as transformers' apply_chat_template runs it: the file given, else the model
    directory's own (chat_template.jinja, or tokenizer_config.json's chat_template), else DEFAULT_CHAT_TEMPLATE."""
    from pathlib import Path

    from jinja2.sandbox import ImmutableSandboxedEnvironment
    source, model_dir = DEFAULT_CHAT_TEMPLATE, Path(model_dir)
    if path:
        source = Path(path).read_text()
    elif (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text()
    elif (model_dir / "tokenizer_config.json").is_file():
        source = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template") or source

    def raise_exception(message):
        raise BadRequest(f"the chat template refused the messages: {message}", "messages")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


# -----------------------------------------------------------------------------
# answers: OpenAI's shapes

def usage(outs, asked):
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if asked.drop_output else sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def completion_logprobs(tokenizer, entries, offset=0):
    """OpenAI's completions log-probs for (token id, {token id: Logprob} or None) pairs: every entry's tokens (the
    chosen one and the k most likely), text offsets counted from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in entries:
        text = lp[token].decoded_token if lp else tokenizer.decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(lp[token].logprob if lp else None)
        out["top_logprobs"].append({x.decoded_token: x.logprob for x in lp.values()} if lp else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def completion_choice(engine, asked, index, out, sample):
    text, token_ids, logprobs = sample.text, sample.token_ids, sample.logprobs
    if asked.drop_output:
        text, token_ids, logprobs = "", [], []
    entries = list(zip(token_ids, logprobs or []))
    prompt_text = engine.tokenizer.decode(out.prompt_token_ids) if asked.echo else ""
    if asked.echo and asked.k is not None:
        entries = list(zip(out.prompt_token_ids, out.prompt_logprobs)) + entries
    return {"index": index, "text": prompt_text + text, "finish_reason": sample.finish_reason,
            "logprobs": None if asked.k is None else completion_logprobs(engine.tokenizer, entries)}


def chat_logprobs(token_ids, logprobs):
    """OpenAI's chat log-probs: per token, it and its top_logprobs (the k most likely, and it)."""
    def entry(x):
        return {"token": x.decoded_token, "logprob": x.logprob, "bytes": list(x.decoded_token.encode())}
    return {"content": [{**entry(lp[t]), "top_logprobs": [entry(x) for x in sorted(lp.values(), key=lambda x: x.rank)]}
                        for t, lp in zip(token_ids, logprobs)]}


def chat_choice(engine, asked, index, out, sample):
    logprobs = None if asked.k is None else chat_logprobs(sample.token_ids, sample.logprobs)
    return {"index": index, "message": {"role": "assistant", "content": sample.text}, "logprobs": logprobs,
            "finish_reason": sample.finish_reason}


# -----------------------------------------------------------------------------
# the app

class RequireKey:
    """--api-key: every /v1 route answers 401 without `Authorization: Bearer <key>`, compared in constant time. A plain
    ASGI middleware: Starlette's BaseHTTPMiddleware would hide a client's disconnect from the routes."""
    def __init__(self, app, key):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and \
                not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.key):
            response = error_response("a valid API key is needed: the header `Authorization: Bearer <key>`",
                                      status=401)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def make_app(engine, model_name, chat_template=None, api_key=None):
    """The routes, over an EngineProcess (which has the tokenizer and config the requests are read with)."""
    app, created = FastAPI(title="nanoinfer"), int(time.time())
    template = load_chat_template(chat_template, engine.model_dir)

    @app.exception_handler(HTTPException)  # 404s and 405s in OpenAI's error shape, as every other error
    async def http_error(request, e):
        return error_response(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return error_response(str(e))

    if api_key:
        app.add_middleware(RequireKey, key=f"Bearer {api_key}".encode())

    @app.get("/health")
    async def health():
        return Response(status_code=503 if engine.dead else 200)

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "nanoinfer",
                  "max_model_len": engine.config.n_ctx}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error_response(f"the model `{model_id}` does not exist; this server serves `{model_name}`",
                                  "model", 404)
        return model_card

    @app.get("/metrics")
    async def metrics():
        s = engine.stats  # as of the engine's last step
        finished = sorted(s["finished"].items())
        return PlainTextResponse(f"nanoinfer_kv_blocks_free {s['free']}\n"
                                 f"nanoinfer_kv_blocks_total {s['total']}\n"
                                 f"nanoinfer_requests_running {s['running']}\n"
                                 f"nanoinfer_requests_waiting {s['waiting']}\n"
                                 f"nanoinfer_prefix_cache_queries_total {s['prefix_queries']}\n"
                                 f"nanoinfer_prefix_cache_hits_total {s['prefix_hits']}\n"
                                 f"nanoinfer_spec_decode_num_draft_tokens_total {s['drafted']}\n"
                                 f"nanoinfer_spec_decode_num_accepted_tokens_total {s['accepted']}\n"
                                 f"nanoinfer_spec_decode_acceptance_rate {s['accepted'] / max(s['drafted'], 1)}\n" +
                                 "".join(f'nanoinfer_samples_finished{{reason="{reason}"}} {n}\n'
                                         for reason, n in finished))

    async def body_of(request):
        body = b""
        async for chunk in request.stream():  # read no more than MAX_BODY of it
            body += chunk
            if len(body) > MAX_BODY:
                raise BadRequest(f"the request body is larger than {MAX_BODY >> 20} MiB", status=413)
        try:
            return json.loads(body)
        except ValueError:
            raise BadRequest("the request body is not valid JSON") from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await body_of(request)
            check_common(body, model_name)
            ids = prompt_ids(engine, body.get("prompt"))
        except BadRequest as e:
            return error_response(str(e), e.param, e.status)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.config.n_ctx}

    @app.get("/tokenizer_info")
    async def tokenizer_info():  # vLLM's: what a remote tokenizer (lm-eval's) needs to know
        eot = engine.tokenizer.decode([engine.tokenizer.eot_token])
        return {"tokenizer_class": "GPT2Tokenizer", "eos_token": eot, "bos_token": eot, "pad_token": None,
                "model_max_length": engine.config.n_ctx, "vocab_size": engine.tokenizer.n_vocab}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await body_of(request)
            check_common(body, model_name)
            ids = prompt_ids(engine, body.get("tokens"), "tokens")
        except BadRequest as e:
            return error_response(str(e), e.param, e.status)
        return {"prompt": engine.tokenizer.decode(ids)}

    async def serve(request, parse, kind, choice):
        try:
            asked = check_prompts(engine, parse(await body_of(request)))
            queue = asyncio.Queue()
            ids = engine.add(asked.prompts, asked.params, queue, asyncio.get_running_loop())
        except BadRequest as e:
            return error_response(str(e), e.param, e.status)
        except ConnectionError as e:  # the engine process is gone
            return error_response(str(e), status=503)
        head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if kind == "chat" else "text_completion", "created": int(time.time()),
                "model": model_name}
        if asked.stream:
            return StreamingResponse(stream_events(engine, ids, queue, asked, head, kind),
                                     media_type="text/event-stream")
        outs = await whole_outputs(engine, request, ids, queue)
        if isinstance(outs, Response):
            return outs
        choices = [choice(engine, asked, p * asked.params.n + c.index, out, c) for p, out in enumerate(outs)
                   for c in out.outputs]
        return {**head, "choices": choices, "usage": usage(outs, asked)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, lambda body: parse_completion(body, model_name, engine), "text", completion_choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, lambda body: parse_chat(body, model_name, engine, template), "chat", chat_choice)

    return app


async def next_events(queue):
    """Every event queued by now, at least one: a graph run brings up to 16 tokens of each sequence at once, and
    one write for them all costs the event loop far less than a write each."""
    events = [await queue.get()]
    while not queue.empty():
        events.append(queue.get_nowait())
    for event in events:
        if isinstance(event, Exception):
            raise event
    return events


async def stream_events(engine, ids, queue, asked, head, kind):
    """Server-sent events: a chunk per new text of a choice (prompt index * n + sample index), a last one per choice
    with its finish_reason, a usage chunk if asked, then [DONE]. A client gone (the response closed) aborts the
    requests still running."""
    chat, n = kind == "chat", asked.params.n
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    offsets = Counter()  # characters of each choice's text streamed so far: its log-probs' text offsets

    def chunk(index, text, reason, role=False):
        logprobs = None
        if asked.k is not None and getattr(text, "token_ids", None):  # a TextDelta's tokens and their log-probs
            entries = list(zip(text.token_ids, text.logprobs))
            logprobs = chat_logprobs(*zip(*entries)) if chat else \
                completion_logprobs(engine.tokenizer, entries, offsets[index])
        offsets[index] += len(text)
        if chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text or not reason else {}
            body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return "data: " + json.dumps({**head, "choices": [body]}) + "\n\n"
    try:
        remaining, outs = len(ids), []
        if chat:  # OpenAI's first chunk of each choice names the role
            yield "".join(chunk(i, "", None, role=True) for i in range(len(ids) * n))
        while remaining:
            text = []
            for i, sample, delta, out in await next_events(queue):
                if delta or getattr(delta, "token_ids", None) and asked.k is not None:
                    text.append(chunk(i * n + sample, delta, None))
                if out is not None:
                    remaining -= 1
                    outs.append(out)
                    if out.error:
                        text.append("data: " + json.dumps({"error": {"message": out.error, "type": "server_error"}})
                                    + "\n\n")
                    text += [chunk(i * n + c.index, "", c.finish_reason) for c in out.outputs]
            if text:
                yield "".join(text)
        if asked.include_usage:
            yield "data: " + json.dumps({**head, "choices": [], "usage": usage(outs, asked)}) + "\n\n"
    except ConnectionError as e:  # the engine process is gone: say so, and end the stream as usual
        yield "data: " + json.dumps({"error": {"message": str(e), "type": "server_error", "code": 503}}) + "\n\n"
    finally:
        engine.abort(ids)
    yield "data: [DONE]\n\n"


async def whole_outputs(engine, request, ids, queue):
    """Each prompt's RequestOutput once finished, in order; or the error Response. The requests are aborted if the
    client goes away first."""
    outs, checked = {}, time.monotonic()
    try:
        while len(outs) < len(ids):
            try:
                outs.update((i, out) for i, _, _, out in await asyncio.wait_for(next_events(queue), timeout=0.25)
                            if out is not None)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - checked > 0.25:  # events may come all the time: look at the socket every 0.25 s
                if await request.is_disconnected():
                    return Response(status_code=499)  # nginx's "client closed request"; no one reads it
                checked = time.monotonic()
    except ConnectionError as e:
        return error_response(str(e), status=503)
    except Exception as e:  # never a bare 500 page: OpenAI's error body, whatever broke
        return error_response(f"the server failed: {type(e).__name__}: {e}", status=500)
    finally:
        engine.abort(ids)
    outs = [outs[i] for i in range(len(ids))]
    failed = next((o.error for o in outs if o.error), None)
    return error_response(failed, status=500) if failed else outs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, -large, -xl, distilgpt2, a directory, or "
                    "random:gpt2 (random weights at a GPT-2 size: no network, the text is noise); default: gpt2")
    ap.add_argument("--served-model-name", help="the name clients ask for; default: the --model given")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface); "
                    "default: 127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="the port to listen on; default: 8000")
    ap.add_argument("--api-key", help="if given, every /v1 route wants the header `Authorization: Bearer <key>`")
    ap.add_argument("--chat-template", help="a Jinja chat template file for /v1/chat/completions; default: the "
                    "model directory's own, else plain 'role: content' lines")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: the GPU if CuPy sees a Hopper GPU, else the CPU")
    ap.add_argument("--dtype", choices=["float16", "float32"], help="default: float16 on the GPU, float32 on the CPU")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sequences in the running batch at most; "
                    "default: 256")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="the fraction of the GPU's memory the "
                    "engine may fill, the KV cache taking what the weights leave; default: 0.9")
    ap.add_argument("--quantization", choices=["int8"], help="weight-only int8 (W8A16): one scale per output channel, quantized at load")
    ap.add_argument("--speculative-config", type=json_object, help='speculative decoding, as JSON: {"method": '
                    '"ngram", "num_speculative_tokens": 3} (prompt_lookup_max, prompt_lookup_min too), or a draft '
                    'model: {"model": "gpt2", "num_speculative_tokens": 3}')
    ap.add_argument("--api-server-count", type=int, default=1, help="HTTP server processes, each with its own "
                    "event loop, on one socket and one engine (a server's JSON and events take a core at high load); "
                    "default: 1")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the KV of prompts' shared first blocks across requests; default: on")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each layer is split over (Megatron's "
                    "split); default: 1")
    ap.add_argument("--distributed-executor-backend", choices=["mp", "uni"], help="mp: a process a rank (GPUs' "
                    "default); uni: ranks as threads of the engine process (the CPU's)")
    args = ap.parse_args()
    if args.api_server_count < 1:
        ap.error(f"--api-server-count {args.api_server_count}: must be at least 1")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # bound before the model loads: a port in use fails at once, with what to do
        sock.bind((args.host, args.port))
    except OSError as e:
        ap.exit(1, f"serve.py: cannot listen on {args.host}:{args.port} ({e.strerror}): pick another --port, or stop "
                   "what holds it\n")
    engine_args = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
                       speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                       distributed_executor_backend=args.distributed_executor_backend)
    process, conns = start_engine(engine_args, args.api_server_count)
    try:
        engine = EngineProcess(conns[0], process)
    except RuntimeError as e:
        ap.exit(1, f"serve.py: the engine did not start: {e}\n")
    # the other HTTP servers (--api-server-count): processes of their own, accepting on the same socket
    others = [multiprocessing.get_context("spawn").Process(target=api_server, args=(conn, sock, args), name="api")
              for conn in conns[1:]]
    return serve_all(engine, others, conns[1:], sock, args)


def serve_all(engine, others, their_conns, sock, args):
    """Serve, in this process and the others, until a signal (HttpServer); then stop them all and the engine. The
    exit status: 130 after a Ctrl-C, else 0."""
    with sigint_ignored():  # until their uvicorn takes it: this server passes a Ctrl-C on (interrupted)
        for p in others:
            p.start()
    for conn in their_conns:  # theirs alone now: one that dies unannounced (SIGTERM while importing) reads as gone
        conn.close()  # to the engine, which would otherwise wait for it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # until uvicorn is up: nothing in flight to finish

    def interrupted():  # the first Ctrl-C: one line, and the other servers stop as this one does (from a terminal
        # they have it already: a second changes nothing for them)
        log(f"interrupted: no new requests; those in flight have {GRACE_S} s to finish, then are aborted "
            "(Ctrl-C again: quit now)")
        for p in others:
            os.kill(p.pid, signal.SIGINT)

    def quit_now(*_):  # a second Ctrl-C: no one waits (the engine's tensor-parallel ranks end with it)
        for p in others:
            p.kill()
        engine.process.terminate()  # it exits at its next bytecode (engine_main), which is soon unless it hangs
        engine.process.join(timeout=1)
        engine.process.kill()
        os._exit(130)

    log(f"serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1" +
        (f" ({len(others) + 1} HTTP server processes)" if others else ""))
    try:
        stopped_by_ctrl_c = serve_http(engine, sock, args, interrupted, quit_now)
        signal.signal(signal.SIGINT, quit_now)  # what is left is stopping: a Ctrl-C now need not wait for it
    finally:
        for p in others:  # SIGTERM: each finishes its requests as this one did
            p.terminate()
        for p in others:
            p.join(timeout=35)
        engine.stop()  # the engine process ends once every server has stopped
    return 130 if stopped_by_ctrl_c else 0


class HttpServer(uvicorn.Server):
    """uvicorn's server, stopped by a signal as serve.py promises. SIGTERM: uvicorn's graceful shutdown (no new
    connections; requests in flight finish, 30 s at most). SIGINT (Ctrl-C): the same, but the requests still in flight
    after GRACE_S are aborted, each ending as usual (finish_reason "abort"), and on_interrupt is called; a second
    SIGINT calls quit_now (None: it changes nothing)."""
    def __init__(self, config, engine, on_interrupt=None, quit_now=None):
        super().__init__(config)
        self.engine, self.on_interrupt, self.quit_now, self.interrupted = engine, on_interrupt, quit_now, False

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own also raises each signal again once the server is down, for the handler it replaced: for a
        # SIGINT, asyncio.run's, whose KeyboardInterrupt ends in two tracebacks. Here the caller exits by itself.
        self.loop = asyncio.get_running_loop()
        before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame):
        self.should_exit = True  # uvicorn's main loop sees it within 0.1 s and shuts down
        if sig == signal.SIGINT and self.interrupted and self.quit_now:
            self.quit_now()
        elif sig == signal.SIGINT and not self.interrupted:
            self.interrupted = True
            # a signal handler runs between two bytecodes of the loop's thread: the loop's own call sets the timer
            self.loop.call_soon_threadsafe(self.loop.call_later, GRACE_S, self.engine.abort_all)
            if self.on_interrupt:
                self.on_interrupt()


def serve_http(engine, sock, args, on_interrupt=None, quit_now=None):
    """One HTTP server process: uvicorn on the socket, its routes over its pipe to the engine. Whether a Ctrl-C
    stopped it."""
    app = make_app(engine, args.served_model_name or args.model, args.chat_template, args.api_key)
    server = HttpServer(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=30), engine, on_interrupt,
                        quit_now)
    server.run(sockets=[sock])
    return server.interrupted


def api_server(conn, sock, args):
    """An HTTP server process past the first (spawned): its own event loop and GIL, the engine's other pipe."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine = EngineProcess(conn)
    try:
        serve_http(engine, sock, args)
    finally:
        engine.stop()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # while the model loads: nothing is in flight yet
        log("interrupted before the server was up")
        sys.exit(130)
