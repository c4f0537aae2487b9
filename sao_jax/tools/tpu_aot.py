"""Compiling for TPU topologies without TPUs (libtpu's compile-only devices).

With the `libtpu` wheel installed (the version jax pins; see the `test` and
`tpu` extras), `jax.experimental.topologies` describes a TPU slice on any
machine, and `jax.jit(f).lower(...).compile()` for its devices runs the full
XLA:TPU and Mosaic compilers. That catches what lowering alone misses (VMEM
overflow, unaligned tiles, unsupported dtypes) and reports the compiler's
memory and cost analysis: the way to plan TPU runs without TPUs.
"""

from __future__ import annotations

import functools

import jax

# Small slices of each generation; a kernel compiled for one device of a
# slice is compiled for that chip.
TOPOLOGIES = {
    'v4': 'v4:2x2x1',
    'v5e': 'v5e:2x2',
    'v5p': 'v5p:2x2x1',
    'v6e': 'v6e:2x2',
}


@functools.cache
def devices(topology: str):
  """Compile-only devices of a TPU topology such as 'v5p:4x4x4'.

  Raises:
    RuntimeError: when libtpu is missing, with the command that installs it.
  """
  # Imported here: importing topologies is cheap, but loading libtpu is not,
  # and CPU-only code paths should never pay for it.
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return topologies.get_topology_desc(platform='tpu',
                                        topology_name=topology).devices
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        f'cannot describe TPU topology {topology!r}: {e}. Compiling for TPU'
        ' without TPUs needs libtpu: pip install "libtpu==0.0.42.*" (the'
        ' version jax 0.10 pins); when another process holds libtpu, set'
        ' ALLOW_MULTIPLE_LIBTPU_LOAD=1') from e


def on_device(spec: jax.ShapeDtypeStruct, device) -> jax.ShapeDtypeStruct:
  """`spec` placed on one compile-only device."""
  return jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                              sharding=jax.sharding.SingleDeviceSharding(device))


def compile_single_device(fn, *specs, topology: str):
  """Compiles `fn` for the first chip of `topology`; returns the Compiled."""
  device = devices(topology)[0]
  placed = [jax.tree.map(lambda s: on_device(s, device), spec) for spec in specs]
  return jax.jit(fn).lower(*placed).compile()
