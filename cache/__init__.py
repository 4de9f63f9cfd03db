"""KV memory: the block allocator (blocks.py: free list, ref counts, prefix hashing, block tables, KVarN side
slots), the KV tensor pools (kv_pool.py: per-token elements; kvarn_pool.py: KVarN tiles and side rows), the
formats they store (kv_format.py, kvarn.py) and the KV layouts that say where each token's K/V lives
(layout.py). Which request runs next is the scheduler's business, not this package's."""
