"""A quiet start on machines without TPUs or GPUs.

`sao_jax/__init__.py` calls `install()` before anything imports JAX or
TensorFlow. With no accelerator device node and `JAX_PLATFORMS` unset, it
sets `JAX_PLATFORMS=cpu`, which stops libtpu's TPU_WORKER_HOSTNAMES trace;
with no NVIDIA device node, TensorFlow's first import runs with its CUDA,
cuInit and CPU-feature notices dropped from stderr (`TF_CPP_MIN_LOG_LEVEL=0`
turns that off). A machine with a device node, or a user who set
`JAX_PLATFORMS`, gets the libraries' defaults. What each line is and why
hiding it is safe: docs/design/quiet_start.md.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.util
import os
import sys
import tempfile

# Device nodes of the accelerators JAX can drive: TPU VMs (v4 and v5e
# /dev/accel*, v5p and v6e /dev/vfio/<group>; /dev/vfio/vfio alone is just
# the kernel module), NVIDIA and AMD GPUs.
TPU_NODES = ('/dev/accel*', '/dev/vfio/[0-9]*')
GPU_NODES = ('/dev/nvidia*', '/dev/kfd')

# Lines TensorFlow writes on a machine without CUDA: at import (its CUDA
# stubs, before its log level applies; its CPU notice, shown when JAX did
# not set the level first), and when it looks for GPUs.
_TENSORFLOW_NOISE = (
    'Could not find cuda drivers on your machine',
    'All log messages before absl::InitializeLog() is called are written to'
    ' STDERR',
    'cpu_feature_guard.cc',
    'To enable the following instructions:',
    'failed call to cuInit',
    # TensorFlow 2.21 on x86 CPUs (twice during the import).
    'oneDNN custom operations are on',
)


def _exists(patterns) -> bool:
  return any(glob.glob(pattern) for pattern in patterns)


def install() -> None:
  """Quiets JAX's and TensorFlow's start where they have no device to use."""
  gpu, tpu = _exists(GPU_NODES), _exists(TPU_NODES)
  if ('JAX_PLATFORMS' not in os.environ and 'jax' not in sys.modules
      and not gpu and not tpu):
    os.environ['JAX_PLATFORMS'] = 'cpu'
  if ('tensorflow' not in sys.modules and not gpu
      and not any(isinstance(f, _QuietTensorFlowImport)
                  for f in sys.meta_path)):
    sys.meta_path.insert(0, _QuietTensorFlowImport(look_for_gpus=not tpu))


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
  """Runs the first import of `tensorflow` quietly (see install)."""

  def __init__(self, look_for_gpus: bool):
    self._look_for_gpus = look_for_gpus

  def find_spec(self, fullname, path, target=None):
    del path, target
    if fullname != 'tensorflow':
      return None
    # Once: the real spec comes from the other finders, and TensorFlow's own
    # submodules import normally.
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader, self._look_for_gpus)
    return spec


class _QuietLoader(importlib.abc.Loader):
  """Wraps TensorFlow's loader: executes it quietly, then steps aside."""

  def __init__(self, loader, look_for_gpus: bool):
    self._loader = loader
    self._look_for_gpus = look_for_gpus

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    # The module keeps its real loader (resources, reloads).
    module.__loader__ = self._loader
    if module.__spec__ is not None:
      module.__spec__.loader = self._loader
    if os.environ.get('TF_CPP_MIN_LOG_LEVEL') == '0':
      self._loader.exec_module(module)
      return
    with filtered_stderr(_TENSORFLOW_NOISE):
      self._loader.exec_module(module)
      if self._look_for_gpus:
        # TensorFlow looks once and remembers: absl's start-up look (or a
        # first use) finds the answer and logs nothing.
        try:
          module.config.list_physical_devices('GPU')
        except Exception:  # pylint: disable=broad-except
          pass  # then it looks later, noisily: nothing worse


@contextlib.contextmanager
def filtered_stderr(noise):
  """Drops the lines containing one of `noise` that file descriptor 2 gets.

  Native libraries write there directly, past `sys.stderr`. The output is
  held in a temporary file and passed on, less the noise, at the end of the
  block (in order, but late: keep the block short).
  """
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError, AttributeError):  # no usable stderr
    yield
    return
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      try:
        sys.stderr.flush()
      except (OSError, ValueError):
        pass
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      kept = [line for line in held.read().splitlines(keepends=True)
              if not any(n.encode() in line for n in noise)]
      out = b''.join(kept)
      while out:
        out = out[os.write(2, out):]
