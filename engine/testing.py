"""Random-weight engines for benchmarks and tests: no files, no real tokenizer.

    eng = build_random_engine("mixtral", dtype="bfloat16", quantization="fp8", num_layers=8)
    outs = eng.generate([[1, 2, 3], [4, 5]], max_tokens=16)   # greedy; outs[i].token_ids

The default shapes are Mixtral-8x7B's (hidden 4096, 8 experts of 14336, top-2, 32 heads over 8 kv
heads, vocab 32000) with `num_layers` layers; pass `model_config` for other shapes (tests use tiny
ones). Weights are drawn on the target device in the target dtype (normal, std 0.02; norms 1), with
the expert tensors in transformers 5's fused layout, and loaded through the normal ModelRunner path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.loader import Tokenizer
from engine.model_runner import ModelRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mixtral_config(num_layers: int) -> ModelConfig:
    """Mixtral-8x7B's shapes with `num_layers` decoder layers."""
    return ModelConfig(architecture="mixtral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=num_layers, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=4096, rope_theta=1e6, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
                       model_id="random-mixtral")


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights for a Llama / Mixtral / Qwen3-style `config` (q/k norms when it has
    them; a dense MLP on the layers that are not sparse)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, q, kv = (config.hidden_size, config.num_heads * config.head_dim,
                config.num_kv_heads * config.head_dim)
    weights = {"model.embed_tokens.weight": randn(config.vocab_size, h),
               "model.norm.weight": ones(h), "lm_head.weight": randn(config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": ones(h),
                    p + "post_attention_layernorm.weight": ones(h),
                    p + "self_attn.q_proj.weight": randn(q, h),
                    p + "self_attn.k_proj.weight": randn(kv, h),
                    p + "self_attn.v_proj.weight": randn(kv, h),
                    p + "self_attn.o_proj.weight": randn(h, q)}
        # per head (Qwen3): [Dh]; over the projection (OLMoE): [Q], [K]
        if config.qk_norm is not None:
            per_head = config.qk_norm == "per_head"
            weights |= {p + "self_attn.q_norm.weight": ones(config.head_dim if per_head else q),
                        p + "self_attn.k_norm.weight": ones(config.head_dim if per_head else kv)}
        if config.is_sparse_layer(i):
            e, inter = config.num_experts, config.moe_intermediate_size
            weights |= {p + "mlp.gate.weight": randn(e, h),
                        p + "mlp.experts.gate_up_proj": randn(e, 2 * inter, h),  # [E, 2I, H]
                        p + "mlp.experts.down_proj": randn(e, h, inter)}  # [E, H, I]
        else:
            inter = config.intermediate_size
            weights |= {p + "mlp.gate_proj.weight": randn(inter, h),
                        p + "mlp.up_proj.weight": randn(inter, h),
                        p + "mlp.down_proj.weight": randn(h, inter)}
    return weights


def placeholder_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer whose ids 0..vocab_size-1 decode to "t0", "t1", ... (for
    detokenization)."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = BackendTokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, chat_template=None, bos_token_id=None, eos_token_id=None)


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)


class RandomEngine:
    """An LLMEngine plus a blocking batch `generate` (greedy, eos ignored: exactly max_tokens
    each)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._num_requests = 0

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int) -> list[Generation]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request_ids = []
        for prompt in prompt_token_ids:
            request_ids.append(f"random-{self._num_requests}")
            self._num_requests += 1
            self.engine.add_request(request_ids[-1], list(prompt), params)
        results = {r: Generation() for r in request_ids}
        max_steps = len(prompt_token_ids) * (max_tokens + max(map(len, prompt_token_ids)) + 1) + 100
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests:
                return [results[r] for r in request_ids]
            for output in self.engine.step():
                results[output.request_id].token_ids += output.new_token_ids
        raise RuntimeError(f"requests unfinished after {max_steps} steps")


def build_random_engine(arch: str = "mixtral", dtype: str | None = None,
                        quantization: str | None = None,
                        num_layers: int = 2, *, device: str | None = None,
                        model_config: ModelConfig | None = None,
                        kv_cache_memory_bytes: int | None = None,
                        max_num_batched_tokens: int = 8192, max_num_seqs: int = 64,
                        seed: int = 0) -> RandomEngine:
    """A random-weight engine of architecture `arch` ("mixtral" shapes unless `model_config` is
    given).

    device: default "cuda" when available; dtype: default float32 on CPU, bfloat16 on CUDA;
    quantization: None or "fp8" (the engine's --quantization).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config or mixtral_config(num_layers)
    if config.architecture != arch:
        raise ValueError(f"model_config is {config.architecture!r}, asked for {arch!r}")
    on_gpu = device.startswith("cuda")
    engine_config = EngineConfig(
        model_path="<random>", device=device, dtype=dtype, quantization=quantization,
        num_threads=None if on_gpu else 1, seed=seed,
        cache=CacheConfig(kv_cache_memory_bytes=kv_cache_memory_bytes or (8 << 30 if on_gpu
                                                                          else 64 << 20)),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs))
    torch_dtype = _DTYPES[engine_config.resolved_dtype]
    weights = random_weights(config, torch.device(device), torch_dtype, seed)
    runner = ModelRunner(engine_config, config, weights)
    return RandomEngine(LLMEngine(engine_config, config, runner,
                                  placeholder_tokenizer(config.vocab_size)))
