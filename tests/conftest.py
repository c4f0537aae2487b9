"""Test session setup.

Eight fake CPU devices are requested before JAX starts, so that sharding tests
can build real meshes on one CPU; libtpu may be loaded by several processes
(compile-only TPU devices, no TPU is ever opened). A session that executed no test fails: a
suite that silently collects nothing (or skips everything) must not pass CI.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The TPU compile tests load libtpu (compile-only); subprocesses that do too
# (benchmark quick modes) would otherwise fail on libtpu's process lock.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

import pytest  # pylint: disable=g-import-not-at-top

from sao_jax.models import tiny  # pylint: disable=g-import-not-at-top

_executed = {'count': 0}


def pytest_runtest_logreport(report):
  if report.when == 'call' and report.outcome in ('passed', 'failed'):
    _executed['count'] += 1


def pytest_sessionfinish(session, exitstatus):
  del exitstatus
  collect_only = session.config.getoption('collectonly', default=False)
  if not collect_only and _executed['count'] == 0:
    session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
    print('\nerror: no test was executed; failing the run')


@pytest.fixture(scope='session')
def tiny_checkpoint(tmp_path_factory):
  """Path of a tiny random Llama checkpoint directory (HF layout)."""
  return tiny.save(str(tmp_path_factory.mktemp('tiny_llama')))


@pytest.fixture(scope='session')
def tiny_checkpoint_no_eos(tmp_path_factory):
  """Like `tiny_checkpoint`, but generations always run to max_tokens."""
  return tiny.save(str(tmp_path_factory.mktemp('tiny_llama_no_eos')),
                   with_stop=False)
