"""Self-attention implementations against the definition, forward and VJP.

The definition (`reference.dense_self_attention`) is itself checked against a
numpy loop over queries. Inputs are packed rows (several segments, padding
between and after them), grouped-query heads, and lengths that are not
multiples of the tiles; only queries that attend something are compared
(padding queries are read by nothing). The splash kernel runs in interpret
mode here; its Mosaic compile is in test_tpu_compile.py.
"""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.kernels.attention import api
from sao_jax.kernels.attention import pallas_tpu
from sao_jax.kernels.attention import reference
from sao_jax.models import tiny
from sao_jax.models import transformer

DTYPES = {'f32': (jnp.float32, 1e-5), 'bf16': (jnp.bfloat16, 2e-2)}


def packed_ids(length):
  """Row 0: three segments with padding between and after; row 1: one
  right-padded segment; row 2: left padding then one segment."""
  ids = np.zeros((3, length), np.int32)
  a, b, c = length // 5, length // 2, (4 * length) // 5
  ids[0, :a] = 1
  ids[0, a + 2:b] = 2
  ids[0, b:c] = 3
  ids[1, :length - 7] = 1
  ids[2, 9:] = 1
  return ids


def inputs(seed, length, heads=4, kv_heads=2, head_dim=16,
           dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  ids = packed_ids(length)
  q, k, v = (jnp.asarray(rng.normal(size=(3, length, n, head_dim)), dtype)
             for n in (heads, kv_heads, kv_heads))
  # A cotangent on the queries that attend something.
  cot = rng.normal(size=(3, length, heads, head_dim)) * (ids > 0)[..., None,
                                                                  None]
  return q, k, v, jnp.asarray(ids), jnp.asarray(cot, jnp.float32)


def numpy_attention(q, k, v, ids):
  """Query by query: softmax over keys s <= t with the same id > 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  groups = h // k.shape[2]
  out = np.zeros_like(q)
  for row in range(b):
    for i in range(t):
      if ids[row, i] == 0:
        continue
      keys = [s for s in range(i + 1) if ids[row, s] == ids[row, i]]
      for head in range(h):
        kv = head // groups
        scores = k[row, keys, kv] @ q[row, i, head] / np.sqrt(d)
        p = np.exp(scores - scores.max())
        out[row, i, head] = (p / p.sum()) @ v[row, keys, kv]
  return out


def test_the_definition_matches_a_numpy_loop():
  q, k, v, ids, _ = inputs(0, 37)
  want = numpy_attention(q, k, v, np.asarray(ids))
  got = np.asarray(reference.dense_self_attention(q, k, v, ids))
  real = np.asarray(ids) > 0
  np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-6)


def value_and_grads(fn, q, k, v, ids, cot):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v, ids).astype(jnp.float32) * cot)
  out = fn(q, k, v, ids)
  return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def assert_matches_definition(fn, q, k, v, ids, cot, tol):
  out, grads = value_and_grads(fn, q, k, v, ids, cot)
  want_out, want_grads = value_and_grads(reference.dense_self_attention, q, k,
                                         v, ids, cot)
  real = np.asarray(ids) > 0
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(out)[real], f32(want_out)[real], rtol=tol,
                             atol=tol)
  for name, got, want in zip('qkv', grads, want_grads):
    # Relative to the gradient's scale: elements near zero carry f32 noise.
    scale = np.abs(f32(want)).max()
    np.testing.assert_allclose(f32(got) / scale, f32(want) / scale, rtol=0,
                               atol=tol, err_msg=f'd{name}')


@pytest.mark.parametrize('dtype', DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize('length, block', [(45, 8), (64, 16), (100, 512),
                                           (130, 32)])
def test_blockwise_matches_the_definition(length, block, dtype):
  dt, tol = DTYPES[dtype]
  q, k, v, ids, cot = inputs(1, length, dtype=dt)
  assert_matches_definition(
      lambda *a: reference.blockwise_attention(*a, block=block), q, k, v, ids,
      cot, tol)


@pytest.mark.parametrize('heads, kv_heads', [(4, 4), (4, 1), (6, 2)])
def test_blockwise_grouped_query_heads(heads, kv_heads):
  q, k, v, ids, cot = inputs(2, 70, heads=heads, kv_heads=kv_heads)
  assert_matches_definition(
      lambda *a: reference.blockwise_attention(*a, block=16), q, k, v, ids,
      cot, 1e-5)


def test_blockwise_memory_is_linear_in_length():
  """The compiled forward-and-backward's temporaries at 4x the length grow
  about 4x (the dense form's grow ~16x)."""
  def temp_bytes(fn, length):
    q, k, v, ids, cot = (jax.ShapeDtypeStruct(x.shape, x.dtype)
                         for x in inputs(0, 8, heads=2, kv_heads=1))
    shape = lambda s, t: jax.ShapeDtypeStruct((3, t) + s.shape[2:], s.dtype)
    args = [shape(x, length) for x in (q, k, v, ids, cot)]
    compiled = jax.jit(lambda *a: value_and_grads(fn, *a)).lower(
        *args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  blockwise = lambda *a: reference.blockwise_attention(*a, block=128)
  small, large = temp_bytes(blockwise, 1024), temp_bytes(blockwise, 4096)
  dense_small = temp_bytes(reference.dense_self_attention, 1024)
  dense_large = temp_bytes(reference.dense_self_attention, 4096)
  assert large / small < 5, (small, large)
  assert dense_large / dense_small > 12, (dense_small, dense_large)
  assert large < dense_large / 8


@pytest.mark.slow
@pytest.mark.parametrize('fused', [True, False])
def test_splash_interpret_matches_the_definition(fused):
  """Both backward kernels: the fused one, and the separate dq kernel that
  long sequences take."""
  q, k, v, ids, cot = inputs(3, 200, heads=4, kv_heads=2, head_dim=128)
  assert_matches_definition(
      lambda *a: pallas_tpu.splash_self_attention(*a, interpret=True,
                                                  fused=fused),
      q, k, v, ids, cot, 1e-5)


@pytest.mark.parametrize('dtype', DTYPES, ids=list(DTYPES))
def test_cudnn_wrapper_matches_the_definition_on_one_segment_rows(dtype):
  """The `jax.nn.dot_product_attention` call (XLA's implementation off GPU)
  with lengths from the ids: row 1 of `packed_ids`, one right-padded
  segment, is the layout it is for."""
  dt, tol = DTYPES[dtype]
  q, k, v, ids, cot = (x[1:2] for x in inputs(4, 70, dtype=dt))
  assert_matches_definition(api.IMPLEMENTATIONS['cudnn'], q, k, v, ids, cot,
                            tol)


def test_auto_picks_by_platform_and_length():
  assert api.resolve('auto', 512) == 'dense'  # CPU, one tile
  assert api.resolve('auto', 513) == 'blockwise'
  assert api.resolve('dense', 100_000) == 'dense'
  with pytest.raises(ValueError, match="attention='flash' is not one of"):
    api.resolve('flash', 10)


@pytest.mark.parametrize('implementation', ['blockwise', 'splash'])
def test_the_model_gives_the_same_logits_with_each_attention(implementation):
  """Packed rows through the tiny model: logits and the gradient of a
  token loss agree with dense attention."""
  model, _ = tiny.make()
  other = model.config.replace(attention=implementation)
  ids = jnp.asarray(packed_ids(40))
  tokens = jnp.asarray(np.random.default_rng(4).integers(
      0, model.config.vocab_size, size=ids.shape), jnp.int32)
  positions = jnp.maximum(jnp.cumsum(ids > 0, axis=1) - 1, 0)

  def logits(cfg):
    built = transformer.CausalLM(cfg, rngs=nnx.Rngs(0))
    nnx.update(built, nnx.state(model))
    return built(tokens, positions, ids > 0, ids)

  real = np.asarray(ids) > 0
  chex.assert_trees_all_close(np.asarray(logits(other))[real],
                              np.asarray(logits(model.config))[real],
                              rtol=1e-4, atol=1e-5)
