"""Learner checkpoints: round trips, resharding, pruning, kills, SIGTERM."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax import checkpointing
from sao_jax import stop_signal

_REPO = pathlib.Path(__file__).resolve().parents[1]
_TMP_SUFFIX = '.orbax-checkpoint-tmp'


def mesh(shape, names):
  return jax.make_mesh(shape, names,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def abstract(tree):
  """A restore target with the shapes, dtypes and shardings of `tree`."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      tree)


@jax.jit  # one compile instead of one per eager op: keeps the test fast
def learner_state():
  params = {'w': jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 7,
            'b': jnp.linspace(-1, 1, 8).astype(jnp.bfloat16)}
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
  updates, opt_state = opt.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {
      'params': params,
      'opt_state': opt_state,
      'step': jnp.int32(11),
      'tokens_seen': jnp.uint32(4_000_000_000),
  }


METADATA = {
    'data_cursor': {'epoch': 2, 'index': 12345, 'shuffle_seed': 9},
    'policy_version': 17,
    'queue': {'produced': 400, 'consumed': 388, 'dropped_stale': 3},
    'running_mean_slots': {'task/gsm8k': 0, 'task/code': 1},
    'config': {'lr': 1e-6, 'gamma': 1.0, 'model': 'tiny', 'use_kl': False,
               'mesh': [1, 8, 1], 'notes': None},
}


def test_round_trip_of_learner_state_and_metadata(tmp_path):
  state = learner_state()
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    assert ckpt.save(11, state, METADATA)
    ckpt.wait()
    assert ckpt.latest_step() == 11
  # A fresh Checkpointer, as a resumed process would open it.
  with checkpointing.Checkpointer(tmp_path) as ckpt:
    restored, metadata = ckpt.restore(abstract_state=abstract(state))
    assert ckpt.read_metadata(11) == METADATA
  assert metadata == METADATA
  # The dtypes separately: chex compares bfloat16 values as float32.
  chex.assert_trees_all_equal_dtypes(restored, state)
  chex.assert_trees_all_equal(restored, state)
  # The optax state keeps its types (ScaleByAdamState, EmptyState) and the
  # first Adam moment is the one update's 0.1 * grad = 0.05.
  assert type(restored['opt_state'][0]) is type(state['opt_state'][0])
  np.testing.assert_allclose(restored['opt_state'][0].mu['w'], 0.05)
  assert int(restored['opt_state'][0].count) == 1


def test_restore_lands_in_target_sharding(tmp_path):
  saved_mesh = mesh((4, 2), ('data', 'fsdp'))
  target_mesh = mesh((2, 2, 2), ('x', 'y', 'z'))
  w = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  rows = jnp.arange(8, dtype=jnp.uint32)
  state = {
      'w': jax.device_put(w, NamedSharding(saved_mesh, P('data', 'fsdp'))),
      'rows': jax.device_put(rows, NamedSharding(saved_mesh, P('data'))),
      'count': jax.device_put(jnp.int32(3), NamedSharding(saved_mesh, P())),
  }
  target_shardings = {
      'w': NamedSharding(target_mesh, P(None, ('x', 'z'))),
      'rows': NamedSharding(target_mesh, P('y')),
      'count': NamedSharding(target_mesh, P()),
  }
  target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      state, target_shardings)
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    ckpt.save(1, state, {})
    restored, _ = ckpt.restore(abstract_state=target)

  for name, sharding in target_shardings.items():
    assert restored[name].sharding == sharding, name
  # w split 4 ways along columns (x * z), replicated over y: shards of
  # (8, 4) holding the right columns.
  for shard in restored['w'].addressable_shards:
    assert shard.data.shape == (8, 4)
    np.testing.assert_array_equal(shard.data, w[shard.index])
  np.testing.assert_array_equal(restored['w'], w)
  np.testing.assert_array_equal(restored['rows'], rows)
  assert int(restored['count']) == 3


def test_save_interval_and_force(tmp_path):
  state = {'x': jnp.zeros(3)}
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=5) as ckpt:
    assert not ckpt.save(3, state, {})  # not a multiple of 5
    assert ckpt.save(5, state, {})
    assert not ckpt.save(6, state, {})
    assert ckpt.save(7, state, {}, force=True)
    # A forced save of a step already saved (SIGTERM right after a periodic
    # save) is a no-op, not an error.
    assert not ckpt.save(7, state, {}, force=True)
    assert ckpt.save(10, state, {})
    ckpt.wait()
    assert ckpt.all_steps() == [5, 7, 10]


def test_max_to_keep_prunes_oldest(tmp_path):
  with checkpointing.Checkpointer(tmp_path, max_to_keep=2,
                                  save_interval_steps=1) as ckpt:
    for step in range(1, 6):
      assert ckpt.save(step, {'x': jnp.full(3, step)}, {'step': step})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
    restored, metadata = ckpt.restore(
        4, abstract_state=abstract({'x': jnp.zeros(3, jnp.int32)}))
  np.testing.assert_array_equal(restored['x'], [4, 4, 4])
  assert metadata == {'step': 4}
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [
      '4', '5']


def test_metadata_is_copied_when_save_starts(tmp_path):
  metadata = {'queue': {'consumed': 1}}
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    ckpt.save(1, {'x': jnp.zeros(2)}, metadata)
    metadata['queue']['consumed'] = 99  # the trainer moves on at once
    ckpt.wait()
    assert ckpt.read_metadata() == {'queue': {'consumed': 1}}


def test_bad_metadata_is_refused_before_saving(tmp_path):
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    with pytest.raises(TypeError, match=r"metadata\['slots'\]\[3\].*str"):
      ckpt.save(1, {'x': jnp.zeros(2)}, {'slots': {3: 'gsm8k'}})
    with pytest.raises(TypeError, match='not JSON-able'):
      ckpt.save(1, {'x': jnp.zeros(2)}, {'lr': np.float32(0.1)})
    with pytest.raises(TypeError, match='not JSON-able'):
      ckpt.save(1, {'x': jnp.zeros(2)}, {'loss': float('nan')})
    assert ckpt.latest_step() is None


def test_mismatched_target_names_leaf_and_shapes(tmp_path):
  state = {'params': {'w': jnp.zeros((4, 8)), 'b': jnp.zeros(8)},
           'step': jnp.int32(0)}
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    ckpt.save(3, state, {})
    good = abstract(state)

    wrong_shape = dict(good, params=dict(
        good['params'], w=jax.ShapeDtypeStruct((4, 9), jnp.float32,
                                               sharding=good['params']['w']
                                               .sharding)))
    with pytest.raises(ValueError) as e:
      ckpt.restore(abstract_state=wrong_shape)
    assert str(e.value) == (
        "checkpoint step 3 does not match abstract_state at leaf 'params/w':"
        ' checkpoint shape (4, 8), abstract_state shape (4, 9)')

    missing = dict(good, params=dict(good['params'], v=good['params']['b']))
    with pytest.raises(ValueError, match=r"leaf 'params/v' \(shape \(8,\)\) "
                       'is not in the checkpoint'):
      ckpt.restore(abstract_state=missing)

    extra = {'params': {'w': good['params']['w']}, 'step': good['step']}
    with pytest.raises(ValueError, match=r"checkpoint has leaf 'params/b' "
                       r'\(shape \(8,\)\) that abstract_state lacks'):
      ckpt.restore(abstract_state=extra)

    no_sharding = dict(good, params=dict(
        good['params'], b=jax.ShapeDtypeStruct((8,), jnp.float32)))
    with pytest.raises(ValueError, match="leaf 'params/b'.*no sharding"):
      ckpt.restore(abstract_state=no_sharding)

    with pytest.raises(FileNotFoundError, match=r'step 4 .*steps: \[3\]'):
      ckpt.restore(4, abstract_state=good)


def test_empty_directory_has_no_step(tmp_path):
  with checkpointing.Checkpointer(tmp_path / 'new') as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match='no finalized checkpoint'):
      ckpt.restore(abstract_state={'x': abstract(jnp.zeros(2))})


# -- a process killed mid-save ------------------------------------------------

# Saves step 2 in a child whose orbax stalls inside the finalize of the
# temporary path named `stall_at` (an item, or the step directory itself),
# after writing a marker; the test SIGKILLs it there. This is the real
# on-disk state of a preempted save, written by orbax itself.
_SAVE_AND_STALL = textwrap.dedent('''
    import pathlib, sys, time
    import jax, jax.numpy as jnp
    import orbax.checkpoint as ocp
    from sao_jax import checkpointing

    directory, stall_at, marker = sys.argv[1:4]
    cls = ocp.path.atomicity.AtomicRenameTemporaryPath
    finalize = cls.finalize

    async def stalling_finalize(self, *args, **kwargs):
      if self.get_final().name == stall_at:
        pathlib.Path(marker).write_text(str(self.get()))
        time.sleep(600)
      return await finalize(self, *args, **kwargs)

    cls.finalize = stalling_finalize
    ckpt = checkpointing.Checkpointer(directory, save_interval_steps=1)
    ckpt.save(2, {'w': jnp.full(16, 2.0), 'step': jnp.int32(2)},
              {'step': 2})
    ckpt.wait()
''')


def _subprocess_env():
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [str(_REPO)] + [p for p in [env.get('PYTHONPATH')] if p])
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _kill_mid_save(directory, stall_at, marker):
  proc = subprocess.Popen(
      [sys.executable, '-c', _SAVE_AND_STALL, str(directory), stall_at,
       str(marker)],
      env=_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 60
    while not marker.exists():
      if proc.poll() is not None:
        raise AssertionError(
            f'child exited before stalling:\n{proc.stdout.read().decode()}')
      assert time.monotonic() < deadline, 'child never reached finalize'
      time.sleep(0.02)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize('stall_at, written', [
    # Killed while the state item is still a temporary directory, its
    # arrays written.
    ('state', f'state{_TMP_SUFFIX}/manifest.ocdbt'),
    # Killed after both items were finalized inside the step's temporary
    # directory (each with its commit_success.txt), just before the step
    # directory's own rename: a complete-looking step 2 under a temporary name.
    ('2', 'state/commit_success.txt'),
], ids=['during_items', 'before_step_rename'])
def test_save_killed_mid_save_is_never_loaded(tmp_path, stall_at, written):
  marker = tmp_path / 'stalled'
  tmp_path = tmp_path / 'checkpoints'
  state = {'w': jnp.full(16, 1.0), 'step': jnp.int32(1)}
  target = abstract(state)
  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    ckpt.save(1, state, {'step': 1})

  _kill_mid_save(tmp_path, stall_at, marker)
  # The killed save left its temporary step directory with the arrays
  # written: exactly what must not be mistaken for step 2.
  leftover = tmp_path / f'2{_TMP_SUFFIX}'
  assert (leftover / written).is_file()
  assert not (tmp_path / '2').exists()

  with checkpointing.Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
    assert ckpt.latest_step() == 1
    assert ckpt.all_steps() == [1]
    restored, metadata = ckpt.restore(abstract_state=target)
    assert metadata == {'step': 1}
    np.testing.assert_array_equal(restored['w'], np.full(16, 1.0))
    with pytest.raises(FileNotFoundError):
      ckpt.restore(2, abstract_state=target)

    # Saving again in the same directory works, the same step included.
    assert ckpt.save(2, {'w': jnp.full(16, 2.5), 'step': jnp.int32(2)},
                     {'step': 2})
    assert ckpt.save(3, {'w': jnp.full(16, 3.0), 'step': jnp.int32(3)},
                     {'step': 3})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3]
    restored, metadata = ckpt.restore(2, abstract_state=target)
  assert metadata == {'step': 2}
  np.testing.assert_array_equal(restored['w'], np.full(16, 2.5))
  assert not list(tmp_path.glob(f'*{_TMP_SUFFIX}*'))


# -- stopping on SIGTERM ------------------------------------------------------


def test_sigterm_sets_flag_and_uninstall_restores_handler():
  previous = signal.getsignal(signal.SIGTERM)
  stop = stop_signal.install_sigterm_handler()
  try:
    assert not stop.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not stop.should_stop() and time.monotonic() < deadline:
      time.sleep(0.01)
    assert stop.should_stop()
    assert stop.signum == signal.SIGTERM
  finally:
    stop.uninstall()
  assert signal.getsignal(signal.SIGTERM) is previous


# A training loop following the documented contract; it prints each step so
# the test can send SIGTERM while it runs.
_TRAIN_UNTIL_SIGTERM = textwrap.dedent('''
    import sys, time
    import jax.numpy as jnp
    from sao_jax import checkpointing
    from sao_jax import stop_signal

    stop = stop_signal.install_sigterm_handler()
    ckpt = checkpointing.Checkpointer(sys.argv[1], save_interval_steps=1000)
    state = {'x': jnp.zeros(4)}
    for step in range(1, 100_000):
      state = {'x': state['x'] + 1}
      print(step, flush=True)
      ckpt.save(step, state, {'step': step})
      if stop.should_stop():
        ckpt.save(step, state, {'step': step, 'stopped': True}, force=True)
        break
      time.sleep(0.01)
    ckpt.wait()
''')


def test_training_loop_saves_on_sigterm(tmp_path):
  directory = tmp_path / 'checkpoints'
  with open(tmp_path / 'stderr', 'w+') as stderr:
    proc = subprocess.Popen(
        [sys.executable, '-c', _TRAIN_UNTIL_SIGTERM, str(directory)],
        env=_subprocess_env(), stdout=subprocess.PIPE, stderr=stderr,
        text=True)
    try:
      first = proc.stdout.readline().strip()
      if first == '1':
        proc.send_signal(signal.SIGTERM)
      proc.communicate(timeout=60)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    stderr.seek(0)
    log = stderr.read()[-3000:]
  assert first == '1', log
  assert proc.returncode == 0, log
  with checkpointing.Checkpointer(directory) as ckpt:
    step = ckpt.latest_step()
    assert step is not None and step < 1000  # saved by the forced save
    restored, metadata = ckpt.restore(
        abstract_state={'x': abstract(jnp.zeros(4))})
  assert metadata == {'step': step, 'stopped': True}
  np.testing.assert_array_equal(restored['x'], np.full(4, float(step)))


_WRITE_FAILS = textwrap.dedent('''
    import resource, signal, sys
    import numpy as np
    from sao_jax import checkpointing
    ckpt = checkpointing.Checkpointer(sys.argv[1], save_interval_steps=1)
    ckpt.save(1, {'w': np.ones(1000, np.float32)}, {})
    ckpt.wait()
    # From here on no file may grow past 1 MiB: the kernel refuses the write
    # (EFBIG) as it refuses one on a full disk (ENOSPC).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    noise = np.random.default_rng(0).normal(size=1 << 20).astype(np.float32)
    ckpt.save(2, {'w': noise}, {})
    try:
      ckpt.wait()
    except checkpointing.CheckpointWriteError as e:
      print('ERROR', e)
    print('STEPS', ckpt.all_steps())
''')


def test_a_failed_write_is_one_line_naming_step_reason_and_last_good(
    tmp_path):
  proc = subprocess.run(
      [sys.executable, '-c', _WRITE_FAILS, str(tmp_path / 'ckpt')],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = {line.split(' ', 1)[0]: line.split(' ', 1)[1]
           for line in proc.stdout.splitlines() if ' ' in line}
  message = lines['ERROR']
  assert '\n' not in message
  assert 'checkpoint of step 2 could not be written' in message
  assert 'File too large' in message
  assert 'step 1 is the last complete one' in message
  assert lines['STEPS'] == '[1]'
