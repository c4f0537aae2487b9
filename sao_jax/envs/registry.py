"""Building the environment a config names (`config.task`)."""

from __future__ import annotations

from sao_jax.envs import arithmetic
from sao_jax.envs import base
from sao_jax.envs import calculator
from sao_jax.envs import nonstationary
from sao_jax.envs import word_target
# Our own environments; any other name is a reasoning-gym dataset.
OWN = ('arith_chain_sum', 'arith_countdown', 'calculator', 'humaneval',
       'jsonl', 'word_target')


def reasoning_gym_names() -> tuple[str, ...]:
  from reasoning_gym import factory  # pylint: disable=g-import-not-at-top
  return tuple(sorted(factory.DATASETS))


def check_name(name: str) -> str | None:
  """None if `name` is a known task, else a one-line problem naming it."""
  if name in OWN:
    return None
  known = reasoning_gym_names()
  if name in known:
    return None
  return (f'config.task.name={name!r} is neither one of {OWN} nor a'
          ' reasoning-gym dataset (e.g. chain_sum, countdown, basic_arithmetic,'
          ' gsm_symbolic)')


def make(task) -> base.Environment:
  """The environment of `config.task` (a ConfigDict), wrapped as configured.

  Raises:
    ValueError: for an unknown task name, naming `config.task.name`.
  """
  problem = check_name(task.name)
  if problem:
    raise ValueError(problem)
  if task.name == 'arith_chain_sum':
    env = arithmetic.ChainSum(num_terms=task.num_terms, digits=task.digits,
                              seed=task.seed,
                              answer_format=task.answer_format)
  elif task.name == 'arith_countdown':
    env = arithmetic.Countdown(seed=task.seed, answer_format=task.answer_format)
  elif task.name == 'calculator':
    c = task.calculator
    env = calculator.CalculatorEnvironment(
        num_terms=task.num_terms, digits=task.digits, operators=c.operators,
        max_turns=c.max_turns, max_calls_per_turn=c.max_calls_per_turn,
        seed=task.seed, tool_delay_median_s=c.tool_delay_median_s,
        tool_delay_sigma=c.tool_delay_sigma,
        tool_delay_max_s=c.tool_delay_max_s or None)
  elif task.name == 'humaneval':
    from sao_jax.envs import humaneval_env  # pylint: disable=g-import-not-at-top
    s = task.sandbox
    env = humaneval_env.HumanEvalEnvironment(
        eval_size=task.humaneval_eval_size, seed=task.seed,
        max_turns=task.humaneval_max_turns, timeout_s=s.timeout_s,
        memory_mb=s.memory_mb, max_concurrent_runs=s.max_concurrent_runs or None,
        mode=None if s.mode == 'auto' else s.mode, cpu_s=s.cpu_s,
        max_file_mb=s.max_file_mb, max_procs=s.max_procs)
  elif task.name == 'word_target':
    w = task.word_target
    env = word_target.WordTarget(
        seed=task.seed, switch_steps=tuple(w.switch_steps), turns=w.turns,
        observation_words=w.observation_words,
        delay_median_s=w.delay_median_s, delay_sigma=w.delay_sigma,
        delay_max_s=w.delay_max_s or None, scored_reply=w.scored_reply)
  elif task.name == 'jsonl':
    from sao_jax.envs import jsonl_dataset  # pylint: disable=g-import-not-at-top
    j = task.jsonl
    if not j.path:
      raise ValueError("config.task.jsonl.path must name a JSONL file when"
                       " config.task.name='jsonl'")
    env = jsonl_dataset.JsonlEnvironment(
        j.path, scorer=j.scorer, eval_fraction=j.eval_fraction,
        eval_path=j.eval_path or None, answer_format=task.answer_format,
        cache_dir=j.cache_dir or None)
  else:
    from sao_jax.envs import reasoning_gym_env  # pylint: disable=g-import-not-at-top
    env = reasoning_gym_env.ReasoningGymEnvironment(
        task.name, seed=task.seed, answer_format=task.answer_format,
        partial_credit=task.partial_credit, **dict(task.dataset_kwargs))
  if task.nonstationary.enabled:
    env = nonstationary.NonStationaryEnvironment(
        env, formats=tuple(task.nonstationary.formats),
        switch_steps=tuple(task.nonstationary.switch_steps))
  return env
