"""Architecture hyperparameters of a Llama / Qwen2 / Qwen3 decoder, and HF mapping.

`ModelConfig` is what the Flax modules are built from. It is read from (and
written back to) a Hugging Face `config.json` so that checkpoints round-trip.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from sao_jax import config_lib
from sao_jax.kernels.attention import api as attention_api

ARCHITECTURES = {
    # model_type -> the HF class name written into config.json on export.
    'llama': 'LlamaForCausalLM',
    'qwen2': 'Qwen2ForCausalLM',
    'qwen3': 'Qwen3ForCausalLM',
    'qwen3_moe': 'Qwen3MoeForCausalLM',
}
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
LAYER_LOOPS = ('auto', 'scan', 'unroll')
# `model.moe_routing` -> whether the learner replays the engine's recorded
# experts (routing replay) instead of routing each token itself.
MOE_ROUTINGS = {'learn': False, 'replay': True}
ATTENTIONS = attention_api.CHOICES
# 'auto' unrolls stacks up to this depth off TPU. Measured on CPU (BENCHMARKS.md,
# learner): 2 layers, -24% step time at equal compile time; SmolLM2's 30,
# -6% step time and -1.7 GB of temporaries for +33 s of compile per jitted
# function. On TPU it scans: compile time of deep models matters more there,
# and no TPU number says unrolling pays (none was measured).
AUTO_UNROLL_MAX_LAYERS = 32


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer shape (Llama / Qwen2 / Qwen3 family).

  Attributes:
    model_type: 'llama', 'qwen2' (adds biases to q/k/v) or 'qwen3' (an
      RMSNorm over each query and key head before RoPE, no biases).
    vocab_size: V.
    hidden_size: d, the residual width.
    intermediate_size: F, the SwiGLU hidden width.
    num_layers: L.
    num_heads: H query heads.
    num_kv_heads: K key/value heads (grouped-query attention; H % K == 0).
    head_dim: D per head.
    rope_theta: RoPE base.
    rms_norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reuses the input embedding.
    qkv_bias: q/k/v projections have biases (Qwen2).
    qk_norm: each query and key head is RMS-normalised (its own learned
      `[D]` scale, shared by the heads) after the projection and before
      RoPE (Qwen3).
    num_experts: E routed experts per layer replacing the dense MLP (0: a
      dense SwiGLU MLP; Qwen3-MoE: every layer routed).
    num_experts_per_tok: k experts each token goes to.
    moe_intermediate_size: each expert's SwiGLU hidden width.
    norm_topk_prob: the k chosen router probabilities are renormalised to
      sum to 1 (else they weigh the experts as the softmax gave them).
    max_position_embeddings: longest context the checkpoint was trained for.
    rope_scaling: None, or the Llama-3.1 'llama3' scaling as a tuple of
      (factor, low_freq_factor, high_freq_factor, original_max_position).
    dtype: compute dtype name ('float32' or 'bfloat16').
    param_dtype: parameter storage dtype name.
    bos_token_id, eos_token_id: kept for the exported config.json.
    remat: recompute each layer's activations in the backward pass (saves
      memory in training; no effect on values).
    logits_dtype: the LM head's operand dtype, '' for `dtype`: 'float32'
      under bfloat16 compute runs the head's matmul (and the log-softmax,
      always float32) on float32 operands, the layer where rounding moves
      log-probs most (the vocabulary-wide logsumexp).
    attention: the full-sequence self-attention, a name of
      `attention_api.CHOICES`: 'dense' (the definition, scores in memory,
      quadratic in T), 'blockwise' (online softmax in tiles, linear), 'splash'
      (JAX's TPU kernel) or 'auto' (splash on TPU, blockwise past one tile
      elsewhere, dense below).
  """
  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  max_position_embeddings: int = 2048
  rope_scaling: tuple[float, float, float, int] | None = None
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  remat: bool = False
  layer_loop: str = 'auto'
  logits_dtype: str = ''
  attention: str = 'auto'

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(f'attention={self.attention!r} is not one of'
                       f' {ATTENTIONS}')
    if self.layer_loop not in LAYER_LOOPS:
      raise ValueError(f'layer_loop={self.layer_loop!r} is not one of'
                       f' {LAYER_LOOPS}')
    if self.model_type not in ARCHITECTURES:
      raise ValueError(f'model_type {self.model_type!r} is not supported;'
                       f' expected one of {sorted(ARCHITECTURES)}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads={self.num_heads} is not a multiple of'
                       f' num_kv_heads={self.num_kv_heads}')
    if self.num_experts and not (
        0 < self.num_experts_per_tok <= self.num_experts
        and self.moe_intermediate_size > 0):
      raise ValueError(
          f'num_experts={self.num_experts} needs 0 < num_experts_per_tok'
          f' ({self.num_experts_per_tok}) <= num_experts and'
          f' moe_intermediate_size > 0 ({self.moe_intermediate_size})')
    if self.head_dim % 2:
      raise ValueError(f'head_dim={self.head_dim} must be even for RoPE')
    if self.logits_dtype and self.logits_dtype not in DTYPES:
      raise ValueError(f'logits_dtype={self.logits_dtype!r} is not one of'
                       f" {sorted(DTYPES)} (or '')")
    for name in ('dtype', 'param_dtype'):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f'{name}={getattr(self, name)!r} is not one of'
                         f' {sorted(DTYPES)}')

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def head_dtype(self):
    """The LM head's operand dtype (`logits_dtype`, or the compute dtype)."""
    return DTYPES[self.logits_dtype] if self.logits_dtype else self.compute_dtype

  @property
  def params_dtype(self):
    return DTYPES[self.param_dtype]

  def unroll_layers(self, platform: str) -> bool:
    """Whether the layer stack runs unrolled when built for `platform`."""
    if self.layer_loop != 'auto':
      return self.layer_loop == 'unroll'
    return platform != 'tpu' and self.num_layers <= AUTO_UNROLL_MAX_LAYERS

  def replace(self, **changes) -> 'ModelConfig':
    return dataclasses.replace(self, **changes)

  def rope_inv_freq(self) -> np.ndarray:
    """Inverse RoPE frequencies `[D/2]` (float32), with llama3 scaling if set."""
    exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / self.head_dim
    inv_freq = 1.0 / (self.rope_theta ** exponents)
    if self.rope_scaling is None:
      return inv_freq.astype(np.float32)
    factor, low, high, original = self.rope_scaling
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def from_hf_config(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face `config.json` dict.

  Accepts both the transformers 4 layout (`rope_theta`, `rope_scaling` at the
  top level) and the transformers 5 one (`rope_parameters`).

  Raises:
    ValueError: naming the field for an unsupported architecture, activation
      or RoPE type, or a missing required field.
  """
  model_type = hf.get('model_type')
  if model_type not in ARCHITECTURES:
    raise ValueError(f'config.json: model_type {model_type!r} is not supported;'
                     f' expected one of {sorted(ARCHITECTURES)}')
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'config.json: hidden_act {hf["hidden_act"]!r} is not'
                     ' supported; expected "silu"')
  if hf.get('mlp_bias'):
    raise ValueError('config.json: mlp_bias=true is not supported')
  if model_type != 'llama' and hf.get('use_sliding_window'):
    raise ValueError('config.json: use_sliding_window=true is not supported')

  def need(key):
    if key not in hf:
      raise ValueError(f'config.json: required field {key!r} is missing')
    return hf[key]

  moe = {}
  if model_type == 'qwen3_moe':
    # Every layer routed: the stacked layers share one shape.
    if hf.get('mlp_only_layers') or hf.get('decoder_sparse_step', 1) != 1:
      raise ValueError('config.json: dense layers among routed ones'
                       ' (mlp_only_layers, decoder_sparse_step != 1) are not'
                       ' supported')
    experts = hf.get('num_experts') or hf.get('num_local_experts')
    if not experts:
      raise ValueError("config.json: required field 'num_experts' is missing")
    moe = dict(num_experts=int(experts),
               num_experts_per_tok=int(need('num_experts_per_tok')),
               moe_intermediate_size=int(need('moe_intermediate_size')),
               norm_topk_prob=bool(hf.get('norm_topk_prob', False)))

  rope = dict(hf.get('rope_parameters') or {})
  legacy_scaling = hf.get('rope_scaling') or {}
  rope_theta = rope.get('rope_theta', hf.get('rope_theta', 10000.0))
  rope_type = rope.get('rope_type') or legacy_scaling.get(
      'rope_type', legacy_scaling.get('type', 'default'))
  scaling_fields = {**legacy_scaling, **rope}
  if rope_type == 'default':
    rope_scaling = None
  elif rope_type == 'llama3':
    rope_scaling = (float(scaling_fields['factor']),
                    float(scaling_fields['low_freq_factor']),
                    float(scaling_fields['high_freq_factor']),
                    int(scaling_fields['original_max_position_embeddings']))
  else:
    raise ValueError(f'config.json: rope type {rope_type!r} is not supported;'
                     ' expected "default" or "llama3"')

  num_heads = need('num_attention_heads')
  hidden = need('hidden_size')
  eos = hf.get('eos_token_id')
  fields = dict(
      model_type=model_type,
      vocab_size=need('vocab_size'),
      hidden_size=hidden,
      intermediate_size=need('intermediate_size'),
      num_layers=need('num_hidden_layers'),
      num_heads=num_heads,
      num_kv_heads=hf.get('num_key_value_heads') or num_heads,
      head_dim=hf.get('head_dim') or hidden // num_heads,
      rope_theta=float(rope_theta),
      rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      qkv_bias=bool(hf.get('attention_bias', model_type == 'qwen2')),
      qk_norm=model_type in ('qwen3', 'qwen3_moe'),
      **moe,
      max_position_embeddings=int(hf.get('max_position_embeddings', 2048)),
      rope_scaling=rope_scaling,
      bos_token_id=hf.get('bos_token_id'),
      eos_token_id=eos[0] if isinstance(eos, list) else eos,
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
  """The `config.json` dict for `config` (inverse of `from_hf_config`)."""
  rope: dict[str, Any] = {'rope_theta': config.rope_theta, 'rope_type': 'default'}
  if config.rope_scaling is not None:
    factor, low, high, original = config.rope_scaling
    rope.update(rope_type='llama3', factor=factor, low_freq_factor=low,
                high_freq_factor=high, original_max_position_embeddings=original)
  hf = {
      'architectures': [ARCHITECTURES[config.model_type]],
      'model_type': config.model_type,
      'vocab_size': config.vocab_size,
      'hidden_size': config.hidden_size,
      'intermediate_size': config.intermediate_size,
      'num_hidden_layers': config.num_layers,
      'num_attention_heads': config.num_heads,
      'num_key_value_heads': config.num_kv_heads,
      'head_dim': config.head_dim,
      'hidden_act': 'silu',
      'rms_norm_eps': config.rms_norm_eps,
      'max_position_embeddings': config.max_position_embeddings,
      'tie_word_embeddings': config.tie_embeddings,
      # Both spellings, so transformers 4 and 5 read the same RoPE.
      'rope_theta': config.rope_theta,
      'rope_parameters': rope,
      'bos_token_id': config.bos_token_id,
      'eos_token_id': config.eos_token_id,
      'torch_dtype': config.param_dtype,
  }
  if config.rope_scaling is not None:
    hf['rope_scaling'] = dict(rope)
  if config.model_type == 'llama':
    hf['mlp_bias'] = False
  else:
    hf['use_sliding_window'] = False
  if config.model_type != 'qwen2':  # Qwen2's biases are implied
    hf['attention_bias'] = config.qkv_bias
  if config.num_experts:
    hf.update(num_experts=config.num_experts,
              num_experts_per_tok=config.num_experts_per_tok,
              moe_intermediate_size=config.moe_intermediate_size,
              norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
              mlp_only_layers=[])
  return hf


# -- the config section this module owns (`config.model`) -----------------------


def check_config(check) -> None:
  """`config.model`'s settings (its source is checked with the inputs).

  Args:
    check: a `config_lib.Checker` of the whole config.
  """
  model = check.scope('model')
  model.choice('dtype', config_lib.DTYPES)
  model.choice('param_dtype', config_lib.DTYPES)
  model.choice('logits_dtype', ('',) + config_lib.DTYPES)
  model.choice('attention', ATTENTIONS)
  model.choice('layer_loop', LAYER_LOOPS)
  model.non_negative_int('logits_chunk_size')
  model.choice('moe_routing', MOE_ROUTINGS)
  model.non_negative('router_aux_loss_coef')


def overrides(model) -> dict[str, Any]:
  """The `ModelConfig` fields `config.model` sets (for `from_pretrained`)."""
  return dict(dtype=model.dtype, param_dtype=model.param_dtype,
              remat=model.remat, layer_loop=model.layer_loop,
              logits_dtype=model.get('logits_dtype', ''),
              attention=model.get('attention', 'auto'))
