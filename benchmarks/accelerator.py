r"""The accelerator check: kernels, learner and rollouts on a GPU or TPU, one JSON.

  python benchmarks/accelerator.py --out /tmp/accelerator.json    # on the host
  python benchmarks/accelerator.py --dry-run                      # the plan only

On a machine with a GPU or TPU it (1) makes sure JAX sees the accelerator,
installing the matching jax extra when `--install` is given and the machine
reaches PyPI (`jax[cuda12]` / `jax[cuda13]` at the installed jax version on
an NVIDIA host, this package's `tpu` extra on a TPU VM); (2) runs, each in a
subprocess with its own time limit, the kernel benchmark (measured times next
to the HBM roofline), the learner benchmark on SmolLM2-135M at the demo's
batch and on a Llama-3.2-1B shape (bf16 compute, remat), and the rollout
benchmark; (3) writes their results, exit codes and timings into one JSON.
The limits add up to under ten minutes (`TOTAL_BUDGET_S`), so the whole check
fits one call of a lent machine; a step that runs out of time is recorded as
such and the next one still runs.

`--dry-run` prints the platform it found and the commands it would run, and
writes the plan as the JSON, without running any (CI runs it on the CPU).
On a machine with no network, carry the wheels the install step would fetch
and install them first; the check then uses whatever JAX is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_BUDGET_S = 560  # under ten minutes for one call, start-up included

# name -> (argv after the interpreter, time limit in seconds). The learner's
# rounds are few: on an accelerator a step takes milliseconds and the
# compiles dominate.
STEPS = {
    'kernels': (['benchmarks/kernels.py', '--repeats', '20'], 150),
    'learner_smollm2_135m': (
        ['benchmarks/learner.py', '--shape', 'smollm2_135m', '--rounds', '3',
         '--steps', '5', '--layer-loops', 'scan', 'unroll'], 150),
    'learner_llama_1b': (
        ['benchmarks/learner.py', '--shape', 'llama_1b', '--rounds', '3',
         '--steps', '3', '--critic-steps', '2', '--layer-loops', 'scan',
         '--override', 'model.logits_chunk_size=256'], 150),
    'rollout': (['benchmarks/rollout.py', '--repeats', '2', '--swaps', '2'],
                100),
}
assert sum(limit for _, limit in STEPS.values()) <= TOTAL_BUDGET_S


def detect_platform() -> str:
  """'gpu' (an NVIDIA driver answers), 'tpu' (TPU device files) or 'cpu'."""
  if shutil.which('nvidia-smi'):
    try:
      subprocess.run(['nvidia-smi', '-L'], check=True, capture_output=True,
                     timeout=30)
      return 'gpu'
    except (subprocess.SubprocessError, OSError):
      pass
  if any(os.path.exists(p) for p in ('/dev/accel0', '/dev/vfio/0')):
    return 'tpu'
  return 'cpu'


def install_command(found: str) -> list[str] | None:
  """The pip command that gives JAX its accelerator backend, or None."""
  pip = [sys.executable, '-m', 'pip', 'install', '--quiet']
  if found == 'tpu':
    return pip + ['-e', f'{ROOT}[tpu]']
  if found == 'gpu':
    try:
      import jax  # pylint: disable=g-import-not-at-top
      version = jax.__version__
    except ImportError:
      version = None
    pin = f'=={version}' if version else ''
    return pip + [f'jax[cuda13]{pin}']
  return None


def jax_backend(env) -> dict:
  """What a fresh interpreter's JAX sees: backend and devices (or the error)."""
  probe = ('import json, jax; print(json.dumps({"backend":'
           ' jax.default_backend(), "devices": [str(d) for d in'
           ' jax.devices()], "jax": jax.__version__}))')
  proc = subprocess.run([sys.executable, '-c', probe], capture_output=True,
                        text=True, env=env, timeout=120, cwd=ROOT)
  if proc.returncode:
    return {'error': proc.stderr[-2000:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run_step(name: str, argv: list[str], limit_s: int, outdir: str,
             env) -> dict:
  out = os.path.join(outdir, f'{name}.json')
  cmd = [sys.executable] + argv + ['--out', out]
  start = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=limit_s, cwd=ROOT)
    record = {'returncode': proc.returncode,
              'stdout_tail': proc.stdout[-4000:],
              'stderr_tail': proc.stderr[-4000:] if proc.returncode else ''}
  except subprocess.TimeoutExpired as e:
    record = {'returncode': None, 'timed_out_after_s': limit_s,
              'stdout_tail': (e.stdout or b'')[-4000:].decode(errors='replace')
              if isinstance(e.stdout, bytes) else (e.stdout or '')[-4000:]}
  record['command'] = ' '.join(cmd[1:])
  record['seconds'] = time.perf_counter() - start
  if os.path.exists(out):
    with open(out) as f:
      record['result'] = json.load(f)
  return record


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(
      ROOT, 'benchmarks', 'results', 'accelerator.json'))
  parser.add_argument('--dry-run', action='store_true',
                      help='print and write the plan; run nothing')
  parser.add_argument('--install', action='store_true',
                      help='pip-install the jax extra of the platform found')
  parser.add_argument('--only', nargs='+', choices=sorted(STEPS),
                      help='run these steps only')
  args = parser.parse_args(argv)
  found = detect_platform()
  install = install_command(found) if args.install else None
  steps = {n: STEPS[n] for n in (args.only or STEPS)}
  report = {
      'platform_found': found,
      'host': {'platform': platform.platform(), 'cpus': os.cpu_count(),
               'python': sys.version.split()[0]},
      'install_command': install and ' '.join(install[1:]),
      'plan': {n: {'command': ' '.join(a), 'limit_s': lim}
               for n, (a, lim) in steps.items()},
  }
  print(f'platform: {found}')
  for name, (step_argv, limit) in steps.items():
    print(f'  {name} (<= {limit} s): python {" ".join(step_argv)}')
  if args.dry_run:
    report['dry_run'] = True
  else:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED='1')
    if found == 'cpu':
      print('no GPU or TPU found: the numbers below are CPU numbers')
    if install:
      proc = subprocess.run(install, capture_output=True, text=True)
      report['install_returncode'] = proc.returncode
      if proc.returncode:
        report['install_error'] = proc.stderr[-2000:]
    report['jax'] = jax_backend(env)
    print(f'jax: {report["jax"]}')
    outdir = tempfile.mkdtemp(prefix='sao_accelerator_')
    report['steps'] = {}
    for name, (step_argv, limit) in steps.items():
      record = run_step(name, step_argv, limit, outdir, env)
      report['steps'][name] = record
      status = ('timed out' if record['returncode'] is None
                else f'exit {record["returncode"]}')
      print(f'{name}: {status} in {record["seconds"]:.0f} s')
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(report, f, indent=2)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
