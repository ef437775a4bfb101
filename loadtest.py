"""The server under load (bench.py's server lines): serve.py in a process of its own, as deployed, and streaming
clients from processes of 32 (one Python process's event loop cannot keep up with more), each sending requests one
after another: requests/s, time to first token and per output token (p50, p99), output tokens/s beside offline.

    python loadtest.py --model random:gpt2 --clients 256 --offline 100000 [--api-server-count 2]
"""
import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def stream_clients(url, clients, seed, prompt_len, max_tokens, rounds, go, results):
    """`clients` clients streaming completions at once (asyncio, httpx), each `rounds` requests one after another,
    sent when `go` is set: into `results`, each request's (time to first token, time per output token after it: from
    its first text event to its last over its tokens but one, vLLM's TPOT). Greedy, ignoring EOS: every request gets
    max_tokens."""
    import asyncio
    import httpx
    rng, times = np.random.default_rng(seed), []

    async def client(http):
        for _ in range(rounds):
            body = {"prompt": rng.integers(0, 50000, prompt_len).tolist(), "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            t0, seen = time.perf_counter(), []  # when each text event came
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text": ""' not in line:
                        seen.append(time.perf_counter())
            times.append((seen[0] - t0, (seen[-1] - seen[0]) / max(1, max_tokens - 1)))

    async def load():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
            await asyncio.to_thread(go.wait)
            await asyncio.gather(*(client(http) for _ in range(clients)))
    asyncio.run(load())
    results.put(times)


def server_load(path, offline, clients=64, prompt_len=64, max_tokens=128, rounds=4, script="serve.py", **engine_args):
    """`serve.py` in a process of its own, as deployed (its engine in another), and `clients` streaming clients at once
    from processes of 32 (one Python process's event loop and HTTP client cannot keep up with more), each sending
    `rounds` requests one after another (a steady load, not one burst): requests/s, time to first token and per
    output token (p50, p99), and output tokens/s beside the offline number."""
    import httpx
    import multiprocessing
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name(script)), "--model", str(path),
                               "--port", str(port), *args])
    url, ctx = f"http://127.0.0.1:{port}", multiprocessing.get_context("spawn")
    try:
        while True:
            if server.poll() is not None:
                sys.exit(f"loadtest.py: {script} exited ({server.returncode}) before serving")
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:  # not listening yet
                time.sleep(0.2)
        times = []
        for n, r in ((8, 1), (clients, rounds)):  # a warm-up (the first graphs, the first sockets), then the load
            go, results, per = ctx.Event(), ctx.Queue(), min(n, 32)
            procs = [ctx.Process(target=stream_clients, args=(url, per, i, prompt_len, max_tokens, r, go, results))
                     for i in range(n // per)]
            for p in procs:
                p.start()
            time.sleep(3)  # each process imports and makes its client before the start
            t0 = time.perf_counter()
            go.set()
            times = sum((results.get() for _ in procs), [])
            dt = time.perf_counter() - t0
            for p in procs:
                p.join()
    finally:
        server.terminate()
        server.wait()
    (t50, t99), (p50, p99) = (np.percentile([t[j] for t in times], [50, 99]) * 1e3 for j in (0, 1))
    done = len(times)  # requests
    return (f"{done / dt:.1f} requests/s, first token p50 {t50:.0f} ms, p99 {t99:.0f} ms, time per output token "
            f"p50 {p50:.2f} ms, p99 {p99:.2f} ms; {done * max_tokens / dt:,.0f} output tokens/s, "
            f"{done * max_tokens / dt / offline:.0%} of offline ({offline:,.0f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--offline", type=float, default=0, help="the engine's offline tok/s, to print the share of")
    ap.add_argument("--api-server-count", type=int, default=1)
    args = ap.parse_args()
    print(server_load(args.model, args.offline or float("nan"), args.clients, api_server_count=args.api_server_count))
