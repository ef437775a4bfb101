"""The paged KV cache: PagedAttention's idea in a few dozen lines.

Decoding reuses every earlier token's keys and values, so we keep them: per layer, one K and one V tensor
of shape (num_blocks, block_size, n_head, head_dim). A sequence does not own a contiguous stretch of it;
it owns a list of blocks (its block table), taken from a free list one block at a time as it grows.
Token j of a sequence lives in slot block_table[j // block_size] * block_size + j % block_size.

Why pages: reserving n_ctx tokens for every sequence up front wastes most of the memory on tokens that
never come (most requests stop long before the context limit). With pages, the waste is at most one
partly-filled block per sequence, so many more sequences fit and the batch, and so the throughput, grows.
"""
import numpy as np


class BlockAllocator:
    """A free list of block ids with a reference count each (above 1: a prompt's block its n samples share)."""
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)

    def num_free(self):
        return len(self.free)

    def allocate(self):
        if not self.free:
            raise RuntimeError("KV cache is out of blocks")
        block = self.free.pop()
        self.ref_count[block] = 1
        return block

    def release(self, block):
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released twice")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.append(block)


class PagedKVCache:
    """The cache tensors of every layer, and the block tables that say where each sequence's tokens live."""
    def __init__(self, backend, n_layer, n_head, head_dim, num_blocks, block_size=16):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, n_head, head_dim)
        self.k = [backend.zeros(shape) for _ in range(n_layer)]
        self.v = [backend.zeros(shape) for _ in range(n_layer)]
        self.block_tables = {}  # seq_id -> list of block ids
        self.nbytes = sum(a.nbytes for a in self.k + self.v)

    @staticmethod
    def bytes_per_token(n_layer, n_head, head_dim, itemsize):
        return 2 * n_layer * n_head * head_dim * itemsize  # K and V, every layer

    @staticmethod
    def pool_blocks(config, backend, num_kv_tokens, fraction, max_num_seqs, block_size):
        """num_kv_tokens, or what fits (the backend's budget: on a GPU, its memory fraction the weights leave), but never
        more than the engine can use: max_num_seqs full contexts are the most alive at once."""
        c = config
        per_token = PagedKVCache.bytes_per_token(c.n_layer, c.n_head, c.head_dim, backend.dtype.itemsize)
        if num_kv_tokens is None:
            budget = backend.kv_cache_budget(fraction)
            if budget < per_token * c.n_ctx:
                raise RuntimeError(f"the KV cache would hold only {int(max(budget, 0) // per_token)} tokens, less than "
                                   f"one full context ({c.n_ctx}): raise gpu_memory_utilization, free GPU memory "
                                   "(other processes hold some), or pass num_kv_tokens")
            num_kv_tokens = int(budget // per_token)
        blocks = min(-(-num_kv_tokens // block_size), max_num_seqs * -(-c.n_ctx // block_size))
        return blocks

    def blocks_needed(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self):
        return self.allocator.num_free()

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
        for block in self.block_tables.pop(seq_id, ()):
            self.allocator.release(block)

    def slot_mapping(self, block_tables, rows, positions):
        """Each token's cache slot: token t, sequence rows[t]'s positions[t], is in block_tables[rows[t], pos // bs]."""
        return (block_tables[rows, positions // self.block_size] * self.block_size +
                positions % self.block_size).astype(np.int32)

    def block_table_array(self, seq_ids):
        """(S, max_blocks) int32: each sequence's block table padded with 0 (never read); a freed one: all zeros."""
        tables = [self.block_tables.get(s, ()) for s in seq_ids]
        out = np.zeros((len(tables), max(1, max(len(t) for t in tables))), dtype=np.int32)
        for row, table in zip(out, tables):
            row[:len(table)] = table
        return out
