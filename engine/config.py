"""Engine configuration: frozen dataclasses, validated at construction.

`ModelConfig` describes an architecture (read from GGUF metadata or a Hugging Face config.json);
`CacheConfig` and `SchedulerConfig` describe how a replica serves it; `EngineConfig` nests them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V3 multi-head latent attention. The KV cache holds, per token and layer, only the
    compressed latent and the shared rope key: one "kv head" of kv_lora_rank + qk_rope_head_dim,
    K and V one tensor (engine/models/deepseek_v3.py)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: a plain q_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope dims in interleaved pairs (transformers' default)


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek-V3 routing: sigmoid scores (+ e_score_correction_bias for the choice), the best
    `topk_group` of `n_group` expert groups (by each group's two best scores), top-k inside them,
    weights times `routed_scaling_factor`."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 3 text (engine/models/gemma3.py): what sets it apart from the Llama family."""

    # sliding layers' rope base, unscaled (full layers: rope_theta, rope_scaling)
    local_rope_theta: float
    query_pre_attn_scalar: float  # softmax scale = query_pre_attn_scalar ** -0.5 (not head_dim's)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    attn_logit_softcapping: float | None = None  # the same on attention scores (refused at load)


@dataclass(frozen=True)
class Llama4Config:
    """Llama 4 text (engine/models/llama4.py): per-layer RoPE / NoPE, chunked local attention,
    attention temperature tuning, interleaved MoE layers."""

    # per layer: RoPE + chunked attention (True) or NoPE, global (False)
    rope_layers: tuple[bool, ...]
    attention_chunk_size: int | None  # C: a RoPE layer's query sees its own chunk of C positions
    moe_layers: tuple[int, ...]  # layers with routed experts + a shared expert (others: dense MLP)
    intermediate_size_mlp: int  # the dense layers' MLP (intermediate_size: each expert's)
    use_qk_norm: bool = True  # L2 norm of q and k (no weight) on the RoPE layers, after RoPE
    # NoPE layers: q *= 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture (dense, or MoE when `num_experts` > 0)."""

    architecture: str  # "llama", "mixtral", "qwen2_moe", "olmoe", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF rope_scaling dict as sorted items
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (0 experts = dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # MoE layer placement (Qwen2-MoE / Qwen3-MoE): layer i is sparse iff i not in `mlp_only_layers`
    # and (i + 1) % decoder_sparse_step == 0; the other layers have a dense MLP of
    # intermediate_size.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # RMSNorm of q and k before RoPE: None, "projection" (OLMoE: over all heads' q / k at once,
    # weights [H * Dh] / [G * Dh]) or "per_head" (Qwen3: over each head's Dh, weights [Dh]).
    qk_norm: str | None = None
    # gpt-oss experts' clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    # g = min(gate, limit) (engine/kernels/activation.py::ClampedSwiGLU)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Attention layout: HF `layer_types` ("full_attention" / "sliding_attention" per layer; None:
    # all full) and the window W of the sliding layers (a query at p sees positions p-W+1..p;
    # required when a layer slides).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # Tokens: every id that ends a generation (eos and end-of-turn tokens)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    model_id: str = "model"
    # DeepSeek-V3 (None elsewhere): latent attention (num_kv_heads 1, head_dim = latent + rope dims)
    # and grouped top-k routing
    mla: MLAConfig | None = None
    grouped_topk: GroupedTopK | None = None
    # Gemma 3 (None elsewhere): local rope base, softmax scale, soft-capping
    gemma: GemmaConfig | None = None
    # Llama 4 text (None elsewhere): NoPE layers, chunked attention, temperature tuning, MoE
    # placement
    llama4: Llama4Config | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError("num_experts_per_tok must be in 1..num_experts")
        self._check_attention_layout()
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.qk_norm not in (None, "projection", "per_head"):
            raise ValueError("qk_norm must be None, 'projection' or 'per_head', got "
                             f"{self.qk_norm!r}")

    def _check_attention_layout(self) -> None:
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                 f"{self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"unsupported layer_types {unknown} (supported: "
                                 f"{list(LAYER_TYPES)})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_window is None and "sliding_attention" in (self.layer_types or ()):
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not "
                             "set")
        if self.sliding_window is not None and self.layer_types is None:
            raise ValueError("sliding_window is set but layer_types is not: name the sliding "
                             "layers")

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of decoder layer `layer` in tokens, or None for full attention."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_attention_chunk(self, layer: int) -> int | None:
        """The attention chunk of decoder layer `layer` (Llama 4's RoPE layers), or None."""
        if self.llama4 is not None and self.llama4.rope_layers[layer]:
            return self.llama4.attention_chunk_size
        return None

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.layer_sliding_window(i) is not None for i in range(self.num_layers))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the routed experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_is_shared(self) -> bool:
        """K and V are one cache tensor (MLA's latent), so a token costs one vector per layer."""
        return self.mla is not None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `block_size` is in tokens, `kv_cache_memory_bytes` is the whole budget."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True
    # KV retention (engine/kv_cache/retention.py): the longest time a request may keep its prefix
    # from eviction after it finishes (longer asks are clamped), and the fractions of the pool that
    # retained prefixes may hold per project (cache salt) and in all
    max_retention_s: float = 3600.0
    retention_share_per_project: float = 0.25
    retention_share_total: float = 0.5
    # The second KV tier (engine/kv_cache/host_tier.py): bytes for blocks evicted from the pool,
    # kept to be restored on a prefix hit instead of recomputed (0: none). CUDA: pinned host memory;
    # CPU: a mapped file in `host_tier_dir` (None: the system's temporary directory).
    host_tier_bytes: int = 0
    host_tier_dir: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.host_tier_bytes < 0:
            raise ValueError(f"host_tier_bytes must be >= 0, got {self.host_tier_bytes}")
        if not 0.0 <= self.max_retention_s <= 7 * 86_400:
            raise ValueError(f"max_retention_s must be in 0..604800, got {self.max_retention_s}")
        for name in ("retention_share_per_project", "retention_share_total"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in 0..1, got {getattr(self, name)}")


SCHEDULER_POLICIES = ("fixed", "slo")


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step; `max_num_seqs` caps the running batch.

    Latency targets (engine/slo.py): `ttft_p90_ms` (admission refuses requests whose predicted
    queueing would break it) and `tpot_p90_ms` (policy "slo" sizes each step so running decodes
    keep it; "fixed" keeps `max_num_batched_tokens` every step). None: no target.
    `reserved_shares`: (project, fraction) pairs, a project's provisioned share of each step's
    token budget and of the KV blocks, which other projects cannot take while it has work
    (engine/reserved_shares.py). `flex_max_wait_ms`: a flex request waiting longer is scheduled
    as default (engine/flex_aging.py; None: 2 x flex's TTFT bound, or 60 s without a TTFT
    target; inf: never)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Longest-cached-prefix-first among the first `prefix_aware_window` waiting requests.
    prefix_aware_window: int = 8
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    policy: str = "fixed"
    reserved_shares: tuple[tuple[str, float], ...] = ()
    flex_max_wait_ms: float | None = None

    def __post_init__(self) -> None:
        if self.flex_max_wait_ms is not None and not self.flex_max_wait_ms > 0.0:  # (NaN too)
            raise ValueError("flex_max_wait_ms must be a positive number of milliseconds (or "
                             "inf), "
                             f"got {self.flex_max_wait_ms}")
        for name in ("ttft_p90_ms", "tpot_p90_ms"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value < 3_600_000.0:  # (NaN too)
                raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")
        if self.policy not in SCHEDULER_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULER_POLICIES}, got {self.policy!r}")
        projects = [project for project, _ in self.reserved_shares]
        if len(set(projects)) != len(projects) or not all(projects):
            raise ValueError("reserved_shares: each project once, by a non-empty name")
        if not all(0.0 < share < 1.0 for _, share in self.reserved_shares):
            raise ValueError("reserved_shares: every share must be in (0, 1)")
        if sum(share for _, share in self.reserved_shares) > 0.9:
            raise ValueError("reserved_shares: the shares may hold at most 0.9 of the replica "
                             "together")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running "
                             "request needs a token of budget per step)")
        if self.prefix_aware_window < 1:
            raise ValueError("prefix_aware_window must be >= 1")


QUANTIZE_AT_LOAD = ("q8_0", "q4_1")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    num_threads: int | None = None  # torch intra-op threads on CPU; None: all cores
    compile: bool = False  # torch.compile the decode step
    quantization: str | None = None  # None or "fp8"
    # "float": every linear in `dtype`. "q4": the GGUF's own quantized blocks; with the native CPU
    # kernels (engine/kernels/cpu) every row runs on them with 8-bit activations, decode rows
    # through the fused native decode step and a float16 KV cache (engine/models/llama_decode.py);
    # without them, decode rows use PyTorch's int4 kernel (engine/layers/q4_linear.py). Approximate
    # numerics.
    decode_weights: str = "float"
    # the q4 mode with the native kernels: the block format a float weight (one the file holds in no
    # native block type) is quantized into at load: "q8_0" (near-lossless) or "q4_1" (faster,
    # coarser)
    quantize_at_load: str = "q8_0"
    replica_id: str = "replica-0"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    # N > 1: the model split across N processes, one per CUDA device (cuda:0..N-1) or per share of
    # the CPU cores (engine/parallel/; the KV budget is the replica's, over all N)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.decode_weights not in ("float", "q4"):
            raise ValueError(f"unsupported decode_weights {self.decode_weights!r}")
        if self.quantize_at_load not in QUANTIZE_AT_LOAD:
            raise ValueError(f"quantize_at_load must be one of {QUANTIZE_AT_LOAD}, got "
                             f"{self.quantize_at_load!r}")
        if self.decode_weights == "q4" and not self.device.startswith("cpu"):
            raise ValueError("decode_weights='q4' is a CPU path")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unsupported quantization {self.quantization!r}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError("tensor_parallel_size must be in 1..64, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.cache.host_tier_bytes or self.compile):
            raise ValueError("tensor_parallel_size > 1 does not run with the KV host tier or "
                             "compile")
        for name in ("num_threads", "max_model_len"):  # None means "the default", 0 is no count
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @cached_property
    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"
