"""Named architectures of public checkpoints, for planning runs without weights.

`python -m sao_jax.tools.aot_compile` compiles a sharded train step for a TPU
topology from shapes alone; these are the shapes of well-known Llama, Qwen2
and Qwen3 models (as in their Hugging Face `config.json`). Select one with
`config.model.source = 'arch:<name>'`; real training loads the weights from a
checkpoint directory instead.
"""

from __future__ import annotations

from sao_jax.models import model_config

_LLAMA3_ROPE = (32.0, 1.0, 4.0, 8192)  # Llama 3.1/3.2 'llama3' RoPE scaling

ARCHITECTURES = {
    'smollm2-135m': model_config.ModelConfig(
        'llama', 49152, 576, 1536, 30, 9, 3, 64, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=8192),
    'llama3.2-1b': model_config.ModelConfig(
        'llama', 128256, 2048, 8192, 16, 32, 8, 64, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=131072,
        rope_scaling=_LLAMA3_ROPE),
    'llama3.1-8b': model_config.ModelConfig(
        'llama', 128256, 4096, 14336, 32, 32, 8, 128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling=(8.0, 1.0, 4.0, 8192)),
    'qwen2.5-1.5b': model_config.ModelConfig(
        'qwen2', 151936, 1536, 8960, 28, 12, 2, 128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        max_position_embeddings=32768),
    'qwen2.5-7b': model_config.ModelConfig(
        'qwen2', 152064, 3584, 18944, 28, 28, 4, 128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768),
    # Qwen3: head_dim 128 whatever the width (0.6B: 16 x 128 > 1024).
    'qwen3-0.6b': model_config.ModelConfig(
        'qwen3', 151936, 1024, 3072, 28, 16, 8, 128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
        max_position_embeddings=40960),
    'qwen3-8b': model_config.ModelConfig(
        'qwen3', 151936, 4096, 12288, 36, 32, 8, 128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=40960),
    # 128 routed experts of width 768, 8 per token, in every layer.
    'qwen3-30b-a3b': model_config.ModelConfig(
        'qwen3_moe', 151936, 2048, 6144, 48, 32, 4, 128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, qk_norm=True, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        max_position_embeddings=40960),
}


def get(name: str, **overrides) -> model_config.ModelConfig:
  """The named architecture, with dtype/remat overrides."""
  if name not in ARCHITECTURES:
    raise ValueError(f'unknown architecture {name!r}; expected one of'
                     f' {sorted(ARCHITECTURES)}')
  return ARCHITECTURES[name].replace(**overrides)
