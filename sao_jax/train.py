r"""Trains a policy with SAO: `python -m sao_jax.train`.

  python -m sao_jax.train --config=configs/default.py --workdir=runs/demo

starts local JetStream rollout servers for the embedded default model (or
connects to `--config.rollout.server_addresses=host:port,...`), runs rollout
workers into the async queue, trains as batches arrive, pushes weights every
`sync_every` steps, evaluates on the held-out split, checkpoints (a workdir
with a checkpoint resumes it), and ends with the held-out accuracy before and
after training side by side and a plot of the learning curves.

A mistake the user can fix (a bad setting, a missing model directory or JSONL
file, a workdir that is a file, remote servers without an admin secret, no
batch in time) ends the run with one `error: ...` line on stderr and exit
status 2; `--verbose` shows its traceback (`config_lib.run`).
"""

import logging
from collections.abc import Sequence

from absl import flags

from sao_jax import config_lib
from sao_jax import evaluation
from sao_jax import trainer

_CONFIG = config_lib.define_config_flag()
_WORKDIR = flags.DEFINE_string('workdir', 'runs/default',
                               'checkpoints, logs and plots (resumed if present)')


def main(argv: Sequence[str]) -> None:
  del argv
  logging.getLogger().setLevel(logging.WARNING)
  result = trainer.run(_CONFIG.value, _WORKDIR.value)
  if result.before is not None and result.after is not None:
    print(evaluation.format_report(result.before, result.after))
  elif result.after is not None:
    print(f'held-out accuracy {result.after.accuracy:.3f}'
          f' +- {result.after.standard_error:.3f} (n={result.after.n})')
  if result.plot_path:
    print(f'learning curves: {result.plot_path}')
  if result.stopped_early:
    print(f'stopped at step {result.steps}; run the same command to resume')


if __name__ == '__main__':
  config_lib.run(main)
