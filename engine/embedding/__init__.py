"""The embedding path: a BERT-style encoder, pooling and normalization, batched across requests
(engine/embedding/embedder.py). It shares no state with the generation engine (no KV cache, no
scheduler): an embedding replica serves only this (engine/server/embeddings.py)."""
