r"""Array layouts of the model's products: forward + backward time, side by side.

  python benchmarks/layouts.py            # the tiny Qwen2 shape of learner.py
  python benchmarks/layouts.py --quick    # small shapes, for CI

Each pair computes the same function two ways; the benchmark times the jitted
gradient (forward and backward, with respect to inputs and weights) of
`sum(sin(y))` in alternating rounds and checks that both ways agree:
  * `projection`: `x [B, T, d] x W [d, H, D]`, as a 3-D einsum and as the
    model's `transformer.dense` (one `[B T, d] x [d, H D]` matmul);
  * `mlp`: the SwiGLU block, 3-D `@` against `transformer.dense`;
  * `attention`: scores and mixing with the heads between batch and time
    (`'btkgd,bskd->bkgts'`, the model's layout before issue 15) against the
    heads-first layout of `attention.reference.dense_attention`.
The model uses the faster way of each pair; docs/design/learner_speed.md
says why. On a new backend this is the first thing to rerun.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys

import sao_jax  # pylint: disable=unused-import  # quiet start before JAX
import jax  # pylint: disable=g-bad-import-order
import jax.numpy as jnp
import numpy as np

from sao_jax.kernels.attention import reference as attention_reference
from sao_jax.models import transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
learner_benchmark = importlib.import_module('learner')  # benchmarks/learner.py

# (B, T, d, F, H, K, D): batch rows, tokens, width, MLP width, query heads,
# key/value heads, head dim. `full` is learner.py's tiny Qwen2 shape.
SHAPES = {'full': (8, 256, 256, 1024, 4, 4, 64),
          'quick': (2, 32, 32, 64, 4, 2, 8)}


def attend_heads_inner(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
  """The model's attention before issue 15: heads between batch and time."""
  b, t, h, d = q_BxTxHxD.shape
  kv_heads = k_BxSxKxD.shape[2]
  q = q_BxTxHxD.reshape(b, t, kv_heads, h // kv_heads, d)
  scores = jnp.einsum('btkgd,bskd->bkgts', q, k_BxSxKxD) * (d ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum('bkgts,bskd->btkgd', probs, v_BxSxKxD).reshape(b, t, h, d)


def pairs(shape):
  """name -> (args, {way: fn(*args) -> y})."""
  b, t, d, f, h, k, hd = shape
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda *s: jax.random.normal(next(keys), s, jnp.float32)
  x = normal(b, t, d)
  w_proj = normal(d, h, hd) * d ** -0.5
  w_mlp = (normal(d, f) * d ** -0.5, normal(d, f) * d ** -0.5,
           normal(f, d) * f ** -0.5)
  qkv = (normal(b, t, h, hd), normal(b, t, k, hd), normal(b, t, k, hd))
  mask = attention_reference.self_attention_mask(jnp.ones((b, t), jnp.int32))

  def mlp_3d(x, w):
    return (jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2]

  def mlp_dense(x, w):
    dense = transformer.dense
    return dense(jax.nn.silu(dense(x, w[0])) * dense(x, w[1]), w[2])

  return {
      'projection': ((x, w_proj), {
          'einsum_3d': lambda x, w: jnp.einsum('btd,dnh->btnh', x, w),
          'dense_2d': transformer.dense}),
      'mlp': ((x, w_mlp), {'matmul_3d': mlp_3d, 'dense_2d': mlp_dense}),
      'attention': (qkv, {
          'heads_inner': lambda q, k, v: attend_heads_inner(q, k, v, mask),
          'heads_first': lambda q, k, v: attention_reference.dense_attention(
              q, k, v, mask)}),
  }


def _forward_backward(fn, num_args):
  loss = lambda *args: jnp.sum(jnp.sin(fn(*args)))
  return jax.jit(jax.grad(loss, argnums=tuple(range(num_args))))


def run(args):
  shape = SHAPES['quick' if args.quick else 'full']
  rounds, calls = (2, 2) if args.quick else (args.rounds, args.calls)
  results = {}
  for name, (inputs, ways) in pairs(shape).items():
    outputs = [np.asarray(jax.jit(fn)(*inputs)) for fn in ways.values()]
    grads = {way: _forward_backward(fn, len(inputs))
             for way, fn in ways.items()}
    for fn in grads.values():  # compile and warm up
      jax.block_until_ready(fn(*inputs))
    ms = {way: [] for way in ways}
    for _ in range(rounds):
      for way, fn in grads.items():
        ms[way].append(1e3 * learner_benchmark.median_seconds(
            lambda fn=fn: jax.block_until_ready(fn(*inputs)), calls))
    first, second = ways
    results[name] = {
        'ms': ms,
        'median_ms': {way: statistics.median(v) for way, v in ms.items()},
        'speedup_per_round': [a / b for a, b in zip(ms[first], ms[second])],
        'max_abs_diff': float(np.max(np.abs(outputs[0] - outputs[1]))),
    }
    results[name]['speedup'] = statistics.median(
        results[name]['speedup_per_round'])
  return {
      'shape': dict(zip(('B', 'T', 'd', 'F', 'H', 'K', 'D'), shape)),
      'results': results,
      'machine': {'platform': platform.platform(), 'cpus': os.cpu_count(),
                  'backend': jax.default_backend(), 'jax': jax.__version__,
                  'command': ' '.join(sys.argv)},
  }


def table(result) -> str:
  lines = ['| product | way (before) | ms | way (model) | ms | speed-up |',
           '|---|---|---|---|---|---|']
  for name, r in result['results'].items():
    (old, old_ms), (new, new_ms) = r['median_ms'].items()
    lines.append(f'| {name} | {old} | {old_ms:.1f} | {new} | {new_ms:.1f} |'
                 f' {r["speedup"]:.2f}x |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='small shapes, 2 rounds of 2 calls (CI)')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--calls', type=int, default=10,
                      help='timed calls per way per round (median)')
  parser.add_argument('--out', default=os.path.join(
      ROOT, 'benchmarks', 'results', 'layouts.json'))
  args = parser.parse_args(argv)
  result = run(args)
  learner_benchmark.write_result(args.out, result, table(result))


if __name__ == '__main__':
  main()
