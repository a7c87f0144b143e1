"""Tensor-parallel replicas: one model split across N processes (one per device or CPU core group).

    plan.py      which slice of every dimension a rank holds; the rank's ModelConfig
    shard.py     the slice of each checkpoint tensor, by name
    loading.py   a rank's tensors read from the file (safetensors slices; GGUF cut after
                 dequantizing)
    group.py     the process groups (gloo on the CPU, NCCL on CUDA) and the timed collectives
    layers.py    row-parallel all-reduce, vocab-parallel embedding and lm head
    rank.py      a rank's config and runner
    worker.py    ranks 1..N-1: join, load, then one forward pass per broadcast batch
    executor.py  rank 0: start and supervise the workers, broadcast each step's batch

docs/design/tensor-parallel.md describes the whole.
"""
