"""Paged KV cache bookkeeping: block hashing, the block pool, per-request blocks, and KV events."""
