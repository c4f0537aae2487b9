"""Multi-host start-up: `jax.distributed.initialize` when configured.

On a TPU pod every host runs the same program; JAX multi-controller needs each
process to join the coordinator before it touches a device. On Cloud TPU VMs
the coordinator, process count and id are discovered from the environment;
elsewhere (several CPU processes, GPU clusters) the config names them.
Once joined, the hosts exchange host-side records with
`host_gather.allgather_json`.
"""

from __future__ import annotations

import logging

import jax

_log = logging.getLogger(__name__)
_initialized = False


def initialize(cfg) -> None:
  """Joins the process group if `cfg.enabled`; idempotent.

  Args:
    cfg: `config.distributed`: `enabled`, `coordinator_address` ('' to let
      JAX discover it, as on Cloud TPU), `num_processes` and `process_id`
      (-1 / -1 to discover), `local_device_ids` ('' for all).
  """
  global _initialized
  if not cfg.enabled or _initialized:
    return
  kwargs = {}
  if cfg.coordinator_address:
    kwargs['coordinator_address'] = cfg.coordinator_address
  if cfg.num_processes > 0:
    kwargs['num_processes'] = cfg.num_processes
  if cfg.process_id >= 0:
    kwargs['process_id'] = cfg.process_id
  if cfg.local_device_ids:
    kwargs['local_device_ids'] = [int(i) for i in
                                  cfg.local_device_ids.split(',')]
  # Collectives between CPU processes (tests, CPU clusters) need gloo; the
  # setting is read by the CPU client only, so TPU and GPU runs ignore it.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(**kwargs)
  _initialized = True
  _log.info('joined as process %d of %d (%d local / %d global devices)',
            jax.process_index(), jax.process_count(),
            jax.local_device_count(), jax.device_count())
