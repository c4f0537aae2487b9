"""Up-front argument checks for the algorithm functions.

Shapes are static under `jax.jit`, so these checks run at trace time and cost
nothing per step. Every message names the function, the argument, the shape it
got and the layout it wanted, on one line, so that a wrong batch is found from the
error alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def require_rank(where: str, name: str, x, layout: str) -> None:
  """Raises ValueError unless `x` has as many axes as `layout` names.

  Args:
    where: the public function doing the check (goes into the message).
    name: the argument's name.
    x: the array (anything with `.shape`).
    layout: the expected layout, e.g. "[B, T]".
  """
  rank = len(_split_layout(layout))
  shape = tuple(jnp.shape(x))
  if len(shape) != rank:
    raise ValueError(
        f'{where}: {name} has shape {shape} (rank {len(shape)}), expected'
        f' rank {rank} {layout}')


def require_shape(where: str, name: str, x, shape: Sequence[int],
                  layout: str) -> None:
  """Raises ValueError unless `x.shape == shape`, naming the layout symbols."""
  got = tuple(jnp.shape(x))
  want = tuple(shape)
  if got != want:
    raise ValueError(
        f'{where}: {name} has shape {got}, expected {layout} = {want}')


def require_float(where: str, name: str, x) -> None:
  """Raises ValueError unless `x` has a floating dtype."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'{where}: {name} has dtype {dtype}, expected a float dtype')


def _split_layout(layout: str) -> list[str]:
  inner = layout.strip().removeprefix('[').removesuffix(']')
  return [s for s in (p.strip() for p in inner.split(',')) if s]
