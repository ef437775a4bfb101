"""The engine against Hugging Face transformers: the logits of prefill, chunked prefill, decode and mixed batches, and
of every config setting; greedy tokens alone, batched and under preemption; logprobs, streams, n samples, seeded
sampling; stop strings, stop tokens and min_tokens, penalties, EOS and the context limit; batch invariance.

No network. Tiny GPT-2 checkpoints with random weights, written by transformers' own save_pretrained with the real
GPT-2 vocabulary (conftest.py); references are computed by transformers in float64. Every engine test runs on the CPU
(numpy, fp32) and, where CuPy and a GPU are present, on CUDA in fp32 and fp16.

Tolerance policy: the error is max|ours - ref| / max|ref| against transformers' float64 logits, under 1e-4 in fp32
and 1e-2 in fp16 (TOL, conftest.py); a NaN or inf fails at once. Greedy tests use only prompts whose reference top-2
gap exceeds 2 * TOL['float16'] at every step, where an engine within tolerance cannot pick another token.

The other layers have files of their own: test_ops.py (the numpy op set against torch), test_kernels.py (the CUDA
kernels against their numpy twins), test_sampler.py, test_kv_scheduler.py, test_reliability.py, test_checkpoint.py,
test_server.py and test_cli.py; the levers too: test_speculation.py, test_parallel.py.
"""
import dataclasses

import numpy as np
import pytest
import torch

import nanoinfer as ni
from conftest import (ALL_DEVICES, CPU, EOT, EXACT_DEVICES, N_NEW, NO_GPU, SAMPLED, TOL, Driver, assert_idle,
                      check_kv, finish_by_steps, greedy, hf_greedy, hf_logits, make_llm, random_ids, rel_err, solo,
                      tokens, write_checkpoint)
from nanoinfer import SamplingParams
from scheduler import Sequence


# -----------------------------------------------------------------------------
# logits against transformers, driving llm.model.forward with hand-built batches (conftest.Driver)

@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_prefill_logits(request, dev, which):
    """One prefill of 45 tokens: the logits of every position equal transformers' within TOL."""
    ckpt = request.getfixturevalue(which)
    ids = random_ids(45, 1)
    (ours,) = Driver(make_llm(ckpt, dev)).step([(0, ids)])
    assert rel_err(ours, hf_logits(ckpt, ids)) < dev.tol


def test_chunked_prefill_logits(tiny, dev):
    """A prompt fed in uneven chunks (across block boundaries) reads its earlier K/V from the paged cache."""
    ids, d, got = random_ids(60, 2), Driver(make_llm(tiny, dev)), []
    for a, b in [(0, 7), (7, 8), (8, 24), (24, 41), (41, 60)]:
        got += d.step([(0, ids[a:b])])
    assert rel_err(np.concatenate(got), hf_logits(tiny, ids)) < dev.tol


def test_decode_logits_step_by_step(tiny, dev):
    """Prefill 5 tokens, then 40 single-token decode steps: each step's logits match transformers."""
    ids, d = random_ids(45, 3), Driver(make_llm(tiny, dev))
    got = d.step([(0, ids[:5])]) + [d.step([(0, [t])])[0] for t in ids[5:]]
    assert rel_err(np.concatenate(got), hf_logits(tiny, ids)) < dev.tol


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_logits(tiny, dev, block_size):
    """One flat batch mixing a fresh prefill, two decodes and a prefill chunk over earlier context, with the four
    sequences' blocks interleaved in the pool: every row matches transformers."""
    seqs = {s: random_ids(n, 10 + s) for s, n in enumerate([30, 18, 50, 34])}
    d, got = Driver(make_llm(tiny, dev, block_size=block_size)), {s: [] for s in seqs}
    for s, a, b in [(1, 0, 9), (2, 0, 20), (3, 0, 5), (1, 9, 17), (3, 5, 33), (2, 20, 35)]:  # earlier steps
        got[s] += d.step([(s, seqs[s][a:b])])
    rows = d.step([(0, seqs[0]), (1, seqs[1][17:18]), (2, seqs[2][35:50]), (3, seqs[3][33:34])])
    for s, r in zip(seqs, rows):
        got[s].append(r)
        assert rel_err(np.concatenate(got[s]), hf_logits(tiny, seqs[s])) < dev.tol, f"sequence {s}"


def capture_logits(llm):
    """Record the logits of every forward the engine runs (the engine is not changed, only observed)."""
    seen, orig = [], llm.model.forward

    def wrapped(*args, **kw):
        out = orig(*args, **kw)
        seen.append(np.asarray(llm.backend.tohost(out), dtype=np.float64))
        return out

    llm.model.forward = wrapped
    return seen


def test_engine_chunked_prefill_logits(tiny, dev):
    """Through the scheduler: max_num_batched_tokens=8 splits a 45-token prompt into 6 chunks, and the logits
    that the last chunk yields (the first new token's) match transformers. Eager steps, whose logits can be watched:
    on the GPU a lone prompt's last chunk would replay a CUDA graph (test_a_lone_prefill_replays_its_graph)."""
    llm = make_llm(tiny, dev, max_num_batched_tokens=8, cuda_graphs=False)
    seen = capture_logits(llm)
    ids = random_ids(45, 4)
    llm.generate([ids], greedy(1))
    assert len(seen) >= 6 and all(len(s) == 0 for s in seen[:-1]), "the prompt was not run in chunks of 8"
    assert rel_err(seen[-1], hf_logits(tiny, ids)[-1:]) < dev.tol


@pytest.mark.parametrize("dev", EXACT_DEVICES)
@pytest.mark.parametrize("config", [dict(tie_word_embeddings=False), dict(scale_attn_by_inverse_layer_idx=True),
                                    dict(reorder_and_upcast_attn=True), dict(scale_attn_weights=False),
                                    dict(vocab_size=50304)], ids=lambda c: next(iter(c)))
def test_config_settings_are_honoured(tmp_path, dev, config):
    """An untied lm_head, attention scaled by 1/layer, reordered upcast attention, unscaled attention, and an
    embedding padded to 50304 (nanoGPT's) give transformers' logits; the padding is never sampled (it once was, and
    decoding it raised KeyError)."""
    ckpt = write_checkpoint(tmp_path / "m", seed=4, **config)
    llm = make_llm(ckpt, dev)
    ids = random_ids(40, 9)
    ours = Driver(llm).step([(0, ids)])[0]
    ref = hf_logits(ckpt, ids)[:, :50257]
    assert ours.shape == ref.shape and rel_err(ours, ref) < dev.tol
    if "vocab_size" in config:  # temperature 5 makes the random padding rows likely, were they in the logits
        out = llm.generate(["Hello"], SamplingParams(max_tokens=100, temperature=5.0, seed=1, ignore_eos=True))[0]
        assert out.outputs[0].finish_reason == "length" and max(out.outputs[0].token_ids) < 50257


# -----------------------------------------------------------------------------
# generation: greedy against transformers, batching, preemption, logprobs, streaming

def test_greedy_matches_transformers(tiny, dev, greedy_cases):
    """Each prompt alone: greedy tokens equal transformers' generate token for token; text is their decoding."""
    llm = make_llm(tiny, dev)
    for prompt, ids, ref in greedy_cases:
        (out,) = llm.generate(prompt, greedy())
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].text == llm.tokenizer.decode(ref) and out.outputs[0].finish_reason == "length"


def test_empty_prompt_generates_from_endoftext(tiny):
    """An empty prompt (string or token list) generates from <|endoftext|>, as transformers does from [50256]."""
    ref, gap = hf_greedy(tiny, [EOT], 10)
    assert gap > 2 * TOL["float32"]
    llm = make_llm(tiny, CPU)
    for out in llm.generate(["", []], greedy(10)):
        assert out.prompt_token_ids == [EOT] and out.outputs[0].token_ids == ref


def test_batched_equals_solo(tiny, dev, greedy_cases):
    """All prompts in one generate (different max_tokens, so some finish while others run) give each prompt's solo
    output, which is transformers' tokens."""
    llm = make_llm(tiny, dev)
    prompts = [p for p, _, _ in greedy_cases]
    params = [greedy(N_NEW - i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for out, (prompt, _, ref), p in zip(outs, greedy_cases, params):
        assert out.outputs[0].token_ids == llm.generate(prompt, p)[0].outputs[0].token_ids == ref[:p.max_tokens], prompt
    assert llm.kv.allocator.num_free() == llm.kv.num_blocks


def test_preemption_keeps_greedy_outputs(tiny, dev, greedy_cases):
    """A pool of 5 blocks of 16 cannot hold all requests: sequences get preempted and recomputed, and every
    greedy output is still transformers' (so equal to an unpressured run); no block leaks."""
    prompts = [ids for _, ids, _ in greedy_cases]
    roomy = [o.outputs[0].token_ids for o in make_llm(tiny, dev).generate(prompts, greedy())]
    llm = make_llm(tiny, dev, num_kv_tokens=80, block_size=16)
    outs = llm.generate(prompts, greedy())
    assert llm.scheduler.num_preemptions > 0, "the tiny pool did not force a preemption"
    assert [o.outputs[0].token_ids for o in outs] == roomy == [ref for _, _, ref in greedy_cases]
    assert llm.kv.allocator.num_free() == llm.kv.num_blocks and not llm.kv.block_tables


def test_logprobs_match_transformers(tiny, dev, greedy_cases):
    """logprobs=5, vLLM's shape: per generated token {token id: Logprob} for the sampled one and the 5 most likely,
    log-probabilities equal to log_softmax of transformers' logits (error bound: 2 * TOL * max|logit|), ranks 1..5 in
    order, each token's text; cumulative_logprob their sum over the sampled tokens."""
    _, ids, _ = greedy_cases[0]
    llm = make_llm(tiny, dev)
    (out,) = llm.generate([ids], greedy(8, logprobs=5))
    sample = out.outputs[0]
    ref = hf_logits(tiny, ids + sample.token_ids)[len(ids) - 1:-1]
    ref_lp = torch.log_softmax(torch.tensor(ref), -1).numpy()
    assert len(sample.logprobs) == len(sample.token_ids) == 8
    for lp, tok, row, row_lp in zip(sample.logprobs, sample.token_ids, ref, ref_lp):
        tol = 2 * dev.tol * np.abs(row).max()
        assert tok in lp and abs(lp[tok].logprob - row_lp[tok]) < tol  # greedy: the sampled token is the top one
        assert len(lp) == 5 and sorted(x.rank for x in lp.values()) == [1, 2, 3, 4, 5]
        assert all(abs(x.logprob - row_lp[t]) < tol and x.decoded_token == llm.tokenizer.decode([t])
                   for t, x in lp.items())
        assert np.allclose(sorted((x.logprob for x in lp.values()), reverse=True), np.sort(row_lp)[::-1][:5],
                           atol=tol, rtol=0)
    assert sample.cumulative_logprob == sum(lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids))


@pytest.mark.parametrize("how", ["whole", "chunked", "preempted", "n=2"])
def test_prompt_logprobs_match_transformers(tiny, dev, greedy_cases, how):
    """prompt_logprobs=3, vLLM's shape: None for the first prompt token, then per prompt token {token id: Logprob} for
    it and the 3 most likely given the tokens before, log_softmax of transformers' logits (error bound: 2 * TOL *
    max|logit|), once each, whether the prompt is prefilled at once, in chunks of 7 tokens, recomputed after a
    preemption, or shared by 2 samples (the first computes them); the generated tokens are unchanged."""
    prompts = [ids for _, ids, _ in greedy_cases[:4]]
    kw = dict(chunked=dict(max_num_batched_tokens=7), preempted=dict(num_kv_tokens=80, block_size=16)).get(how, {})
    llm = make_llm(tiny, dev, **kw)
    params = greedy(12, prompt_logprobs=3, n=2 if how == "n=2" else 1)
    outs = llm.generate(prompts * (3 if how == "preempted" else 1), params)
    if how == "preempted":
        assert llm.scheduler.num_preemptions > 0, "the tiny pool did not force a preemption"
    for out in outs:
        ids = out.prompt_token_ids
        ref = hf_logits(tiny, ids)
        ref_lp = torch.log_softmax(torch.tensor(ref), -1).numpy()
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for p, lp in enumerate(out.prompt_logprobs[1:]):
            tok, row, row_lp = ids[p + 1], ref[p], ref_lp[p]
            tol = 2 * dev.tol * np.abs(row).max()
            assert tok in lp and abs(lp[tok].logprob - row_lp[tok]) < tol
            assert abs(np.sort(row_lp)[::-1][lp[tok].rank - 1] - row_lp[tok]) < tol  # its rank, up to near ties
            top = sorted((x for t, x in lp.items() if x.rank <= 3), key=lambda x: x.rank)
            assert [x.rank for x in top] == [1, 2, 3] and np.allclose(
                [x.logprob for x in top], np.sort(row_lp)[::-1][:3], atol=tol, rtol=0)
            assert all(x.decoded_token == llm.tokenizer.decode([t]) for t, x in lp.items())
        for c in out.outputs:
            assert c.token_ids == next(new for _, i, new in greedy_cases if i == ids)[:12]
    assert llm.kv.allocator.num_free() == llm.kv.num_blocks


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_prefix_caching_changes_no_output(tiny, dev):
    """Requests that share a 40-token prefix (blocks of 16), one after another: the later ones start from the first's
    cached blocks (num_cached_tokens 32: the prefix's full blocks), a repeated prompt from all but the block of its
    last token (48 of 49), and
    every output, greedy and seeded, and every log-prob is what the cache off gives, bitwise with batch_invariant; a
    pool too small to keep them evicts, and reset_prefix_cache forgets; every block is free at the end."""
    prefix = random_ids(40, 1)
    prompts = [prefix + random_ids(9, 10 + i) for i in range(3)] + [prefix + random_ids(9, 10)]
    params = [greedy(8, logprobs=2), SamplingParams(**{**SAMPLED, "max_tokens": 8}, seed=3, logprobs=2)]
    outs = {}
    for on in (False, True):
        llm = make_llm(tiny, dev, enable_prefix_caching=on, batch_invariant=True)
        outs[on] = [llm.generate([p], q, use_tqdm=False)[0] for p in prompts for q in params]  # one at a time
        if on:
            assert [o.num_cached_tokens for o in outs[on]] == [0, 48, 32, 48, 32, 48, 48, 48]
            assert llm.kv.hits == 304 and llm.reset_prefix_cache()
            assert llm.generate([prompts[0]], params[0], use_tqdm=False)[0].num_cached_tokens == 0
        assert llm.kv.allocator.num_free() == llm.kv.num_blocks
    same = lambda a, b: a.token_ids == b.token_ids and [{t: x.logprob for t, x in lp.items()} for lp in a.logprobs] == \
        [{t: x.logprob for t, x in lp.items()} for lp in b.logprobs]
    assert all(same(a.outputs[0], b.outputs[0]) for a, b in zip(outs[False], outs[True]))
    small = make_llm(tiny, dev, num_kv_tokens=64, block_size=16)  # 4 blocks: the next prompt evicts the first's
    first = small.generate([prompts[0]], greedy(8), use_tqdm=False)[0]
    small.generate([random_ids(50, 99)], greedy(8), use_tqdm=False)
    again = small.generate([prompts[0]], greedy(8), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


@NO_GPU
def test_fp16_long_context_within_transformers_fp16(loud):
    """fp16 at long context, where rounding adds up: greedy decoding after 960-token prompts on 24 layers with huge
    residual channels (text_model.fp16_long_context). Each token's log-prob against transformers' float64 on the same
    tokens: the largest error within twice transformers' own fp16 error (on its own greedy tokens) plus 1e-3; and no
    choice further below the reference's best logit than transformers' fp16 choices are, plus 0.05."""
    from text_model import fp16_long_context
    worst = fp16_long_context(loud.path, [random_ids(960, seed) for seed in (1, 2)])
    (gap, err), (hf_gap, hf_err) = worst["ours"], worst["transformers"]
    assert err <= 2 * hf_err + 1e-3 and gap <= hf_gap + 0.05, worst


def test_int8_quality_against_transformers(tiny, dev):
    """quantization='int8' (W8A16): on the unquantized engine's greedy continuations of 8 prompts, the int8 forward's
    logits against transformers' (teacher-forced): mean KL of the next-token distributions < 2e-4 (CPU: 3.5e-5),
    largest logit error < 0.2 of max|logit| (CPU: 0.105); greedy decoding agrees with the unquantized engine's on at
    least 75 % of the first 8 tokens (CPU: 86 %), and repeats itself token for token. A value other than int8 is
    refused."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, EOT, 16).tolist() for _ in range(8)]
    fp, int8 = make_llm(tiny, dev), make_llm(tiny, dev, quantization="int8")
    ref_outs = fp.generate(prompts, greedy(48), use_tqdm=False)
    outs = int8.generate(prompts, greedy(48), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in int8.generate(prompts, greedy(48), use_tqdm=False)]
    agree = np.mean([a == b for x, y in zip(ref_outs, outs)
                     for a, b in zip(x.outputs[0].token_ids[:8], y.outputs[0].token_ids[:8])])
    kl, err = [], []
    for out in ref_outs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        n, i32 = len(ids), lambda a: np.asarray(a, np.int32)
        batch = ni.Batch(input_ids=i32(ids), positions=i32(range(n)), slot_mapping=i32(range(n)),
                         cu_seqlens_q=i32([0, n]), context_lens=i32([n]), block_tables=i32([range(-(-n // 16))]),
                         logits_idx=i32(range(n)))
        ref = torch.tensor(hf_logits(tiny, ids))
        ours = torch.tensor(int8.backend.tohost(int8.model.forward(batch, int8.kv)), dtype=torch.float64)
        p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
        kl.append(float((p.exp() * (p - q)).sum(-1).mean()))
        err.append(float((ours - ref).abs().max() / ref.abs().max()))
    assert np.mean(kl) < 2e-4 and max(err) < 0.2 and agree >= 0.75, (np.mean(kl), max(err), agree)
    with pytest.raises(ValueError, match="quantization"):
        make_llm(tiny, CPU, quantization="int4")


def test_stream_matches_generate(tiny, dev, greedy_cases):
    """llm.stream's deltas, per prompt, concatenate to generate()'s text; each finishes exactly once, last."""
    prompts = [p for p, _, _ in greedy_cases[:3]]
    llm = make_llm(tiny, dev)
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy())]
    texts, finished = ["" for _ in prompts], [None for _ in prompts]
    for i, _, delta, out in llm.stream(prompts, greedy()):
        assert finished[i] is None, "a delta after the request finished"
        texts[i] += delta
        finished[i] = out
    assert texts == want and all(o is not None and o.outputs[0].text == t for o, t in zip(finished, texts))


# -----------------------------------------------------------------------------
# sampling through the engine: seeds, batches, n samples

@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_seeded_sampling_reproducible_and_batch_independent(tiny, dev):
    """A seeded request samples the same tokens alone, again, and beside other requests in the batch; another
    seed gives other tokens; and each token is the sampler's definition (nanoinfer.sample_row) applied to
    transformers' logits with (seed, step = index of the new token)."""
    llm, prompt = make_llm(tiny, dev), "Once upon a time"
    alone = llm.generate(prompt, SamplingParams(seed=1234, **SAMPLED))[0]
    again = llm.generate(prompt, SamplingParams(seed=1234, **SAMPLED))[0].outputs[0].token_ids
    crowd = llm.generate(["The meaning of life is", prompt, "I", prompt],
                         [SamplingParams(seed=7, **SAMPLED), SamplingParams(seed=1234, **SAMPLED), greedy(),
                          SamplingParams(seed=99, **SAMPLED)])
    assert alone.outputs[0].token_ids == again == crowd[1].outputs[0].token_ids
    assert crowd[3].outputs[0].token_ids != alone.outputs[0].token_ids and len(set(alone.outputs[0].token_ids)) > 1
    ids = alone.prompt_token_ids
    ref = hf_logits(tiny, ids + alone.outputs[0].token_ids)[len(ids) - 1:-1].astype(np.float32)
    keys = ni.sample_key(np.full(len(ref), 1234, np.uint64), np.arange(len(ref), dtype=np.int32))
    args = SAMPLED["temperature"], SAMPLED["top_k"], SAMPLED["top_p"]
    assert tokens(alone) == [ni.sample_row(row, *args, keys[step], SAMPLED["min_p"]) for step, row in enumerate(ref)]


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_seeded_sampling_survives_batching(tiny, dev):
    """Issue 18's measure: 48 requests of mixed lengths, half greedy and half seeded under mixed sampling settings,
    each run alone and then all together through a pool so tight that prefill is chunked and sequences are preempted.
    The seeded ones may differ from their solo runs hardly more often than the greedy ones: at most 2 more (the race,
    like argmax, flips only at a near tie, 0 or 1 in 24 either way, so equal counts would fail by chance; the
    running-sum sampler it replaced differed in 7 of 20 on the H200). Prints both counts."""
    rng = np.random.default_rng()
    settings = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=40),
                dict(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02), dict(temperature=1.0, min_p=0.1),
                dict(temperature=0.7, top_p=0.95)]
    prompts, params = [], []
    for i in range(48):
        prompts.append(rng.integers(0, 50256, int(rng.integers(1, 60))).tolist())
        seed = int(rng.integers(2 ** 63))
        params.append(greedy(24) if i % 2 else
                      SamplingParams(max_tokens=24, ignore_eos=True, seed=seed, **settings[i // 2 % 6]))
    llm = make_llm(tiny, dev)
    solo = [llm.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    tight = make_llm(tiny, dev, num_kv_tokens=384, max_num_batched_tokens=64)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0, "the tight pool did not preempt"
    differ = [a != b for a, b in zip(solo, together)]
    greedy_differ, seeded_differ = sum(differ[1::2]), sum(differ[0::2])
    print(f"{dev.device}: solo against batched, greedy {greedy_differ} of 24 differ, seeded {seeded_differ} of 24")
    assert seeded_differ <= greedy_differ + 2, (seeded_differ, greedy_differ)


def test_n_samples_share_the_prompt(tiny, dev):
    """SamplingParams(n=3): the request prefills its prompt once; its other samples start from the first one's full
    blocks (reference count 3), recomputing only the partial last one. Each sample is what a request alone with its
    seed (nanoinfer.sample_seed) samples, the three differ, greedy ones are all greedy's, and no block is left."""
    llm = make_llm(tiny, dev, block_size=4)
    prompt = random_ids(18, 7)
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    rid = llm.add_request(prompt, params)
    llm.step()  # the prefill: the first sample's first token, and the fork
    first, *others = llm._requests[rid].seqs
    shared = llm.kv.block_tables[first.seq_id][:(18 - 1) // 4]
    assert len(shared) == 4 and all(llm.kv.block_tables[s.seq_id][:4] == shared for s in others)
    assert (llm.kv.allocator.ref_count[shared] == 3).all() and all(s.num_computed == 16 for s in others)
    check_kv(llm.kv)
    (out,) = finish_by_steps(llm).values()
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.request_id == rid and out.prompt is None
    alone = [solo(tiny, dev, prompt, SamplingParams(seed=ni.sample_seed(11, i), temperature=1.0, max_tokens=6,
                                                    ignore_eos=True)) for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone and len({tuple(a) for a in alone}) == 3
    (g,) = llm.generate(["Hello there"], greedy(5, n=3))
    assert [c.token_ids for c in g.outputs] == [solo(tiny, dev, llm.tokenizer.encode("Hello there"), greedy(5))] * 3
    assert g.prompt == "Hello there"
    assert_idle(llm)


# -----------------------------------------------------------------------------
# stopping, and the logits processors

def test_stop_string(tiny, greedy_cases):
    """A stop string met mid-generation ends the request with 'stop', the text ends right before it, and the
    stream never hands out a piece of it."""
    prompt, _, ref = greedy_cases[0]
    llm = make_llm(tiny, CPU)
    full = llm.tokenizer.decode(ref)
    stop = llm.tokenizer.decode(ref[6:8])  # spans a token boundary
    assert stop.strip()
    params = greedy(stop=[stop, "never appears \u2603"])
    (out,) = llm.generate(prompt, params)
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and stop not in text and text == full[:full.find(stop)]
    assert len(out.outputs[0].token_ids) <= 8 and out.outputs[0].token_ids == ref[:len(out.outputs[0].token_ids)]
    assert "".join(delta for _, _, delta, _ in llm.stream(prompt, params)) == out.outputs[0].text


def test_stop_string_kept_in_output(tiny, greedy_cases):
    """include_stop_str_in_output keeps the stop string: the text ends right after it."""
    prompt, _, ref = greedy_cases[0]
    llm = make_llm(tiny, CPU)
    full, stop = llm.tokenizer.decode(ref), llm.tokenizer.decode(ref[6:8])
    (out,) = llm.generate(prompt, greedy(stop=[stop], include_stop_str_in_output=True))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == full[:full.find(stop) + len(stop)]


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_stop_token_ids_and_min_tokens_match_transformers(tiny, dev, greedy_cases):
    """A stop token ends the request with 'stop' (its id in token_ids, its text kept only with
    include_stop_str_in_output); with min_tokens it cannot be sampled before: the tokens are transformers' greedy ones
    with min_new_tokens and that token as eos_token_id."""
    prompt, ids, ref = greedy_cases[0]
    llm, stop = make_llm(tiny, dev), ref[2]
    (out,) = llm.generate(prompt, greedy(stop_token_ids=[stop]))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == ref[:3]
    assert out.outputs[0].text == llm.tokenizer.decode(ref[:2])
    (kept,) = llm.generate(prompt, greedy(stop_token_ids=[stop], include_stop_str_in_output=True))
    assert kept.outputs[0].text == llm.tokenizer.decode(ref[:3])
    with torch.no_grad():
        want = tiny.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=N_NEW, min_new_tokens=6, do_sample=False, eos_token_id=stop,
                                pad_token_id=EOT)[0, len(ids):].tolist()
    (out,) = llm.generate(prompt, greedy(stop_token_ids=[stop], min_tokens=6))
    assert out.outputs[0].token_ids == want and stop not in out.outputs[0].token_ids[:6]


@pytest.mark.parametrize("dev", EXACT_DEVICES)
def test_repetition_penalty_greedy_matches_transformers(tiny, dev, greedy_cases):
    """Greedy decoding with a repetition penalty, in a batch beside requests without one, gives transformers'
    tokens (its generate with repetition_penalty); the others still give theirs."""
    llm, changed = make_llm(tiny, dev), 0
    for prompt, ids, ref in greedy_cases[:3]:
        with torch.no_grad():
            want = tiny.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=N_NEW, do_sample=False, repetition_penalty=1.8,
                                    eos_token_id=None, pad_token_id=EOT)[0, len(ids):].tolist()
        outs = llm.generate([prompt, prompt], [greedy(repetition_penalty=1.8), greedy()])
        assert outs[0].outputs[0].token_ids == want and outs[1].outputs[0].token_ids == ref
        changed += want != ref
    assert changed, "the penalty changed no output: the test shows nothing"


def test_logit_bias(tiny, dev, greedy_cases):
    """logit_bias (OpenAI's): +100 on a token makes greedy pick it every step, -100 on each greedy token the reference
    picks moves greedy off it; a request beside them without a bias gives its reference tokens; a token id past the
    vocabulary is refused, naming the field."""
    _, ids, ref = greedy_cases[0]
    llm = make_llm(tiny, dev)
    outs = llm.generate([ids] * 3, [greedy(6, logit_bias={40000: 100}), greedy(6, logit_bias={ref[0]: -100}),
                                    greedy(6)])
    assert outs[0].outputs[0].token_ids == [40000] * 6 and outs[1].outputs[0].token_ids[0] != ref[0]
    assert outs[2].outputs[0].token_ids == ref[:6]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.add_request(ids, greedy(2, logit_bias={60000: 1}))


def test_eos_finishes_unless_ignored(tiny):
    """<|endoftext|> ends a request with 'stop' (and adds no text), unless ignore_eos."""
    tok = make_llm(tiny, CPU, num_kv_tokens=128).tokenizer
    for ignore, want in [(False, "stop"), (True, None)]:
        seq = Sequence(0, [EOT], SamplingParams(max_tokens=5, ignore_eos=ignore), 0, tok)
        seq.append(15496, n_ctx=1024)
        seq.append(EOT, n_ctx=1024)
        assert seq.finish_reason == want and seq.text == "Hello"


def test_length_at_the_context_limit(tiny):
    """A prompt 3 tokens short of the context stops after 3 tokens with 'length', matching transformers."""
    ids = random_ids(tiny.n_ctx - 3, 8)
    ref, gap = hf_greedy(tiny, ids, 3)
    assert gap > 2 * TOL["float32"]
    (out,) = make_llm(tiny, CPU).generate([ids], greedy(50))
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == ref


# -----------------------------------------------------------------------------
# batch invariance

@pytest.mark.parametrize("dev", ALL_DEVICES)
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_batch_invariant_outputs_are_bitwise_solo(tiny, dev, quantization):
    """batch_invariant=True: 200 requests of mixed lengths and sampling settings give each request's solo tokens and
    bitwise its solo log-probs, run together three ways: with chunked prefill and a pool tight enough to preempt; all
    at once (a batch of up to 200 rows); and without log-probs, which on the GPU decodes in CUDA graphs. Weights in
    fp32 (fp16) or int8."""
    rng = np.random.default_rng()
    reqs = []
    for i in range(200):
        n, max_tokens, seed = int(rng.integers(1, 100)), int(rng.integers(1, 12)), int(rng.integers(2 ** 32))
        sampled = dict(temperature=float(rng.choice([0.5, 1.0, 1.5])), top_k=int(rng.choice([0, 40])),
                       top_p=float(rng.choice([1.0, 0.9])), seed=seed) if i % 2 else dict(temperature=0)
        reqs.append((random_ids(n, seed), SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                                                         **sampled)))
    prompts = [p for p, _ in reqs]
    solo_llm = make_llm(tiny, dev, batch_invariant=True, quantization=quantization)
    alone = [solo_llm.generate([p], q, use_tqdm=False)[0].outputs[0] for p, q in reqs]
    tight = make_llm(tiny, dev, batch_invariant=True, max_num_batched_tokens=24, num_kv_tokens=112, block_size=4,
                     quantization=quantization)
    roomy = make_llm(tiny, dev, batch_invariant=True, quantization=quantization)
    runs = {"tight": tight.generate(prompts, [q for _, q in reqs], use_tqdm=False),
            "all at once": roomy.generate(prompts, [q for _, q in reqs], use_tqdm=False),
            "no logprobs": roomy.generate(prompts, [dataclasses.replace(q, logprobs=None) for _, q in reqs],
                                          use_tqdm=False)}
    assert tight.scheduler.num_preemptions > 0, "the pool did not force a preemption"
    for name, together in runs.items():
        differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a.token_ids != b.outputs[0].token_ids or (
            b.outputs[0].logprobs is not None and a.logprobs != b.outputs[0].logprobs)]  # floats with ==: bitwise
        assert not differ, f"{name}: {len(differ)} of 200 requests differ from their solo runs, first {differ[:5]}"
