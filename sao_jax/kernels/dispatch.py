"""Choosing a kernel implementation: Pallas on TPU, the XLA reference elsewhere."""

from __future__ import annotations

import contextlib

import jax

IMPLEMENTATIONS = ('auto', 'xla', 'pallas')
_target_platform: list[str] = []  # set while compiling ahead of time


@contextlib.contextmanager
def compile_target(platform: str):
  """Choose kernels for `platform` rather than the local backend.

  Ahead-of-time compiles for TPU topologies run on a CPU host; inside this
  context 'auto' picks the Mosaic kernels (not interpret mode) for 'tpu'.
  """
  _target_platform.append(platform)
  try:
    yield
  finally:
    _target_platform.pop()


def on_tpu() -> bool:
  """Whether kernels are being built for a TPU (the backend, or an AOT target)."""
  if _target_platform:
    return _target_platform[-1] == 'tpu'
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
