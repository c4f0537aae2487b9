"""Device-mesh layout from config.

The learner's mesh has three named axes: `data` (pure data parallelism),
`fsdp` (data parallelism with parameters and optimizer state sharded over it)
and `tensor` (model parallelism inside a layer). The batch is split over
`data x fsdp`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MESH_AXES = ('data', 'fsdp', 'tensor')
# Axes over which the global batch is split.
BATCH_AXES = ('data', 'fsdp')


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Resolves the configured axis sizes against the number of devices.

  Args:
    mesh_config: `{axis: size}` for every axis of `MESH_AXES`; at most one size
      may be -1, meaning "all devices the other axes leave".
    num_devices: devices the mesh must cover exactly.

  Returns:
    `{axis: size}` with every size positive and their product `num_devices`.

  Raises:
    ValueError: naming `config.mesh` when the sizes cannot cover the devices.
  """
  missing = [a for a in MESH_AXES if a not in mesh_config]
  extra = [a for a in mesh_config if a not in MESH_AXES]
  if missing or extra:
    raise ValueError(f'config.mesh must have exactly the axes {MESH_AXES};'
                     f' missing {missing}, unknown {extra}')
  sizes = {a: int(mesh_config[a]) for a in MESH_AXES}
  bad = {a: s for a, s in sizes.items() if s == 0 or s < -1}
  if bad:
    raise ValueError(f'config.mesh sizes must be positive or -1, got {bad}')
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ValueError(f'config.mesh: only one axis may be -1, got {fill}')
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % fixed:
      raise ValueError(
          f'config.mesh={sizes}: the fixed axes need a multiple of {fixed}'
          f' devices to fill config.mesh.{fill[0]}, but there are {num_devices}')
    sizes[fill[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f'config.mesh={sizes} needs {fixed} devices, but there are'
                     f' {num_devices}')
  return sizes


def batch_parallelism(sizes: Mapping[str, int]) -> int:
  """Number of batch shards: the product of the `BATCH_AXES` sizes."""
  return math.prod(sizes[a] for a in BATCH_AXES)
