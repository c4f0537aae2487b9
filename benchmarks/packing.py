r"""Packing benchmark: padding and learner tokens/s, one trajectory per row vs packed.

  python benchmarks/packing.py            # calculator-like lengths, T = 704
  python benchmarks/packing.py --quick    # small and short, for CI

Trajectory lengths are drawn like the calculator task's multi-turn episodes
(sao_jax/envs/calculator.py, SmolLM2's chat template, measured with its
tokenizer):
  * prompt: 99 tokens (the instructions and a 3-digit two-term question);
  * turns: 1-4 (max_turns = 4) with probabilities 0.4, 0.3, 0.2, 0.1 (an
    answer at once, or 1-3 tool calls first);
  * each reply: lognormal, median 24 tokens, sigma 0.8, clipped to [4, 128]
    (max_new_tokens = 128);
  * each tool turn's observation: 20-26 tokens (`<result>V</result>` between
    the chat template's turn markers).
So 103 to 689 tokens (T = 704), the response part 4 to 590: an order of
magnitude. The demo's single-turn chain sums (48 prompt + 2-16 reply tokens
in T = 64) are measured too: no two fit a row, so packing cannot gain there.

For each length distribution it reports, over `--samples` sampled batches of
N trajectories: the padding fraction one per row and packed into R rows
(first-fit decreasing; `batching.default_packed_rows`, R = 3N / 8, and
`--rows`), how often a batch overflows R (then it takes N rows), and the
fewest rows FFD needs (p50 / p95 / max). Then, on the tiny Qwen2 shape of
benchmarks/learner.py (2 layers, d = 256), the median seconds of one full
SAO learner step (`Learner.train_step`, K = 2) on the same batches, one per
row and packed, and the real (non-padding) tokens per second of each. JSON
to `--out`; prints the table recorded in BENCHMARKS.md (packing).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import platform
import statistics
import sys

# sao_jax first: its quiet start (no TPU probe on a CPU-only machine) must run
# before JAX is imported.
import sao_jax  # pylint: disable=unused-import
import jax  # pylint: disable=g-bad-import-order
import numpy as np


from sao_jax.models import model_config

from sao_jax import recipe_checks
from sao_jax import types
from sao_jax.learner import learner as learner_lib
from sao_jax.models import transformer
from sao_jax.rollout import batching

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
learner_benchmark = importlib.import_module('learner')  # benchmarks/learner.py


@dataclasses.dataclass(frozen=True)
class Lengths:
  """A length distribution of trajectories (docstring of this module)."""
  name: str
  max_length: int  # T
  prompt: int
  turn_probs: tuple[float, ...]  # P(1 turn), P(2 turns), ...
  reply_median: float
  reply_sigma: float
  reply_min: int
  reply_max: int
  observation: tuple[int, int]  # tokens of one tool turn's observation, [lo, hi]

  def sample(self, rng) -> tuple[int, list[int]]:
    """One trajectory: `(length, [(start, end) of each reply])`."""
    turns = 1 + int(rng.choice(len(self.turn_probs), p=self.turn_probs))
    position, replies = self.prompt, []
    for turn in range(turns):
      if turn:
        position += int(rng.integers(self.observation[0],
                                     self.observation[1] + 1))
      reply = int(np.clip(round(rng.lognormal(np.log(self.reply_median),
                                              self.reply_sigma)),
                          self.reply_min, self.reply_max))
      replies.append((position, position + reply))
      position += reply
    return position, replies


CALCULATOR = Lengths('calculator', 704, 99, (0.4, 0.3, 0.2, 0.1), 24.0, 0.8,
                     4, 128, (20, 26))
CHAIN_SUM = Lengths('chain_sum', 64, 48, (1.0,), 6.0, 0.5, 2, 16, (0, 0))
QUICK = Lengths('calculator_quick', 128, 20, (0.4, 0.3, 0.2, 0.1), 6.0, 0.8,
                2, 24, (4, 6))


def trajectories(lengths: Lengths, num: int, vocab: int, rng):
  """N random-token trajectories with `lengths`' shapes, binary rewards."""
  out = []
  for i in range(num):
    length, replies = lengths.sample(rng)
    mask = np.zeros(length, bool)
    for start, end in replies:
      mask[start:end] = True
    out.append(types.Trajectory(
        prompt_id=f'p{i}', tokens=rng.integers(3, vocab, length).astype(
            np.int32),
        action_mask=mask,
        # Close to a random model's log-probs, so DIS masks few tokens.
        behavior_logprobs=np.where(
            mask, -np.log(vocab) + rng.normal(0, 0.05, length),
            0.0).astype(np.float32),
        versions=np.where(mask, 0, -1).astype(np.int32),
        reward=float(rng.integers(0, 2))))
  return out


def rows_needed(lengths_of_batch, max_length: int) -> int:
  """The fewest rows first-fit decreasing packs a batch into."""
  rows = -(-sum(lengths_of_batch) // max_length)
  while batching.first_fit_decreasing(lengths_of_batch, max_length,
                                      rows) is None:
    rows += 1
  return rows


def padding_stats(lengths: Lengths, num: int, rows: list[int], samples: int,
                  seed: int):
  """Padding one per row and packed at each R, over sampled batches."""
  rng = np.random.default_rng(seed)
  batches = [[lengths.sample(rng)[0] for _ in range(num)]
             for _ in range(samples)]
  size = lengths.max_length
  real = np.array([sum(b) for b in batches], np.float64)
  needed = np.array([rows_needed(b, size) for b in batches])
  out = {'unpacked_padding': float(np.mean(1 - real / (num * size))),
         'mean_length': float(np.mean([np.mean(b) for b in batches])),
         'length_p5_p50_p95': [float(np.percentile(np.concatenate(
             [np.asarray(b) for b in batches]), q)) for q in (5, 50, 95)],
         'rows_needed_p50_p95_max': [float(np.percentile(needed, 50)),
                                     float(np.percentile(needed, 95)),
                                     int(needed.max())],
         'packed': {}}
  for r in rows:
    overflow = needed > r
    used = np.where(overflow, num, r)  # an overflowing batch takes N rows
    out['packed'][str(r)] = {
        'padding': float(np.mean(1 - real / (used * size))),
        'overflow_fraction': float(np.mean(overflow))}
  return out


class Step:
  """The SAO learner's full step on a list of (host) batches, cycled.

  `initial` is a host copy of the learner's initial state: each contender
  donates its own placed copy, and init_state() can be called only once.
  """

  def __init__(self, learner, initial, batches):
    self.learner = learner
    self.state = jax.device_put(initial, learner.state_shardings)
    self.batches = [learner.device_batch(b) for b in batches]
    self.real_tokens = [int(np.sum(b.input_mask_BxT)) for b in batches]
    self.calls = 0

  def __call__(self):
    batch = self.batches[self.calls % len(self.batches)]
    self.calls += 1
    self.state, metrics = self.learner.train_step(self.state, batch)
    jax.block_until_ready((self.state, metrics))


def learner_speed(lengths: Lengths, num: int, rows: list[int], cfg, args,
                  seed: int):
  """Seconds and real tokens/s of one learner step, one per row and packed.

  The same `args.batches` batches for every contender: batches that
  overflow the smallest R are drawn again (an overflowing batch runs at
  one-per-row's speed, with N rows).
  """
  config = learner_benchmark.sao_config(num, 2)
  config.rollout.max_sequence_length = lengths.max_length
  config.rollout.max_target_length = max(lengths.max_length, 160)
  recipe_checks.validate(config)
  policy = transformer.init_causal_lm(
      cfg.replace(**model_config.overrides(config.model)), seed=0)
  mesh = learner_lib.mesh_from_config(config)
  learner = learner_lib.Learner(config, policy, mesh)
  rng = np.random.default_rng(seed)
  drawn = []
  while len(drawn) < args.batches:
    trajs = trajectories(lengths, num, cfg.vocab_size, rng)
    if batching.first_fit_decreasing([t.length for t in trajs],
                                     lengths.max_length, min(rows)):
      drawn.append(trajs)
  layouts = {'unpacked': 0, **{f'packed_{r}': r for r in rows}}
  initial = jax.tree.map(np.asarray, learner.init_state())
  contenders = {
      name: Step(learner, initial,
                 [batching.assemble_batch(t, lengths.max_length, 0, r)
                  for t in drawn])
      for name, r in layouts.items()}
  for fn in contenders.values():  # compile and warm up
    fn()
    fn()
  seconds = {name: [] for name in contenders}
  for _ in range(args.rounds):
    for name, fn in contenders.items():
      seconds[name].append(learner_benchmark.median_seconds(fn, args.steps))
  real = statistics.mean(contenders['unpacked'].real_tokens)
  median = {n: statistics.median(s) for n, s in seconds.items()}
  return {'rows': {n: r or num for n, r in layouts.items()},
          'real_tokens_per_batch': real,
          'seconds': seconds, 'median_seconds': median,
          'real_tokens_per_s': {n: real / s for n, s in median.items()},
          'speedup': {n: median['unpacked'] / s for n, s in median.items()}}


def run(args):
  cfg = (learner_benchmark.QUICK if args.quick
         else learner_benchmark.SHAPES['tiny_qwen2'])[0]
  if args.quick:
    args.num, args.samples, args.batches = 4, 50, 2
    args.steps, args.rounds = 2, 1
    dists = [QUICK]
  else:
    dists = [CALCULATOR, CHAIN_SUM]
  default_rows = batching.default_packed_rows(args.num)  # on one device
  rows = sorted({default_rows, *(r for r in args.rows if r < args.num)})
  result = {'num_trajectories': args.num, 'default_rows': default_rows,
            'distributions': {}}
  for i, lengths in enumerate(dists):
    entry = {'lengths': dataclasses.asdict(lengths),
             'padding': padding_stats(lengths, args.num, rows, args.samples,
                                      seed=i)}
    # Timed at the R that fit most batches (none of the chain sums' do).
    timed = [r for r in rows if entry['padding']['packed'][str(r)][
        'overflow_fraction'] < 0.5]
    if timed:
      entry['learner'] = learner_speed(lengths, args.num, timed, cfg, args,
                                       seed=100 + i)
    result['distributions'][lengths.name] = entry
  result['model'] = {k: v for k, v in vars(cfg).items()
                     if isinstance(v, (int, float, str, bool))}
  result['machine'] = {'platform': platform.platform(),
                       'cpus': os.cpu_count(),
                       'backend': jax.default_backend(),
                       'jax': jax.__version__, 'command': ' '.join(sys.argv)}
  return result


def table(result) -> str:
  num = result['num_trajectories']
  lines = [f'N = {num} trajectories a batch; R = packed rows (default'
           f' {result["default_rows"]}).', '',
           '| lengths | mean length (p5/p50/p95) | rows FFD needs'
           ' (p50/p95/max) | padding, one per row | R | padding, packed |'
           ' overflow | step s, one per row | step s, packed | real tokens/s,'
           ' one per row | real tokens/s, packed | speed-up |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for name, entry in result['distributions'].items():
    pad = entry['padding']
    p5, p50, p95 = pad['length_p5_p50_p95']
    need = '/'.join(f'{x:g}' for x in pad['rows_needed_p50_p95_max'])
    speed = entry.get('learner')
    for r, packed in pad['packed'].items():
      name_r = f'packed_{r}'
      timing = ('| - | - | - | - | - |'
                if speed is None or name_r not in speed['median_seconds'] else
                f'| {speed["median_seconds"]["unpacked"]:.3f} |'
                f' {speed["median_seconds"][name_r]:.3f} |'
                f' {speed["real_tokens_per_s"]["unpacked"]:.0f} |'
                f' {speed["real_tokens_per_s"][name_r]:.0f} |'
                f' **{speed["speedup"][name_r]:.2f}x** |')
      lines.append(
          f'| {name} (T = {entry["lengths"]["max_length"]}) |'
          f' {pad["mean_length"]:.0f} ({p5:.0f}/{p50:.0f}/{p95:.0f}) |'
          f' {need} | {pad["unpacked_padding"]:.1%} | {r} |'
          f' {packed["padding"]:.1%} | {packed["overflow_fraction"]:.1%} '
          + timing)
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='tiny shapes, one round of 2 steps (CI)')
  parser.add_argument('--num', type=int, default=16,
                      help='N, trajectories a batch (config.batch_size)')
  parser.add_argument('--rows', type=int, nargs='*', default=[8],
                      help='R values besides the default 3N / 8')
  parser.add_argument('--samples', type=int, default=2000,
                      help='sampled batches for the padding statistics')
  parser.add_argument('--batches', type=int, default=3,
                      help='distinct batches each timed step cycles through')
  parser.add_argument('--steps', type=int, default=3,
                      help='timed calls per contender per round (median)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--out', default=None,
                      help='JSON path (default benchmarks/results/'
                           'packing.json, packing_quick.json)')
  args = parser.parse_args(argv)
  result = run(args)
  out = args.out or os.path.join(
      ROOT, 'benchmarks', 'results',
      'packing_quick.json' if args.quick else 'packing.json')
  learner_benchmark.write_result(out, result, table(result))


if __name__ == '__main__':
  main()
