"""Qwen3-MoE: routed experts against transformers and a per-token loop."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from sao_jax import sharding
from sao_jax.models import model_config
from sao_jax.models import moe
from sao_jax.models import pretrained
from sao_jax.models import transformer

import test_transformer as dense_tests  # pylint: disable=wrong-import-order

VOCAB = dense_tests.VOCAB


@pytest.fixture(scope='module', params=[True, False], ids=['norm_topk',
                                                           'softmax_weights'])
def checkpoint(request, tmp_path_factory):
  """(HF reference model, checkpoint dir) of a tiny random Qwen3-MoE."""
  torch.manual_seed(0)
  hf_config = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, num_experts=6,
      num_experts_per_tok=2, norm_topk_prob=request.param, rope_theta=5000.0,
      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
  reference = transformers.Qwen3MoeForCausalLM(hf_config).eval()
  with torch.no_grad():  # the router starts at 0, the norms at 1
    for name, p in reference.named_parameters():
      if name.endswith('mlp.gate.weight'):
        p.normal_(0, 0.5)
      if name.endswith(('q_norm.weight', 'k_norm.weight')):
        p.normal_(1, 0.3)
  directory = str(tmp_path_factory.mktemp('qwen3_moe'))
  reference.save_pretrained(directory)
  dense_tests.save_tiny_tokenizer(directory)
  return reference, directory


def test_logits_match_transformers_with_padding(checkpoint):
  reference, directory = checkpoint
  model = dense_tests.load(directory)
  assert model.config.num_experts == 6 and model.config.qk_norm
  tokens, mask = dense_tests.padded_batch()
  got = nnx.jit(lambda mdl, t, m: mdl(t, input_mask=m))(model, tokens, mask)
  want = dense_tests.reference_logits(reference, tokens, mask)
  assert np.abs(np.asarray(got) - want)[mask].max() < 1e-4


def test_bfloat16_compute_stays_close(checkpoint):
  _, directory = checkpoint
  tokens, mask = dense_tests.padded_batch()
  f32 = np.asarray(dense_tests.load(directory)(tokens, input_mask=mask))
  bf16 = np.asarray(dense_tests.load(directory, dtype='bfloat16',
                                     param_dtype='bfloat16')(
                                         tokens, input_mask=mask))
  # A token whose top-k flips under bf16 rounding moves further than in a
  # dense model, so the bound is on the typical token.
  assert np.median(np.abs(bf16 - f32)[mask]) < 0.05


def test_export_round_trip_and_transformers_reads_it(checkpoint, tmp_path):
  _, directory = checkpoint
  model, tok = pretrained.from_pretrained(directory)
  tokens, mask = dense_tests.padded_batch()
  before = np.asarray(model(tokens, input_mask=mask))
  pretrained.export_pretrained(model, tok, str(tmp_path))
  again, _ = pretrained.from_pretrained(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(again(tokens, input_mask=mask)),
                                before)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert isinstance(hf, transformers.Qwen3MoeForCausalLM)
  assert np.abs(dense_tests.reference_logits(hf, tokens, mask)
                - before)[mask].max() < 1e-4


def _loop_reference(layer, x_Nxd):
  """Each token through its k experts one at a time (float64 numpy)."""
  router = np.asarray(layer.router[...], np.float64)
  gate, up, down = (np.asarray(p[...], np.float64) for p in
                    (layer.gate_proj, layer.up_proj, layer.down_proj))
  x = np.asarray(x_Nxd, np.float64)
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    logits = x[n] @ router
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs)[:layer.top_k]
    weights = probs[chosen]
    if layer.normalise:
      weights = weights / weights.sum()
    for e, w in zip(chosen, weights):
      g = x[n] @ gate[e]
      out[n] += w * (((g / (1 + np.exp(-g))) * (x[n] @ up[e])) @ down[e])
  return out


@pytest.mark.parametrize('normalise', [True, False])
def test_grouped_matmuls_equal_a_loop_over_tokens(normalise):
  cfg = model_config.ModelConfig(
      'qwen3_moe', 50, 16, 32, 1, 2, 1, 8, qk_norm=True, num_experts=5,
      num_experts_per_tok=3, moe_intermediate_size=12,
      norm_topk_prob=normalise)
  layer = transformer.RoutedMLP(cfg, rngs=nnx.Rngs(0))
  layer.router[...] = layer.router[...] * 20  # spread the router's choices
  x = jax.random.normal(jax.random.key(1), (3, 7, 16))
  got = np.asarray(layer(x)[0]).reshape(-1, 16)
  np.testing.assert_allclose(got, _loop_reference(layer, x.reshape(-1, 16)),
                             rtol=1e-5, atol=1e-6)
  # Gradients reach every expert that was chosen, and the router.
  graphdef, params = nnx.split(layer, nnx.Param)
  grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x)[0] ** 2))(
      params)
  assert float(jnp.abs(grads['router'][...]).sum()) > 0
  _, experts, _, _ = moe.route(x.reshape(-1, 16), layer.router[...], top_k=3,
                        normalise=normalise, dtype=jnp.float32)
  used = np.unique(np.asarray(experts))
  norms = np.abs(np.asarray(grads['gate_proj'][...])).sum(axis=(1, 2))
  assert (norms[used] > 0).all() and len(used) > 1


def test_config_errors_name_the_problem():
  with pytest.raises(ValueError, match='num_experts_per_tok'):
    model_config.ModelConfig('qwen3_moe', 50, 16, 32, 1, 2, 1, 8,
                             num_experts=4, num_experts_per_tok=5,
                             moe_intermediate_size=8)
  hf = model_config.to_hf_config(model_config.ModelConfig(
      'qwen3_moe', 50, 16, 32, 1, 2, 1, 8, qk_norm=True, num_experts=4,
      num_experts_per_tok=2, moe_intermediate_size=8))
  assert model_config.from_hf_config(hf).num_experts == 4
  with pytest.raises(ValueError, match='mlp_only_layers'):
    model_config.from_hf_config(dict(hf, mlp_only_layers=[0]))


@pytest.mark.parametrize('mesh_sizes', [
    {'expert': 4, 'fsdp': 2}, {'expert': 2, 'fsdp': 2, 'tensor': 2},
    {'data': 2, 'sequence': 2, 'tensor': 2}])
def test_expert_parallel_layer_equals_one_device(mesh_sizes):
  """Experts split over `expert` (tokens all-gathered within the group and
  reduce-scattered back), hidden width over `tensor`, tokens over the
  batch and sequence axes: values and gradients are the unsharded ones."""
  sizes = {a: mesh_sizes.get(a, 1) for a in sharding.MESH_AXES}
  mesh = sharding.make_mesh(sizes, jax.devices()[:8])
  cfg = model_config.ModelConfig(
      'qwen3_moe', 50, 16, 32, 1, 2, 1, 8, qk_norm=True, num_experts=8,
      num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True)
  layer = transformer.RoutedMLP(cfg, rngs=nnx.Rngs(0))
  layer.router[...] = layer.router[...] * 20
  graphdef, params = nnx.split(layer, nnx.Param)
  x = jax.random.normal(jax.random.key(2), (8, 6, 16))

  recorded = jax.random.randint(jax.random.key(3), (8, 6, 2), -1, 8)
  recorded = jnp.where(recorded[..., :1] < 0, -1, recorded)

  def loss(p, x):
    y, routing = nnx.merge(graphdef, p)(x, recorded_BxTxk=recorded,
                                        replay=True)
    return jnp.sum(y * jnp.cos(x)) + moe.load_balancing_loss(routing), y

  want_grads, (_, want) = jax.grad(loss, argnums=(0, 1), has_aux=True)(
      params, x), loss(params, x)
  shardings = sharding.state_shardings(params, mesh)
  x_sharding = jax.sharding.NamedSharding(mesh, moe.P(
      sharding.BATCH_AXES, 'sequence' if sizes['sequence'] > 1 else None))

  @jax.jit
  def on_mesh(p, x):
    with sharding.mesh_context(mesh):
      return jax.grad(loss, argnums=(0, 1), has_aux=True)(p, x), loss(p, x)

  got_grads, (_, got) = on_mesh(jax.device_put(params, shardings),
                                jax.device_put(x, x_sharding))
  gate_spec = str(shardings['gate_proj'].get_raw_value().spec)
  assert ('expert' in gate_spec) == (sizes['expert'] > 1)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-6)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got_grads),
                              jax.tree.map(np.asarray, want_grads),
                              rtol=1e-5, atol=1e-6)


def _layer(num_experts=6, top_k=2, normalise=True):
  cfg = model_config.ModelConfig(
      'qwen3_moe', 50, 16, 32, 1, 2, 1, 8, qk_norm=True,
      num_experts=num_experts, num_experts_per_tok=top_k,
      moe_intermediate_size=12, norm_topk_prob=normalise)
  layer = transformer.RoutedMLP(cfg, rngs=nnx.Rngs(0))
  layer.router[...] = layer.router[...] * 20
  return layer


def test_replay_routes_recorded_tokens_to_the_recorded_experts():
  """A token with a record goes to its recorded experts, weighted by this
  router's probabilities of them; a token without one (-1) routes itself;
  replaying the router's own choice changes nothing."""
  layer = _layer(normalise=False)
  x_Nxd = jax.random.normal(jax.random.key(1), (1, 5, 16))
  own_y, own = layer(x_Nxd)
  assert float(own.mismatched) == 0 and float(own.recorded) == 0
  same_y, same = layer(x_Nxd, recorded_BxTxk=own.experts, replay=True)
  np.testing.assert_array_equal(np.asarray(same_y), np.asarray(own_y))
  assert float(same.mismatched) == 0 and float(same.recorded) == 10
  # Token 0: experts the router did not pick; token 1: no record.
  own_experts = np.asarray(own.experts)[0]
  spare = [e for e in range(6) if e not in own_experts[0]][:2]
  recorded = np.array(own_experts)
  recorded[0], recorded[1] = spare, -1
  y, routing = layer(x_Nxd, recorded_BxTxk=jnp.asarray(recorded)[None],
                     replay=True)
  np.testing.assert_array_equal(np.asarray(routing.experts)[0, 0], spare)
  np.testing.assert_array_equal(np.asarray(routing.experts)[0, 1:],
                                own_experts[1:])
  assert float(routing.mismatched) == 2 and float(routing.recorded) == 8
  # The replayed token's output by hand: its recorded experts under this
  # router's (unnormalised) softmax weights.
  x = np.asarray(x_Nxd[0, 0], np.float64)
  logits = x @ np.asarray(layer.router[...], np.float64)
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  want = np.zeros(16)
  for e in spare:
    g = x @ np.asarray(layer.gate_proj[...][e], np.float64)
    up = x @ np.asarray(layer.up_proj[...][e], np.float64)
    want += probs[e] * ((g / (1 + np.exp(-g)) * up)
                        @ np.asarray(layer.down_proj[...][e], np.float64))
  np.testing.assert_allclose(np.asarray(y)[0, 0], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(y)[0, 1:], np.asarray(own_y)[0, 1:])
  # `learn` compares but keeps the router's own choice.
  learned_y, learned = layer(x_Nxd, recorded_BxTxk=jnp.asarray(recorded)[None])
  np.testing.assert_array_equal(np.asarray(learned_y), np.asarray(own_y))
  assert float(learned.mismatched) == 2


def test_load_balancing_loss_matches_transformers():
  """`E * sum_e f_e P_e` over real tokens of every layer, against HF's
  `load_balancing_loss_func` on the same router logits and padding."""
  from transformers.models.qwen3_moe import modeling_qwen3_moe  # pylint: disable=g-import-not-at-top
  layers = [_layer(num_experts=6, top_k=2) for _ in range(2)]
  layers[1].router[...] = layers[1].router[...][::-1] * 0.3
  x_BxTxd = jax.random.normal(jax.random.key(4), (2, 5, 16))
  real_BxT = np.ones((2, 5), bool)
  real_BxT[1, 3:] = False
  sums = [layer(x_BxTxd, jnp.asarray(real_BxT))[1] for layer in layers]
  pooled = jax.tree.map(lambda a, b: a + b, sums[0], sums[1])
  got = float(moe.load_balancing_loss(pooled))
  logits = tuple(
      torch.tensor(np.asarray(x_BxTxd.reshape(-1, 16) @ layer.router[...]))
      for layer in layers)
  want = float(modeling_qwen3_moe.load_balancing_loss_func(
      logits, 6, 2, torch.tensor(real_BxT.astype(np.int64))))
  np.testing.assert_allclose(got, want, rtol=1e-5)
