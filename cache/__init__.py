"""KV memory: the block allocator (blocks.py: free list, ref counts, prefix hashing, block tables) and
the KV tensor pool (kv_pool.py). Which request runs next is the scheduler's business, not this package's."""
