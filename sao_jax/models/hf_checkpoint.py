"""Hugging Face checkpoint layout <-> our stacked Flax parameters.

Hugging Face stores one `[out_features, in_features]` matrix per layer and
projection (`model.layers.{i}.self_attn.q_proj.weight`, ...); we store one
array per projection with a leading layer axis and the heads split out
(`decoder.blocks.attn.q_proj`: `[L, d, H, D]`). This module is the one place
that knows both layouts, in both directions, and reads/writes safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import numpy as np
import safetensors
import safetensors.flax

from sao_jax.models import model_config

Path = tuple[str, ...]


def _layer_specs(cfg: model_config.ModelConfig):
  """(our path under decoder.blocks, HF name suffix, HF shape, ours<-hf, hf<-ours)."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def proj_in(n):  # HF [n*D, d] <-> ours [d, n, D]
    return (lambda w: w.T.reshape(d, n, dh),
            lambda w: w.reshape(d, n * dh).T)

  def bias(n):  # HF [n*D] <-> ours [n, D]
    return (lambda w: w.reshape(n, dh), lambda w: w.reshape(n * dh))

  transpose = (lambda w: w.T, lambda w: w.T)
  same = (lambda w: w, lambda w: w)
  specs = [
      (('attn_norm', 'scale'), 'input_layernorm.weight', (d,), *same),
      (('attn', 'q_proj'), 'self_attn.q_proj.weight', (h * dh, d), *proj_in(h)),
      (('attn', 'k_proj'), 'self_attn.k_proj.weight', (k * dh, d), *proj_in(k)),
      (('attn', 'v_proj'), 'self_attn.v_proj.weight', (k * dh, d), *proj_in(k)),
      (('attn', 'o_proj'), 'self_attn.o_proj.weight', (d, h * dh),
       lambda w: w.T.reshape(h, dh, d), lambda w: w.reshape(h * dh, d).T),
      (('mlp_norm', 'scale'), 'post_attention_layernorm.weight', (d,), *same),
  ]
  if cfg.num_experts:
    specs.append((('mlp', 'router'), 'mlp.gate.weight', (cfg.num_experts, d),
                  *transpose))
  else:
    specs += [
        (('mlp', 'gate_proj'), 'mlp.gate_proj.weight', (f, d), *transpose),
        (('mlp', 'up_proj'), 'mlp.up_proj.weight', (f, d), *transpose),
        (('mlp', 'down_proj'), 'mlp.down_proj.weight', (d, f), *transpose),
    ]
  if cfg.qk_norm:
    specs += [
        (('attn', 'q_norm', 'scale'), 'self_attn.q_norm.weight', (dh,), *same),
        (('attn', 'k_norm', 'scale'), 'self_attn.k_norm.weight', (dh,), *same),
    ]
  if cfg.qkv_bias:
    specs += [
        (('attn', 'q_bias'), 'self_attn.q_proj.bias', (h * dh,), *bias(h)),
        (('attn', 'k_bias'), 'self_attn.k_proj.bias', (k * dh,), *bias(k)),
        (('attn', 'v_bias'), 'self_attn.v_proj.bias', (k * dh,), *bias(k)),
    ]
  return specs


def _expert_specs(cfg: model_config.ModelConfig):
  """(our path, HF name suffix with `{e}`, HF shape) of each routed expert's
  projections; HF stores one `[out, in]` matrix per expert, we one
  `[E, in, out]` array per projection."""
  if not cfg.num_experts:
    return []
  d, f = cfg.hidden_size, cfg.moe_intermediate_size
  return [(('mlp', 'gate_proj'), 'mlp.experts.{e}.gate_proj.weight', (f, d)),
          (('mlp', 'up_proj'), 'mlp.experts.{e}.up_proj.weight', (f, d)),
          (('mlp', 'down_proj'), 'mlp.experts.{e}.down_proj.weight', (d, f))]


def _global_specs(cfg: model_config.ModelConfig):
  d, v = cfg.hidden_size, cfg.vocab_size
  specs = [
      (('decoder', 'embed'), 'model.embed_tokens.weight', (v, d),
       lambda w: w, lambda w: w),
      (('decoder', 'final_norm', 'scale'), 'model.norm.weight', (d,),
       lambda w: w, lambda w: w),
  ]
  if not cfg.tie_embeddings:
    specs.append((('lm_head',), 'lm_head.weight', (v, d),
                  lambda w: w.T, lambda w: w.T))
  return specs


def _checked(tensors: Mapping[str, np.ndarray], name: str, shape, cfg):
  if name not in tensors:
    raise ValueError(f'checkpoint is missing tensor {name!r}')
  tensor = np.asarray(tensors[name])
  if tensor.shape != tuple(shape):
    raise ValueError(
        f'checkpoint tensor {name!r} has shape {tensor.shape}, expected'
        f' {tuple(shape)} from the config (hidden_size={cfg.hidden_size},'
        f' intermediate_size={cfg.intermediate_size}, heads={cfg.num_heads},'
        f' kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim},'
        f' vocab_size={cfg.vocab_size})')
  return tensor


def to_params(tensors: Mapping[str, np.ndarray],
              cfg: model_config.ModelConfig) -> dict[Path, np.ndarray]:
  """HF-named tensors -> `{our parameter path: array}` of a `CausalLM`.

  Raises:
    ValueError: naming the tensor that is missing or has the wrong shape.
  """
  params = {}
  for path, name, shape, to_ours, _ in _global_specs(cfg):
    params[path] = to_ours(_checked(tensors, name, shape, cfg))
  for sub, suffix, shape, to_ours, _ in _layer_specs(cfg):
    layers = [to_ours(_checked(tensors, f'model.layers.{i}.{suffix}', shape, cfg))
              for i in range(cfg.num_layers)]
    params[('decoder', 'blocks') + sub] = np.stack(layers)
  for sub, suffix, shape in _expert_specs(cfg):
    params[('decoder', 'blocks') + sub] = np.stack([
        np.stack([_checked(tensors, f'model.layers.{i}.' + suffix.format(e=e),
                           shape, cfg).T for e in range(cfg.num_experts)])
        for i in range(cfg.num_layers)])
  return params


def from_params(params: Mapping[Path, np.ndarray],
                cfg: model_config.ModelConfig) -> dict[str, np.ndarray]:
  """`{our parameter path: array}` -> HF-named tensors (inverse of `to_params`)."""
  tensors = {}
  for path, name, _, _, to_hf in _global_specs(cfg):
    tensors[name] = np.ascontiguousarray(to_hf(np.asarray(params[path])))
  for sub, suffix, _, _, to_hf in _layer_specs(cfg):
    stacked = np.asarray(params[('decoder', 'blocks') + sub])
    for i in range(cfg.num_layers):
      tensors[f'model.layers.{i}.{suffix}'] = np.ascontiguousarray(
          to_hf(stacked[i]))
  for sub, suffix, _ in _expert_specs(cfg):
    stacked = np.asarray(params[('decoder', 'blocks') + sub])
    for i in range(cfg.num_layers):
      for e in range(cfg.num_experts):
        tensors[f'model.layers.{i}.' + suffix.format(e=e)] = (
            np.ascontiguousarray(stacked[i, e].T))
  return tensors


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
  """All tensors of `model.safetensors` or of the shards of its index."""
  index = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
  else:
    files = sorted(n for n in os.listdir(directory) if n.endswith('.safetensors'))
  if not files:
    raise ValueError(f'{directory}: no *.safetensors file')
  tensors = {}
  # The flax reader, unlike the numpy one, understands bfloat16 (numpy has
  # no such dtype); host memory keeps big checkpoints off the accelerator.
  with jax.default_device(_host_device()):
    for name in files:
      with safetensors.safe_open(os.path.join(directory, name),
                                 framework='flax') as f:
        for key in f.keys():
          tensors[key] = np.asarray(f.get_tensor(key))
  return tensors


def _host_device():
  try:
    return jax.devices('cpu')[0]
  except RuntimeError:  # JAX_PLATFORMS excludes the CPU: use the default.
    return None


def write_safetensors(directory: str, tensors: Mapping[str, np.ndarray],
                      shard_bytes: int = 4 << 30) -> None:
  """Writes `model.safetensors`, or shards plus an index past `shard_bytes`."""
  os.makedirs(directory, exist_ok=True)
  shards, current, size = [], {}, 0
  for name in sorted(tensors):
    tensor = np.ascontiguousarray(tensors[name])
    if current and size + tensor.nbytes > shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = tensor
    size += tensor.nbytes
  shards.append(current)
  def save(shard, filename):
    with jax.default_device(_host_device()):
      safetensors.flax.save_file(
          {k: jax.numpy.asarray(v) for k, v in shard.items()},
          os.path.join(directory, filename), metadata={'format': 'pt'})

  if len(shards) == 1:
    save(shards[0], 'model.safetensors')
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    filename = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    save(shard, filename)
    weight_map.update({name: filename for name in shard})
  total = sum(t.nbytes for t in tensors.values())
  with open(os.path.join(directory, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f,
              indent=2)
