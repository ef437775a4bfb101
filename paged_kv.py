"""The paged KV cache: PagedAttention's idea in a few dozen lines.

Decoding reuses every earlier token's keys and values, so we keep them: per layer, one K and one V tensor
of shape (num_blocks, block_size, n_head, head_dim). A sequence does not own a contiguous stretch of it;
it owns a list of blocks (its block table), taken from a free list one block at a time as it grows.
Token j of a sequence lives in slot block_table[j // block_size] * block_size + j % block_size.

Why pages: reserving n_ctx tokens for every sequence up front wastes most of the memory on tokens that
never come (most requests stop long before the context limit). With pages, the waste is at most one
partly-filled block per sequence, so many more sequences fit and the batch, and so the throughput, grows.

Pages can also be reused across requests (automatic prefix caching, as vLLM has it): a full block is named by a
hash of its tokens and of the block before it, so requests that start the same way find their first blocks computed.
A freed block keeps its name and stays findable until a fresh block is needed, least recently freed first.
"""
import copy
import hashlib
from collections import OrderedDict
from itertools import takewhile

import numpy as np


class BlockAllocator:
    """Block ids with a reference count each (above 1: shared by a prompt's samples, or by requests that start the
    same way), and the free ones in the order they were freed, oldest first: the next handed out. A free block may
    still hold a full block's KV under its hash (`cached`); it is forgotten only when handed out again."""
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free = OrderedDict.fromkeys(range(num_blocks))  # block 0 is handed out first
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self.cached, self.hash_of = {}, {}  # hash -> block, and back

    def num_free(self):
        return len(self.free)

    def allocate(self):
        if not self.free:
            raise RuntimeError("KV cache is out of blocks")
        block, _ = self.free.popitem(last=False)
        if block in self.hash_of:  # evicted: its KV is about to be overwritten
            del self.cached[self.hash_of.pop(block)]
        self.ref_count[block] = 1
        return block

    def take(self, block):
        """One more owner of a cached block (from the free list, if it was free)."""
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, block):
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released twice")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None

    def name(self, block, block_hash):
        """A full block's KV is computed: it is findable under its hash (unless another block already is)."""
        if block_hash not in self.cached and block not in self.hash_of:
            self.cached[block_hash], self.hash_of[block] = block, block_hash


def block_hashes(token_ids, block_size, parent=b""):
    """The names of token_ids' full blocks, in order (a generator: a lookup stops at its first miss), chained from
    parent, the name of the block before them (b"" at a sequence's start): each is the sha256 of the block before's
    name and its token ids as int64. A collision would hand a request another's KV; with sha256 (vLLM's choice too) it
    is not a practical risk, so a hit is not checked against the tokens."""
    data, step = np.asarray(token_ids, np.int64).tobytes(), 8 * block_size  # one conversion, not one a block
    for i in range(len(data) // step):
        parent = hashlib.sha256(parent + data[i * step:(i + 1) * step]).digest()
        yield parent


class PagedKVCache:
    """The cache tensors of every layer, and the block tables that say where each sequence's tokens live."""
    def __init__(self, backend, n_layer, n_head, head_dim, num_blocks, block_size=16, enable_prefix_caching=True):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.named = {}  # seq_id -> the hashes of its first blocks, those named so far
        self.queries = self.hits = 0  # prompt tokens looked up in the prefix cache, and found
        self.block_tables = {}  # seq_id -> list of block ids
        self._make_tensors(backend, n_layer, n_head, head_dim)

    def _make_tensors(self, backend, n_layer, n_head, head_dim):
        shape = (self.num_blocks, self.block_size, n_head, head_dim)
        self.k = [backend.zeros(shape) for _ in range(n_layer)]
        self.v = [backend.zeros(shape) for _ in range(n_layer)]
        self.nbytes = sum(a.nbytes for a in self.k + self.v)

    def with_tensors(self, backend, n_layer, n_head, head_dim):
        """A cache of its own K/V tensors in this one's blocks (a draft model's, speculation.py): the allocator and the
        block tables are this cache's objects, shared, so that each block holds both models' K/V of its tokens."""
        other = copy.copy(self)
        other._make_tensors(backend, n_layer, n_head, head_dim)
        return other

    @staticmethod
    def bytes_per_token(n_layer, n_head, head_dim, itemsize):
        return 2 * n_layer * n_head * head_dim * itemsize  # K and V, every layer

    @staticmethod
    def pool_blocks(config, backend, num_kv_tokens, fraction, max_num_seqs, block_size, draft_config=None):
        """num_kv_tokens, or what fits (the backend's budget: on a GPU, its memory fraction the weights leave; a draft
        model's K/V share each slot), but no more than the engine can use: max_num_seqs full contexts at once."""
        per_token = sum(PagedKVCache.bytes_per_token(m.n_layer, m.n_head, m.head_dim, backend.dtype.itemsize)
                        for m in (config, draft_config) if m is not None)
        if num_kv_tokens is None:
            budget = backend.kv_cache_budget(fraction)
            if budget < per_token * config.n_ctx:
                raise RuntimeError(f"the KV cache would hold only {int(max(budget, 0) // per_token)} tokens, less than "
                                   f"one full context ({config.n_ctx}): raise gpu_memory_utilization, free GPU memory "
                                   "(other processes hold some), or pass num_kv_tokens")
            num_kv_tokens = int(budget // per_token)
        return min(-(-num_kv_tokens // block_size), max_num_seqs * -(-config.n_ctx // block_size))

    def blocks_needed(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def can_fit(self, seq_id, num_tokens):
        """Can seq_id hold num_tokens tokens, taking blocks only from the free list?"""
        return self.can_fit_all([(seq_id, num_tokens)])

    def can_fit_all(self, wants):
        """Can each (seq_id, num_tokens) of wants hold that many tokens at once, taking blocks from the free list?"""
        new = sum(max(0, self.blocks_needed(n) - len(self.block_tables.get(s, ()))) for s, n in wants)
        return new <= self.allocator.num_free()

    def grow(self, seq_id, num_tokens):
        """Give seq_id enough blocks for num_tokens tokens (the caller checked can_fit)."""
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self.allocator.allocate())

    def share(self, parent_id, child_id, num_blocks):
        """child_id starts as the owner of parent_id's first num_blocks blocks too, full blocks neither writes again:
        the n samples of a prompt hold its KV once. A block goes back to the free list when its last owner frees it."""
        table = self.block_tables[parent_id][:num_blocks]
        self.allocator.ref_count[table] += 1
        self.block_tables[child_id] = list(table)

    def free(self, seq_id):
        """Release seq_id's blocks, its last first: of one request, the last blocks are forgotten before the first."""
        self.named.pop(seq_id, None)
        for block in reversed(self.block_tables.pop(seq_id, ())):
            self.allocator.release(block)

    def take_cached(self, seq_id, token_ids):
        """A sequence with no blocks yet starts with the cached blocks of its first tokens, up to the block holding its
        last token (which it must compute, to sample from its logits): how many tokens they hold."""
        if not self.enable_prefix_caching or seq_id in self.block_tables:
            return 0
        bs, cached = self.block_size, self.allocator.cached
        named = list(takewhile(cached.__contains__, block_hashes(token_ids[:(len(token_ids) - 1) // bs * bs], bs)))
        table = [cached[h] for h in named]  # its first blocks found, to the first miss
        for block in table:
            self.allocator.take(block)
        self.queries += len(token_ids)
        self.hits += len(table) * bs
        if table:
            self.block_tables[seq_id], self.named[seq_id] = table, named
        return len(table) * bs

    def name_computed(self, seq_id, token_ids, num_computed):
        """Name seq_id's full blocks whose KV is computed (the first num_computed tokens): findable from now on."""
        table = self.block_tables.get(seq_id)
        if not self.enable_prefix_caching or table is None:
            return
        named, bs = self.named.setdefault(seq_id, []), self.block_size
        first, end = len(named), min(num_computed // bs, len(table))
        if end <= first:  # most steps fill no block
            return
        for i, h in enumerate(block_hashes(token_ids[first * bs:end * bs], bs, named[-1] if named else b""), first):
            named.append(h)
            self.allocator.name(table[i], h)

    def reset_prefix_cache(self):
        """Forget every cached block (vLLM's reset_prefix_cache): nothing is found until computed again."""
        self.allocator.cached.clear()
        self.allocator.hash_of.clear()
        self.named.clear()

    def slot_mapping(self, block_tables, rows, positions):
        """Each token's cache slot: token t, sequence rows[t]'s positions[t], is in block_tables[rows[t], pos // bs]."""
        return (block_tables[rows, positions // self.block_size] * self.block_size +
                positions % self.block_size).astype(np.int32)

    def block_table_array(self, seq_ids):
        """(S, max_blocks) int32: each sequence's block table padded with 0 (never read); a freed one: all zeros."""
        tables = [self.block_tables.get(s, ()) for s in seq_ids]
        out = np.zeros((len(tables), max([1] + [len(t) for t in tables])), dtype=np.int32)
        for row, table in zip(out, tables):
            row[:len(table)] = table
        return out
