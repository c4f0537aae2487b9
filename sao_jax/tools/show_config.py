r"""Prints a recipe after overrides and validation, with the resolved mesh.

  python -m sao_jax.tools.show_config --config=configs/default.py:algorithm=grpo \
      --config.policy_loss.eps_low=0.1

Exits with a one-line error (status 2) for an unknown key, a bad value or an
inconsistent setting, exactly as the training entry points do.
"""

from collections.abc import Sequence

import jax
from absl import flags

from sao_jax import config_lib
from sao_jax import recipe_checks

_CONFIG = config_lib.define_config_flag()
_NUM_DEVICES = flags.DEFINE_integer(
    'num_devices', None,
    'validate the mesh for this many devices instead of the local ones')


def main(argv: Sequence[str]) -> None:
  del argv
  config = _CONFIG.value
  num_devices = _NUM_DEVICES.value or jax.device_count()
  mesh = recipe_checks.validate(config, num_devices=num_devices)
  print(config, end="")
  print(f'# mesh for {num_devices} devices: {mesh}')


if __name__ == '__main__':
  config_lib.run(main)
