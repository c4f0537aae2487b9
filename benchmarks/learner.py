r"""Learner benchmark: tokens/s of one update and its parts, memory, and Tunix.

  python benchmarks/learner.py                      # tiny Qwen2 shape, K = 1, 2
  python benchmarks/learner.py --compare-tunix      # + Tunix 0.1.7 PPO steps
  python benchmarks/learner.py --shape smollm2_135m # the demo's model and batch
  python benchmarks/learner.py --quick              # small and short, for CI

For each shape (random weights; speed does not depend on them) it builds the
learner of `configs/default.py` (SAO: DIS loss, skip-observation GAE, frozen-
attention critic) and times, in alternating rounds, each a median of
`--steps` calls after a compile-and-warm-up call:
  * `step_k1`, `step_k2`: one full learner step (`Learner.train_step`) with
    K = 1 and K = 2 critic updates per policy update;
  * `policy`: the policy part alone (the same step of a critic-free learner);
  * `critic`: one critic update (`Learner.critic_step`).
Tokens/s counts every token of the batch (B x T). Memory: the compiled step's
own buffers (`memory_analysis`: arguments, outputs, temporaries; XLA's
numbers, on every backend) and the process's peak RSS.

`--compare-tunix` (needs the `compare` extra: `pip install -e '.[compare]'`,
which pins google-tunix==0.1.7) builds Tunix's Qwen2 with the same shape and
runs Tunix's own jitted PPO actor step (`ppo_policy_loss_fn`) and critic step
(`ppo_value_loss_fn`, a Qwen2 whose head gives one value per token), through
`rl_trainer.Trainer` as Tunix's PPO learner does, inside the same rounds. It
reports sao_jax / Tunix speed ratios per round and their medians:
`k1` = (Tunix actor + critic step) / (sao_jax step, K = 1) and `k2` likewise
with K = 2 (SAO's default; Tunix's PPO has one critic step per actor step).
Tunix's old-log-prob and value passes (outside its steps) are not counted.

Writes a JSON result (`--out`) and prints the table recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

# sao_jax first: its quiet start (no TPU probe on a CPU-only machine) must run
# before JAX is imported.
import sao_jax  # pylint: disable=unused-import
import jax  # pylint: disable=g-bad-import-order
import jax.numpy as jnp
import numpy as np

from sao_jax import config_lib

from sao_jax import recipe_checks
from sao_jax import types
from sao_jax.learner import learner as learner_lib
from sao_jax.models import architectures
from sao_jax.models import model_config
from sao_jax.models import transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (model shape, batch rows B, prompt tokens, action tokens, config
# overrides of the shape's recipe, applied before --override's).
# The Tunix comparison keeps every activation and the whole logits, as Tunix
# does (configs/default.py trades time for memory for the demo).
_AS_TUNIX = ('model.remat=False', 'model.logits_chunk_size=0')
SHAPES = {
    # The shape of the Tunix comparison: 2 layers, d = 256, F = 1024, 4 heads
    # of 64, vocab 1000, untied head, f32; 8 x (64 prompt + 192 action).
    'tiny_qwen2': (model_config.ModelConfig(
        'qwen2', 1000, 256, 1024, 2, 4, 4, 64, qkv_bias=True,
        rope_theta=1000000.0), 8, 64, 192, _AS_TUNIX),
    # The demo's model at the demo's batch: 16 rows of T = 64
    # (rollout.max_sequence_length; chat-templated chain sums and the reply).
    'smollm2_135m': (architectures.get('smollm2-135m'), 16, 48, 16, ()),
    # A 1B model for accelerators (bf16 compute, remat), 8 x 1024 tokens.
    'llama_1b': (architectures.get('llama3.2-1b'), 8, 256, 768,
                 ('model.dtype=bfloat16', 'model.remat=True')),
}
QUICK = (model_config.ModelConfig('qwen2', 128, 64, 128, 2, 4, 4, 16,
                                  qkv_bias=True), 4, 16, 48, _AS_TUNIX)


def sao_config(batch_size: int, critic_steps: int, algorithm: str = 'sao',
               overrides=()):
  config = config_lib.load_config(
      os.path.join(ROOT, 'configs', 'default.py') + f':algorithm={algorithm}')
  config.batch_size = batch_size
  config.critic.steps_per_policy_step = critic_steps
  for override in overrides:
    key, value = override.split('=', 1)
    config_lib.set_from_text(config, key, value)
  return config


def random_batch(vocab: int, rows: int, prompt: int, action: int,
                 seed: int = 0) -> types.TrainBatch:
  """A full batch of single-turn trajectories (no padding), binary rewards."""
  rng = np.random.default_rng(seed)
  length = prompt + action
  action_mask = np.zeros((rows, length), bool)
  action_mask[:, prompt:] = True
  reward_B = rng.integers(0, 2, rows).astype(np.float32)
  rewards_BxT = np.zeros((rows, length), np.float32)
  rewards_BxT[:, -1] = reward_B
  return types.TrainBatch(
      tokens_BxT=rng.integers(3, vocab, (rows, length)).astype(np.int32),
      input_mask_BxT=np.ones((rows, length), bool),
      action_mask_BxT=action_mask,
      # Close to a random model's log-probs, so DIS masks few tokens.
      behavior_logprobs_BxT=np.where(
          action_mask, -np.log(vocab) + rng.normal(0, 0.05, (rows, length)),
          0.0).astype(np.float32),
      versions_BxT=np.where(action_mask, 0, -1).astype(np.int32),
      rewards_BxT=rewards_BxT,
      positions_BxT=np.broadcast_to(np.arange(length, dtype=np.int32),
                                    (rows, length)).copy(),
      segment_ids_BxT=np.broadcast_to(
          np.arange(1, rows + 1, dtype=np.int32)[:, None],
          (rows, length)).copy(),
      reward_N=reward_B,
      num_action_tokens_N=np.full(rows, action, np.int32),
      slot_ids_N=np.zeros(rows, np.int32))


class SaoStep:
  """One jitted learner function of sao_jax and the state it threads."""

  def __init__(self, cfg, batch_rows, critic_steps, algorithm, batch,
               overrides, part='train'):
    config = sao_config(batch_rows, critic_steps, algorithm, overrides)
    recipe_checks.validate(config)
    policy = transformer.init_causal_lm(
        cfg.replace(**model_config.overrides(config.model)), seed=0)
    mesh = learner_lib.mesh_from_config(config)
    self.learner = learner_lib.Learner(config, policy, mesh)
    self.state = self.learner.init_state()
    self.batch = self.learner.device_batch(batch)
    self.fn = (self.learner.train_step if part == 'train'
               else self.learner.critic_step)
    start = time.perf_counter()
    compiled = self.fn.lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    self.memory = None if memory is None else {
        name: int(getattr(memory, f'{name}_size_in_bytes'))
        for name in ('argument', 'output', 'temp', 'generated_code')}

  def __call__(self):
    self.state, metrics = self.fn(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))


class TunixSteps:
  """Tunix 0.1.7's jitted PPO actor and critic steps on the same shape."""

  def __init__(self, cfg, batch: types.TrainBatch, prompt: int):
    # pylint: disable=g-import-not-at-top
    import optax
    from flax import nnx
    from tunix.models.qwen2 import model as qwen2
    from tunix.rl import algo_core  # registers the PPO loss functions
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.ppo import ppo_learner
    from tunix.sft import peft_trainer
    # pylint: enable=g-import-not-at-top
    if cfg.num_heads != cfg.num_kv_heads or not cfg.qkv_bias:
      raise ValueError('the Tunix comparison builds Qwen2 (q/k/v biases,'
                       ' as many kv heads as query heads)')
    tcfg = qwen2.ModelConfig(
        num_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size, hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps, use_tied_embedding=cfg.tie_embeddings)
    actor = qwen2.Qwen2(tcfg, rngs=nnx.Rngs(0))
    critic = qwen2.Qwen2(tcfg, rngs=nnx.Rngs(1))
    # Tunix's critic is any model giving [B, T, 1]: the LM head with one
    # output is its value head.
    critic.lm_head = qwen2.Einsum(
        einsum_str='BTD,DV->BTV', shape=(cfg.hidden_size, 1),
        rngs=nnx.Rngs(2), sharding=(None, None), dtype=jnp.float32,
        param_dtype=jnp.float32)
    algo = ppo_learner.PPOConfig()
    training = peft_trainer.TrainingConfig(eval_every_n_steps=10**9,
                                           max_steps=10**9)
    tokens = np.asarray(batch.tokens_BxT)
    action = np.asarray(batch.action_mask_BxT)[:, prompt:]
    rows, completion = action.shape
    example = ppo_learner.TrainExample(
        prompt_ids=jnp.asarray(tokens[:, :prompt]),
        prompt_mask=jnp.ones((rows, prompt), jnp.int32),
        completion_ids=jnp.asarray(tokens[:, prompt:]),
        completion_mask=jnp.asarray(action.astype(np.int32)),
        advantages=jnp.asarray(
            np.random.default_rng(1).normal(size=(rows, completion)),
            jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=jnp.asarray(
            np.asarray(batch.behavior_logprobs_BxT)[:, prompt:]),
        returns=jnp.asarray(np.repeat(np.asarray(batch.reward_N)[:, None],
                                      completion, 1)),
        old_values=jnp.zeros((rows, completion), jnp.float32))
    # pad/eos outside the random tokens' range (3..V): no early EOS.
    pad_id, eos_id = 0, 1
    self.actor = rl_trainer.Trainer(
        actor, optax.adamw(1e-6), training, dict).with_loss_fn(
            algo_core.ppo_policy_loss_fn, has_aux=True).with_gen_model_input_fn(
                lambda x: {'train_example': x, 'algo_config': algo,
                           'pad_id': pad_id, 'eos_id': eos_id})
    self.critic = rl_trainer.Trainer(
        critic, optax.adamw(5e-6), training, dict).with_loss_fn(
            algo_core.ppo_value_loss_fn, has_aux=True).with_gen_model_input_fn(
                lambda x: {'train_example': x,
                           'clip_range_value': algo.clip_range_value,
                           'pad_id': pad_id, 'eos_id': eos_id})
    self.actor_step, _ = self.actor.jit_train_and_eval_step()
    self.critic_step, _ = self.critic.jit_train_and_eval_step()
    self.example = example

  def actor_call(self):
    jax.block_until_ready(self.actor_step(self.example))

  def critic_call(self):
    jax.block_until_ready(self.critic_step(self.example))


def median_seconds(fn, calls: int) -> float:
  """Median wall time of `calls` calls of `fn()` (which blocks until done)."""
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def write_result(out: str, result, table_text: str) -> None:
  """Writes `result` as JSON to `out`, then prints the table and the path."""
  os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
  with open(out, 'w') as f:
    json.dump(result, f, indent=2)
  print(table_text)
  print(f'wrote {out}')


def run(args):
  cfg, rows, prompt, action, recipe = (QUICK if args.quick
                                       else SHAPES[args.shape])
  if args.quick:
    args.steps, args.rounds = 2, 2
  batch = random_batch(cfg.vocab_size, rows, prompt, action)
  tokens = rows * (prompt + action)
  contenders = {}
  for loop in args.layer_loops:
    # One set of contenders per layer loop; the first loop's carry the plain
    # names (the ratios against Tunix are taken with those).
    suffix = '' if loop == args.layer_loops[0] else f'_{loop}'
    overrides = (list(recipe) + list(args.override)
                 + [f'model.layer_loop={loop}'])
    if 'step' in args.parts:
      for k in args.critic_steps:
        contenders[f'step_k{k}{suffix}'] = SaoStep(cfg, rows, k, 'sao', batch,
                                                   overrides)
    if 'policy' in args.parts:
      contenders[f'policy{suffix}'] = SaoStep(cfg, rows, 1, 'running_mean',
                                              batch, overrides)
    if 'critic' in args.parts:
      contenders[f'critic{suffix}'] = SaoStep(cfg, rows, 1, 'sao', batch,
                                              overrides, part='critic')
  tunix = None
  if args.compare_tunix:
    tunix = TunixSteps(cfg, batch, prompt)
    contenders['tunix_actor'] = tunix.actor_call
    contenders['tunix_critic'] = tunix.critic_call
  # Compile and warm up everything before the first timed round.
  for fn in contenders.values():
    fn()
    fn()
  seconds = {name: [] for name in contenders}
  for _ in range(args.rounds):
    for name, fn in contenders.items():
      seconds[name].append(median_seconds(fn, args.steps))
  result = {
      'shape': 'quick' if args.quick else args.shape,
      'model': {k: v for k, v in vars(cfg).items()
                if isinstance(v, (int, float, str, bool))},
      'batch': {'rows': rows, 'prompt_tokens': prompt,
                'action_tokens': action, 'tokens': tokens},
      'overrides': list(args.override),
      'seconds': seconds,
      'median_seconds': {n: statistics.median(s) for n, s in seconds.items()},
      'tokens_per_s': {n: tokens / statistics.median(s)
                       for n, s in seconds.items()},
      'compiled_memory_bytes': {n: fn.memory for n, fn in contenders.items()
                                if isinstance(fn, SaoStep)},
      'compile_s': {n: fn.compile_s for n, fn in contenders.items()
                    if isinstance(fn, SaoStep)},
      'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                        * 1024,
      'machine': {'platform': platform.platform(), 'cpus': os.cpu_count(),
                  'backend': jax.default_backend(),
                  'devices': [str(d) for d in jax.devices()],
                  'jax': jax.__version__, 'command': ' '.join(sys.argv)},
  }
  if tunix is not None:
    tunix_s = [a + c for a, c in zip(seconds['tunix_actor'],
                                     seconds['tunix_critic'])]
    result['tunix_actor_plus_critic_s'] = tunix_s
    result['ratio_vs_tunix'] = {}
    for k in args.critic_steps:
      if f'step_k{k}' not in seconds:
        continue
      per_round = [t / s for t, s in zip(tunix_s, seconds[f'step_k{k}'])]
      result['ratio_vs_tunix'][f'k{k}'] = {
          'per_round': per_round, 'median': statistics.median(per_round)}
  return result


def table(result) -> str:
  lines = ['| part | median s | tokens/s | compile s | compiled temp MB |',
           '|---|---|---|---|---|']
  for name, s in result['median_seconds'].items():
    memory = result['compiled_memory_bytes'].get(name)
    temp = f'{memory["temp"] / 2**20:.0f}' if memory else '-'
    compile_s = result['compile_s'].get(name)
    compile_s = '-' if compile_s is None else f'{compile_s:.1f}'
    lines.append(f'| {name} | {s:.3f} | {result["tokens_per_s"][name]:.0f} |'
                 f' {compile_s} | {temp} |')
  for k, ratio in result.get('ratio_vs_tunix', {}).items():
    spread = ', '.join(f'{r:.2f}' for r in ratio['per_round'])
    lines.append(f'\nsao_jax / Tunix ({k}): **{ratio["median"]:.2f}x**'
                 f' (rounds: {spread})')
  lines.append(f'\npeak RSS {result["peak_rss_bytes"] / 2**30:.2f} GB')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--shape', default='tiny_qwen2', choices=sorted(SHAPES))
  parser.add_argument('--quick', action='store_true',
                      help='a tiny shape, 2 rounds of 2 steps (CI)')
  parser.add_argument('--compare-tunix', action='store_true')
  parser.add_argument('--critic-steps', type=int, nargs='+', default=[1, 2],
                      help='K values of the full-step contenders')
  parser.add_argument('--layer-loops', nargs='+', default=['auto'],
                      choices=['auto', 'scan', 'unroll'],
                      help='model.layer_loop of each set of contenders')
  parser.add_argument('--parts', nargs='+', default=['step', 'policy', 'critic'],
                      choices=['step', 'policy', 'critic'],
                      help='which contenders to build (each holds a whole'
                      ' learner state: SmolLM2 takes ~3 GB apiece)')
  parser.add_argument('--steps', type=int, default=3,
                      help='timed calls per contender per round (median)')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--override', action='append', default=[],
                      help='config override key=value (e.g. model.remat=True)')
  parser.add_argument('--out', default=None,
                      help='JSON path (default benchmarks/results/'
                           'learner_<shape>.json)')
  args = parser.parse_args(argv)
  result = run(args)
  out = args.out or os.path.join(
      ROOT, 'benchmarks', 'results', f'learner_{result["shape"]}.json')
  write_result(out, result, table(result))


if __name__ == '__main__':
  main()
