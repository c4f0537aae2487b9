r"""Kernel benchmark: HBM bytes, rooflines, measured XLA time, TPU compiler estimates.

  python benchmarks/kernels.py            # full sizes (a few minutes on 2 CPUs)
  python benchmarks/kernels.py --quick    # tiny sizes, for CI

For each kernel (skip-observation GAE; DIS loss forward + backward) and size:
  * the HBM bytes the op must move (read inputs once, write outputs once);
  * the roofline time at the HBM bandwidth of TPU v5e, v5p and an H200;
  * the XLA reference measured here (median of repeats, after warm-up);
  * on a GPU or TPU host, the measured time of what runs there (the Pallas
    kernel on TPU, the XLA reference elsewhere) and its fraction of roofline;
  * for v5e / v5p / v6e, compiled without hardware (libtpu compile-only
    devices): the compiler's `bytes accessed` and `optimal_seconds` for the
    Pallas kernel and for the XLA reference.

Writes a JSON file and prints the markdown table recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

# Compile-only TPU devices never open a TPU; other processes may hold libtpu.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from sao_jax import kernels  # pylint: disable=g-import-not-at-top
from sao_jax.tools import tpu_aot  # pylint: disable=g-import-not-at-top

HBM_BYTES_PER_SECOND = {'v5e': 819e9, 'v5p': 2765e9, 'h200': 4.8e12,
                        'v6e': 1640e9}
FULL_SIZES = [(256, 32768), (64, 8192)]
QUICK_SIZES = [(8, 1024)]


def gae_fn(implementation, interpret=None):
  def fn(rewards, values, mask, lam):
    return kernels.skip_observation_gae(rewards, values, mask, gamma=1.0,
                                        lam=lam, implementation=implementation,
                                        interpret=interpret)
  return fn


def dis_fn(implementation, interpret=None):
  def fn(logp, mu, adv, mask):
    return jax.value_and_grad(
        lambda x: kernels.dis_policy_loss(
            x, mu, adv, mask, eps_low=0.3, eps_high=5.0,
            implementation=implementation, interpret=interpret),
        has_aux=True)(logp)
  return fn


def specs(kernel, batch, length):
  f32 = jax.ShapeDtypeStruct((batch, length), jnp.float32)
  mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
  if kernel == 'gae':
    return [f32, f32, mask, jax.ShapeDtypeStruct((batch,), jnp.float32)]
  return [f32, f32, f32, mask]


def min_hbm_bytes(kernel, batch, length):
  """Bytes an ideal implementation moves: f32 arrays, bool mask, once each."""
  tokens = batch * length
  if kernel == 'gae':  # read r, v, mask; write A, R
    return tokens * (4 + 4 + 1 + 4 + 4) + batch * 4
  # read logp, mu, A, mask once; write dlogp once
  return tokens * (4 * 3 + 1 + 4)


def random_inputs(kernel, batch, length):
  rng = np.random.default_rng(0)
  mask = rng.random((batch, length)) < 0.7
  if kernel == 'gae':
    return [rng.normal(size=(batch, length)).astype(np.float32),
            rng.normal(size=(batch, length)).astype(np.float32), mask,
            rng.uniform(0.5, 1.0, batch).astype(np.float32)]
  logp = -rng.uniform(0.05, 3.0, (batch, length)).astype(np.float32)
  return [logp, (logp + rng.normal(scale=0.3, size=logp.shape)).astype(
      np.float32), rng.normal(size=logp.shape).astype(np.float32), mask]


def measure_ms(fn, args, repeats):
  compiled = jax.jit(fn)
  args = [jax.device_put(a) for a in args]
  jax.block_until_ready(compiled(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def tpu_estimates(kernel, batch, length, topologies):
  make = gae_fn if kernel == 'gae' else dis_fn
  out = {}
  for name in topologies:
    out[name] = {}
    for impl, interpret in (('pallas', False), ('xla', None)):
      compiled = tpu_aot.compile_single_device(
          make(impl, interpret), *specs(kernel, batch, length),
          topology=tpu_aot.TOPOLOGIES[name])
      cost = compiled.cost_analysis()
      seconds = cost.get('optimal_seconds', -1.0)
      out[name][impl] = {
          'bytes_accessed': cost.get('bytes accessed'),
          # XLA reports a negative value when it has no estimate (loops).
          'optimal_us': seconds * 1e6 if seconds > 0 else None,
      }
  return out


def run(sizes, repeats, topologies):
  backend = jax.default_backend()
  results = []
  for kernel in ('gae', 'dis_fwd_bwd'):
    make = gae_fn if kernel == 'gae' else dis_fn
    for batch, length in sizes:
      nbytes = min_hbm_bytes(kernel, batch, length)
      row = {
          'kernel': kernel, 'batch': batch, 'length': length,
          'min_hbm_bytes': nbytes,
          'roofline_us': {k: nbytes / bw * 1e6
                          for k, bw in HBM_BYTES_PER_SECOND.items()},
          'xla_reference_ms': {backend: measure_ms(
              make('xla'), random_inputs(kernel, batch, length), repeats)},
      }
      if backend == 'tpu':
        row['pallas_ms'] = measure_ms(
            make('pallas'), random_inputs(kernel, batch, length), repeats)
      row['tpu_compile_only'] = tpu_estimates(kernel, batch, length,
                                              topologies)
      results.append(row)
      print(f'{kernel} {batch}x{length} done', file=sys.stderr)
  return results


def markdown(results):
  topologies = list(results[0]['tpu_compile_only'])
  lines = [
      '| kernel | B x T | min HBM MB | roofline us v5e / v5p / v6e / H200 |'
      ' XLA ref measured here, ms | compiler bytes MB, Pallas / XLA ref (' +
      ', '.join(topologies) + ') | compiler estimate us, Pallas / XLA ref (' +
      ', '.join(topologies) + ') | Pallas estimate / roofline |',
      '|---|---|---|---|---|---|---|---|']
  fmt = lambda v: '-' if v is None else f'{v:.0f}'
  for r in results:
    roof = r['roofline_us']
    ref = ', '.join(f'{v:.1f} ({k})' for k, v in r['xla_reference_ms'].items())
    byts, est, ratio = [], [], []
    for topo, impls in r['tpu_compile_only'].items():
      pallas, xla = impls['pallas'], impls['xla']
      byts.append(f'{pallas["bytes_accessed"] / 1e6:.0f} /'
                  f' {xla["bytes_accessed"] / 1e6:.0f}')
      est.append(f'{fmt(pallas["optimal_us"])} / {fmt(xla["optimal_us"])}')
      if pallas['optimal_us']:
        ratio.append(f'{pallas["optimal_us"] / roof[topo]:.2f}x ({topo})')
    lines.append(
        f'| {r["kernel"]} | {r["batch"]} x {r["length"]} |'
        f' {r["min_hbm_bytes"] / 1e6:.1f} |'
        f' {roof["v5e"]:.0f} / {roof["v5p"]:.0f} / {roof["v6e"]:.0f} /'
        f' {roof["h200"]:.0f} | {ref} | {"; ".join(byts)} | {"; ".join(est)} |'
        f' {", ".join(ratio)} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes and one TPU target (CI)')
  parser.add_argument('--repeats', type=int, default=None)
  parser.add_argument('--out', default='benchmarks/results/kernels.json')
  args = parser.parse_args()
  sizes = QUICK_SIZES if args.quick else FULL_SIZES
  repeats = args.repeats or (3 if args.quick else 7)
  topologies = ['v5e'] if args.quick else ['v5e', 'v5p', 'v6e']
  results = run(sizes, repeats, topologies)
  machine = {'platform': platform.platform(), 'cpus': os.cpu_count(),
             'backend': jax.default_backend(),
             'devices': [str(d) for d in jax.devices()],
             'jax': jax.__version__, 'command': ' '.join(sys.argv)}
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump({'machine': machine, 'results': results}, f, indent=2)
  print(markdown(results))


if __name__ == '__main__':
  main()
