"""The contracts between the parts, imported by both sides of each: block hashing (block_hash),
KV event records and their Redis stream (kv_events), the usage headers a replica answers with
(usage_headers), the replica's OpenAI request bodies (replica_protocol) with their sampling
parameters (sampling_params) and output grammars (output_grammar).

Torch-free; imports nothing of ours but infra/ (checked by the import contracts in pyproject.toml).
"""
