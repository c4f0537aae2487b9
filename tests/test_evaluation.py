"""Held-out evaluation: batching, scoring, statistics and the report."""

import collections
import math
import os

import pytest

from sao_jax import config_lib
from sao_jax import evaluation
from sao_jax.envs import base
from sao_jax.envs import registry
from sao_jax.models import decoding
from sao_jax.models import sampling
from sao_jax.models import tiny

_CONFIG = os.path.join(os.path.dirname(__file__), '..', 'configs',
                       'default.py')


class _WordEnv(base.Environment):
  """Questions are runs of tiny-vocabulary words; a reply is right if it
  contains `word`.

  Questions repeat every `distinct` indices and vary in length (1 to 9
  words), so length sorting reorders them. With `report_correct=False` the
  environment leaves `info['correct']` out and pays 0.5 for a miss, so
  correctness must come from `reward >= 1` and mean reward differs from
  accuracy. `max_turns > 1` asks for another turn, showing `observation`,
  until the last turn or, with `finish=False`, never ends the episode.
  """

  name = 'words'

  def __init__(self, word='w0', distinct=1000, report_correct=True,
               max_turns=1, observation='w7 w8', finish=True):
    self.word = word
    self.distinct = distinct
    self.report_correct = report_correct
    self.max_turns = max_turns
    self.observation = observation
    self.finish = finish
    self.calls = collections.defaultdict(list)  # task id -> [(turn, text)]

  def task(self, split, index):
    k = index % self.distinct
    words = ' '.join(f'w{(7 * k + j) % 50}' for j in range(1 + k % 9))
    return base.Task(id=f'words/{split}/{index}', question=words)

  def prompt_messages(self, task):
    return [{'role': 'user', 'content': task.question}]

  def step(self, task, turn, action_text):
    self.calls[task.id].append((turn, action_text))
    if turn < self.max_turns - 1 or not self.finish:
      return base.StepResult(done=False, observation=self.observation)
    hit = self.word in action_text.split()
    if self.report_correct:
      return base.StepResult(done=True, reward=float(hit),
                             info={'correct': hit})
    return base.StepResult(done=True, reward=1.0 if hit else 0.5)


@pytest.fixture(scope='module')
def tiny_model():
  return tiny.make()


def _common_word(replies):
  """A word in some replies but not all, so scoring has both outcomes."""
  counts = collections.Counter(w for r in replies for w in set(r.split()))
  for word, count in counts.most_common():
    if 0 < count < len(replies):
      return word
  raise AssertionError(f'no word separates the replies {replies}')


def _judged_by_a_separating_word(tiny_model, **env_kwargs):
  """20 greedy replies, then the same tasks judged by a word some contain.

  Returns:
    `(tasks, replies, env, result)`.
  """
  model, tok = tiny_model
  probe = _WordEnv()
  tasks = evaluation.held_out_tasks(probe, 20)
  replies = evaluation.evaluate(model, tok, probe, tasks,
                                max_new_tokens=8).replies
  env = _WordEnv(word=_common_word(replies), **env_kwargs)
  result = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=8)
  return tasks, replies, env, result


def test_accuracy_is_counted_from_the_replies(tiny_model):
  tasks, replies, env, result = _judged_by_a_separating_word(tiny_model)

  assert result.replies == replies  # greedy: the same replies again
  hits = [env.word in r.split() for r in replies]
  assert 0 < sum(hits) < 20
  assert result.correct == hits
  assert result.n == 20
  assert result.accuracy == sum(hits) / 20
  assert result.mean_reward == sum(hits) / 20
  p = sum(hits) / 20
  assert result.standard_error == pytest.approx(math.sqrt(p * (1 - p) / 20))
  assert result.task_ids == [f'words/eval/{i}' for i in range(20)]
  assert result.seconds > 0
  # Every task was judged once, on turn 0, with its own reply.
  assert dict(env.calls) == {
      task.id: [(0, reply)] for task, reply in zip(tasks, replies)}


def test_correct_falls_back_to_full_reward(tiny_model):
  _, replies, env, result = _judged_by_a_separating_word(
      tiny_model, report_correct=False)
  hits = sum(env.word in r.split() for r in replies)
  assert result.accuracy == hits / 20
  # A hit pays 1, a miss 0.5 that is not counted as correct.
  assert result.mean_reward == pytest.approx((hits + 0.5 * (20 - hits)) / 20)


def test_order_survives_sorting_and_padding(tiny_model):
  model, tok = tiny_model
  env = _WordEnv()
  tasks = evaluation.held_out_tasks(env, 20)
  lengths = [len(tok.encode_chat(env.prompt_messages(t))) for t in tasks]
  assert lengths != sorted(lengths)  # sorting does reorder these prompts
  full = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=8,
                             batch_size=64)
  # 20 = 6 batches of 3 and a last batch of 2 padded with a repeat.
  padded = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=8,
                               batch_size=3)
  assert padded.replies == full.replies
  assert padded.correct == full.correct
  assert len(set(full.replies)) > 5  # replies differ: order is observable
  # Reference: one unsorted batch of all prompts, in the given order.
  prompts = [tok.encode_chat(env.prompt_messages(t)) for t in tasks]
  reference = decoding.generate(model, prompts, 8, params=evaluation.GREEDY,
                                stop_ids=tok.stop_ids, pad_id=tok.pad_id)
  assert full.replies == [tok.decode(g.tokens, skip_special_tokens=True)
                          for g in reference]


def _record_batches(monkeypatch):
  """Row counts of every `decoding.generate` call from now on."""
  rows, generate = [], decoding.generate

  def recording(model, prompts, *args, **kwargs):
    rows.append(len(prompts))
    return generate(model, prompts, *args, **kwargs)

  monkeypatch.setattr(decoding, 'generate', recording)
  return rows


def test_batches_are_equal(tiny_model, monkeypatch):
  model, tok = tiny_model
  env = _WordEnv()
  tasks = evaluation.held_out_tasks(env, 20)
  rows = _record_batches(monkeypatch)
  # One new token: the batching is what is tested, prefill is all it needs.
  evaluation.evaluate(model, tok, env, tasks, max_new_tokens=1, batch_size=3)
  assert rows == [3] * 7  # 21 rows: one padding row
  del rows[:]
  evaluation.evaluate(model, tok, env, tasks, max_new_tokens=1, batch_size=8)
  assert rows == [7] * 3  # not 8 + 8 + 4 padded to 8
  del rows[:]
  evaluation.evaluate(model, tok, env, tasks, max_new_tokens=1, batch_size=64)
  assert rows == [20]


def test_repeated_questions_are_generated_once(tiny_model, monkeypatch):
  model, tok = tiny_model
  env = _WordEnv(distinct=5)
  tasks = evaluation.held_out_tasks(env, 20)
  rows = _record_batches(monkeypatch)
  result = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=8,
                               batch_size=3)
  assert rows == [3, 3]  # the 5 distinct prompts and a padding row
  distinct = evaluation.evaluate(model, tok, env, tasks[:5], max_new_tokens=8,
                                 batch_size=3)
  assert result.replies == distinct.replies * 4
  assert result.correct == distinct.correct * 4
  # Every task is still judged, repeats included.
  assert sorted(env.calls) == sorted(t.id for t in tasks)
  # Sampled replies are independent draws: every task is generated.
  del rows[:]
  evaluation.evaluate(model, tok, env, tasks, max_new_tokens=1, batch_size=3,
                      params=sampling.SamplingParams(1.0))
  assert rows == [3] * 7


def test_multi_turn_plays_until_the_environment_ends(tiny_model):
  model, tok = tiny_model
  env = _WordEnv(max_turns=2, observation='w7 w8')
  tasks = evaluation.held_out_tasks(env, 4)
  result = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=3,
                               bucket=64)
  for task, reply, correct in zip(tasks, result.replies, result.correct):
    (turn0, text0), (turn1, text1) = env.calls[task.id]
    assert (turn0, turn1) == (0, 1)
    # The reply is turn 0, the observation, then turn 1.
    assert reply.split() == text0.split() + ['w7', 'w8'] + text1.split()
    assert correct == (env.word in text1.split())

  never = _WordEnv(max_turns=3, finish=False)
  result = evaluation.evaluate(model, tok, never, tasks, max_new_tokens=3,
                               bucket=64)
  assert result.accuracy == 0 and result.mean_reward == 0
  assert all([c[0] for c in never.calls[t.id]] == [0, 1, 2] for t in tasks)


def test_from_outcomes_standard_error():
  result = evaluation.EvalResult.from_outcomes(
      [True, True, True, False], [1, 1, 1, 0], ['a', 'b', 'c', 'd'], 2.0)
  assert result.accuracy == 0.75
  assert result.standard_error == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
  assert result.standard_error == pytest.approx(0.21650635)
  assert result.mean_reward == 0.75
  with pytest.raises(ValueError, match='at least one'):
    evaluation.EvalResult.from_outcomes([], [], [], 0.0)


def _result(correct):
  return evaluation.EvalResult.from_outcomes(
      correct, [float(c) for c in correct], [''] * len(correct), 1.0)


def test_compare_values():
  f, t = False, True
  before = _result([t, t, f, f, f, f, f, f, f, f])  # 0.2
  after = _result([t, f, t, t, t, f, f, f, f, f])  # 0.4: gained 3, lost 1
  c = evaluation.compare(before, after)
  assert c['difference'] == pytest.approx(0.2)
  # sqrt(0.2 * 0.8 / 10 + 0.4 * 0.6 / 10) = sqrt(0.04)
  assert c['standard_error'] == pytest.approx(0.2)
  assert (c['gained'], c['lost']) == (3, 1)
  # Per-question differences (+1 x3, -1 x1, 0 x6): population sd / sqrt(n).
  d = [0, -1, 1, 1, 1, 0, 0, 0, 0, 0]
  mean = sum(d) / 10
  sd = math.sqrt(sum((x - mean)**2 for x in d) / 10)
  assert c['paired_standard_error'] == pytest.approx(sd / math.sqrt(10))
  assert c['paired_standard_error'] == pytest.approx(math.sqrt(3.6) / 10)
  assert c['significant'] is False  # 0.2 is not above 2 * 0.2

  big_before = _result([t] * 30 + [f] * 70)
  big_after = _result([t] * 60 + [f] * 40)
  c = evaluation.compare(big_before, big_after)
  assert c['standard_error'] == pytest.approx(math.sqrt(0.0045))
  assert c['significant'] is True  # 0.3 > 2 * 0.067
  assert (c['gained'], c['lost']) == (30, 0)
  # A drop is never significant, however large.
  assert evaluation.compare(big_after, big_before)['significant'] is False


def test_compare_rejects_different_sets():
  with pytest.raises(ValueError, match='same held-out set'):
    evaluation.compare(_result([True]), _result([True, False]))
  a = evaluation.EvalResult.from_outcomes([True], [1.0], [''], 1.0, ['x/0'])
  b = evaluation.EvalResult.from_outcomes([True], [1.0], [''], 1.0, ['x/1'])
  with pytest.raises(ValueError, match='different tasks'):
    evaluation.compare(a, b)


def test_format_report():
  f, t = False, True
  before = _result([t, t, f, f, f, f, f, f, f, f])
  after = _result([t, f, t, t, t, f, f, f, f, f])
  report = evaluation.format_report(before, after)
  lines = report.splitlines()
  assert lines[0].split() == ['before', 'after']
  assert lines[1].split() == ['accuracy', '0.200', '±', '0.126', '0.400', '±',
                              '0.155']
  assert lines[2].split() == ['n', '10', '10']
  assert lines[3].split() == ['mean', 'reward', '0.200', '0.400']
  assert lines[4].split() == ['seconds', '1.0', '1.0']
  assert '+0.200 ± 0.200' in lines[5]
  assert 'gained 3, lost 1' in lines[5] and 'significant: no' in lines[5]
  # The table's columns line up.
  assert len({len(line) for line in lines[:5]}) == 1


def test_held_out_tasks_keep_repeats():
  env = _WordEnv(distinct=5)
  tasks = evaluation.held_out_tasks(env, 12)
  assert [t.id for t in tasks] == [f'words/eval/{i}' for i in range(12)]
  assert tasks[0].question == tasks[5].question == tasks[10].question
  assert len({t.question for t in tasks}) == 5
  distinct = evaluation.held_out_tasks(env, 5, distinct=True)
  assert [t.id for t in distinct] == [f'words/eval/{i}' for i in range(5)]
  with pytest.raises(ValueError, match='distinct'):
    evaluation.held_out_tasks(env, 6, distinct=True)
  with pytest.raises(ValueError, match='n must be'):
    evaluation.held_out_tasks(env, -1)


def test_chain_sum_plumbing(tiny_model):
  model, tok = tiny_model
  config = config_lib.load_config(_CONFIG)
  env = registry.make(config.task)
  tasks = evaluation.held_out_tasks(env, 200)
  # 200 draws from chain_sum's 200 questions repeat some.
  assert len({t.question for t in tasks}) < 200
  tasks = tasks[:10]
  result = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=4)
  assert result.n == 10 and len(result.replies) == 10
  assert result.task_ids == [f'chain_sum/eval/{i}' for i in range(10)]
  # Judged by the real scorer: re-scoring the replies agrees.
  assert result.correct == [env.step(t, 0, r).info['correct']
                            for t, r in zip(tasks, result.replies)]
  assert all(len(r.split()) <= 4 for r in result.replies)
