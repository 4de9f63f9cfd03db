"""KV memory: the block allocator (blocks.py: free list, ref counts, prefix hashing, block tables), the
KV tensor pool (kv_pool.py), and the KV layouts that say where each token's K/V lives (layout.py).
Which request runs next is the scheduler's business, not this package's."""
