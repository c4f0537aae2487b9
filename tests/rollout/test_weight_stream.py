"""The streamed weight transport's wire format, without gRPC: a version
streamed in buckets arrives bit-exact in the served dtype, parts of several
learner processes assemble into one version, and every corruption a stream
can carry is refused before anything is served."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from sao_jax import checksums
from sao_jax.rollout import weight_staging
from sao_jax.rollout import weight_stream


class Tiny(nnx.Module):

  def __init__(self, dtype=jnp.float32):
    self.w = nnx.Param(jnp.zeros((6, 4), dtype))
    self.b = nnx.Param(jnp.zeros((5,), dtype))


def abstract(model):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      nnx.state(model))


def values(seed=0):
  rng = np.random.default_rng(seed)
  return {'w': rng.normal(size=(6, 4)).astype(np.float32),
          'b': rng.normal(size=(5,)).astype(np.float32)}


def receive(staging, pieces, version=3, part=0, parts=1, bucket_bytes=7,
            corrupt=None, checksum='sum64'):
  header = weight_stream.parse_manifest(weight_stream.manifest(
      pieces, version=version, part=part, parts=parts,
      bucket_bytes=bucket_bytes, checksum=checksum))
  stream = staging.begin(header)
  for i, message in enumerate(weight_stream.buckets(pieces, bucket_bytes,
                                                    checksum)):
    if corrupt is not None:
      message = corrupt(i, message)
      if message is None:
        continue
    staging.bucket(stream, message)
  staging.end(stream, part)


@pytest.mark.parametrize('wire, checksum', [('float32', 'sum64'),
                                            ('bfloat16', 'sum64'),
                                            ('float32', 'crc32')])
def test_a_version_arrives_exactly_in_the_served_dtype(wire, checksum):
  served = jnp.float32 if wire == 'float32' else jnp.bfloat16
  staging = weight_staging.Staging(abstract(Tiny(served)), 3, parts=1)
  sent = values()
  # Buckets of 7 bytes: every piece is cut across buckets and buckets
  # straddle pieces.
  receive(staging, weight_stream.host_pieces(sent, wire), checksum=checksum)
  assert staging.complete and staging.bytes == sum(
      v.size for v in sent.values()) * np.dtype(
          weight_stream.dtype_of(wire)).itemsize
  got = nnx.to_pure_dict(staging.state())
  for name, x in sent.items():
    assert got[name].dtype == served
    np.testing.assert_array_equal(
        np.asarray(got[name]), x.astype(weight_stream.dtype_of(wire)))


def test_a_server_in_another_dtype_converts_what_arrives():
  # The learner sends f32 to a bf16 server (remote servers may differ).
  staging = weight_staging.Staging(abstract(Tiny(jnp.bfloat16)), 1, parts=1)
  sent = values()
  receive(staging, weight_stream.host_pieces(sent), version=1)
  got = nnx.to_pure_dict(staging.state())
  np.testing.assert_array_equal(np.asarray(got['w']),
                                sent['w'].astype(ml_dtypes.bfloat16))


def shards(x, rows):
  """Pieces of leaf 'w' for row ranges `rows` (as another process holds)."""
  return [weight_stream.Piece('w', x.shape, ((a, b), (0, x.shape[1])),
                              np.ascontiguousarray(x[a:b])) for a, b in rows]


def test_parts_of_two_processes_assemble_into_one_version():
  staging = weight_staging.Staging(abstract(Tiny()), 2, parts=2)
  sent = values(1)
  b_piece = weight_stream.host_pieces({'b': sent['b']})
  # Process 0 holds rows 0-1 and 4-5 of w, process 1 rows 2-3 and all of b.
  receive(staging, shards(sent['w'], [(0, 2), (4, 6)]), version=2, part=0,
          parts=2)
  assert not staging.complete and staging.missing() == ['b', 'w']
  receive(staging, shards(sent['w'], [(2, 4)]) + b_piece, version=2,
          part=1, parts=2)
  assert staging.complete
  got = nnx.to_pure_dict(staging.state())
  np.testing.assert_array_equal(np.asarray(got['w']), sent['w'])
  np.testing.assert_array_equal(np.asarray(got['b']), sent['b'])


def test_a_version_with_a_part_missing_is_never_served():
  staging = weight_staging.Staging(abstract(Tiny()), 2, parts=2)
  receive(staging, weight_stream.host_pieces(values()), version=2, part=0,
          parts=2)
  # Everything arrived, but the other process's (empty) part did not end.
  assert not staging.complete
  with pytest.raises(weight_stream.StreamError, match='incomplete'):
    staging.state()


def flip(i, message):
  if i != 2:
    return message
  changed = bytearray(message)
  changed[-1] ^= 1
  return bytes(changed)


def sum64_reference(data: bytes) -> int:
  """The words of `data` (little-endian, the tail zero-padded) summed
  modulo 2**64, one Python int at a time."""
  padded = data + bytes(-len(data) % 8)
  return sum(int.from_bytes(padded[i:i + 8], 'little')
             for i in range(0, len(padded), 8)) % 2**64


@pytest.mark.parametrize('n', [0, 5, 8, 64, 1003])
def test_sum64_sums_the_words_and_sees_a_changed_or_zeroed_byte(n):
  data = np.random.default_rng(n).integers(0, 256, n, np.uint8).tobytes()
  sum64 = checksums.CHECKSUMS['sum64']
  assert sum64(memoryview(data)) == sum64_reference(data)
  # Wrap-around: words near 2**64 carry out of the sum.
  assert sum64(memoryview(b'\xff' * 16)) == (2 * (2**64 - 1)) % 2**64
  for at in range(0, n, max(1, n // 7)):
    for bit in (0, 7):
      changed = bytearray(data)
      changed[at] ^= 1 << bit
      assert sum64(memoryview(changed)) != sum64(memoryview(data))
  if any(data[:64]):
    zeroed = bytes(64) + data[64:]
    assert sum64(memoryview(zeroed)) != sum64(memoryview(data))


def test_an_unknown_checksum_is_refused_on_both_sides():
  pieces = weight_stream.host_pieces(values())
  with pytest.raises(ValueError, match='sum64, crc32'):
    weight_stream.manifest(pieces, version=1, checksum='md5')
  header = json.loads(weight_stream.manifest(pieces, version=1))
  header['checksum'] = 'md5'
  with pytest.raises(weight_stream.StreamError, match='checksum must be'):
    weight_stream.parse_manifest(json.dumps(header).encode())


@pytest.mark.parametrize('corrupt, match', [
    (flip, 'checksum'),
    (lambda i, m: None if i == 1 else m, 'expected bucket 1'),
    (lambda i, m: m[:weight_stream.HEADER_BYTES - 1] if i == 0 else m,
     'shorter than its header'),
    (lambda i, m: m + b'x' if i == 0 else m, 'header says'),
])
def test_a_corrupted_stream_is_refused(corrupt, match):
  staging = weight_staging.Staging(abstract(Tiny()), 3, parts=1)
  with pytest.raises(weight_stream.StreamError, match=match):
    receive(staging, weight_stream.host_pieces(values()), corrupt=corrupt)
  assert not staging.complete


def test_a_stream_that_ends_early_is_refused():
  staging = weight_staging.Staging(abstract(Tiny()), 3, parts=1)
  with pytest.raises(weight_stream.StreamError, match='ended after'):
    receive(staging, weight_stream.host_pieces(values()),
            corrupt=lambda i, m: None if i > 3 else m)
  assert not staging.complete


def test_overlapping_shards_are_refused():
  staging = weight_staging.Staging(abstract(Tiny()), 2, parts=1)
  x = values()['w']
  with pytest.raises(weight_stream.StreamError, match='overlapping'):
    receive(staging, shards(x, [(0, 4), (2, 6)]), version=2)


@pytest.mark.parametrize('edit, match', [
    (lambda h: h['pieces'][0].update(path='nope'), 'name no served'),
    (lambda h: h['pieces'][0].update(shape=[7, 4]), 'does not fit'),
    (lambda h: h['pieces'][0].update(nbytes=3), 'bytes for'),
    (lambda h: h.update(total_bytes=1), 'total_bytes'),
    (lambda h: h.update(parts=0), 'parts >= 1'),
    (lambda h: h.update(version=True), "'version' must be an int"),
    (lambda h: h.update(pieces=[{'path': 1}]), 'must list'),
])
def test_a_manifest_that_does_not_fit_the_server_is_refused(edit, match):
  pieces = weight_stream.host_pieces(values())
  header = json.loads(weight_stream.manifest(pieces, version=1))
  edit(header)
  staging = weight_staging.Staging(abstract(Tiny()), 1, parts=1)
  with pytest.raises(weight_stream.StreamError, match=match):
    staging.begin(weight_stream.parse_manifest(json.dumps(header).encode()))


def test_garbage_is_not_a_manifest():
  with pytest.raises(weight_stream.StreamError, match='not a JSON manifest'):
    weight_stream.parse_manifest(b'\xff\x00')
  with pytest.raises(weight_stream.StreamError, match='not a JSON object'):
    weight_stream.parse_manifest(b'[1]')


def test_host_pieces_are_copies_the_learner_may_donate():
  x = jnp.arange(8.0)
  piece, = weight_stream.host_pieces({'x': x})
  assert not np.shares_memory(piece.data, np.asarray(x))
  np.testing.assert_array_equal(piece.data, np.arange(8.0))
