"""GGUF reading against gguf-py's dequantizer and transformers' GGUF loader."""

import os
import re

import gguf
from gguf import quants
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from sao_jax.models import decoding
from sao_jax.models import gguf_checkpoint
from sao_jax.models import hf_checkpoint
from sao_jax.models import model_config
from sao_jax.models import pretrained
from sao_jax.models import sampling
import sao_jax.models


@pytest.fixture(scope='module')
def gguf_path():
  return gguf_checkpoint.find_smollm2_gguf()


@pytest.fixture(scope='module')
def reader(gguf_path):
  return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope='module')
def loaded(gguf_path):
  return gguf_checkpoint.read_gguf(gguf_path)


@pytest.fixture(scope='module')
def hf_model(gguf_path):
  # transformers dequantizes with its own code and undoes llama.cpp's q/k
  # permutation itself, so this is an independent reference for both.
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
      dtype=torch.float32)


def test_find_smollm2_gguf(gguf_path):
  assert gguf_path.endswith('.gguf') and os.path.isfile(gguf_path)


@pytest.mark.parametrize('name', [
    'token_embd.weight',  # Q8_0
    'blk.0.attn_q.weight',  # Q4_1
    'blk.0.ffn_down.weight',  # Q4_1, [576, 1536]
    'blk.29.attn_k.weight',  # Q4_1
    'blk.0.attn_norm.weight',  # F32
])
def test_dequantize_matches_gguf_quants(reader, name):
  tensor = next(t for t in reader.tensors if t.name == name)
  shape = tuple(int(d) for d in reversed(tensor.shape))
  got = gguf_checkpoint.dequantize(tensor.data, tensor.tensor_type, shape)
  want = quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
  assert got.dtype == np.float32 and got.shape == shape
  np.testing.assert_array_equal(got, want)


def test_the_file_has_the_types_tested_above(reader):
  types = {t.tensor_type.name for t in reader.tensors}
  assert types == {'Q8_0', 'Q4_1', 'F32'}


def _f16_bytes(x):
  return np.array([x], '<f2').view(np.uint8)


def test_dequantize_q4_1_hand_built_block():
  d, m = 0.5, -3.0
  low = np.arange(16, dtype=np.uint8)  # weights 0..15
  high = 15 - np.arange(16, dtype=np.uint8)  # weights 16..31
  block = np.concatenate([_f16_bytes(d), _f16_bytes(m), low | (high << 4)])
  want = np.concatenate([d * low + m, d * high + m]).astype(np.float32)
  got = gguf_checkpoint.dequantize(block, gguf.GGMLQuantizationType.Q4_1,
                                   (32,))
  np.testing.assert_array_equal(got, want)
  # Two blocks form one row of 64 weights, in order.
  two = gguf_checkpoint.dequantize(np.concatenate([block, block]),
                                   gguf.GGMLQuantizationType.Q4_1, (1, 64))
  np.testing.assert_array_equal(two, np.tile(want, 2)[None])


def test_dequantize_q8_0_hand_built_block():
  q = np.arange(-16, 16, dtype=np.int8)
  block = np.concatenate([_f16_bytes(0.25), q.view(np.uint8)])
  got = gguf_checkpoint.dequantize(block, gguf.GGMLQuantizationType.Q8_0,
                                   (32,))
  np.testing.assert_array_equal(got, 0.25 * q.astype(np.float32))


def test_dequantize_f16_and_bf16():
  values = np.array([[1.0, -2.5], [3.140625, 61440.0]], np.float32)
  f16 = values.astype(np.float16).view(np.uint8)
  np.testing.assert_array_equal(
      gguf_checkpoint.dequantize(f16, gguf.GGMLQuantizationType.F16, (2, 2)),
      values)
  # These values are exact in float16 and in bfloat16 (the top 16 bits of
  # their float32).
  bf16 = (values.view(np.uint32) >> 16).astype('<u2').view(np.uint8)
  np.testing.assert_array_equal(
      gguf_checkpoint.dequantize(bf16, gguf.GGMLQuantizationType.BF16, (2, 2)),
      values)


def test_dequantize_rejects_unsupported_type_and_bad_size():
  with pytest.raises(ValueError, match='Q4_0'):
    gguf_checkpoint.dequantize(np.zeros(18, np.uint8),
                               gguf.GGMLQuantizationType.Q4_0, (32,))
  with pytest.raises(ValueError, match='bytes'):
    gguf_checkpoint.dequantize(np.zeros(19, np.uint8),
                               gguf.GGMLQuantizationType.Q4_1, (32,))


def test_read_gguf_tensors_match_transformers(loaded, hf_model):
  _, tensors, _ = loaded
  state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
  # transformers' state dict lists the tied lm_head; read_gguf leaves it out.
  np.testing.assert_array_equal(state.pop('lm_head.weight'),
                                state['model.embed_tokens.weight'])
  assert sorted(tensors) == sorted(state)
  for name, want in state.items():
    got = tensors[name]
    assert got.dtype == np.float32 and got.shape == want.shape, name
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)


def test_read_gguf_config_matches_transformers(loaded, hf_model):
  config, _, tok = loaded
  hf = hf_model.config
  for key in ('vocab_size', 'hidden_size', 'intermediate_size',
              'num_hidden_layers', 'num_attention_heads',
              'num_key_value_heads', 'head_dim', 'max_position_embeddings',
              'tie_word_embeddings', 'bos_token_id', 'eos_token_id',
              'pad_token_id', 'attention_bias', 'mlp_bias', 'hidden_act',
              'model_type'):
    assert config[key] == getattr(hf, key), key
  rope = getattr(hf, 'rope_parameters', None) or {}
  assert config['rope_theta'] == rope.get('rope_theta',
                                          getattr(hf, 'rope_theta', None))
  # GGUF stores eps as float32; both sides are the same float32.
  assert np.float32(config['rms_norm_eps']) == np.float32(hf.rms_norm_eps)
  assert config['architectures'] == ['LlamaForCausalLM']
  assert config['torch_dtype'] == 'float32'
  assert (tok.bos_id, tok.eos_id) == (config['bos_token_id'],
                                      config['eos_token_id'])
  # The exact values of SmolLM2-135M(-Instruct)'s config.json.
  assert (config['rope_theta'], config['rms_norm_eps']) == (100000.0, 1e-5)


def test_read_gguf_config_builds_a_transformers_model(loaded):
  config, _, _ = loaded
  hf_config = transformers.LlamaConfig(**config)
  assert hf_config.num_key_value_heads == 3
  assert hf_config.tie_word_embeddings


# A tiny llama GGUF written here: F32 tensors with known values, so that the
# q/k permutation and the error paths are checked without transformers.
_TINY = dict(hidden=16, heads=4, kv_heads=2, ffn=24, vocab=8, layers=2)


def _llama_cpp_permute(w, n_head):
  """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _tiny_hf_tensors(rng):
  t = _TINY
  head_dim = t['hidden'] // t['heads']
  shapes = {'model.embed_tokens.weight': (t['vocab'], t['hidden']),
            'model.norm.weight': (t['hidden'],),
            'lm_head.weight': (t['vocab'], t['hidden'])}
  for i in range(t['layers']):
    prefix = f'model.layers.{i}.'
    shapes.update({
        prefix + 'input_layernorm.weight': (t['hidden'],),
        prefix + 'post_attention_layernorm.weight': (t['hidden'],),
        prefix + 'self_attn.q_proj.weight': (t['hidden'], t['hidden']),
        prefix + 'self_attn.k_proj.weight': (t['kv_heads'] * head_dim,
                                             t['hidden']),
        prefix + 'self_attn.v_proj.weight': (t['kv_heads'] * head_dim,
                                             t['hidden']),
        prefix + 'self_attn.o_proj.weight': (t['hidden'], t['hidden']),
        prefix + 'mlp.gate_proj.weight': (t['ffn'], t['hidden']),
        prefix + 'mlp.up_proj.weight': (t['ffn'], t['hidden']),
        prefix + 'mlp.down_proj.weight': (t['hidden'], t['ffn']),
    })
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _gguf_name(hf_name):
  for hf, g in [('model.embed_tokens', 'token_embd'),
                ('model.norm', 'output_norm'), ('lm_head', 'output'),
                ('model.layers.', 'blk.'),
                ('input_layernorm', 'attn_norm'),
                ('post_attention_layernorm', 'ffn_norm'),
                ('self_attn.q_proj', 'attn_q'), ('self_attn.k_proj', 'attn_k'),
                ('self_attn.v_proj', 'attn_v'),
                ('self_attn.o_proj', 'attn_output'),
                ('mlp.gate_proj', 'ffn_gate'), ('mlp.up_proj', 'ffn_up'),
                ('mlp.down_proj', 'ffn_down')]:
    hf_name = hf_name.replace(hf, g)
  return hf_name


def _write_tiny_llama(path, hf_tensors, arch='llama', drop=(), extra=()):
  t = _TINY
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(t['layers'])
  writer.add_context_length(128)
  writer.add_embedding_length(t['hidden'])
  writer.add_feed_forward_length(t['ffn'])
  writer.add_head_count(t['heads'])
  writer.add_head_count_kv(t['kv_heads'])
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_tokenizer_model('gpt2')
  writer.add_tokenizer_pre('smollm')
  writer.add_token_list(['<|endoftext|>', 'a', 'b', 'c', 'd', 'e', 'f', 'ab'])
  writer.add_token_types([3] + [1] * 7)
  writer.add_token_merges(['a b'])  # llama.cpp requires merges.
  writer.add_eos_token_id(0)
  for hf_name, value in hf_tensors.items():
    name = _gguf_name(hf_name)
    if name in drop:
      continue
    if name.endswith('attn_q.weight'):
      value = _llama_cpp_permute(value, t['heads'])
    elif name.endswith('attn_k.weight'):
      value = _llama_cpp_permute(value, t['kv_heads'])
    writer.add_tensor(name, value)  # numpy order; GGUF stores ne reversed.
  for name in extra:
    writer.add_tensor(name, np.zeros(4, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def test_read_gguf_undoes_the_rope_permutation(tmp_path):
  want = _tiny_hf_tensors(np.random.default_rng(0))
  path = _write_tiny_llama(tmp_path / 'tiny.gguf', want)
  config, tensors, tok = gguf_checkpoint.read_gguf(path)
  assert sorted(tensors) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(tensors[name], value, err_msg=name)
  assert not config['tie_word_embeddings']
  assert config['head_dim'] == 4 and config['num_key_value_heads'] == 2
  assert config['bos_token_id'] is None and config['eos_token_id'] == 0
  assert tok.eos_id == 0


def test_read_gguf_rejects_another_architecture(tmp_path):
  path = _write_tiny_llama(tmp_path / 'tiny.gguf',
                           _tiny_hf_tensors(np.random.default_rng(0)),
                           arch='qwen2')
  with pytest.raises(ValueError, match=r"general\.architecture 'qwen2'"):
    gguf_checkpoint.read_gguf(path)


def test_read_gguf_names_a_missing_tensor(tmp_path):
  path = _write_tiny_llama(tmp_path / 'tiny.gguf',
                           _tiny_hf_tensors(np.random.default_rng(0)),
                           drop=('blk.1.ffn_up.weight',))
  with pytest.raises(ValueError, match=r'blk\.1\.ffn_up\.weight'):
    gguf_checkpoint.read_gguf(path)


def test_read_gguf_names_an_unexpected_tensor(tmp_path):
  path = _write_tiny_llama(tmp_path / 'tiny.gguf',
                           _tiny_hf_tensors(np.random.default_rng(0)),
                           extra=('blk.0.attn_q.bias',))
  with pytest.raises(ValueError, match=r'blk\.0\.attn_q\.bias'):
    gguf_checkpoint.read_gguf(path)


def test_smollm2_logits_match_transformers_gguf_model(loaded, hf_model):
  hf_config, tensors, tok = loaded
  cfg = model_config.from_hf_config(hf_config)
  model = pretrained.build(cfg, hf_checkpoint.to_params(tensors, cfg))
  ids = tok.encode_chat([{'role': 'user', 'content': 'Name three colours.'}])
  with torch.no_grad():
    want = hf_model(torch.tensor([ids])).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, x: m(x))(model, np.array([ids])))
  assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_smollm2_answers_a_sum_greedily():
  model, tok = sao_jax.models.from_pretrained('smollm2-135m-instruct')
  prompt = tok.encode_chat(
      [{'role': 'user', 'content': 'What is 2+3? Answer with a number.'}])
  (out,) = decoding.generate(model, [prompt], 16,
                             sampling.SamplingParams(temperature=0),
                             stop_ids=tok.stop_ids)
  answer = tok.decode(out.tokens, skip_special_tokens=True)
  assert out.stopped
  # The model answers "2 + 3 = 5": the last number it states is the answer.
  assert re.findall(r'\d+', answer)[-1] == '5', answer
