"""The XLA_FLAGS a child process (a server, a training run) inherits.

A parent may run on fake CPU devices (`--xla_force_host_platform_device_count`,
as the test suite does, to build real meshes on one CPU). A server or a
training run it starts must see the machine's own devices instead, or it would
split its model over fake ones. Every other flag is the user's choice (an
optimisation level, dumps, GPU tuning) and passes through: dropping XLA_FLAGS
whole, as this project once did, also dropped the test suite's fast-compile
flags from every server and run it started.

Standard library only: benchmarks/training_runs.py, which never imports JAX,
uses it too.
"""

from __future__ import annotations

from collections.abc import Mapping

DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def without_device_count(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) less any fake host device count."""
  return ' '.join(f for f in flags.split()
                  if f.split('=', 1)[0] != DEVICE_COUNT_FLAG)


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
  """A copy of `env` for a child process: XLA_FLAGS without the device count
  (and without XLA_FLAGS at all when nothing else was in it)."""
  child = dict(env)
  flags = without_device_count(child.pop('XLA_FLAGS', ''))
  if flags:
    child['XLA_FLAGS'] = flags
  return child
