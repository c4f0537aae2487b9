"""Choosing a kernel implementation: Pallas on TPU, the XLA reference elsewhere."""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ('auto', 'xla', 'pallas')


def on_tpu() -> bool:
  """Whether the default backend is a TPU (where Pallas compiles with Mosaic)."""
  return jax.default_backend() == 'tpu'


def resolve(implementation: str) -> tuple[str, bool]:
  """Maps a requested implementation to `(name, interpret)`.

  `auto` is Pallas on TPU and the XLA reference elsewhere; `pallas` off a TPU
  runs the kernel in interpret mode (slow, for tests and debugging).

  Raises:
    ValueError: for an unknown name.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'implementation={implementation!r} is not one of'
                     f' {IMPLEMENTATIONS}')
  if implementation == 'auto':
    return ('pallas', False) if on_tpu() else ('xla', False)
  if implementation == 'pallas':
    return 'pallas', not on_tpu()
  return 'xla', False
