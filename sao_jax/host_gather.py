"""Exchanging small host-side records between the processes of a run.

A multi-host run (`distributed.initialize`) must agree on, or save together,
records that are not jax arrays: per-host data cursors, question digests,
evaluation outcomes, the rollout servers' addresses and admin secret.
`allgather_json` moves them over JAX's own collectives, so any layer can use
it without depending on how the processes were started.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def allgather_json(value: Any) -> list[Any]:
  """`value` of every process, in process order (a collective).

  For the small host-side records that multi-host training must agree on or
  save together (per-host data cursors, question digests, evaluation
  outcomes). `value` goes through JSON, so every process must call this at
  the same point with a JSON-able value; one process returns `[value]`
  without communicating.
  """
  if jax.process_count() == 1:
    return [json.loads(json.dumps(value))]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))
  sizes = np.asarray(sizes).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(
      len(sizes), -1)
  return [json.loads(bytes(row[:size]).decode())
          for row, size in zip(gathered, sizes)]
