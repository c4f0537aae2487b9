"""The Pallas kernels compile with Mosaic for real TPU generations, on a CPU.

libtpu's compile-only devices run the full XLA:TPU and Mosaic compilers, which
reject what interpret mode accepts (VMEM overflow, unaligned tiles, dtypes a
chip lacks). A failing compile fails the test.
"""

import platform

import jax
import jax.numpy as jnp
import pytest

from sao_jax import kernels
from sao_jax.kernels.attention import pallas_tpu as attention_tpu
from sao_jax.tools import tpu_aot

if platform.system() != 'Linux' or platform.machine() != 'x86_64':
  pytest.skip('libtpu wheels exist for Linux x86_64 only',
              allow_module_level=True)

S = jax.ShapeDtypeStruct
TOPOLOGIES = ['v5e', 'v5p', 'v6e']
SIZES = [(256, 32768), (3, 17), (130, 300)]


def gae(rewards, values, mask, lam):
  return kernels.skip_observation_gae(rewards, values, mask, gamma=1.0, lam=lam,
                                      implementation='pallas', interpret=False)


def dis_value_and_grad(logp, mu, adv, mask):
  return jax.value_and_grad(
      lambda x: kernels.dis_policy_loss(
          x, mu, adv, mask, eps_low=0.3, eps_high=5.0,
          implementation='pallas', interpret=False),
      has_aux=True)(logp)


@pytest.mark.parametrize('topology', TOPOLOGIES)
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16],
                         ids=['f32', 'bf16'])
def test_kernels_compile_for_tpu(topology, dtype):
  target = tpu_aot.TOPOLOGIES[topology]
  for batch, length in SIZES:
    tokens = S((batch, length), dtype)
    mask = S((batch, length), jnp.bool_)
    compiled_gae = tpu_aot.compile_single_device(
        gae, tokens, tokens, mask, S((batch,), jnp.float32), topology=target)
    compiled_dis = tpu_aot.compile_single_device(
        dis_value_and_grad, tokens, tokens, tokens, mask, topology=target)
    # Mosaic kernels, not an interpret-mode emulation of them.
    assert 'tpu_custom_call' in compiled_gae.as_text()
    assert 'tpu_custom_call' in compiled_dis.as_text()


def packed_gae(rewards, values, mask, lam_BxT, segment_ids):
  return kernels.skip_observation_gae(rewards, values, mask, gamma=1.0,
                                      lam=lam_BxT, segment_ids=segment_ids,
                                      implementation='pallas', interpret=False)


def packed_dis_value_and_grad(logp, mu, adv, mask, segment_ids):
  return jax.value_and_grad(
      lambda x: kernels.dis_policy_loss(
          x, mu, adv, mask, eps_low=0.3, eps_high=5.0,
          aggregation='seq_mean_token_mean', segment_ids=segment_ids,
          implementation='pallas', interpret=False),
      has_aux=True)(logp)


@pytest.mark.parametrize('topology', TOPOLOGIES)
def test_packed_kernels_compile_for_tpu(topology):
  """The packed path: per-token lambda, segment ends in the mask, and the
  sequence mean as a weighted token sum."""
  target = tpu_aot.TOPOLOGIES[topology]
  batch, length = 130, 300
  tokens = S((batch, length), jnp.bfloat16)
  mask = S((batch, length), jnp.bool_)
  ids = S((batch, length), jnp.int32)
  compiled_gae = tpu_aot.compile_single_device(
      packed_gae, tokens, tokens, mask, S((batch, length), jnp.float32), ids,
      topology=target)
  compiled_dis = tpu_aot.compile_single_device(
      packed_dis_value_and_grad, tokens, tokens, tokens, mask, ids,
      topology=target)
  assert 'tpu_custom_call' in compiled_gae.as_text()
  assert 'tpu_custom_call' in compiled_dis.as_text()


def splash_value_and_grad(q, k, v, ids):
  def loss(q, k, v):
    out = attention_tpu.splash_self_attention(q, k, v, ids, interpret=False)
    return jnp.sum(out.astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


# The block sizes depend on the length only (`pallas_tpu._block`): each
# length compiles for one generation, and each generation for one length.
@pytest.mark.parametrize('topology, length, head_dim', [
    ('v5e', 1000, 64), ('v5p', 4096, 128), ('v6e', 8192, 64)])
def test_splash_attention_compiles_for_tpu(topology, length, head_dim):
  """Forward and backward (fused up to 4k, the separate dq kernel at 8k),
  grouped-query heads (Llama-3.2-1B's 32 over 8), segment ids, a length the
  kernel's tiles do not divide."""
  target = tpu_aot.TOPOLOGIES[topology]
  q = S((2, length, 32, head_dim), jnp.bfloat16)
  kv = S((2, length, 8, head_dim), jnp.bfloat16)
  compiled = tpu_aot.compile_single_device(
      splash_value_and_grad, q, kv, kv, S((2, length), jnp.int32),
      topology=target)
  assert 'tpu_custom_call' in compiled.as_text()


def test_splash_attention_memory_is_linear_in_length():
  """Forward and backward temporaries on v6e at 32k tokens stay a small
  multiple of the queries' size (12.4x, lane padding included: buffers of
  linear size only). The fused backward's dq partials alone,
  `[T / 512, G, T, D]`, would be 64x."""
  length = 32768
  q = S((1, length, 32, 64), jnp.bfloat16)
  kv = S((1, length, 8, 64), jnp.bfloat16)
  compiled = tpu_aot.compile_single_device(
      splash_value_and_grad, q, kv, kv, S((1, length), jnp.int32),
      topology=tpu_aot.TOPOLOGIES['v6e'])
  q_bytes = length * 32 * 64 * 2
  assert not attention_tpu.fused_backward(length)
  assert compiled.memory_analysis().temp_size_in_bytes < 20 * q_bytes
