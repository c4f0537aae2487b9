"""Causal self-attention over packed segments: the definition and a blockwise form.

Both take queries `[B, T, H, D]` and `K` shared key/value heads `[B, T, K, D]`
(grouped-query attention, `G = H / K` query heads per key/value head), and a
row's segment ids `[B, T]`: query t attends key s when `s <= t`, both carry
the same id, and the id is not 0 (padding). A packed row holds several
trajectories as segments 1, 2, ...; an unpacked row is segment 1 with
padding 0. A query with no key to attend (a padding query) gets zeros from
`blockwise_attention` and the mean of all values from `dense_attention`:
either is read by nothing.

  dense_attention      scores `[B, K, G*T, S]` materialised: the definition,
                       and the decode path (one query over a KV cache)
  blockwise_attention  online softmax over key blocks (Rabe & Staats 2021,
                       FlashAttention-2's recurrence) with its own VJP that
                       recomputes scores from the saved log-sum-exp: memory
                       linear in T, forward and backward
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_NEG_INF = -1e30  # finite: a fully masked row (padding) must not become NaN
DEFAULT_BLOCK = 512


def self_attention_mask(segment_ids_BxT):
  """`[B, T, T]` bool: query t sees key s <= t of its own segment (id > 0)."""
  ids_BxT = jnp.asarray(segment_ids_BxT)
  t = ids_BxT.shape[1]
  causal_TxT = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same_BxTxT = ids_BxT[:, :, None] == ids_BxT[:, None, :]
  return causal_TxT[None] & same_BxTxT & (ids_BxT > 0)[:, None, :]


def group_queries(q_BxTxHxD, kv_heads: int):
  """`[B, T, H, D]` -> `[B, K, G, T, D]`: the G query heads of each kv head."""
  b, t, h, d = q_BxTxHxD.shape
  return q_BxTxHxD.reshape(b, t, kv_heads, h // kv_heads, d).transpose(
      0, 2, 3, 1, 4)


def ungroup(out_BxKxGxTxD):
  """`[B, K, G, T, D]` -> `[B, T, H, D]`, the inverse of `group_queries`."""
  b, k, g, t, d = out_BxKxGxTxD.shape
  return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, d)


def tiled_layout(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT,
                 multiple: int):
  """Heads first (`[B, K, G, T, D]` queries, `[B, K, T, D]` keys/values)
  and T padded to a multiple of `multiple` as padding (id 0): the layout
  the tiled implementations (blockwise, splash) work in."""
  t = q_BxTxHxD.shape[1]
  extra = -(-t // multiple) * multiple - t
  time = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 2) + ((0, extra), (0, 0)))
  return (time(group_queries(q_BxTxHxD, k_BxTxKxD.shape[2])),
          time(k_BxTxKxD.transpose(0, 2, 1, 3)),
          time(v_BxTxKxD.transpose(0, 2, 1, 3)),
          jnp.pad(jnp.asarray(segment_ids_BxT).astype(jnp.int32),
                  ((0, 0), (0, extra))))


def dense_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
  """Softmax attention of H query heads over K shared key/value heads.

  `mask_BxTxS[b, t, s]`: query t may attend key s. Heads go first and each
  key/value head's G query heads are stacked along the query axis, so both
  products are plain batched matmuls `[B K] x [(G T), D] x [D, S]`: with the
  heads between batch and time, XLA:CPU ran the backward 1.7x slower
  (docs/design/learner_speed.md).
  """
  b, t, h, d = q_BxTxHxD.shape
  kv_heads = k_BxSxKxD.shape[2]
  groups = h // kv_heads
  q_BxKxQxD = group_queries(q_BxTxHxD, kv_heads).reshape(
      b, kv_heads, groups * t, d)
  k_BxKxSxD = k_BxSxKxD.transpose(0, 2, 1, 3)
  v_BxKxSxD = v_BxSxKxD.transpose(0, 2, 1, 3)
  scores = jnp.einsum('bkqd,bksd->bkqs', q_BxKxQxD, k_BxKxSxD,
                      preferred_element_type=_F32) * (d ** -0.5)
  scores_BxKxGxTxS = scores.reshape(b, kv_heads, groups, t, -1)
  scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS,
                               _NEG_INF)
  probs = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxD.dtype)
  out = jnp.einsum('bkqs,bksd->bkqd', probs.reshape(scores.shape), v_BxKxSxD)
  return ungroup(out.reshape(b, kv_heads, groups, t, d))


def dense_self_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT):
  """`dense_attention` under `self_attention_mask`: the definition."""
  return dense_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD,
                         self_attention_mask(segment_ids_BxT))


def blockwise_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT,
                        block: int = DEFAULT_BLOCK):
  """Causal self-attention over segments in `block`-token tiles.

  Equal to `dense_self_attention` on every query that attends a key, with
  memory `O(B H T D)` instead of `O(B H T^2)`: the `[block, block]` scores of
  one query tile and one key tile are all that exist at once, forward and
  backward. Key tiles after a query tile's diagonal are skipped (causality),
  so the work is about half the dense product's. T is padded to a multiple
  of `block` (as padding, id 0) and the padding sliced off.
  """
  t = q_BxTxHxD.shape[1]
  block = min(block, t)
  q, k, v, seg_BxT = tiled_layout(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD,
                                  segment_ids_BxT, block)
  out = _flash(q, k, v, seg_BxT, block)
  return ungroup(out[:, :, :, :t])


def _tile(x, index, block: int, axis: int):
  return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis)


def _tile_scores(q_tile, k_tile, seg_q_BxQ, seg_k_BxS, i, j, block: int,
                 scale: float):
  """Scaled scores `[B, K, G, Q, S]` (f32) of query tile i against key tile
  j, and where they are attended (`[B, 1, 1, Q, S]`)."""
  scores = jnp.einsum('bkgqd,bksd->bkgqs', q_tile, k_tile,
                      preferred_element_type=_F32) * scale
  q_pos = i * block + jnp.arange(block)
  k_pos = j * block + jnp.arange(block)
  allowed_BxQxS = ((k_pos[None, :] <= q_pos[:, None])[None]
                   & (seg_q_BxQ[:, :, None] == seg_k_BxS[:, None, :])
                   & (seg_k_BxS > 0)[:, None, :])
  return scores, allowed_BxQxS[:, None, None]


def _forward(q, k, v, seg_BxT, block: int):
  """`(out [B, K, G, T, D], lse [B, K, G, T])` with lse = +inf on queries
  that attend nothing (so that `exp(s - lse)` is 0 there)."""
  tiles = q.shape[3] // block
  scale = q.shape[-1] ** -0.5

  def query_tile(i):
    q_tile = _tile(q, i, block, 3)
    seg_q = _tile(seg_BxT, i, block, 1)

    def key_tile(j, carry):
      m, l, acc = carry
      scores, allowed = _tile_scores(q_tile, _tile(k, j, block, 2), seg_q,
                                     _tile(seg_BxT, j, block, 1), i, j, block,
                                     scale)
      scores = jnp.where(allowed, scores, -jnp.inf)
      m_new = jnp.maximum(m, scores.max(axis=-1))
      shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(scores - shift[..., None])
      correction = jnp.exp(m - shift)
      acc = acc * correction[..., None] + jnp.einsum(
          'bkgqs,bksd->bkgqd', p.astype(v.dtype), _tile(v, j, block, 2),
          preferred_element_type=_F32)
      return m_new, l * correction + p.sum(axis=-1), acc

    stats_shape = q_tile.shape[:-1]
    init = (jnp.full(stats_shape, -jnp.inf, _F32),
            jnp.zeros(stats_shape, _F32), jnp.zeros(q_tile.shape, _F32))
    # Causal: key tiles 0..i only.
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_tile, init)
    attended = l > 0
    out = acc / jnp.where(attended, l, 1.0)[..., None]
    lse = jnp.where(attended, m + jnp.log(jnp.where(attended, l, 1.0)),
                    jnp.inf)
    return out.astype(q.dtype), lse

  out_N, lse_N = jax.lax.map(query_tile, jnp.arange(tiles))
  # [N, B, K, G, block, ...] -> [B, K, G, N * block, ...]
  out = jnp.moveaxis(out_N, 0, 3).reshape(q.shape)
  lse = jnp.moveaxis(lse_N, 0, 3).reshape(q.shape[:-1])
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg_BxT, block: int):
  return _forward(q, k, v, seg_BxT, block)[0]


def _flash_fwd(q, k, v, seg_BxT, block: int):
  out, lse = _forward(q, k, v, seg_BxT, block)
  return out, (q, k, v, seg_BxT, out, lse)


def _flash_bwd(block: int, residuals, d_out):
  """FlashAttention-2's backward: per key tile j, over query tiles i >= j,
  `dV += P^T dO`, `dS = P (dO V^T - rowsum(dO O))`, `dK += dS^T Q`,
  `dQ += dS K`, with P recomputed from the saved log-sum-exp."""
  q, k, v, seg_BxT, out, lse = residuals
  tiles = q.shape[3] // block
  scale = q.shape[-1] ** -0.5
  delta = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1)

  def key_tile(dq, j):
    k_tile, v_tile = _tile(k, j, block, 2), _tile(v, j, block, 2)
    seg_k = _tile(seg_BxT, j, block, 1)

    def query_tile(i, carry):
      dq, dk, dv = carry
      q_tile, do_tile = _tile(q, i, block, 3), _tile(d_out, i, block, 3)
      scores, allowed = _tile_scores(q_tile, k_tile,
                                     _tile(seg_BxT, i, block, 1), seg_k, i, j,
                                     block, scale)
      p = jnp.where(allowed, jnp.exp(scores - _tile(lse, i, block, 3)[..., None]),
                    0.0)
      dv = dv + jnp.einsum('bkgqs,bkgqd->bksd', p.astype(d_out.dtype),
                           do_tile, preferred_element_type=_F32)
      dp = jnp.einsum('bkgqd,bksd->bkgqs', do_tile, v_tile,
                      preferred_element_type=_F32)
      ds = p * (dp - _tile(delta, i, block, 3)[..., None]) * scale
      dk = dk + jnp.einsum('bkgqs,bkgqd->bksd', ds.astype(q.dtype), q_tile,
                           preferred_element_type=_F32)
      dq_tile = _tile(dq, i, block, 3) + jnp.einsum(
          'bkgqs,bksd->bkgqd', ds.astype(k.dtype), k_tile,
          preferred_element_type=_F32)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_tile, i * block, 3)
      return dq, dk, dv

    zeros = jnp.zeros(k_tile.shape, _F32)
    # Causal: query tiles j..N-1 only.
    dq, dk, dv = jax.lax.fori_loop(j, tiles, query_tile, (dq, zeros, zeros))
    return dq, (dk, dv)

  dq, (dk_N, dv_N) = jax.lax.scan(key_tile, jnp.zeros(q.shape, _F32),
                                  jnp.arange(tiles))
  dk = jnp.moveaxis(dk_N, 0, 2).reshape(k.shape)
  dv = jnp.moveaxis(dv_N, 0, 2).reshape(v.shape)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
