"""Up-front argument checks for the algorithm functions, through chex.

Each check is one chex assertion (`chex.assert_rank`, `chex.assert_shape`,
`chex.assert_type`) raising ValueError, with a message that names the public
function, the argument, the shape or dtype it got and the layout it wanted, so
that a wrong batch is found from the error alone (chex's own text comes first,
this message follows in brackets):

  array_checks.require_rank('sample', 'logits', logits_BxV, '[B, V]')

Shapes are static under `jax.jit`, so the checks run at trace time and cost
nothing per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax.numpy as jnp
import numpy as np


def require_rank(where: str, name: str, x, layout: str) -> None:
  """Raises ValueError unless `x` has as many axes as `layout` names.

  Args:
    where: the public function doing the check (goes into the message).
    name: the argument's name.
    x: an array, a Python scalar or a list.
    layout: the expected layout, e.g. "[B, T]".
  """
  x = _one_array(x)
  got = tuple(x.shape)
  rank = len(_split_layout(layout))
  chex.assert_rank(
      x, rank, exception_type=ValueError,
      custom_message=(f'{where}: {name} has shape {got} (rank {len(got)}),'
                      f' expected rank {rank} {layout}'))


def require_shape(where: str, name: str, x, shape: Sequence[int],
                  layout: str) -> None:
  """Raises ValueError unless `x.shape == shape`, naming the layout symbols."""
  x = _one_array(x)
  got, want = tuple(x.shape), tuple(shape)
  chex.assert_shape(
      x, want, exception_type=ValueError,
      custom_message=(f'{where}: {name} has shape {got}, expected {layout} ='
                      f' {want}'))


def require_float(where: str, name: str, x) -> None:
  """Raises ValueError unless `x` has a floating dtype."""
  x = _one_array(x)
  chex.assert_type(
      x, jnp.floating, exception_type=ValueError,
      custom_message=(f'{where}: {name} has dtype {x.dtype}, expected a float'
                      ' dtype'))


def _one_array(x):
  # chex takes a Python list as several inputs; here it is one argument.
  return x if hasattr(x, 'shape') else np.asarray(x)


def _split_layout(layout: str) -> list[str]:
  inner = layout.strip().removeprefix('[').removesuffix(']')
  return [s for s in (p.strip() for p in inner.split(',')) if s]
