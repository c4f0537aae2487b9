"""The word-target task of the tiny model: phases, latency and multi-turn."""

import asyncio
import os
import time

import pytest

from sao_jax import config_lib
from sao_jax import evaluation
from sao_jax import recipe_checks
from sao_jax.envs import calculator
from sao_jax.envs import latency
from sao_jax.envs import registry
from sao_jax.envs import word_target
from sao_jax.logs import train_metrics
from sao_jax.models import tiny
from sao_jax.rollout import client as client_lib
from sao_jax.rollout import episodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def test_default_is_the_single_turn_even_word_share():
  env = word_target.WordTarget()
  assert env.max_turns == 1
  # index 2: words 2 * 7 + 13 k (mod 61); eval starts 7919 = 50 (mod 61).
  assert env.task('train', 2).question == 'w14 w27 w40 #train2'
  assert env.prompt_messages(env.task('eval', 0)) == [
      {'role': 'user', 'content': 'w50 w2 w15'}]
  task = env.task('train', 0)
  # Words: w0 w3 w4 who w10; even: w0 w4 w10. 'who' is a word of no parity.
  result = env.step(task, 0, 'w0 w3 w4 who w10 and')
  assert result.done and result.reward == pytest.approx(3 / 5)
  assert result.info == {'correct': False, 'words': 5, 'phase': 0}
  assert env.step(task, 0, 'w2 w4 w6 w7').info['correct']  # 0.75
  assert env.step(task, 0, 'no words').reward == 0.0


def test_parity_flips_at_each_switch_step():
  env = word_target.WordTarget(switch_steps=(20, 40))
  task = env.task('train', 1)
  reply = 'w1 w2 w3 w5'  # one even word, three odd
  # Policy step -> (phase, reward): even words in phases 0 and 2, odd in 1.
  for step, phase, reward in [(0, 0, 0.25), (19, 0, 0.25), (20, 1, 0.75),
                              (39, 1, 0.75), (40, 2, 0.25), (1000, 2, 0.25),
                              (5, 0, 0.25)]:  # a resumed run may go back
    env.on_policy_step(step)
    result = env.step(task, 0, reply)
    assert (result.info['phase'], result.reward) == (phase, reward), step
    assert result.info['correct'] == (reward >= 0.75)


def test_a_late_verdict_is_judged_in_the_phase_it_ends_in():
  env = word_target.WordTarget(switch_steps=(20,), delay_median_s=0.2,
                               delay_sigma=0.0)
  task = env.task('train', 0)

  async def switch_while_judging():
    episode = asyncio.ensure_future(env.astep(task, 0, 'w1 w3'))
    await asyncio.sleep(0.05)
    env.on_policy_step(20)  # the learner moves on during the latency
    return await episode

  result = asyncio.run(switch_while_judging())
  assert result.info['phase'] == 1 and result.reward == 1.0
  assert result.info['latency_s'] == pytest.approx(0.2)


def test_delays_are_reproducible_capped_and_shared_with_the_calculator():
  kwargs = dict(delay_median_s=0.5, delay_sigma=1.0)
  env, again = word_target.WordTarget(**kwargs), word_target.WordTarget(
      **kwargs)
  tasks = [env.task('train', i) for i in range(500)]
  delays = [env.turn_latency(t, turn) for t in tasks for turn in range(2)]
  assert delays == [again.turn_latency(t, turn) for t in tasks
                    for turn in range(2)]
  assert env.turn_latency(tasks[0], 0) != env.turn_latency(tasks[0], 1)
  assert word_target.WordTarget(seed=1, **kwargs).turn_latency(
      tasks[0], 0) != delays[0]
  # One mechanism: the calculator draws the same delay for the same key.
  tool = calculator.CalculatorEnvironment(tool_delay_median_s=0.5,
                                          tool_delay_sigma=1.0)
  assert [tool.tool_latency(t, 0) for t in tasks[:20]] == delays[:40:2]
  # Lognormal(log 0.5, 1) over 1000 draws: its p99 (5.1 s) far above 2 s.
  capped = word_target.WordTarget(delay_max_s=2.0, **kwargs)
  capped_delays = [capped.turn_latency(t, 0) for t in tasks]
  assert max(capped_delays) == 2.0
  assert capped_delays == [min(d, 2.0) for d in delays[::2]]
  assert word_target.WordTarget(delay_median_s=0.3, delay_sigma=0.0
                                ).turn_latency(tasks[0], 0) == 0.3
  assert word_target.WordTarget().turn_latency(tasks[0], 0) == 0.0


def test_step_never_sleeps_astep_sleeps_the_drawn_delay(monkeypatch):
  env = word_target.WordTarget(delay_median_s=30.0, turns=2)
  task = env.task('eval', 3)
  start = time.perf_counter()
  for turn in range(2):
    env.step(task, turn, 'w2 w4')
  assert time.perf_counter() - start < 0.5  # evaluation's path: no 30 s wait

  slept = []

  async def record(seconds):
    slept.append(seconds)

  monkeypatch.setattr(asyncio, 'sleep', record)
  result = asyncio.run(env.astep(task, 1, 'w2 w4'))
  assert slept == [env.turn_latency(task, 1, 'w2 w4')]
  # Another reply is another call: it waits its own draw (a GRPO group's
  # members do not finish together).
  assert env.turn_latency(task, 1, 'w2 w6') != slept[0]
  assert env.turn_latency(task, 1, 'w2 w4') == slept[0]
  assert result.info['latency_s'] == slept[0] and result.reward == 1.0
  slept.clear()
  result = asyncio.run(word_target.WordTarget().astep(task, 0, 'w2'))
  assert slept == [] and 'latency_s' not in result.info


def test_multi_turn_episode_hand_worked():
  env = word_target.WordTarget(turns=3, observation_words=4)
  assert env.max_turns == 3
  task = env.task('train', 5)
  first = env.step(task, 0, 'w2 w4 w5')  # 3 words, 2 even
  assert not first.done and first.info == {'words': 3, 'phase': 0}
  observation = first.observation.split()
  assert len(observation) == 4
  assert all(w[0] == 'w' and 0 <= int(w[1:]) < 61 for w in observation)
  # Fixed by task id and turn: another instance shows the same words, the
  # next turn and another task other ones.
  assert word_target.WordTarget(turns=3, observation_words=4).step(
      task, 0, 'w1').observation == first.observation
  assert env.observation(task, 1) != first.observation
  assert env.observation(env.task('train', 6), 0) != first.observation
  second = env.step(first.next_task, 1, '')  # an empty reply adds no words
  assert not second.done and second.info['words'] == 0
  assert second.next_task.id == task.id
  last = env.step(second.next_task, 2, 'w1 w6 w8 w9 w11')  # 5 words, 2 even
  # Pooled over the episode: (2 + 0 + 2) / (3 + 0 + 5) = 0.5 (the mean of
  # per-turn shares would be (2/3 + 2/5) / 2 or / 3, not used).
  assert last.done and last.reward == pytest.approx(0.5)
  assert last.info == {'correct': False, 'words': 8, 'phase': 0}
  # The task itself is untouched: judged alone, the last reply scores 2 / 5.
  assert env.step(task, 2, 'w1 w6 w8 w9 w11').reward == pytest.approx(0.4)


def test_first_reply_scoring_ignores_every_later_reply():
  """scored_reply='first': 'w2 w4 w5' scores 2/3 at the end of the episode,
  whatever the later replies say."""
  env = word_target.WordTarget(turns=3, observation_words=4,
                               scored_reply='first')
  task = env.task('train', 5)
  first = env.step(task, 0, 'w2 w4 w5')
  assert not first.done and first.info['words'] == 3
  for later in ('w1 w3 w5 w7', 'w0 w2 w4 w6 w8', ''):
    second = env.step(first.next_task, 1, later)
    assert second.info['words'] == 0  # read, judged by nothing
    last = env.step(second.next_task, 2, later)
    assert last.done and last.reward == pytest.approx(2 / 3)
    assert last.info['words'] == 3
  # The observations are those of the pooled task: only the score differs.
  assert first.observation == word_target.WordTarget(
      turns=3, observation_words=4).step(task, 0, 'w1').observation


class ScriptedPool:
  """A server pool that answers each request with the next scripted reply."""

  def __init__(self, tok, replies, finish_reasons=None):
    self._tok = tok
    self._replies = list(replies)
    self._finish = list(finish_reasons or ['stop'] * len(replies))
    self.prompts = []

  async def generate(self, prompt, max_tokens):
    self.prompts.append(list(prompt))
    tokens = self._tok.encode(self._replies.pop(0))[:max_tokens]
    await asyncio.sleep(0)  # let concurrent episodes interleave
    return [client_lib.Sample(tokens=tokens, logprobs=[-1.0] * len(tokens),
                              versions=[0] * len(tokens),
                              finish_reason=self._finish.pop(0))]


def _play(env, pool, task, tok, reward_cut_replies=True):
  return episodes.run_episode(
      pool, env, task, tok, episodes.ChatFormat(tok),
      episodes.EpisodeLimits(max_new_tokens=8, max_sequence_length=64,
                             reward_cut_replies=reward_cut_replies))


@pytest.mark.parametrize('keep', [True, False])
def test_a_last_reply_cut_by_the_budget_earns_its_reward_only_if_kept(keep):
  _, tok = tiny.make()
  env = word_target.WordTarget(turns=2, observation_words=3)
  task = env.task('train', 4)
  # The first turn's cut does not end the episode: only the last reply's
  # finish decides. Pooled share (1 + 3) / (2 + 4), as in the test below.
  pool = ScriptedPool(tok, ['w2 w3', 'w4 w6 w8 w1'], ['length', 'length'])
  (traj,) = asyncio.run(_play(env, pool, task, tok, reward_cut_replies=keep))
  assert traj.info['finish_reason'] == 'length'
  if keep:
    assert traj.reward == pytest.approx(4 / 6) and 'cut_reward' not in traj.info
  else:
    assert traj.reward == 0.0 and traj.info['cut_reward'] == pytest.approx(4 / 6)
  metrics = train_metrics.batch_metrics([traj], version=1)
  assert metrics['rollout/cut_rewards_withheld'] == (0.0 if keep else 1.0)
  assert metrics['rollout/cut_reward_lost_mean'] == pytest.approx(
      0.0 if keep else 4 / 6)

  # A first reply cut, the last one ended on its own: the reward stands.
  pool = ScriptedPool(tok, ['w2 w3', 'w4 w6 w8 w1'], ['length', 'stop'])
  (traj,) = asyncio.run(_play(env, pool, task, tok, reward_cut_replies=keep))
  assert traj.reward == pytest.approx(4 / 6) and 'cut_reward' not in traj.info


def test_rollout_episode_carries_observations_and_the_pooled_reward():
  _, tok = tiny.make()
  env = word_target.WordTarget(turns=2, observation_words=3)
  task = env.task('train', 4)
  pool = ScriptedPool(tok, ['w2 w3', 'w4 w6 w8 w1'])
  (traj,) = asyncio.run(_play(env, pool, task, tok))
  assert traj.reward == pytest.approx(4 / 6)  # (1 + 3) / (2 + 4)
  assert traj.info['turns'] == 2 and traj.info['phase'] == 0
  assert traj.prompt_id == task.id
  actions = [int(t) for t, a in zip(traj.tokens, traj.action_mask) if a]
  assert tok.decode(actions).split() == ['w2', 'w3', 'w4', 'w6', 'w8', 'w1']
  # The observation is a user turn between the replies, never an action.
  between = tok.decode(pool.prompts[1][len(pool.prompts[0]) + 2:],
                       skip_special_tokens=True).split()
  assert between == env.observation(task, 0).split()
  assert not traj.action_mask[len(pool.prompts[0]) + 2:
                              len(pool.prompts[1])].any()


def test_concurrent_episodes_of_one_task_keep_their_own_counts():
  # A GRPO group plays the same task object in separate, interleaved
  # episodes: each must be judged on its own replies only.
  _, tok = tiny.make()
  env = word_target.WordTarget(turns=2, observation_words=2)
  task = env.task('train', 0)
  pool = ScriptedPool(tok, ['w2 w4', 'w1 w3', 'w6', 'w5'])

  async def group():
    return await asyncio.gather(_play(env, pool, task, tok),
                                _play(env, pool, task, tok))

  (a,), (b,) = asyncio.run(group())
  # Requests alternate: a gets 'w2 w4' then 'w6', b 'w1 w3' then 'w5'.
  assert (a.reward, b.reward) == (1.0, 0.0)


def test_multi_turn_evaluation_judges_all_replies():
  model, tok = tiny.make()
  env = word_target.WordTarget(turns=2, observation_words=3)
  tasks = evaluation.held_out_tasks(env, 4)
  result = evaluation.evaluate(model, tok, env, tasks, max_new_tokens=4)
  want = []
  for task, reply in zip(tasks, result.replies):
    words = reply.split()
    observation = env.observation(task, 0).split()
    # The reply is turn 0, the observation, then turn 1; the reward pools
    # the two turns' words.
    starts = [i for i in range(len(words) - 2) if words[i:i + 3] ==
              observation]
    assert starts, (reply, observation)
    replies = words[:starts[-1]] + words[starts[-1] + 3:]
    total, even, _ = word_target.count_words(' '.join(replies))
    want.append(even / total if total else 0.0)
  assert result.mean_reward == pytest.approx(sum(want) / len(want))
  assert result.correct == [share >= 0.75 for share in want]


def test_bad_options_are_clear_errors():
  with pytest.raises(ValueError, match='strictly increasing'):
    word_target.WordTarget(switch_steps=(40, 20))
  with pytest.raises(ValueError, match='strictly increasing'):
    word_target.WordTarget(switch_steps=(-1,))
  with pytest.raises(ValueError, match='turns >= 1'):
    word_target.WordTarget(turns=0)
  with pytest.raises(ValueError, match='median and sigma must be >= 0'):
    word_target.WordTarget(delay_median_s=-0.1)
  with pytest.raises(ValueError, match=r'cap must be > 0'):
    latency.check(1.0, 1.0, 0.0)
  with pytest.raises(ValueError, match='scored_reply must be one of'):
    word_target.WordTarget(scored_reply='last')


def test_config_builds_the_configured_environment():
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny.py'))
  config.task.word_target.switch_steps = (20, 40)
  config.task.word_target.turns = 2
  config.task.word_target.delay_median_s = 0.5
  config.task.word_target.scored_reply = 'first'
  recipe_checks.validate(config, num_devices=1)
  env = registry.make(config.task)
  assert isinstance(env, word_target.WordTarget) and env.max_turns == 2
  assert env.scored_reply == 'first'
  assert env.turn_latency(env.task('train', 0), 0) > 0
  assert env.delay_max_s is None  # 0 in the config: no cap
  env.on_policy_step(20)
  assert env.phase == 1
