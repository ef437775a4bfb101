"""Measurements, every speed beside a ceiling or a reference measured in the same run. GPU: the ceilings, the matmul
plans, a roofline of every kernel of a step, the kernel targets, one number per lesson, and end-to-end workloads
beside a PyTorch decode step in a CUDA graph. CPU: the numpy engine against transformers' generate.

    python bench.py [--device auto|cpu|cuda] [--repeats 3] [--json out.json] [--plot roofline.png]  |  --plans
Each stage says what it measures as it starts; each end-to-end number is the median of --repeats runs, its range
beside it. --plans prints the matmul plans for an H200 and needs no GPU; --plot needs requirements-bench.txt.
"""
import argparse
import gc
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from checkpoint import SIZES, resolve_model
from nanoinfer import LLM, Batch, SamplingParams
from loadtest import server_load
from paged_kv import PagedKVCache
from sampling_params import log_softmax
from roofline import Roofline, bench_kernels, print_matmul_plans

# end to end, beside anchors measured in the same run
def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def sampled(n):  # the sampling users run: HF's top-k 50 with top-p 0.95 (sample.py's default top-p)
    return SamplingParams(max_tokens=n, temperature=0.8, top_k=50, top_p=0.95, ignore_eos=True)


def time_generate(llm, prompts, max_tokens, params=greedy):
    """(output tokens/s, seconds) of one generate() over these prompts, after a short warm-up."""
    llm.generate(prompts, params(4), use_tqdm=False)
    t0 = time.perf_counter()
    each = [params(n) for n in max_tokens] if isinstance(max_tokens, list) else params(max_tokens)
    outs = llm.generate(prompts, each, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, dt


def repeated(llm, prompts, max_tokens, repeats):
    """An end-to-end row's number: time_generate `repeats` times; (median, min, max) tokens/s."""
    runs = [time_generate(llm, prompts, max_tokens)[0] for _ in range(repeats)]
    return float(np.median(runs)), min(runs), max(runs)


def spread(runs):
    """A number that swings between runs: the median of the repeats, their range beside it."""
    return f"{np.median(runs):,.1f}" + (f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else "")


def a_against_b(run_a, run_b, workloads, repeats):
    """Two ways of the same work, run_x(prompts, max_tokens) -> tokens/s, alternating (each first in every other
    round) so that drifts and warm caches hit both, on each (label, prompts, max_tokens) of workloads: medians and
    their ratio."""
    results = []
    for label, prompts, max_tokens in workloads:
        runs = ([], [])
        for i in range(repeats):
            pairs = list(zip(runs, (run_a, run_b)))
            for times, run in pairs[::-1] if i % 2 else pairs:
                times.append(run(prompts, max_tokens))
        a, b = map(np.median, runs)
        results.append(f"{label} {spread(runs[0])} against {spread(runs[1])} ({a / b:.1%})")
    return "; ".join(results)


def engines_against(llm_a, llm_b, workloads, repeats):
    """a_against_b for two engines, each run timed by time_generate."""
    runs = (lambda p, n, llm=llm: time_generate(llm, p, n)[0] for llm in (llm_a, llm_b))
    return a_against_b(*runs, workloads, repeats)


def batch_invariance_cost(path, device, workloads, repeats, **engine):
    """batch_invariant on against off, one engine each: outputs bitwise the same in any batch, at this price."""
    return engines_against(*(LLM(str(path), device=device, batch_invariant=on, **engine) for on in (True, False)),
                           workloads, repeats)


def prefix_caching_lesson(path, device, repeats, **engine):
    """enable_prefix_caching on against off, one engine each, alternating, fresh tokens every run (so that only what
    the run itself shares is found): time to first token of a 1000-token prompt whose first 900 tokens an earlier
    request left cached; offline tok/s of 256 requests sharing a 512-token prefix, and the prompt tokens the cache
    served; and of 256 sharing nothing (the cache's cost)."""
    rng = np.random.default_rng(7)
    fresh = lambda n: rng.integers(0, 50000, n).tolist()
    llms = {on: LLM(str(path), device=device, enable_prefix_caching=on, **engine) for on in (True, False)}
    runs, served = {(on, what): [] for on in (True, False) for what in ("ttft", "shared", "alone")}, 0

    def rate(llm, prompts):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy(128), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    for _ in range(repeats):
        for on, llm in llms.items():
            prefix = fresh(900)
            llm.generate([prefix + fresh(50)], greedy(1), use_tqdm=False)  # leaves the prefix cached
            t0 = time.perf_counter()
            for _ in llm.stream([prefix + fresh(100)], greedy(1)):
                runs[on, "ttft"].append((time.perf_counter() - t0) * 1e3)
                break
            hits, shared = llm.kv.hits, fresh(512)
            runs[on, "shared"].append(rate(llm, [shared + fresh(64) for _ in range(256)]))
            served = llm.kv.hits - hits if on else served  # (the last run's)
            runs[on, "alone"].append(rate(llm, [fresh(576) for _ in range(256)]))
    m = {key: float(np.median(v)) for key, v in runs.items()}
    return (f"time to first token, 1000 tokens with 900 cached: {m[True, 'ttft']:.1f} ms against "
            f"{m[False, 'ttft']:.1f} off; 256 requests sharing 512 tokens: {m[True, 'shared']:,.0f} tok/s against "
            f"{m[False, 'shared']:,.0f} ({m[True, 'shared'] / m[False, 'shared']:.0%}), {served:,} prompt tokens "
            f"({served // llms[True].kv.block_size:,} blocks) from the cache; sharing nothing: "
            f"{m[True, 'alone']:,.0f} against {m[False, 'alone']:,.0f} ({m[True, 'alone'] / m[False, 'alone']:.1%})")


def speculation_lesson(points, repeats, **engine):
    """Speculative decoding against plain decoding (a_against_b), greedy, for each (label, model, speculative_config,
    prompts, max_tokens, num_kv_tokens): tok/s, the acceptance rate a (draft tokens kept / verified), tokens a target
    step makes (a sequence's step makes 1 + the drafts it keeps), and what k drafts kept each with probability a would
    make, (1 - a^(k+1)) / (1 - a)."""
    out = []
    for label, model, spec, prompts, max_tokens, kv_tokens in points:
        llms = [LLM(model, speculative_config=s, num_kv_tokens=kv_tokens, **engine) for s in (spec, None)]
        timing = engines_against(*llms, [(label, prompts, max_tokens)], repeats)
        s = llms[0].proposer
        tokens = repeats * len(prompts) * (4 + max_tokens)  # each sequence's, time_generate's 4 to warm up included
        a, k, made = s.accepted / max(s.proposed, 1), spec["num_speculative_tokens"], tokens / (tokens - s.accepted)
        out.append(f"{timing} tok/s, acceptance {a:.0%}, {made:.2f} tokens a target step (k = {k} kept at {a:.0%}: "
                   f"{(1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1:.2f})")
        del llms
        gc.collect()
    return "; ".join(out)


def weight_bytes(model):
    """Bytes of weights a decode step reads: each matmul's and the lm_head's once (int8: with a scale a row); of the
    embeddings only a row each."""
    ws = {**model.w, "lm_head.weight": model.lm_head}
    return sum(sum(a.nbytes for a in w) if isinstance(w, tuple) else w.nbytes
               for name, w in ws.items() if name not in ("wte.weight", "wpe.weight"))


def quantization_lesson(size, model, copy_gbs, workloads, repeats, **engine):
    """quantization='int8' (W8A16) against fp16, an engine each, alternating (a_against_b): tok/s, beside the bytes of
    weights a decode step reads and the tok/s they allow at the copy ceiling; and what int8 costs against fp16 along
    fp16's greedy continuation of the first workload's prompt: greedy tokens that agree, the largest logit error (of
    max|logit|) and the mean KL divergence of the next-token distributions (teacher-forced)."""
    llms = {q: LLM(str(model), quantization=q, **engine) for q in ("int8", None)}
    timing = engines_against(*llms.values(), workloads, repeats)
    prompt = workloads[0][1][:1]
    outs = {q: llm.generate(prompt, greedy(128), use_tqdm=False)[0] for q, llm in llms.items()}
    ids = outs[None].prompt_token_ids + outs[None].outputs[0].token_ids
    n, i32 = len(ids), lambda a: np.asarray(a, np.int32)
    batch = Batch(i32(ids), i32(range(n)), i32(range(n)), i32([0, n]), i32([n]), i32([range(-(-n // 16))]),
                  i32(range(n)))  # the prompt and its continuation, in the first free slots of each engine's pool
    lp = {q: log_softmax(llm.backend.tohost(llm.model.forward(batch, llm.kv))) for q, llm in llms.items()}
    kl = float((np.exp(lp[None]) * (lp[None] - lp["int8"])).sum(-1).mean())
    err = np.abs(lp["int8"] - lp[None]).max() / np.abs(lp[None]).max()
    agree = np.mean([a == b for a, b in zip(*(o.outputs[0].token_ids for o in outs.values()))])
    step = {q: weight_bytes(llm.model) for q, llm in llms.items()}
    return (f"{size}: {timing} tok/s (int8 against fp16); a step reads {step['int8'] / 1e6:,.0f} MB of weights against "
            f"{step[None] / 1e6:,.0f} (floors at the copy ceiling {copy_gbs * 1e9 / step['int8']:,.0f} and "
            f"{copy_gbs * 1e9 / step[None]:,.0f} tok/s); against fp16: greedy tokens agree {agree:.0%}, largest "
            f"log-prob error {err:.3f} of max, mean KL {kl:.2e}")


def tensor_parallel_lesson(models, workloads, repeats, **engine):
    """tensor_parallel_size=2 against 1, an engine each, alternating (a_against_b), on each model: gpt2-xl, whose
    halved weight reads should beat two all-reduces a layer, and gpt2, where they cannot."""
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 2:
        return "needs 2 GPUs: not run"
    results = []
    for model in models:  # (on GPUs, a process a rank: "mp", the default)
        llms = [LLM(model, tensor_parallel_size=tp, **engine) for tp in (2, 1)]
        results.append(f"{model}: " + engines_against(*llms, workloads, repeats))
        del llms
        gc.collect()
    return "; ".join(results) + " (tok/s, TP 2 against TP 1)"


def stage(what):
    print(f"bench: {what}", flush=True)


def time_transformers(path, prompts, max_tokens, device):
    """The same greedy workload through transformers' generate (tokens/s), or None without torch."""
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None
    cuda = device == "cuda"
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float16 if cuda else torch.float32).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        if cuda:
            torch.cuda.synchronize()
        return len(prompts) * max_tokens / (time.perf_counter() - t0)


def torch_graph_decode(size, batch, context, steps=200):
    """The anchor: ms per step (all `batch` advance a token) of a plain PyTorch GPT-2 decode step in a CUDA graph."""
    import torch
    import torch.nn.functional as F
    L, H, C = SIZES[size]
    D, V, N_CTX, f16 = C // H, 50257, 1024, dict(device="cuda", dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    wte, wpe = (0.02 * torch.randn(n, C, generator=gen, **f16) for n in (V, N_CTX))
    shapes = ((3 * C, C), (3 * C,), (C, C), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,))  # qkv, proj, fc, proj
    layers = [[0.02 * torch.randn(*shape, generator=gen, **f16) for shape in shapes] for _ in range(L)]
    k_cache, v_cache = torch.zeros(2, L, batch, H, N_CTX, D, **f16)
    tok, slots = torch.zeros(batch, dtype=torch.long, device="cuda"), torch.arange(N_CTX, device="cuda")
    pos = torch.full((1,), context, dtype=torch.long, device="cuda")

    def step():
        x = wte[tok] + wpe[pos]  # (B, C)
        mask = (slots <= pos).view(1, 1, 1, N_CTX)
        for i, (w_qkv, b_qkv, w_o, b_o, w_fc, b_fc, w_pr, b_pr) in enumerate(layers):
            qkv = F.linear(F.layer_norm(x, (C,)), w_qkv, b_qkv).view(batch, 3, H, 1, D)
            k_cache[i].index_copy_(2, pos, qkv[:, 1])
            v_cache[i].index_copy_(2, pos, qkv[:, 2])
            a = F.scaled_dot_product_attention(qkv[:, 0], k_cache[i], v_cache[i], attn_mask=mask)
            x = x + F.linear(a.reshape(batch, C), w_o, b_o)
            x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (C,)), w_fc, b_fc), approximate="tanh"), w_pr, b_pr)
        tok.copy_(F.linear(F.layer_norm(x, (C,)), wte).argmax(-1))

    side = torch.cuda.Stream()  # capture wants its warm-up on a side stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return start.elapsed_time(end) / steps


ABLATIONS = (("CUDA graphs off", dict(cuda_graphs=False)),  # a lesson each: its label, the LLM switch that turns it off
             ("multi-step decoding off (one graph run per step, its tokens read before the next is launched)",
              dict(num_scheduler_steps=1)),
             ("fusion off (layernorm, bias, GELU, residual as kernels of their own)", dict(fused=False)),
             ("dependent launches off (each kernel in a graph starts only once the one before has finished)",
              dict(dependent_launches=False)))


class Lessons(dict):
    """bench_gpu's lessons, each printed as it is measured: a run cut short still shows what it measured."""
    def __setitem__(self, name, value):
        print(f"{name}: {value if isinstance(value, str) else f'{value:,.0f}' if value else '-'}", flush=True)
        super().__setitem__(name, value)


def bench_gpu(path, repeats):
    """End-to-end rows and lessons: single stream and switches off, streaming, batching, the server on gpt2; then
    gpt2-xl. Each row's number is the median of `repeats` runs."""
    import cupy as cp
    stage("end to end on gpt2: single stream, the lessons' switches, streaming, batching, sampling, the server")
    llm, rng, lessons = LLM(str(path), device="cuda", gpu_memory_utilization=0.3), np.random.default_rng(0), Lessons()
    one = [rng.integers(0, 50000, 64).tolist()]
    tps, lo, hi = repeated(llm, one, 256, repeats)  # then with each lesson's switch off, in an engine of a small pool
    rows = [dict(workload="single stream, prompt 64 -> 256", ours=tps, low=lo, high=hi,
                 anchor=1e3 / torch_graph_decode("gpt2", 1, 320), anchor_name="PyTorch CUDA-graph step", target=4000)]
    lessons["transformers generate, single stream (tok/s)"] = time_transformers(str(path), one, 64, "cuda")
    for label, switch in ABLATIONS:
        lessons[f"{label}: single stream tok/s (on: {tps:.0f})"] = time_generate(
            LLM(str(path), device="cuda", num_kv_tokens=200_000, **switch), one, 256)[0]
        gc.collect()  # that engine goes before the next comes
    t0, first = time.perf_counter(), None  # streaming: the first token comes long before the last
    for _ in llm.stream(one, greedy(256)):
        first = first or time.perf_counter()
    lessons["streaming: time to first token / total time (ms)"] = \
        f"{(first - t0) * 1e3:.1f} / {(time.perf_counter() - t0) * 1e3:.1f}"
    sweep = []  # throughput against per-token latency
    for B in (1, 4, 16, 64, 256):
        batch = [rng.integers(0, 50000, 64).tolist() for _ in range(B)]
        rates = [time_generate(llm, batch, 128)[0] for _ in range(repeats)]
        sweep.append(f"B={B}: {spread(rates)} tok/s at {B / np.median(rates) * 1e3:.2f} ms/token")
    lessons["batch sweep (prompt 64 -> 128): throughput vs per-token latency"] = "; ".join(sweep)
    mixed = np.random.default_rng(0)  # 256 requests, 64..512 in and out: all at once, then continuous vs static
    prompts = [mixed.integers(0, 50000, int(p)).tolist() for p in mixed.integers(64, 513, 256)]
    lens = [int(o) for o in mixed.integers(64, 513, 256)]
    offline, lo, hi = repeated(llm, prompts, lens, repeats)
    rows.append(dict(workload="offline: 256 requests, 64..512 in and out", ours=offline, low=lo, high=hi,
                     anchor=256 * 1e3 / torch_graph_decode("gpt2", 256, 320), anchor_name="PyTorch graph B=256 ctx 320",
                     target=100000))
    for clients, servers in ((64, 1), (256, 1), (256, 2)):  # --api-server-count: HTTP processes on one engine
        lessons[f"server: {clients} streaming clients, prompt 64 -> 128, {servers} HTTP process(es)"] = server_load(
            path, offline, clients, gpu_memory_utilization=0.3, api_server_count=servers)
    workloads = [("single stream", one, 256), ("offline", prompts, lens)]
    simple = LLM(str(path), device="cuda", num_kv_tokens=200_000, kernels="simple")
    lessons["the kernel ladder: kernels='simple' (its first rungs) against the default, tok/s"] = engines_against(
        simple, llm, [workloads[0], ("offline, the first 16 requests", prompts[:16], lens[:16])], repeats)
    del simple
    gc.collect()
    lessons["prefix caching (enable_prefix_caching), on against off"] = prefix_caching_lesson(
        path, "cuda", repeats, gpu_memory_utilization=0.2)
    # k 5, as vLLM's n-gram example has it (NOTES, speculative decoding: k on this prompt)
    ngram, by_gpt2 = {"method": "ngram", "num_speculative_tokens": 5}, {"model": str(path), "num_speculative_tokens": 4}
    copy = [rng.integers(0, 50000, 32).tolist() * 8]  # a prompt repeating itself: what n-gram drafts find
    # a prompt whose continuation repeats it: random weights copy no text, but their greedy tail falls into a loop
    looping = [copy[0] + llm.generate(copy, greedy(256), use_tqdm=False)[0].outputs[0].token_ids]
    lessons["speculative decoding (speculative_config), greedy, against plain decoding"] = speculation_lesson([
        ("n-gram, a prompt repeating itself, single stream", str(path), ngram, copy, 256, 4096),
        ("n-gram, a prompt its continuation repeats (the model's own loop), single stream", str(path), ngram, looping,
         256, 4096),
        ("n-gram, gpt2-xl, a prompt repeating itself", "random:gpt2-xl", ngram, copy, 128, 4096),
        ("n-gram, 256 of them", str(path), ngram, copy * 256, 128, 110_000),
        ("n-gram, 256 of them, drafting once at most 16 run (disable_by_batch_size)", str(path),
         {**ngram, "disable_by_batch_size": 16}, copy * 256, 128, 110_000),
        ("gpt2 drafting itself, single stream", str(path), by_gpt2, one, 256, 4096),
        ("gpt2 drafting gpt2-xl, single stream", "random:gpt2-xl", by_gpt2, one, 128, 4096)], repeats, device="cuda")
    lessons["sampling (T 0.8, top-k 50, top-p 0.95) against greedy, tok/s"] = a_against_b(
        lambda p, n: time_generate(llm, p, n, sampled)[0], lambda p, n: time_generate(llm, p, n)[0], workloads, 3)
    lessons["batch-invariant mode (one matmul tile and K split for every batch, every query in 64-key attention "
            "tiles), on against off, tok/s"] = batch_invariance_cost(path, "cuda", workloads, repeats,
                                                                     num_kv_tokens=300_000)
    # an engine of 64 seats (its admission group, 8, set as it is made): continuous, then static, 64 at a time
    seats64 = LLM(str(path), device="cuda", max_num_seqs=64, num_kv_tokens=65_536)
    cont, t0 = time_generate(seats64, prompts, lens)[0], time.perf_counter()
    for i in range(0, 256, 64):
        seats64.generate(prompts[i:i + 64], [greedy(n) for n in lens[i:i + 64]], use_tqdm=False)
    lessons["at most 64 sequences: continuous vs static batching (tok/s)"] = \
        f"{cont:,.0f} vs {sum(lens) / (time.perf_counter() - t0):,.0f}"
    del seats64
    c, pool = llm.config, llm.kv.num_blocks * llm.kv.block_size  # how many of those sequences the KV pool holds
    mean_len = int(np.mean([len(p) for p in prompts]) + np.mean(lens))
    per_token = PagedKVCache.bytes_per_token(c.n_layer, c.n_head, c.head_dim, 2)
    lessons["KV cache"] = (f"{per_token / 1024:.0f} KiB per token; the pool holds {pool:,} tokens: "
                           f"{pool // (-(-mean_len // 16) * 16):,} sequences of the mixed workload's mean length "
                           f"{mean_len} paged, {pool // c.n_ctx:,} reserving n_ctx={c.n_ctx} each")
    del llm
    gc.collect()
    # gpt2-xl: every weight read once per token sets its floor
    xl = LLM("random:gpt2-xl", device="cuda", gpu_memory_utilization=0.3)
    copy_gbs = Roofline(xl.backend).copy_gbs
    floor = lessons["gpt2-xl weight-bandwidth floor (tok/s)"] = copy_gbs * 1e9 / weight_bytes(xl.model)
    xl_tps, lo, hi = repeated(xl, one, 128, repeats)
    rows.append(dict(workload="gpt2-xl single stream", ours=xl_tps, low=lo, high=hi,
                     anchor=1e3 / torch_graph_decode("gpt2-xl", 1, 320), anchor_name="PyTorch CUDA-graph step",
                     target=0.6 * floor))
    del xl
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    # lessons of two engines at once size their pools (num_kv_tokens): under a GPU fraction the second finds it taken
    lessons["int8 weights (quantization='int8', W8A16) against fp16"] = "; ".join([
        quantization_lesson("gpt2", path, copy_gbs, [("single stream", one, 256), ("offline", prompts, lens)], repeats,
                            device="cuda", num_kv_tokens=262_144),
        quantization_lesson("gpt2-xl", "random:gpt2-xl", copy_gbs, [("single stream", one, 128)], repeats,
                            device="cuda", num_kv_tokens=4096)])
    lessons["tensor parallelism (tensor_parallel_size, one process a GPU, NCCL in the graphs)"] = \
        tensor_parallel_lesson(("random:gpt2-xl", "random:gpt2"), [("single stream", one, 128), workloads[1]],
                               repeats, device="cuda", num_kv_tokens=65_536)
    stage("a model that predicts text (text_model.py: trained here unless cached), for what the weights decide")
    import text_model
    paths = text_model.make_models(log=lambda line: print(line, flush=True))
    for line in text_model.speculation_lessons(paths, repeats):
        lessons[f"on the trained model, speculative decoding: {line.split(':')[0]}"] = line.split(": ", 1)[1]
    lessons["on the trained model, what the weights decide"] = text_model.quality_lessons(paths)
    lessons["on the trained model, fp16 at long context"] = text_model.long_context_lesson(paths)
    return rows, lessons


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: the GPU if CuPy sees a Hopper GPU, else the CPU")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each end-to-end workload (median, min-max)")
    ap.add_argument("--model", default="random:gpt2")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--plot", help="draw the roofline here (matplotlib)")
    ap.add_argument("--plans", action="store_true", help="print the matmul plans for 132 SMs (an H200), and exit")
    args = ap.parse_args()
    if args.plans:
        return print_matmul_plans(132)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot draws with matplotlib, which is not installed: pip install -r requirements-bench.txt")
    if args.device != "cpu":
        from cuda_backend import find_gpu
        why = find_gpu()
        if why and args.device == "cuda":
            ap.exit(1, f"bench.py: --device cuda, but {why}. The GPU measurements need CuPy (pip install "
                       "cupy-cuda13x) and a Hopper GPU; --device cpu measures the numpy engine.\n")
        args.device = "cpu" if why else "cuda"
        if why:
            stage(f"no GPU to measure ({why}): the CPU engine against transformers")
    results = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "model": args.model}
    path = resolve_model(args.model)
    if args.device == "cpu":  # the numpy engine against transformers' generate
        llm, rng, rows = LLM(str(path), device="cpu", num_kv_tokens=16384), np.random.default_rng(0), []
        for batch in (1, 8):
            stage(f"CPU, batch {batch}: nanoinfer, then transformers")
            prompts = [rng.integers(0, 50000, 64).tolist() for _ in range(batch)]
            (ours, lo, hi), ref = repeated(llm, prompts, 64, args.repeats), \
                time_transformers(str(path), prompts, 64, "cpu")
            rows.append(dict(workload=f"CPU prompt 64 -> 64, batch {batch}", ours=ours, low=lo, high=hi,
                             anchor=ref, anchor_name="transformers generate",
                             target=(1.0 if batch == 1 else 1.5) * (ref or 0)))
        stage("the batch-invariant mode's cost: batch 1 and 8, on against off, alternating")
        work = [(f"batch {b}", [rng.integers(0, 50000, 64).tolist() for _ in range(b)], 64) for b in (1, 8)]
        print("batch-invariant mode (every reduction row by row, in a fixed order), on against off, tok/s: " +
              batch_invariance_cost(path, "cpu", work, args.repeats, num_kv_tokens=16384))
    else:
        stage("ceilings, matmul plans, the roofline of a step's kernels, kernel targets")
        bench_kernels(results, args.plot)
        rows, results["lessons"] = bench_gpu(path, args.repeats)
    results["end_to_end"] = rows
    print(f"\n{'workload (tokens/s)':44} {'nanoinfer':>11} {f'min-max of {args.repeats}':>19} {'anchor':>11}  "
          f"{'target':>9}  met  anchor")
    for r in rows:
        anchor = f"{r['anchor']:11,.1f}" if r["anchor"] else f"{'-':>11}"
        runs = f"{r['low']:,.0f}-{r['high']:,.0f}"
        print(f"{r['workload']:44} {r['ours']:11,.1f} {runs:>19} {anchor}  {r['target']:9,.1f}  "
              f"{'yes' if r['ours'] >= r['target'] else 'NO ':3}  {r['anchor_name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
