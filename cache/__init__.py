"""KV memory: the block allocator (blocks.py: free list, ref counts, prefix hashing, block tables, KVarN side
slots), the KV tensor pools (kv_pool.py: per-token elements; kvarn_pool.py: KVarN tiles and side rows) and
their size (pool_sizing.py), the formats they store (kv_format.py says what a format is; dense_format.py and
kvarn_format.py, with the KVarN codec kvarn.py, are the formats, registered by name in kv_formats.py) and the
KV layouts that say where each token's K/V lives (layout.py). Which request runs next is the scheduler's
business, not this package's."""
