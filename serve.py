"""An OpenAI-compatible HTTP server: `python serve.py --model gpt2` serves, on 127.0.0.1:8000,
  POST /v1/completions   OpenAI's completions, whole or streamed as server-sent events (vLLM's wire format)
  GET  /v1/models        the one model served
  GET  /health           200 while the engine runs
  GET  /metrics          KV blocks free and in all, requests running and waiting (Prometheus text)

One thread owns the engine and steps it while any request is unfinished; each HTTP request adds its prompts with
add_request and reads their events from its own queue. So requests from many sockets join one running batch, as
continuous batching means to; a client that goes away aborts its requests, and their blocks are free at once.
"""
import argparse
import asyncio
import json
import re
import threading
import time
import uuid
from collections import Counter

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from nanoinfer import LLM, SamplingParams, log

# OpenAI's fields, and vLLM's extra sampling fields, as SamplingParams takes them
SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
                   "frequency_penalty", "logprobs", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop_token_ids", "include_stop_str_in_output")
UNSUPPORTED = {"echo": False, "suffix": None, "best_of": None, "logit_bias": None}  # allowed only with these values


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


class EngineLoop:
    """The LLM, stepped by one thread. add() queues the prompts of one HTTP request, each with an Outbox: the engine
    delivers their events to one asyncio queue, as (prompt index, sample index, new text, RequestOutput once done).
    The event loop never waits for the engine (a step holds it for a whole graph run): add() runs in a worker thread,
    and abort() leaves its ids for the engine thread, which aborts them before its next step."""
    def __init__(self, llm):
        self.llm, self.wake, self.lock = llm, threading.Event(), threading.Lock()
        self.live, self.finished = set(), Counter()  # outboxes of unfinished requests; samples done, by finish_reason
        self.to_abort = []  # request ids the event loop gave up on
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    async def add(self, prompts, params):
        """(request ids, queue); a prompt the engine refuses raises ValueError, and those before it are aborted."""
        return await asyncio.to_thread(self._add, prompts, params, asyncio.Queue(), asyncio.get_running_loop())

    def _add(self, prompts, params, queue, loop):
        ids = []
        try:
            for i, prompt in enumerate(prompts):
                outbox = Outbox(self, queue, i, loop)
                outbox.request_id = self.llm.add_request(prompt, params, outbox)
                ids.append(outbox.request_id)
        except ValueError:
            with self.lock:
                self.live.discard(outbox)  # the refused prompt's: it has no request
            self.abort(ids)
            raise
        self.wake.set()
        return ids, queue

    def abort(self, request_ids):
        with self.lock:
            self.to_abort += request_ids  # ids already finished are ignored
        self.wake.set()

    def _run(self):
        while True:
            with self.lock:
                aborts, self.to_abort = self.to_abort, []
            try:
                self.llm.abort_request(aborts)
                if not self.llm.has_unfinished():
                    self.wake.wait()
                    self.wake.clear()
                    continue
                self.llm.step()  # the events go to the requests' outboxes
            except Exception as e:  # an error no request can be blamed for (scheduling): every request ends with it
                log(f"an engine step failed: {type(e).__name__}: {e}; every request in it ends")
                with self.lock:
                    failing, self.live = self.live, set()
                for outbox in failing:
                    outbox.put(e)
                self.llm.abort_request([o.request_id for o in failing if o.request_id is not None])


class Outbox:
    """Where the engine puts one prompt's events (LLM.add_request's outbox), from its thread into the HTTP request's
    asyncio queue, with the prompt's index."""
    def __init__(self, engine, queue, index, loop):
        self.engine, self.queue, self.index, self.request_id, self.loop = engine, queue, index, None, loop
        with engine.lock:
            engine.live.add(self)

    def put(self, item):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def append(self, event):
        _, sample, delta, out = event
        self.put((self.index, sample, delta, out))
        if out is not None:
            with self.engine.lock:
                self.engine.live.discard(self)
                self.engine.finished.update(c.finish_reason for c in out.outputs)


def error_response(message, param=None, status=400):
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def parse_completion(body, model_name):
    """(prompts, SamplingParams, stream) from a completions request body, or BadRequest saying what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("model", model_name) != model_name:
        raise BadRequest(f"the model `{body['model']}` does not exist; this server serves `{model_name}`", "model", 404)
    for field, allowed in UNSUPPORTED.items():
        if body.get(field, allowed) not in (allowed, None):
            raise BadRequest(f"`{field}` is not supported by this server", field)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("`prompt` must be a string, a list of strings, a list of token ids, or a list of those",
                         "prompt")
    kw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    kw.setdefault("max_tokens", 16)  # OpenAI's default
    try:
        params = SamplingParams(**kw)
    except ValueError as e:  # "SamplingParams.<field>=<value>: must be ..."
        raise BadRequest(str(e), (re.match(r"SamplingParams\.(\w+)", str(e)) or [None, None])[1]) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false", "stream")
    if stream and params.logprobs is not None:
        raise BadRequest("`logprobs` is supported without `stream` only, for now", "logprobs")
    return prompts, params, stream


def openai_logprobs(sample, k):
    """A CompletionOutput's logprobs in OpenAI's completions shape."""
    tokens, offsets, offset = [], [], 0
    for lp, token in zip(sample.logprobs, sample.token_ids):
        tokens.append(lp[token].decoded_token)
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)],
            "top_logprobs": [{x.decoded_token: x.logprob for x in lp.values() if x.rank <= k}
                             for lp in sample.logprobs],
            "text_offset": offsets}


def make_app(llm, model_name):
    app, engine, created = FastAPI(title="nanoinfer"), EngineLoop(llm), int(time.time())

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "nanoinfer", "max_model_len": llm.config.n_ctx}]}

    @app.get("/metrics")
    async def metrics():
        kv, s = llm.kv, llm.scheduler
        with engine.lock:  # the engine thread counts under it
            finished = sorted(engine.finished.items())
        return PlainTextResponse(f"nanoinfer_kv_blocks_free {kv.num_free_blocks()}\n"
                                 f"nanoinfer_kv_blocks_total {kv.num_blocks}\n"
                                 f"nanoinfer_requests_running {len(s.running)}\n"
                                 f"nanoinfer_requests_waiting {len(s.waiting)}\n" +
                                 "".join(f'nanoinfer_samples_finished{{reason="{reason}"}} {n}\n'
                                         for reason, n in finished))

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error_response("the request body is not valid JSON")
        try:
            prompts, params, stream = parse_completion(body, model_name)
            ids, queue = await engine.add(prompts, params)
        except BadRequest as e:
            return error_response(str(e), e.param, e.status)
        except ValueError as e:  # a prompt the engine refuses: too long, too big for the KV cache
            return error_response(str(e), "prompt")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if stream:
            return StreamingResponse(stream_events(engine, ids, queue, params.n, head),
                                     media_type="text/event-stream")
        return await whole_response(engine, request, ids, queue, params, head)

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


async def stream_events(engine, ids, queue, n, head):
    """Server-sent events: a chunk per new text of a choice (prompt index * n + sample index), a last one per choice
    with its finish_reason, then [DONE]. A client gone (the response closed) aborts the requests still running."""
    chunk = lambda index, text, reason: "data: " + json.dumps({**head, "choices": [
        {"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}) + "\n\n"
    try:
        remaining = len(ids)
        while remaining:
            text = []
            for i, sample, delta, out in await next_events(queue):
                if delta:
                    text.append(chunk(i * n + sample, delta, None))
                if out is not None:
                    remaining -= 1
                    if out.error:
                        text.append("data: " + json.dumps({"error": {"message": out.error, "type": "server_error"}})
                                    + "\n\n")
                    text += [chunk(i * n + c.index, "", c.finish_reason) for c in out.outputs]
            if text:
                yield "".join(text)
        yield "data: [DONE]\n\n"
    finally:
        engine.abort(ids)


async def whole_response(engine, request, ids, queue, params, head):
    """Every choice once finished, with usage; the requests are aborted if the client goes away first."""
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
    except Exception as e:
        return error_response(f"the engine failed: {type(e).__name__}: {e}", status=500)
    finally:
        engine.abort(ids)
    outs = [outs[i] for i in range(len(ids))]
    failed = next((o.error for o in outs if o.error), None)
    if failed:
        return error_response(failed, status=500)
    choices = [{"index": p * params.n + c.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": None if params.logprobs is None else openai_logprobs(c, params.logprobs)}
               for p, out in enumerate(outs) for c in out.outputs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return {**head, "choices": choices, "usage": usage}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, -large, -xl, distilgpt2, or a directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float16", "float32"], help="default: fp16 on GPU, fp32 on CPU")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sequences in the running batch at most")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization)
    log(f"serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1")
    uvicorn.run(make_app(llm, args.served_model_name or args.model), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
