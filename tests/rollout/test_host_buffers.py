"""Host buffers: alignment, and a pool that never hands out a buffer in use."""

import gc

import jax
import numpy as np
from flax import nnx

from sao_jax import config_lib
from sao_jax.rollout import host_buffers
from sao_jax.rollout import weight_staging
from sao_jax.rollout import weight_stream
from sao_jax.rollout import weight_sync

_MIB = 1 << 20


def test_aligned_empty_is_aligned_writable_and_adoptable():
  for shape in [(3,), (1000, 300), (2 * _MIB // 4,)]:
    array = host_buffers.aligned_empty(shape, np.float32)
    assert array.shape == shape and array.ctypes.data % 64 == 0
    array[...] = np.arange(array.size, dtype=np.float32).reshape(shape)
    # A CPU device takes it without a copy (what keeps a server at one copy).
    on_device = jax.device_put(array, may_alias=True)
    np.testing.assert_array_equal(np.asarray(on_device), array)


def test_pool_reuses_only_what_no_array_views():
  pool = host_buffers.Pool(max_bytes=4 * _MIB)
  first = pool.empty((_MIB // 4, 2), np.float32)  # 2 MiB
  first[...] = 1.0
  view = first[3:]  # keeps `first`'s pages in use
  address = first.ctypes.data
  del first
  gc.collect()
  second = pool.empty((_MIB // 4, 2), np.float32)
  assert second.ctypes.data != address and pool.reused == 0
  assert float(view[0, 0]) == 1.0  # not written over
  del view
  gc.collect()
  assert pool.held_bytes == 2 * _MIB
  third = pool.empty((_MIB // 2,), np.float32)  # same size, other shape
  assert third.ctypes.data == address and pool.reused == 1
  assert pool.held_bytes == 0
  del second, third
  gc.collect()
  assert pool.held_bytes == 4 * _MIB  # both kept: within max_bytes
  # Past max_bytes a returned buffer is unmapped, not kept.
  small = host_buffers.Pool(max_bytes=2 * _MIB)
  a, b = (small.empty((_MIB // 2,), np.float32) for _ in range(2))
  del a, b
  gc.collect()
  assert small.held_bytes == 2 * _MIB
  # Small arrays come from the heap and are never pooled.
  tiny = small.empty((4,), np.float32)
  assert tiny.ctypes.data % 64 == 0 and small.reused == 0


def test_host_copies_through_a_pool_are_exact_and_reuse_pages():
  rng = np.random.default_rng(0)
  state = {'w': jax.numpy.asarray(rng.normal(size=(512, 1024)), np.float32),
           'b': jax.numpy.asarray(rng.normal(size=(7,)), np.float32)}
  pool = host_buffers.Pool(max_bytes=8 * _MIB)
  held = weight_stream.HostCopy(state, '', pool=pool).pieces()
  for version in range(3):
    new = {k: v + version for k, v in state.items()}
    pieces = weight_stream.HostCopy(new, '', pool=pool).pieces()
    del held  # the last version goes once the next one is on the host
    gc.collect()
    by_path = {p.path: p.data for p in pieces}
    for key, value in new.items():
      np.testing.assert_array_equal(by_path[key], np.asarray(value))
    held = pieces
  # Versions 1 and 2 copied into the pages of versions -1 and 0.
  assert pool.reused == 2


def test_stream_transport_reuses_host_buffers_only_when_configured():
  state = {'w': jax.numpy.ones((1024, 1024), np.float32)}
  for reuse in (False, True):
    config = config_lib.load_config('configs/default.py')
    config.rollout.weight_reuse_host_buffers = reuse
    transport = weight_sync.StreamTransport.from_config(
        config.rollout, weights_dir='', dtype='', part=0, parts=1)
    assert (transport.pool is not None) == reuse
    for version in range(3):
      prepared = transport.prepare(state, version)
      transport.wait(prepared)
      del prepared
      gc.collect()
    if reuse:
      assert transport.pool.reused == 2


def test_a_server_staging_through_a_pool_never_writes_over_what_it_serves():
  # A CPU device adopts a staged leaf's pages (may_alias), so the pages a
  # pool hands out again must be those of a version no longer served.
  shapes = {'w': (512, 1024), 'b': (7,)}  # 2 MiB: pooled; 28 B: heap
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = nnx.State({k: jax.ShapeDtypeStruct(s, np.float32,
                                                sharding=device)
                         for k, s in shapes.items()})
  pool = host_buffers.Pool(max_bytes=4 * _MIB)
  gc.collect()
  gc.disable()  # what is freed is freed by reference counting
  try:
    served = {}  # version -> state, as a server holds them around a swap
    for version in range(5):
      state = {k: np.full(s, version, np.float32) for k, s in shapes.items()}
      pieces = weight_stream.HostCopy(state, '').pieces()
      header = weight_stream.parse_manifest(weight_stream.manifest(
          pieces, version=version, bucket_bytes=_MIB))
      staging = weight_staging.Staging(abstract, version, 1, pool=pool)
      stream = staging.begin(header)
      for message in weight_stream.buckets(pieces, _MIB):
        staging.bucket(stream, message)
      staging.end(stream, 0)
      served[version] = staging.state()
      del staging, stream
      # Both versions held are intact; then the older one is dropped.
      for held, held_state in served.items():
        for value in jax.tree.leaves(held_state):
          np.testing.assert_array_equal(np.asarray(value), held)
      # The swap. No gc.collect(): a staging must not keep a version it
      # handed over alive until the cycle collector runs.
      served.pop(version - 1, None)
      host_buffers.settle()
  finally:
    gc.enable()
  # From version 2 on, each went into the pages of the one two before.
  assert pool.reused == 3
