"""Tensor parallelism, Megatron's split of each layer across tensor_parallel_size ranks (vLLM's LLM argument).

A layer's two matmul pairs split so that each pair needs one all-reduce:
- QKV and the MLP's up-projection by output columns: rank r computes its heads' q, k, v and its quarter of the MLP's
  hidden units from the whole (replicated) residual stream, with no communication;
- the attention projection and the MLP's down-projection by input rows: each rank multiplies what it holds by its rows
  of w, and an all-reduce sums the partial results into the next residual stream on every rank. Rank 0 adds the bias
  and the residual in its matmul's epilogue, the others add nothing, so the sum holds each once;
- attention needs no communication: each rank's heads attend over its heads' K and V, so each rank's paged KV cache
  holds its heads only (the block tables, one allocator's, are the same on every rank);
- the lm_head splits over the vocabulary; its logits are gathered where the sampler runs.

Here the ranks are simulated in one process (the numpy twin): each a thread running GPT.forward over its shard, the
all-reduce and the gather as barriers, so the CPU tests prove the partitioning exact. It imports nothing from
nanoinfer.py: the model a rank runs is handed in.
"""
import threading
from functools import reduce

import numpy as np

from checkpoint import Int8Weight
from paged_kv import PagedKVCache


def part(n, rank, size):
    """Rank's indices of n things in size equal parts (the vocabulary need not divide: the last part is the shorter)."""
    step = -(-n // size)
    return np.arange(rank * step, min((rank + 1) * step, n))


def take(w, index, axis=0):
    """w's entries at index along axis (an Int8Weight's scale follows its rows)."""
    if isinstance(w, Int8Weight):
        return Int8Weight(np.take(w.q, index, axis), w.scale if axis == 1 else w.scale[index])
    return np.take(w, index, axis)


def shard(weights, config, n_vocab, rank, size):
    """Rank's weights: QKV (each of q, k, v by heads) and the MLP's up-projection by output rows of w, their biases
    likewise; the attention projection and the down-projection by input columns of w (their biases whole: rank 0
    adds them); the lm_head by vocabulary rows; layernorms and embeddings whole."""
    C = config.n_embd
    heads = part(C, rank, size)  # this rank's columns of q (of k, of v): whole heads, as size divides n_head
    out = {}
    for name, w in weights.items():
        if ".attn.c_attn." in name:
            out[name] = take(w, np.concatenate([j * C + heads for j in range(3)]))
        elif ".mlp.c_fc." in name:
            out[name] = take(w, part(config.n_inner, rank, size))
        elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
            out[name] = take(w, part(C if "attn" in name else config.n_inner, rank, size), axis=1)
        elif name != "lm_head.weight":
            out[name] = w
    head = weights.get("lm_head.weight", weights["wte.weight"])
    head = head if isinstance(head, Int8Weight) else head[:n_vocab]
    out["lm_head.weight"] = take(head, part(n_vocab, rank, size))
    return out


class Single:
    """One rank: the collectives do nothing (the model's forward as it reads with no parallelism)."""
    rank, size = 0, 1

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x


class ThreadComm:
    """Rank `rank` of `size` threads of this process, NCCL's collectives as barriers: each rank leaves its array, all
    wait, each takes the sum (in rank order: the same bits on every rank) or the concatenation, all wait again."""
    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, len(group["slots"])

    def _exchange(self, x, combine):
        slots, barrier = self.group["slots"], self.group["barrier"]
        slots[self.rank] = x
        barrier.wait()
        out = combine(slots)
        barrier.wait()  # everyone has read the slots before the next collective writes them
        return out

    def all_reduce(self, x):
        return self._exchange(x, lambda xs: reduce(np.add, xs))

    def all_gather(self, x):  # along the last axis (the lm_head's vocabulary)
        return self._exchange(x, lambda xs: np.concatenate(xs, axis=-1))


def check(size, config, backend):
    if size > 1 and (backend.name != "cpu" or config.n_head % size):
        raise ValueError(f"tensor_parallel_size={size}: runs, for now, on device='cpu' only (its ranks simulated in "
                         f"one process), and must divide the model's {config.n_head} heads")


class SimulatedRanks:
    """tensor_parallel_size ranks in one process: make_model(rank's weights, comm) is each rank's model (a GPT), kv
    the engine's KV cache, with rank 0's heads; the other ranks' heads get K/V tensors of their own in its blocks.
    forward(batch, kv) runs the batch on every rank, each in a thread, and gives rank 0's logits, gathered over the
    whole vocabulary. A rank that raises breaks the barriers, so no rank waits for it; its error is raised here."""
    def __init__(self, make_model, weights, config, n_vocab, size, kv):
        self.group = dict(slots=[None] * size, barrier=threading.Barrier(size))
        self.ranks = [make_model(shard(weights, config, n_vocab, r, size), ThreadComm(self.group, r))
                      for r in range(size)]
        self.config, self.backend = config, self.ranks[0].backend
        self.rank_kv = [None] + [PagedKVCache(self.backend, config.n_layer, config.n_head // size, config.head_dim,
                                              kv.num_blocks, kv.block_size, False) for _ in range(1, size)]

    def forward(self, batch, kv):
        results, errors = [None] * len(self.ranks), []

        def run(r):
            try:
                results[r] = self.ranks[r].forward(batch, self.rank_kv[r] or kv)
            except BaseException as e:  # noqa: B902 (a rank's Ctrl-C too: the step must not wait for it)
                errors.append(e)
                self.group["barrier"].abort()
        threads = [threading.Thread(target=run, args=(r,), name=f"rank {r}") for r in range(1, len(self.ranks))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            self.group["barrier"].reset()  # for the next step
            first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            raise first
        return results[0]
