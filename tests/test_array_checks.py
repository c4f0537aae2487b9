"""array_checks: a wrong rank, shape or dtype raises a named ValueError.

The message names the function, the argument and the layout it wanted.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import array_checks


def test_wrong_rank_names_function_argument_and_layout():
  with pytest.raises(ValueError) as error:
    array_checks.require_rank('gae', 'rewards', jnp.zeros((5,)), '[B, T]')
  assert ('gae: rewards has shape (5,) (rank 1), expected rank 2 [B, T]'
          in str(error.value))


def test_wrong_shape_names_function_argument_and_layout():
  with pytest.raises(ValueError) as error:
    array_checks.require_shape('gae', 'values', jnp.zeros((2, 4)), (2, 5),
                               '[B, T]')
  assert ('gae: values has shape (2, 4), expected [B, T] = (2, 5)'
          in str(error.value))


def test_wrong_dtype_names_function_and_argument():
  with pytest.raises(ValueError) as error:
    array_checks.require_float('gae', 'values', jnp.zeros((2,), jnp.int32))
  assert ('gae: values has dtype int32, expected a float dtype'
          in str(error.value))


def test_a_python_list_is_one_argument():
  # chex reads a list as several inputs; the check sees one [3] array.
  with pytest.raises(ValueError, match=re.escape('lam has shape (3,)')):
    array_checks.require_shape('gae', 'lam', [0.9, 0.9, 0.9], (2,), '[B]')
  array_checks.require_shape('gae', 'lam', [0.9, 0.9], (2,), '[B]')


@pytest.mark.parametrize('x', [
    jnp.zeros((2, 3)),
    np.zeros((2, 3), np.float32),
    jnp.zeros((2, 3), jnp.bfloat16),
])
def test_right_arguments_pass(x):
  array_checks.require_rank('f', 'x', x, '[B, T]')
  array_checks.require_shape('f', 'x', x, (2, 3), '[B, T]')
  array_checks.require_float('f', 'x', x)


def test_checks_run_at_trace_time_under_jit():
  def f(x_BxT):
    array_checks.require_rank('f', 'x', x_BxT, '[B, T]')
    array_checks.require_float('f', 'x', x_BxT)
    return x_BxT

  jax.jit(f)(jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match=re.escape('f: x has shape (3,)')):
    jax.jit(f)(jnp.zeros((3,)))
