"""Device-mesh layout from config.

The learner's mesh has five named axes: `data` (pure data parallelism),
`fsdp` (data parallelism with parameters and optimizer state sharded over it),
`expert` (expert parallelism: a routed layer's experts split over devices,
which are data parallel for everything else), `sequence` (context
parallelism: the tokens of a row split over devices, for trajectories one chip
cannot hold) and `tensor` (model parallelism inside a layer). Batch rows are
split over `data x fsdp x expert`, their tokens over `sequence`. `expert` and
`sequence` may be left out of a mesh config (size 1).

`mesh_context` makes the mesh known to the layers that run per shard under
`jax.shard_map` (the splash attention kernel, routed experts) while a step is
traced.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

# `tensor` last: the innermost axis gets the closest devices.
MESH_AXES = ('data', 'fsdp', 'expert', 'sequence', 'tensor')
# Axes over which the global batch is split.
BATCH_AXES = ('data', 'fsdp', 'expert')
# The axis over which a routed layer's experts are split.
EXPERT_AXIS = 'expert'
# The axis over which a row's tokens are split.
SEQUENCE_AXIS = 'sequence'
# Axes a config may leave out, and the size they then have.
OPTIONAL_AXES = {'expert': 1, 'sequence': 1}

_meshes: list = []  # the mesh of the step being traced, innermost last


@contextlib.contextmanager
def mesh_context(mesh):
  """Layers that run per shard (`current_mesh`) see `mesh` while a step is
  traced inside; without it they run as one call, and XLA partitions what
  it can."""
  _meshes.append(mesh)
  try:
    yield
  finally:
    _meshes.pop()


def current_mesh():
  """The mesh of the innermost `mesh_context`, or None."""
  return _meshes[-1] if _meshes else None


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
  mesh_config = {**OPTIONAL_AXES, **mesh_config}
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
  """Number of batch shards: the product of the `BATCH_AXES` sizes (an
  axis of `OPTIONAL_AXES` left out has its default size)."""
  sizes = {**OPTIONAL_AXES, **sizes}
  return math.prod(sizes[a] for a in BATCH_AXES)


# Logical parameter/activation axis -> mesh axes. Parameters shard their
# `embed` dimension over fsdp (ZeRO-3 style) and their head / MLP / vocab
# dimensions over tensor (Megatron style); the layer axis of the stacked blocks
# is never sharded. The learner and the engine take other rules as an argument;
# no config key sets them.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),
    ('layers', None),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('vocab', 'tensor'),
    ('norm', None),
    ('cache_length', None),
    ('expert', 'expert'),  # a routed layer's experts
)


def logical_to_spec(logical_axes, shape, mesh, rules=DEFAULT_RULES):
  """A PartitionSpec for an array with `logical_axes` names on `mesh`.

  A logical axis maps to the mesh axes its rule names, skipping mesh axes of
  size 1 and any mesh axis already used by an earlier dimension. A dimension
  that the mapped axes do not divide evenly is left unsharded (replicated)
  rather than padded: e.g. SmolLM2's 3 KV heads on a 2-way tensor axis.
  """
  table = dict(rules)
  used = set()
  spec = []
  for name, size in zip(logical_axes, shape):
    target = table.get(name)
    if target is None:
      spec.append(None)
      continue
    axes = tuple(a for a in ((target,) if isinstance(target, str) else target)
                 if mesh.shape.get(a, 1) > 1 and a not in used)
    ways = math.prod(mesh.shape[a] for a in axes)
    if not axes or size % ways:
      spec.append(None)
      continue
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else axes)
  return jax.sharding.PartitionSpec(*spec)


def state_shardings(state, mesh, rules=DEFAULT_RULES):
  """NamedShardings for an nnx State whose Variables carry `logical_axes`.

  Variables without the metadata (counters, RNG state) are replicated.
  """
  def one(var):
    # The raw value: an array, or a ShapeDtypeStruct when planning a compile.
    value = var.get_raw_value() if isinstance(var, nnx.Variable) else var
    axes = (var.get_metadata().get('logical_axes')
            if isinstance(var, nnx.Variable) else None)
    if axes is None:
      spec = jax.sharding.PartitionSpec()
    else:
      spec = logical_to_spec(axes, value.shape, mesh, rules)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return var.replace(sharding) if isinstance(var, nnx.Variable) else sharding

  return jax.tree.map(one, state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_mesh(sizes, devices=None):
  """A `jax.sharding.Mesh` with the `MESH_AXES` at the resolved `sizes`
  (an axis of `OPTIONAL_AXES` left out has its default size)."""
  devices = jax.devices() if devices is None else devices
  sizes = {**OPTIONAL_AXES, **sizes}
  shape = tuple(sizes[a] for a in MESH_AXES)
  grid = np.asarray(devices).reshape(shape)
  return jax.sharding.Mesh(grid, MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,)
                           * len(MESH_AXES))
