"""The multi-turn agent loop: model turn, environment observation, repeat.

Token-in/token-out: the model's actions are kept exactly as sampled (never
detokenized and re-tokenized, which would change ids and break mu_t), and the
environment's observations are appended as tokens formatted by the model's own
chat template, marked non-action. The outcome reward goes on the trajectory.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from sao_jax import types
from sao_jax.envs import base
from sao_jax.models import tokenizer as tokenizer_lib
from sao_jax.rollout import client as client_lib

_log = logging.getLogger(__name__)
_PROBE_USER, _PROBE_ACTION, _PROBE_OBSERVATION = 'U\u2063', 'A\u2063', 'O\u2063'


class ChatFormat:
  """How an observation turn is written in the model's chat template.

  Rendering `[user, assistant]` and `[user, assistant, user(obs)]` with the
  template and diffing the two gives the text between the end of an assistant
  turn and the start of the next one, with the observation inside. The part of
  that tail the model already produced (its end-of-turn token) is not
  repeated. Observation content is tokenized with special tokens disabled, so
  an environment cannot inject role markers.
  """

  def __init__(self, tok: tokenizer_lib.Tokenizer, role: str = 'user'):
    self._tok = tok
    probe = [{'role': 'user', 'content': _PROBE_USER},
             {'role': 'assistant', 'content': _PROBE_ACTION}]
    before = tok.apply_chat_template(probe, add_generation_prompt=False)
    after = tok.apply_chat_template(
        probe + [{'role': role, 'content': _PROBE_OBSERVATION}],
        add_generation_prompt=True)
    if not after.startswith(before) or _PROBE_OBSERVATION not in after:
      raise ValueError('the chat template does not render a conversation as a'
                       ' prefix of its continuation; observation turns cannot'
                       ' be appended token-in/token-out')
    # What the template writes after an assistant message's content...
    self._turn_end = before[before.rindex(_PROBE_ACTION) + len(_PROBE_ACTION):]
    # ...and around the observation, up to the next generation prompt.
    self._prefix, self._suffix = after[len(before):].split(_PROBE_OBSERVATION)

  def observation_tokens(self, action_tokens, observation: str) -> list[int]:
    """Tokens that close the model's turn, carry `observation`, and open the
    model's next turn."""
    ended = self._tok.decode(action_tokens[-1:]) if len(action_tokens) else ''
    tail = self._turn_end
    if ended and tail.startswith(ended):
      tail = tail[len(ended):]  # the model wrote its end-of-turn marker
    return (self._tok.encode(tail + self._prefix)
            + self._tok.encode(observation, allow_special=False)
            + self._tok.encode(self._suffix))


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Token budgets of an episode.

  Attributes:
    max_new_tokens: per model turn.
    max_sequence_length: prompt + actions + observations; a turn is not started
      (and an observation not appended) beyond it.
    max_prompt_length: longest context a server prefills (its
      max_prefill_length less the BOS JetStream adds); a multi-turn episode
      whose context outgrows it ends there ('prompt_length') rather than
      failing the request.
    reward_cut_replies: whether an episode the environment ends on a reply
      cut by `max_new_tokens` (finish reason 'length') keeps the
      environment's reward; False gives it 0 (an answer the budget cut off
      is not an answer) and marks it `info['cut_reward']`, the reward it
      lost.
  """
  max_new_tokens: int
  max_sequence_length: int
  max_prompt_length: int | None = None
  reward_cut_replies: bool = True


async def run_episode(pool: client_lib.ServerPool, env: base.Environment,
                      task: base.Task, tok: tokenizer_lib.Tokenizer,
                      chat: ChatFormat, limits: EpisodeLimits,
                      group_id: str | None = None
                      ) -> list[types.Trajectory]:
  """Plays one episode (or, with G samples per server slot, G of them).

  A server configured with `samples_per_slot = G` answers one prompt with G
  samples; single-turn GRPO groups use that (one prefill per group).
  Multi-turn episodes use G = 1 requests.

  Raises:
    client_lib.RequestFailed: when the server pool gives up; the caller
      counts it and releases the admission ticket.
  """
  prompt = tok.encode_chat(env.prompt_messages(task))
  tokens = [list(prompt)]
  masks = [[False] * len(prompt)]
  logprobs = [[0.0] * len(prompt)]
  versions = [[types.NO_VERSION] * len(prompt)]
  # Per row, the routing record's pieces: a token count where the engine
  # recorded none (prompt, observations), its `[n, R]` records otherwise.
  records = [[len(prompt)]]
  rewards, infos, open_ = [0.0], [{}], [True]
  # The task each row's next turn is judged with (`StepResult.next_task`).
  judged = [task]
  turn = 0
  while any(open_) and turn < env.max_turns:
    budget = limits.max_sequence_length - max(len(t) for t in tokens)
    if budget <= 0:
      break
    if limits.max_prompt_length and len(tokens[0]) > limits.max_prompt_length:
      if turn == 0:  # the task itself does not fit: a request error
        raise client_lib.RequestFailed(
            'prompt_too_long', f'{len(tokens[0])} > {limits.max_prompt_length}'
            f' tokens for task {task.id}')
      infos[0] = dict(infos[0], finish_reason='prompt_length')
      open_[0] = False
      break
    # All open rows share a prompt at turn 0 (the only turn with G > 1).
    samples = await pool.generate(tokens[0], min(limits.max_new_tokens, budget))
    if turn == 0 and len(samples) > 1:
      tokens = [list(tokens[0]) for _ in samples]
      masks = [list(masks[0]) for _ in samples]
      logprobs = [list(logprobs[0]) for _ in samples]
      versions = [list(versions[0]) for _ in samples]
      records = [list(records[0]) for _ in samples]
      rewards, infos, open_ = [0.0] * len(samples), [{}] * len(samples), [
          True] * len(samples)
      judged = [task] * len(samples)
    if len(samples) != len(tokens):
      raise client_lib.RequestFailed(
          'bad_response', f'{len(samples)} samples for {len(tokens)} rows')
    for row, sample in enumerate(samples):
      if not open_[row]:
        continue
      tokens[row] += sample.tokens
      masks[row] += [True] * len(sample.tokens)
      logprobs[row] += sample.logprobs
      versions[row] += sample.versions
      records[row].append(len(sample.tokens) if sample.experts is None
                          else sample.experts)
      text = tok.decode(sample.tokens, skip_special_tokens=True)
      result = await env.astep(judged[row], turn, text)
      infos[row] = dict(result.info, finish_reason=sample.finish_reason,
                        turns=turn + 1)
      if result.done:
        rewards[row] = float(result.reward)
        if sample.finish_reason == 'length' and not limits.reward_cut_replies:
          infos[row]['cut_reward'] = rewards[row]
          rewards[row] = 0.0
        open_[row] = False
        continue
      if result.next_task is not None:
        judged[row] = result.next_task
      observation = chat.observation_tokens(sample.tokens,
                                            result.observation or '')
      if len(tokens[row]) + len(observation) >= limits.max_sequence_length:
        infos[row]['finish_reason'] = 'sequence_length'
        open_[row] = False
        continue
      tokens[row] += observation
      masks[row] += [False] * len(observation)
      logprobs[row] += [0.0] * len(observation)
      versions[row] += [types.NO_VERSION] * len(observation)
      records[row].append(len(observation))
    turn += 1
    if len(tokens) > 1:
      break  # G samples per request: single-turn only (see the docstring)
  for row in range(len(tokens)):
    if open_[row]:
      infos[row] = dict(infos[row], finish_reason='turns')
  # An episode that ended without the environment's verdict (turn, length or
  # context budget) keeps reward 0.
  return [
      types.Trajectory(
          prompt_id=task.id, group_id=group_id,
          tokens=np.asarray(tokens[row], np.int32),
          action_mask=np.asarray(masks[row], bool),
          behavior_logprobs=np.asarray(logprobs[row], np.float32),
          versions=np.asarray(versions[row], np.int32),
          reward=rewards[row], info=dict(infos[row], task_id=task.id),
          routed_experts=_routing_record(records[row]))
      for row in range(len(tokens))
  ]


def _routing_record(pieces) -> np.ndarray | None:
  """A row's `[L, R]` routing record from its pieces (None when the engine
  recorded nothing: a dense policy)."""
  widths = {p.shape[1] for p in pieces if isinstance(p, np.ndarray)}
  if not widths:
    return None
  width = widths.pop()
  return np.concatenate([
      p.astype(np.int16) if isinstance(p, np.ndarray)
      else np.full((p, width), types.NOT_RECORDED, np.int16) for p in pieces])
