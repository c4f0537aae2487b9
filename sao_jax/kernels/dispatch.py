"""Choosing a kernel implementation: Pallas on TPU, the XLA reference elsewhere."""

from __future__ import annotations

from sao_jax import platforms

IMPLEMENTATIONS = ('auto', 'xla', 'pallas')


def on_tpu() -> bool:
  """Whether kernels are being built for a TPU (the backend, or an AOT target).

  Inside `platforms.compile_target('tpu')` (AOT compiles on a CPU host) 'auto'
  picks the Mosaic kernels, not interpret mode.
  """
  return platforms.target() == 'tpu'


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
