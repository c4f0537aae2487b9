"""The metrics logger: JSONL contents, resume semantics, TensorBoard events."""

import glob
import json
import math
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.logs import event_file
from sao_jax.logs import metrics_log

def strict_lines(path):
  """Parses every line as strict JSON: NaN/Infinity tokens are an error."""

  def reject(token):
    raise ValueError(f'non-standard JSON token {token}')

  with open(path, encoding='utf-8') as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def test_jsonl_round_trip_converts_scalars_and_nulls_nonfinite(tmp_path):
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    logger.write(3, {
        'py_int': 7,
        'py_float': 0.25,
        'flag': True,
        'np_f32': np.float32(0.5),
        'np_i64': np.int64(-4),
        'jax_f32': jnp.float32(1.25),
        'jax_sum': jnp.sum(jnp.arange(4)),  # a 0-d int32 jax array: 6
        'jax_bf16': jnp.asarray(2.5, jnp.bfloat16),
        'one_elem': np.array([9.0]),
    }, prefix='train')
    logger.write(4, {'nan': jnp.nan, 'inf': np.float32(np.inf),
                     'neg_inf': -math.inf, 'ok': 1.0})

  lines = strict_lines(tmp_path / metrics_log.JSONL_NAME)
  assert len(lines) == 2
  first, second = lines
  assert first['step'] == 3 and first['time'] >= 0.0
  assert {k: v for k, v in first.items() if k not in ('step', 'time')} == {
      'train/py_int': 7, 'train/py_float': 0.25, 'train/flag': True,
      'train/np_f32': 0.5, 'train/np_i64': -4, 'train/jax_f32': 1.25,
      'train/jax_sum': 6, 'train/jax_bf16': 2.5, 'train/one_elem': 9.0}
  # Integers stay integers (counts must not turn into 6.0).
  assert isinstance(first['train/jax_sum'], int)
  assert isinstance(first['train/np_i64'], int)
  assert 'nonfinite' not in first
  assert second['nan'] is None and second['inf'] is None
  assert second['neg_inf'] is None and second['ok'] == 1.0
  assert second['nonfinite'] == ['nan', 'inf', 'neg_inf']
  assert second['time'] >= first['time']
  # The reader gives the same records back.
  assert metrics_log.read_jsonl(tmp_path / 'metrics.jsonl') == lines


def test_write_flushes_each_record_before_close(tmp_path):
  logger = metrics_log.MetricsLogger(tmp_path, tensorboard=False)
  logger.write(1, {'a': 1.0})
  # Read while the logger is open, as after a kill: the record is there.
  assert [r['a'] for r in strict_lines(tmp_path / 'metrics.jsonl')] == [1.0]
  logger.close()
  logger.close()  # Idempotent.
  with pytest.raises(ValueError, match='closed'):
    logger.write(2, {'a': 2.0})


@pytest.mark.parametrize('metrics,error', [
    ({'v': np.zeros(3)}, ValueError),
    ({'v': jnp.ones((2, 2))}, ValueError),
    ({'step': 1.0}, ValueError),
    ({'resumed': 1.0}, ValueError),
    ({'v': 'text'}, TypeError),
    ({'v': 1 + 2j}, TypeError),
])
def test_write_rejects_bad_metrics(tmp_path, metrics, error):
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    with pytest.raises(error):
      logger.write(1, metrics)
  # Nothing half-written.
  assert strict_lines(tmp_path / 'metrics.jsonl') == []


def test_histogram_goes_to_jsonl_as_a_list(tmp_path):
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    logger.write_histogram(5, 'rollout/staleness', np.array([0, 1, 1, 2]))
    logger.write_histogram(6, 'x', jnp.array([0.5, jnp.nan]))
  first, second = strict_lines(tmp_path / 'metrics.jsonl')
  assert first['rollout/staleness'] == [0, 1, 1, 2]
  assert all(isinstance(v, int) for v in first['rollout/staleness'])
  assert second['x'] == [0.5, None] and second['nonfinite'] == ['x']


def test_histogram_buckets_are_per_integer_for_small_integer_ranges():
  buckets = metrics_log.tensorboard_histogram_buckets(np.array([0, 1, 1, 3]))
  np.testing.assert_array_equal(buckets, [[-0.5, 0.5, 1], [0.5, 1.5, 2],
                                          [1.5, 2.5, 0], [2.5, 3.5, 1]])
  floats = metrics_log.tensorboard_histogram_buckets(np.linspace(0, 1, 101))
  assert floats.shape == (30, 3) and floats[:, 2].sum() == 101
  assert floats[0, 0] == 0.0 and floats[-1, 1] == 1.0
  assert metrics_log.tensorboard_histogram_buckets(np.array([])).shape == (0, 3)


def test_resume_appends_and_dedupe_keeps_the_last_run(tmp_path):
  # Run 1 reaches step 5 (eval at 4), checkpoints at 2, then dies.
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    for step in range(1, 6):
      logger.write(step, {'reward': float(step)}, prefix='train')
    logger.write(4, {'accuracy': 0.5}, prefix='eval')
  # Run 2 resumes from step 2 and re-logs 3..6 with other values.
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    for step in range(3, 7):
      logger.write(step, {'reward': 10.0 * step}, prefix='train')
    logger.write(6, {'accuracy': 0.75}, prefix='eval')

  raw = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl')
  assert len(raw) == 6 + 5  # Appended, not truncated.
  assert [r['step'] for r in raw] == [1, 2, 3, 4, 5, 4, 3, 4, 5, 6, 6]
  assert [r.get('resumed') for r in raw].count(True) == 1
  assert raw[6]['resumed'] is True

  view = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl', dedupe=True)
  assert [r['step'] for r in view] == [1, 2, 3, 4, 5, 6]
  assert [r['train/reward'] for r in view] == [1, 2, 30, 40, 50, 60]
  # The dead run's eval at step 4 is superseded although not re-logged; the
  # new run's eval at 6 merged into step 6's record.
  assert 'eval/accuracy' not in view[3]
  assert view[5]['eval/accuracy'] == 0.75
  assert not any('resumed' in r for r in view)


def test_dedupe_keeps_out_of_order_steps_within_one_run(tmp_path):
  # An asynchronous eval of step 2 finishing after train step 4 is not a resume.
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    for step in range(1, 5):
      logger.write(step, {'train/reward': float(step)})
    logger.write(2, {'eval/accuracy': 0.5, 'nan': math.nan})
    logger.write(2, {'nan': 1.0})
  view = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl', dedupe=True)
  assert [r['train/reward'] for r in view] == [1, 2, 3, 4]
  assert view[1]['eval/accuracy'] == 0.5
  # A later finite value clears the earlier non-finite mark.
  assert view[1]['nan'] == 1.0 and 'nonfinite' not in view[1]


def test_resume_after_a_torn_line_keeps_both_runs(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1, "time": 0.1, "a": 1.0}\n{"step": 2, "ti')
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    logger.write(2, {'a': 2.0})
  records = metrics_log.read_jsonl(path)
  assert [(r['step'], r['a']) for r in records] == [(1, 1.0), (2, 2.0)]


def test_window_means_on_a_hand_made_log():
  records = [
      {'step': 1, 'r': 0.0}, {'step': 2, 'r': 1.0},
      {'step': 2, 'acc': 0.9},  # Another metric: skipped, not a 0.
      {'step': 3, 'r': 2.0}, {'step': 4, 'r': None},  # Non-finite: skipped.
      {'step': 5, 'r': 4.0}, {'step': 6, 'r': 6.0}, {'step': 7, 'r': 9},
  ]
  assert metrics_log.window_means(records, 'r', 2) == [0.5, 3.0, 7.5]
  assert metrics_log.window_means(records, 'r', 4) == [1.75, 7.5]
  assert metrics_log.window_means(records, 'r', 10) == [22.0 / 6]
  assert metrics_log.window_means(records, 'missing', 2) == []
  with pytest.raises(ValueError):
    metrics_log.window_means(records, 'r', 0)


def test_window_means_show_a_noisy_rise(tmp_path):
  rng = np.random.default_rng(0)
  with metrics_log.MetricsLogger(tmp_path, tensorboard=False) as logger:
    for step in range(60):
      logger.write(step, {'reward': step / 60 + rng.normal(0, 0.3)},
                   prefix='train')
  records = metrics_log.read_jsonl(tmp_path / 'metrics.jsonl')
  means = metrics_log.window_means(records, 'train/reward', 20)
  assert len(means) == 3
  assert means[0] < means[1] < means[2]


def test_non_chief_writes_nothing(tmp_path):
  workdir = tmp_path / 'run'
  with metrics_log.MetricsLogger(workdir, is_chief=False) as logger:
    logger.write(1, {'a': 1.0})
    logger.write_histogram(1, 'h', [1, 2])
  assert not workdir.exists()


def tensorboard_events(logdir):
  """{tag: [(step, value)]} from every event file under `logdir`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  events = {}
  for path in glob.glob(os.path.join(logdir, 'events.out.tfevents.*')):
    for raw in tf.data.TFRecordDataset(path):
      event = tf.compat.v1.Event.FromString(raw.numpy())
      for value in event.summary.value:
        events.setdefault(value.tag, []).append(
            (event.step, value.metadata.plugin_data.plugin_name,
             tf.make_ndarray(value.tensor)))
  return events


def test_tensorboard_event_files_hold_the_values(tmp_path):
  with metrics_log.MetricsLogger(tmp_path) as logger:
    logger.write(1, {'reward': 0.25, 'count': np.int64(3)}, prefix='train')
    logger.write(2, {'reward': jnp.float32(0.75)}, prefix='train')
    logger.write_histogram(2, 'rollout/staleness', [0, 1, 1, 2])
  assert glob.glob(str(tmp_path / 'tensorboard' / 'events.out.tfevents.*'))

  events = tensorboard_events(tmp_path / 'tensorboard')
  reward = [(step, plugin, float(v)) for step, plugin, v
            in events['train/reward']]
  assert reward == [(1, 'scalars', 0.25), (2, 'scalars', 0.75)]
  assert [(s, float(v)) for s, _, v in events['train/count']] == [(1, 3.0)]
  [(step, plugin, buckets)] = events['rollout/staleness']
  assert (step, plugin) == (2, 'histograms')
  np.testing.assert_array_equal(
      buckets, [[-0.5, 0.5, 1], [0.5, 1.5, 2], [1.5, 2.5, 1]])


def test_event_file_is_read_by_tensorflow_as_tensorboard_writes_it(tmp_path):
  """TensorFlow (an independent reader) parses every record, checksums
  included, and finds the values, dtypes and plugin metadata TensorBoard's
  own v2 summaries carry."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  writer = event_file.EventFileWriter(str(tmp_path))
  writer.scalars(2**40, [('a', 0.5), ('nan', math.nan)])
  writer.scalars(-1, [('a', -3.0)])
  writer.histogram(7, 'h', np.array([[0.0, 1.0, 4.0]]))
  writer.close()
  events = [tf.compat.v1.Event.FromString(raw.numpy())
            for raw in tf.data.TFRecordDataset(writer.path)]
  assert events[0].file_version == 'brain.Event:2'
  assert events[0].wall_time > 1.7e9
  assert [e.step for e in events[1:]] == [2**40, -1, 7]
  a, nan = events[1].summary.value
  assert (a.tag, float(tf.make_ndarray(a.tensor))) == ('a', 0.5)
  assert a.tensor.dtype == tf.float32.as_datatype_enum
  assert a.metadata.plugin_data.plugin_name == 'scalars'
  assert a.metadata.data_class == 1  # DATA_CLASS_SCALAR
  assert math.isnan(tf.make_ndarray(nan.tensor))
  (h,) = events[3].summary.value
  assert h.metadata.plugin_data.plugin_name == 'histograms'
  assert h.metadata.data_class == 2  # DATA_CLASS_TENSOR
  assert h.tensor.dtype == tf.float64.as_datatype_enum
  np.testing.assert_array_equal(tf.make_ndarray(h.tensor), [[0, 1, 4]])


def test_crc32c_and_its_mask_match_the_published_values():
  # The CRC-32C check value (RFC 3720, B.4); the masked form by hand:
  # 0xe3069283 rotated right by 15 is 0x2507c60d, plus 0xa282ead8.
  assert event_file.crc32c(b'123456789') == 0xe3069283
  assert event_file.masked_crc32c(b'123456789') == (
      0x2507c60d + 0xa282ead8) & 0xffffffff
  assert event_file.crc32c(bytes(32)) == 0x8a9136aa  # RFC 3720, B.4


def test_logging_imports_no_tensorflow(tmp_path):
  script = textwrap.dedent(f"""
      import sys
      from sao_jax.logs import metrics_log
      with metrics_log.MetricsLogger({str(tmp_path)!r}) as logger:
        logger.write(1, {{'a': 1.0}})
        logger.write_histogram(1, 'h', [1, 2])
      assert 'tensorflow' not in sys.modules, 'tensorflow was imported'
  """)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo)
  result = subprocess.run([sys.executable, '-c', script], capture_output=True,
                          text=True, timeout=120, check=False, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
