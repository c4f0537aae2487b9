"""Which platform a program is being built for: the local backend or an AOT target.

Choices that depend on the hardware (Pallas kernels or the XLA reference, a
scanned or unrolled layer stack) ask `target()` rather than
`jax.default_backend()`, so that an ahead-of-time compile for a TPU topology
on a CPU host makes the TPU's choices:

  with platforms.compile_target('tpu'):
    learner.train_step.lower(...).compile()
"""

from __future__ import annotations

import contextlib

import jax

_targets: list[str] = []  # set while compiling ahead of time


@contextlib.contextmanager
def compile_target(platform: str):
  """Build for `platform` ('cpu' | 'gpu' | 'tpu') rather than the local backend."""
  _targets.append(platform)
  try:
    yield
  finally:
    _targets.pop()


def target() -> str:
  """The platform being built for: the AOT target inside `compile_target`."""
  return _targets[-1] if _targets else jax.default_backend()
