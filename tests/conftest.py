"""Test session setup.

Eight fake CPU devices are requested before JAX starts, so that sharding tests
can build real meshes on one CPU; libtpu may be loaded by several processes
(compile-only TPU devices, no TPU is ever opened). A session that executed no test fails: a
suite that silently collects nothing (or skips everything) must not pass CI.
"""

import os

# Eight fake CPU devices on two cores. XLA:CPU's concurrency-optimised
# scheduler lets one device start two independent collectives at once (say a
# global all-reduce and an FSDP-group one); each blocks a worker thread in its
# rendezvous, and with devices waiting on different collectives the step
# deadlocks (jax 0.10: a (2,4,1)-mesh SAO step hung about two runs in three;
# with the scheduler off, 12 of 12 passed). When a collective does wait, XLA
# aborts the process after its terminate timeout: make that long.
os.environ.setdefault('XLA_FLAGS', ' '.join([
    '--xla_force_host_platform_device_count=8',
    '--xla_cpu_enable_concurrency_optimized_scheduler=false',
    '--xla_cpu_collective_call_terminate_timeout_seconds=900',
    '--xla_cpu_collective_call_warn_stuck_timeout_seconds=300',
    '--xla_cpu_collective_timeout_seconds=900',
    # Compiling, not running, is most of the in-process tests' time: their
    # programs are tiny and each runs a few times. LLVM at -O0 without its
    # expensive passes runs test_learner.py and test_packing.py in 3.6 min
    # from a cold cache against 5.9 (2026-12-03); XLA's own HLO passes
    # (fusion, layout) still run, so the arithmetic is the same program.
    # The servers, training runs and scripts the tests start inherit these
    # two (sao_jax/xla_flags.py drops only the device count): a tiny 3-step
    # run, cold, 56 -> 42 s (its compiles 26 -> 13 s), warm 22 -> 21 s.
    '--xla_backend_optimization_level=0',
    '--xla_llvm_disable_expensive_passes=true',
]))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# One persistent XLA compilation cache for the session's processes: the
# xdist workers, and the trainers, servers and benchmarks the tests start
# (they inherit the environment). Dozens of tests compile the same tiny
# programs; a cache hit skips XLA, never the program (the key covers the
# HLO, the compile options and flags, and the jax version). A tiny training
# run as tests/test_faults.py starts it: 30 s cold, 17 s warm. Under the
# ignored .pytest_cache, so a clean clone starts cold.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    '.pytest_cache', 'xla'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
# The TPU compile tests load libtpu (compile-only); subprocesses that do too
# (benchmark quick modes) would otherwise fail on libtpu's process lock.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

from sao_jax.models import pretrained  # pylint: disable=g-import-not-at-top

# XLA:CPU sizes its worker pools by max(cores, devices) (NPROC, when set,
# stands for the core count): eight threads for the eight fake devices on
# two cores. Each device waiting in a collective's rendezvous holds one of
# them, so a device whose remaining work sits queued on the same pool can
# leave all eight waiting for it until the terminate timeout (CI at 00cf3bc:
# a (2,2,2)-mesh Pallas step with two micro-batches hung 15 min and took its
# worker down). Twice the threads leave slack; the client reads NPROC once,
# when the backend starts, and servers and runs this session starts size
# their pools by the machine again.
if 'NPROC' not in os.environ:
  os.environ['NPROC'] = '16'
  jax.devices()
  del os.environ['NPROC']

_executed = {'count': 0}


def pytest_runtest_logreport(report):
  if report.when == 'call' and report.outcome in ('passed', 'failed'):
    _executed['count'] += 1


def pytest_collection_modifyitems(config, items):
  """Slow tests first (stable otherwise): on xdist workers the minute-long
  runs then overlap the short tests instead of finishing the session alone."""
  del config
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)


def pytest_sessionfinish(session, exitstatus):
  del exitstatus
  collect_only = session.config.getoption('collectonly', default=False)
  if not collect_only and _executed['count'] == 0:
    session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
    print('\nerror: no test was executed; failing the run')


@pytest.fixture(scope='session')
def tiny_checkpoint(tmp_path_factory):
  """Path of a tiny random Llama checkpoint directory (HF layout)."""
  return pretrained.save_tiny(str(tmp_path_factory.mktemp('tiny_llama')))


@pytest.fixture(scope='session')
def tiny_checkpoint_no_eos(tmp_path_factory):
  """Like `tiny_checkpoint`, but generations always run to max_tokens."""
  return pretrained.save_tiny(
      str(tmp_path_factory.mktemp('tiny_llama_no_eos')), with_stop=False)
