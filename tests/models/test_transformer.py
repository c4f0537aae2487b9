"""The Flax decoder against Hugging Face transformers (CPU torch) on tiny models."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from flax import nnx

from sao_jax.models import decoding
from sao_jax.models import hf_checkpoint
from sao_jax.models import model_config
from sao_jax.models import pretrained
from sao_jax.models import sampling
from sao_jax.models import transformer

VOCAB = 101
KINDS = {
    'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False)),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True)),
    'llama3_rope': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(rope_scaling=dict(
                        rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0,
                        original_max_position_embeddings=64),
                         max_position_embeddings=512)),
    # head_dim 32 with 4 heads of a 64-wide residual, as Qwen3-0.6B's
    # 16 x 128 heads of a 1024-wide one.
    'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(tie_word_embeddings=False, head_dim=32)),
}


def save_tiny_tokenizer(directory):
  """A word-level tokenizer over VOCAB ids with a chat template, HF layout."""
  vocab = {f'w{i}': i for i in range(VOCAB)}
  vocab.update({'<unk>': 0, '<s>': 1, '</s>': 2})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token='<s>', eos_token='</s>', unk_token='<unk>')
  fast.chat_template = ('{% for m in messages %}{{ m["role"] }} {{ m["content"] }}'
                        ' {% endfor %}{% if add_generation_prompt %}w3{% endif %}')
  fast.save_pretrained(directory)


@pytest.fixture(scope='module', params=list(KINDS))
def checkpoint(request, tmp_path_factory):
  """(kind, HF reference model, checkpoint dir) of a tiny random model."""
  config_cls, model_cls, extra = KINDS[request.param]
  torch.manual_seed(0)
  hf_config = config_cls(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      rope_theta=5000.0, bos_token_id=1, eos_token_id=2, **extra)
  reference = model_cls(hf_config).eval()
  with torch.no_grad():  # Qwen2's biases start at 0, Qwen3's q/k norms at 1:
    for name, p in reference.named_parameters():  # make them matter.
      if name.endswith('bias'):
        p.normal_(0, 0.1)
      if name.endswith(('q_norm.weight', 'k_norm.weight')):
        p.normal_(1, 0.3)
  directory = str(tmp_path_factory.mktemp(request.param))
  reference.save_pretrained(directory)
  save_tiny_tokenizer(directory)
  return request.param, reference, directory


def load(directory, **overrides):
  with open(os.path.join(directory, 'config.json')) as f:
    cfg = model_config.from_hf_config(json.load(f), **overrides)
  return pretrained.build(
      cfg, hf_checkpoint.to_params(hf_checkpoint.read_safetensors(directory), cfg))


def padded_batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, VOCAB, (3, 13))
  mask = np.ones(tokens.shape, bool)
  mask[1, 8:] = False  # right padding
  mask[2, :5] = False  # left padding
  return tokens, mask


def reference_logits(reference, tokens, mask):
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    return reference(input_ids=torch.tensor(tokens),
                     attention_mask=torch.tensor(mask.astype(np.int64)),
                     position_ids=torch.tensor(positions)).logits.numpy()


@pytest.mark.parametrize('layer_loop', ['scan', 'unroll'])
def test_logits_match_transformers_with_padding(checkpoint, layer_loop):
  _, reference, directory = checkpoint
  model = load(directory, layer_loop=layer_loop)
  tokens, mask = padded_batch()
  got = nnx.jit(lambda mdl, t, m: mdl(t, input_mask=m))(model, tokens, mask)
  assert got.dtype == jnp.float32 and got.shape == (3, 13, VOCAB)
  want = reference_logits(reference, tokens, mask)
  assert np.abs(np.asarray(got) - want)[mask].max() < 1e-4


def test_greedy_decoding_matches_transformers_generate(checkpoint):
  _, reference, directory = checkpoint
  model = load(directory)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 11, 2)]
  outputs = decoding.generate(model, prompts, 32,
                              sampling.SamplingParams(temperature=0))
  for prompt, out in zip(prompts, outputs):
    with torch.no_grad():
      want = reference.generate(
          torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens == want


@pytest.mark.parametrize('layer_loop', ['scan', 'unroll'])
def test_kv_cache_decode_equals_full_forward(checkpoint, layer_loop):
  _, _, directory = checkpoint
  model = load(directory, layer_loop=layer_loop)
  rng = np.random.default_rng(2)
  sequence = rng.integers(3, VOCAB, (1, 20))
  full = np.asarray(model(sequence))
  prompt_len = 7
  # Prefill a right-padded prompt (pad garbage must be ignored), slot 1 of 2.
  padded = np.concatenate([sequence[:, :prompt_len], np.full((1, 9), 5)], 1)
  logits, prefix = decoding.prefill(model, padded, np.array([prompt_len]))
  cache = decoding.insert(decoding.init_cache(model.config, 2, 32), prefix, 1)
  got = [np.asarray(logits)[0]]
  step = nnx.jit(decoding.decode_step)
  for t in range(prompt_len, sequence.shape[1] - 1):
    tokens = jnp.array([0, sequence[0, t]])
    logits, cache = step(model, cache, tokens, jnp.array([0, t]))
    got.append(np.asarray(logits)[1])
  np.testing.assert_allclose(np.stack(got), full[0, prompt_len - 1:-1],
                             atol=2e-5, rtol=1e-5)


def test_bfloat16_compute_stays_close(checkpoint):
  _, _, directory = checkpoint
  tokens, mask = padded_batch()
  f32 = np.asarray(load(directory)(tokens, input_mask=mask))
  bf16 = np.asarray(load(directory, dtype='bfloat16',
                         param_dtype='bfloat16')(tokens, input_mask=mask))
  assert bf16.dtype == np.float32
  assert np.abs(bf16 - f32)[mask].max() < 0.1
  assert np.abs(bf16 - f32)[mask].max() > 0  # it did compute in bf16


def test_float32_logits_dtype_runs_the_head_on_float32_operands(checkpoint):
  # The LM head alone, on the same hidden states: with logits_dtype=float32
  # under bf16 compute it is the float32 matmul of the stored weights (numpy,
  # float64 reference); in bf16 its operands are rounded first.
  _, _, directory = checkpoint
  rng = np.random.default_rng(3)
  kwargs = dict(dtype='bfloat16', param_dtype='float32')
  bf16_head = load(directory, **kwargs)
  f32_head = load(directory, logits_dtype='float32', **kwargs)
  assert f32_head.config.head_dtype == jnp.float32
  assert bf16_head.config.head_dtype == jnp.bfloat16
  hidden = rng.normal(size=(2, 5, f32_head.config.hidden_size)).astype(
      np.float32)
  kernel = np.asarray(f32_head.lm_head[...] if f32_head.lm_head is not None
                      else f32_head.decoder.embed[...].T, np.float64)
  want = hidden.astype(np.float64) @ kernel
  got_f32 = np.asarray(f32_head.logits(jnp.asarray(hidden)))
  got_bf16 = np.asarray(bf16_head.logits(jnp.asarray(hidden)))
  np.testing.assert_allclose(got_f32, want, rtol=1e-5, atol=1e-5)
  assert np.abs(got_bf16 - want).max() > 100 * np.abs(got_f32 - want).max()
  with pytest.raises(ValueError, match='logits_dtype'):
    load(directory, logits_dtype='float16')


def test_export_round_trip_and_transformers_reads_it(checkpoint, tmp_path):
  _, _, directory = checkpoint
  model, tok = pretrained.from_pretrained(directory)
  tokens, mask = padded_batch()
  before = np.asarray(model(tokens, input_mask=mask))
  pretrained.export_pretrained(model, tok, str(tmp_path))
  again, tok_again = pretrained.from_pretrained(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(again(tokens, input_mask=mask)),
                                before)
  assert tok_again.encode('w5 w7') == tok.encode('w5 w7') == [5, 7]
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert np.abs(reference_logits(hf, tokens, mask) - before)[mask].max() < 1e-4


def test_auto_layer_loop_unrolls_shallow_stacks_off_tpu():
  cfg = model_config.ModelConfig('llama', 11, 8, 16, 2, 2, 1, 4)
  assert cfg.unroll_layers('cpu') and cfg.unroll_layers('gpu')
  assert not cfg.unroll_layers('tpu')
  deep = cfg.replace(num_layers=model_config.AUTO_UNROLL_MAX_LAYERS + 1)
  assert not deep.unroll_layers('cpu')
  assert not cfg.replace(layer_loop='scan').unroll_layers('cpu')
  assert cfg.replace(layer_loop='unroll').unroll_layers('tpu')
  with pytest.raises(ValueError, match='layer_loop'):
    cfg.replace(layer_loop='loop')


@pytest.mark.parametrize('layer_loop', ['scan', 'unroll'])
def test_remat_changes_no_value_and_no_gradient(layer_loop):
  """Recomputing activations in the backward pass (the demo's setting) is
  invisible to the loss and its gradient."""
  cfg = model_config.ModelConfig('qwen2', 50, 32, 48, 3, 4, 2, 8,
                                 qkv_bias=True, layer_loop=layer_loop)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)

  def loss_and_grads(remat):
    model = transformer.init_causal_lm(cfg.replace(remat=remat), seed=3)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * logits[..., 1])

    return jax.value_and_grad(loss)(params)

  (plain_loss, plain_grads), (remat_loss, remat_grads) = (
      loss_and_grads(False), loss_and_grads(True))
  np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6)
  chex.assert_trees_all_close(remat_grads, plain_grads, atol=1e-6)


def test_every_parameter_has_logical_axes():
  cfg = model_config.ModelConfig('qwen2', 50, 32, 48, 2, 4, 2, 8,
                                 qkv_bias=True)
  state = nnx.state(transformer.init_causal_lm(cfg), nnx.Param)
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert leaves
  for var in leaves:
    axes = var.get_metadata()['logical_axes']
    assert len(axes) == var[...].ndim
  q_proj = state['decoder']['blocks']['attn']['q_proj']
  assert q_proj.get_metadata()['logical_axes'] == (
      'layers', 'embed', 'heads', 'head_dim')


def test_checkpoint_errors_name_the_problem(checkpoint, tmp_path):
  kind, _, directory = checkpoint
  with open(os.path.join(directory, 'config.json')) as f:
    hf = json.load(f)
  cfg = model_config.from_hf_config(hf)
  tensors = hf_checkpoint.read_safetensors(directory)
  missing = dict(tensors)
  del missing['model.layers.2.mlp.up_proj.weight']
  with pytest.raises(ValueError, match=r"missing tensor 'model.layers.2.mlp.up_proj.weight'"):
    hf_checkpoint.to_params(missing, cfg)
  bad = dict(tensors)
  bad['model.norm.weight'] = np.zeros(63, np.float32)
  with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\), expected \(64,\)"):
    hf_checkpoint.to_params(bad, cfg)
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    model_config.from_hf_config(dict(hf, model_type='gpt2'))
  with pytest.raises(ValueError, match="required field 'hidden_size' is missing"):
    model_config.from_hf_config({k: v for k, v in hf.items() if k != 'hidden_size'})
  with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
    model_config.from_hf_config(dict(hf, rope_parameters=dict(rope_type='yarn')))
  with pytest.raises(ValueError, match='no config.json'):
    pretrained.from_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match="unknown model source 'gpt-17'"):
    pretrained.from_pretrained('gpt-17')
