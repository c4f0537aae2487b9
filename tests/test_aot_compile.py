"""`python -m sao_jax.tools.aot_compile` plans a TPU run on a CPU host.

The tiny model's SAO step is compiled by XLA:TPU for a v5e slice through
libtpu's compile-only devices; the report's per-device bytes are checked
against the shapes the test computes itself.
"""

import os
import platform
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax import config_lib
from sao_jax.models import pretrained

if platform.system() != 'Linux' or platform.machine() != 'x86_64':
  pytest.skip('libtpu wheels exist for Linux x86_64 only',
              allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**mesh):
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny.py'))
  config.batch_size = 8
  config.rollout.max_sequence_length = 64
  for key, value in mesh.items():
    config.mesh[key] = value
  return config


@pytest.mark.slow
def test_tiny_sao_step_compiles_for_v5e_with_fsdp():
  from sao_jax.tools import aot_compile  # pylint: disable=g-import-not-at-top
  config = tiny_config(data=1, fsdp=4, tensor=1)
  report = aot_compile.compile_train_step(config, 'v5e:2x2')
  assert report.devices == 4 and report.mesh == {
      'data': 1, 'fsdp': 4, 'expert': 1, 'sequence': 1, 'tensor': 1}
  policy = pretrained.abstract_model('tiny-random')
  sizes = [int(np.prod(x.shape))
           for x in jax.tree.leaves(nnx.state(policy, nnx.Param))]
  assert report.parameters == sum(sizes)
  # Policy and critic (smaller: no LM head) in f32 over 4 FSDP shards: more
  # than a quarter of the policy, less than the unsharded policy alone.
  policy_bytes = 4 * sum(sizes)
  assert policy_bytes / 4 < report.params_bytes_per_device < policy_bytes
  # AdamW keeps two moments per trainable parameter.
  assert report.optimizer_bytes_per_device >= report.params_bytes_per_device / 2
  assert report.temp_bytes_per_device > 0 and report.fits
  assert report.analytic_flops == pytest.approx(
      6 * report.parameters * 8 * 64 * 3 + 2 * report.parameters * 8 * 64)
  text = aot_compile.format_report(report)
  assert 'fits' in text and 'v5e:2x2' in text


def test_mesh_that_does_not_fit_is_one_line_error():
  env = dict(os.environ, PYTHONPATH=ROOT, ALLOW_MULTIPLE_LIBTPU_LOAD='1')
  proc = subprocess.run(
      [sys.executable, '-m', 'sao_jax.tools.aot_compile',
       f'--config={os.path.join(ROOT, "configs", "tiny.py")}',
       '--topology=v5e:2x2', '--config.mesh.data=8'],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode != 0
  assert 'mesh' in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_a_servers_prefill_compiles_for_v5e_tensor_parallel():
  """The engine's prefill through splash attention, heads split over 4
  chips; the decode state and prefix cache counted from the shapes."""
  from sao_jax.tools import aot_compile  # pylint: disable=g-import-not-at-top
  config = tiny_config()
  config.rollout.max_prefill_length = 1024
  config.rollout.max_target_length = 2048
  config.rollout.prefix_cache_gib = 1.0
  report = aot_compile.compile_engine_prefill(config, 'v5e:2x2')
  cfg = pretrained.abstract_model('tiny-random').config
  split = 4 if cfg.num_kv_heads % 4 == 0 else 1
  per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
  assert report.decode_state_bytes_per_device == (
      config.rollout.max_concurrent_decodes * 2048 * per_token // split)
  assert report.prefix_cache_bytes_per_device == 2**30 // split
  assert report.temp_bytes_per_device > 0 and report.fits
  assert 'prefill of 1024 tokens' in aot_compile.format_prefill_report(report)
