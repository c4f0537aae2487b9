"""Sparse weight deltas (`rollout.weight_delta = 'sparse'`).

Against numpy brute force: a delta carries exactly the elements whose bits
changed and rebuilds the new weights bit for bit; with a tolerance, only
elements that moved beyond it, with every anchor whole and exact. Through
the receiver: a delta applies only onto the state it names and a bad index
is refused. Over a real server: the second push sends a fraction of the
bytes and the server ends bit-identical to the learner; a server that does
not hold the base refuses, is counted, and gets the next version whole.
"""

import asyncio

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from sao_jax.rollout import weight_delta
from sao_jax.rollout import weight_staging
from sao_jax.rollout import weight_stream
from sao_jax.rollout import weight_sync
import sao_jax.models

KEY = ('w', ((0, 64), (0, 32)))
SECRET = 'weight-delta-test-secret'


def bits(x):
  return x.reshape(-1).view(f'u{x.dtype.itemsize}')


def changed_copy(base, fraction, rng, scale=1e-2):
  new = base.copy()
  flat = new.reshape(-1)
  at = rng.choice(flat.size, int(fraction * flat.size), replace=False)
  flat[at] = (flat[at].astype(np.float32) * (1 + scale)).astype(base.dtype)
  return new


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_a_sparse_piece_rebuilds_the_new_weights_bit_for_bit(dtype):
  rng = np.random.default_rng(0)
  base = rng.normal(size=(64, 32)).astype(dtype)
  new = changed_copy(base, 0.05, rng)
  encoder = weight_delta.Encoder()
  encoder.begin(1)
  assert encoder.anchor and encoder.encode(KEY, base)[1] is None
  encoder.begin(2)
  served, (payload, count) = encoder.encode(KEY, new)
  assert served is new
  assert count == np.count_nonzero(bits(new) != bits(base)) > 0
  assert payload.nbytes == count * (4 + np.dtype(dtype).itemsize)
  rebuilt = weight_delta.apply(base, payload, count)
  np.testing.assert_array_equal(bits(rebuilt), bits(new))


def test_a_piece_that_changed_mostly_goes_whole():
  # 4-byte index + 4-byte value per element: past half, whole is smaller.
  rng = np.random.default_rng(1)
  base = rng.normal(size=(64, 32)).astype(np.float32)
  encoder = weight_delta.Encoder()
  encoder.begin(1)
  encoder.encode(KEY, base)
  encoder.begin(2)
  new = changed_copy(base, 0.6, rng)
  served, sparse = encoder.encode(KEY, new)
  assert sparse is None and served is new


def test_a_tolerance_sends_what_moved_beyond_it_and_an_anchor_resets():
  rng = np.random.default_rng(2)
  v1 = rng.normal(size=(64, 32)).astype(np.float32)
  encoder = weight_delta.Encoder(rtol=1e-3, anchor_every=3)
  encoder.begin(1)
  encoder.encode(KEY, v1)
  # Every element moves by 1e-4 of itself, 3% by 1e-2.
  v2 = changed_copy(v1 * np.float32(1 + 1e-4), 0.03, rng)
  encoder.begin(2)
  served2, (payload, count) = encoder.encode(KEY, v2)
  beyond = ~(np.abs(v2 - v1) <= 1e-3 * np.abs(v1))
  assert count == np.count_nonzero(beyond) == int(0.03 * v1.size)
  np.testing.assert_array_equal(served2, np.where(beyond, v2, v1))
  np.testing.assert_array_equal(
      weight_delta.apply(v1, payload, count), served2)
  # What a server holds stays within the tolerance of the learner's.
  assert np.all(np.abs(served2 - v2) <= 1e-3 * np.abs(v2) * 1.01)
  v3 = v2 * np.float32(1 + 1e-4)
  encoder.begin(3)  # 3 % anchor_every == 0: whole and exact
  served3, sparse = encoder.encode(KEY, v3)
  assert encoder.anchor and sparse is None and served3 is v3


# -- through the receiver -----------------------------------------------------


class Tiny(nnx.Module):

  def __init__(self, dtype):
    self.w = nnx.Param(jnp.zeros((64, 32), dtype))
    self.b = nnx.Param(jnp.zeros((5,), dtype))


def abstract(dtype):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      nnx.state(Tiny(dtype)))


def receive(staging, pieces, *, version, state_id=None, base_id=None,
            bucket_bytes=100):
  header = weight_stream.parse_manifest(weight_stream.manifest(
      pieces, version=version, bucket_bytes=bucket_bytes,
      state_id=state_id, base_id=base_id))
  stream = staging.begin(header)
  for message in weight_stream.buckets(pieces, bucket_bytes):
    staging.bucket(stream, message)
  staging.end(stream, 0)
  return nnx.to_pure_dict(staging.state())


def test_a_delta_through_the_receiver_lands_on_the_exact_new_state():
  rng = np.random.default_rng(3)
  dtype = ml_dtypes.bfloat16
  v1 = {'w': rng.normal(size=(64, 32)).astype(dtype),
        'b': rng.normal(size=(5,)).astype(dtype)}
  encoder = weight_delta.Encoder()
  encoder.begin(1)
  first = weight_stream.HostCopy(v1, 'bfloat16', encoder)
  assert first.base is None
  served = receive(weight_staging.Staging(abstract(jnp.bfloat16), 1, 1),
                   first, version=1, state_id=first.state_id)
  # 'b' does not change: its sparse piece has no bytes at all.
  v2 = {'w': changed_copy(v1['w'], 0.02, rng), 'b': v1['b']}
  encoder.begin(2)
  second = weight_stream.HostCopy(v2, 'bfloat16', encoder)
  deltas = second.deltas()
  assert second.base == (first.state_id, 1)
  assert [d.count for d in deltas] == [0, int(0.02 * 64 * 32)]
  staging = weight_staging.Staging(abstract(jnp.bfloat16), 2, 1,
                                  served=served,
                                  served_ids={0: first.state_id})
  got = receive(staging, deltas, version=2, state_id=second.state_id,
                base_id=second.base[0])
  assert staging.bytes == sum(d.data.nbytes for d in deltas) < (
      first.total_bytes / 10)
  for name, x in v2.items():
    np.testing.assert_array_equal(bits(np.asarray(got[name])), bits(x))


def sparse_version(served_value, *, index):
  """A one-leaf delta setting element `index` of 'w' (and 'b' unchanged)."""
  payload = np.concatenate([np.array([index], '<u4').view(np.uint8),
                            np.array([7.0], np.float32).view(np.uint8)])
  del served_value
  return [weight_stream.Piece('b', (5,), ((0, 5),), np.empty(0, np.uint8),
                              count=0, value_dtype=np.dtype(np.float32)),
          weight_stream.Piece('w', (64, 32), ((0, 64), (0, 32)), payload,
                              count=1, value_dtype=np.dtype(np.float32))]


def served_f32():
  return {'w': jnp.ones((64, 32), jnp.float32),
          'b': jnp.ones((5,), jnp.float32)}


def test_a_delta_applies_only_onto_the_state_it_names():
  staging = weight_staging.Staging(abstract(jnp.float32), 2, 1,
                                  served=served_f32(),
                                  served_ids={0: 'run-a:1'})
  with pytest.raises(weight_stream.StreamError, match='holds .run-a:1.'):
    receive(staging, sparse_version(None, index=3), version=2,
            base_id='run-b:1')
  # A server that loaded a checkpoint (no id) refuses every delta.
  staging = weight_staging.Staging(abstract(jnp.float32), 2, 1,
                                  served=served_f32(), served_ids={})
  with pytest.raises(weight_stream.StreamError, match='delta against'):
    receive(staging, sparse_version(None, index=3), version=2,
            base_id='run-a:1')
  ok = weight_staging.Staging(abstract(jnp.float32), 2, 1,
                             served=served_f32(), served_ids={0: 'run-a:1'})
  got = receive(ok, sparse_version(None, index=3), version=2,
                base_id='run-a:1')
  want = np.ones((64, 32), np.float32)
  want.reshape(-1)[3] = 7.0
  np.testing.assert_array_equal(np.asarray(got['w']), want)


def test_a_sparse_index_outside_its_piece_is_refused():
  staging = weight_staging.Staging(abstract(jnp.float32), 2, 1,
                                  served=served_f32(),
                                  served_ids={0: 'run-a:1'})
  with pytest.raises(weight_stream.StreamError, match='outside the piece'):
    receive(staging, sparse_version(None, index=64 * 32), version=2,
            base_id='run-a:1')
  assert not staging.complete


def test_a_sparse_manifest_whose_size_lies_is_refused():
  staging = weight_staging.Staging(abstract(jnp.float32), 2, 1,
                                  served=served_f32(),
                                  served_ids={0: 'run-a:1'})
  pieces = sparse_version(None, index=3)
  pieces[1] = weight_stream.Piece('w', (64, 32), ((0, 64), (0, 32)),
                                  pieces[1].data, count=2,
                                  value_dtype=np.dtype(np.float32))
  with pytest.raises(weight_stream.StreamError, match='2 changed'):
    receive(staging, pieces, version=2, base_id='run-a:1')


# -- over a real server -------------------------------------------------------


def server_state(server):
  return nnx.to_pure_dict(server.engine.weights.get()[0])


def test_a_delta_push_over_grpc_sends_little_and_lands_bit_exact(
    tiny_checkpoint_no_eos):
  from sao_jax.rollout import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.rollout import server as server_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.models import sampling  # pylint: disable=g-import-not-at-top
  model, tok = sao_jax.models.from_pretrained(tiny_checkpoint_no_eos)
  engine = engine_lib.Engine(model, tok, engine_lib.EngineConfig(
      max_concurrent_decodes=2, max_prefill_length=32, max_target_length=64,
      stop_ids=(), sampling=sampling.SamplingParams(temperature=1.0)))
  server = server_lib.RolloutServer(engine, port=0, secret=SECRET)
  address = f'127.0.0.1:{server.port}'
  try:
    flat = sao_jax.models.pretrained.flat_params(model)
    v1 = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.5), flat)
    # One element in 50 moves: about what a small bf16 step leaves.
    rng = np.random.default_rng(0)
    v2 = jax.tree.map(lambda x: np.where(rng.random(x.shape) < 0.02,
                                         x + np.float32(1), x), v1)

    def push(publisher, params, v):
      built = sao_jax.models.pretrained.build(model.config, params)
      return asyncio.run(publisher.push(
          publisher.transport.prepare(built, v), v))

    transport = weight_sync.StreamTransport(
        bucket_bytes=4096, encoder=weight_delta.Encoder())
    publisher = weight_sync.WeightPublisher([address], SECRET,
                                            transport=transport)
    # As a run starts: version 0 is what the server loaded from the model
    # source (acknowledged, but never streamed: no state of ours there).
    publisher.set_current(transport.prepare(model, 0), 0)
    publisher.acked[address] = 0
    assert push(publisher, v1, 1).updated == [address]
    whole = transport.sent_bytes[address]
    assert whole == transport.version_bytes
    assert push(publisher, v2, 2).updated == [address]
    assert transport.sent_bytes[address] < whole / 5
    got = server_state(server)
    want = nnx.to_pure_dict(nnx.state(sao_jax.models.pretrained.build(
        model.config, v2), nnx.Param))
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(
        bits(np.asarray(g)), bits(np.asarray(w))), got, want)

    # Another learner (its own states) that believes the server acked its
    # version 2: its delta names a base the server does not hold.
    other = weight_sync.StreamTransport(bucket_bytes=4096,
                                        encoder=weight_delta.Encoder())
    stranger = weight_sync.WeightPublisher([address], SECRET,
                                           transport=other)
    push(stranger, v1, 2)  # acked: 2, with its own state id
    server_ids = dict(server._state_ids)  # pylint: disable=protected-access
    # The server took that whole push; make it forget the id, as a server
    # that loaded a checkpoint would.
    server._state_ids = {}  # pylint: disable=protected-access
    result = push(stranger, v2, 3)
    assert result.failed and stranger.counters['pushes_failed'] == 1
    assert server.engine.version == 2
    assert server_ids  # the whole push had recorded its state's id
    # Not acknowledged at 3: the next version goes whole, and lands.
    assert push(stranger, v1, 4).updated == [address]
    assert other.sent_bytes[address] == other.version_bytes
    assert server.engine.version == 4
  finally:
    server.stop()
