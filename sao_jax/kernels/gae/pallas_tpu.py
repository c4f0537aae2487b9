"""Skip-observation GAE as a Pallas TPU kernel (definition: `reference`).

Layout. Inputs arrive as `[B, T]` (batch on sublanes, time on lanes). A
recurrence along lanes would walk one lane at a time, so each block is
transposed in VMEM to `[T, B]`: time on sublanes, 128 trajectories on the
lanes of every vector register. The grid is (batch blocks, time blocks), time
walked right to left, with the recurrence carry kept in VMEM scratch between
time blocks.

The recurrence as two affine scans. Walking backwards, let nv_t be the value of
the first action token at or after t and na_t its advantage. Both follow
`x_t = b_t + a_t * x_{t+1}`:

  nv: a = 1 - m_t,                  b = m_t * V_t
  na: a = m_t ? gamma*lam : 1,      b = m_t ? delta_t : 0,
      delta_t = r_t + gamma * nv_{t+1} - V_t

(a non-action token passes the carry through: that is the skip over
observations). The last token of a trajectory (marked in the mask: packed
rows hold several) has a = 0 and nv_{t+1} = 0: nothing carries from one
trajectory into the one before it. Each 8-row tile (one vreg of time steps) is solved with a
3-step log-depth scan of (a, b) pairs built from sublane rolls, then joined to
the carry from the tile after it; tiles are walked in reverse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sao_jax.kernels import tiling

_F32 = jnp.float32
DEFAULT_BLOCK_B = 128
DEFAULT_BLOCK_T = 512
_TILE = tiling.SUBLANES


def _reverse_affine_scan(a, b):
  """Composes `x_t = b_t + a_t x_{t+1}` over a tile's rows, last row first.

  Returns `(A, B)` with `x_t = B_t + A_t * x_in`, x_in the value after the
  tile's last row. Rows past the end act as the identity (a = 1, b = 0).
  """
  rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
  n = a.shape[0]
  shift = 1
  while shift < n:
    inside = rows + shift < n
    # roll by n - shift brings row t + shift to row t.
    a_later = jnp.where(inside, pltpu.roll(a, n - shift, 0), 1.0)
    b_later = jnp.where(inside, pltpu.roll(b, n - shift, 0), 0.0)
    b = b + a * b_later
    a = a * a_later
    shift *= 2
  return a, b


def _gae_kernel(gamma_ref, lam_ref, rewards_ref, values_ref, mask_ref,
                adv_ref, ret_ref,
                rewards_s, values_s, mask_s, adv_s, ret_s,
                next_value_s, next_adv_s, *lam_s, per_token_lam):
  block_t, block_b = rewards_s.shape
  num_tiles = block_t // _TILE

  @pl.when(pl.program_id(1) == 0)
  def _reset_carry():  # the first time block processed is the row's last
    next_value_s[...] = jnp.zeros_like(next_value_s)
    next_adv_s[...] = jnp.zeros_like(next_adv_s)

  rewards_s[...] = rewards_ref[...].astype(_F32).T
  values_s[...] = values_ref[...].astype(_F32).T
  # int8 compares are not supported on every TPU generation: widen first.
  mask_s[...] = mask_ref[...].astype(_F32).T
  gamma = gamma_ref[0]
  if per_token_lam:
    lam_s[0][...] = lam_ref[...].astype(_F32).T
  else:
    gamma_lam_row = jnp.broadcast_to(gamma * lam_ref[...], (_TILE, block_b))

  def tile(i, carry):
    value_in, adv_in = carry  # V and A of the first action after this tile
    rows = pl.ds(pl.multiple_of((num_tiles - 1 - i) * _TILE, _TILE), _TILE)
    reward, value = rewards_s[rows, :], values_s[rows, :]
    code = mask_s[rows, :]  # action + 2 * (last token of its segment)
    is_end = code >= 2.0
    is_action = jnp.where(is_end, code - 2.0, code) > 0
    gamma_lam = gamma * lam_s[0][rows, :] if per_token_lam else gamma_lam_row
    # A segment's last token takes nothing from the token after it.
    a, b = _reverse_affine_scan(jnp.where(is_action | is_end, 0.0, 1.0),
                                jnp.where(is_action, value, 0.0))
    value_at = b + a * value_in  # V of the first action at or after t
    row = jax.lax.broadcasted_iota(jnp.int32, value_at.shape, 0)
    value_next = jnp.where(row < _TILE - 1,
                           pltpu.roll(value_at, _TILE - 1, 0), value_in)
    value_next = jnp.where(is_end, 0.0, value_next)
    delta = reward + gamma * value_next - value
    a, b = _reverse_affine_scan(
        jnp.where(is_end, 0.0, jnp.where(is_action, gamma_lam, 1.0)),
        jnp.where(is_action, delta, 0.0))
    adv_at = b + a * adv_in
    adv = jnp.where(is_action, adv_at, 0.0)
    adv_s[rows, :] = adv
    ret_s[rows, :] = jnp.where(is_action, adv + value, 0.0)
    return (jnp.broadcast_to(value_at[0:1], value_at.shape),
            jnp.broadcast_to(adv_at[0:1], adv_at.shape))

  value_in, adv_in = jax.lax.fori_loop(
      0, num_tiles, tile, (next_value_s[...], next_adv_s[...]))
  next_value_s[...] = value_in
  next_adv_s[...] = adv_in
  adv_ref[...] = adv_s[...].T
  ret_ref[...] = ret_s[...].T


def vmem_bytes(block_b: int, block_t: int, in_dtype,
               per_token_lam: bool = False) -> int:
  """VMEM the kernel holds at one block size."""
  block = block_b * block_t
  lam = block * 4 if per_token_lam else block_b * 4
  buffers = 2 * (2 * block * tiling.itemsize(in_dtype) + block  # r, v, mask
                 + 2 * block * 4 + lam)  # adv, ret, lam
  scratch = (5 + per_token_lam) * block * 4 + 2 * _TILE * block_b * 4
  return buffers + scratch


def skip_observation_gae(rewards, values, mask_i8, gamma, lam, *,
                         block_b: int | None = None,
                         block_t: int | None = None,
                         interpret: bool = False):
  """Kernel entry: checked `[B, T]` inputs -> float32 (advantages, returns).

  Args:
    rewards, values: float `[B, T]` (f32 or bf16).
    mask_i8: int8 `[B, T]`: 1 on actions, plus 2 on the last token of each
      trajectory (where the recursion restarts: segments of packed rows);
      the row's own last token needs no mark.
    gamma: scalar.
    lam: float32 `[B]` (per row) or `[B, T]` (per token, one more input
      read: 4 bytes a token).
    block_b, block_t: block sizes (multiples of 128); defaults fit the input.
    interpret: run in Pallas interpret mode (off TPU).
  """
  batch, length = rewards.shape
  block_b = block_b or tiling.fit_block(batch, DEFAULT_BLOCK_B, tiling.LANES)
  block_t = block_t or tiling.fit_block(length, DEFAULT_BLOCK_T, tiling.LANES)
  # Trajectories land on lanes after the in-VMEM transpose: blocks of 128.
  if block_b % tiling.LANES:
    raise ValueError(f'gae kernel: block_b={block_b} must be a multiple of'
                     f' {tiling.LANES} (trajectories fill the lanes)')
  per_token_lam = lam.ndim == 2
  tiling.check_block('gae kernel', block_b, block_t, tiling.INT8_SUBLANES,
                     vmem_bytes(block_b, block_t, rewards.dtype,
                                per_token_lam))
  padded_b = tiling.round_up(batch, block_b)
  padded_t = tiling.round_up(length, block_t)
  num_t = padded_t // block_t

  def by_block(b, j):
    return (b, num_t - 1 - j)  # time blocks right to left

  block = pl.BlockSpec((block_b, block_t), by_block)
  out_shape = jax.ShapeDtypeStruct((padded_b, padded_t), _F32)
  scratch = [pltpu.VMEM((block_t, block_b), _F32)] * 5
  scratch += [pltpu.VMEM((_TILE, block_b), _F32)] * 2
  in_bytes = rewards.dtype.itemsize * 2 + 1
  if per_token_lam:
    scratch.append(pltpu.VMEM((block_t, block_b), _F32))
    lam_spec = block
    lam_in = tiling.pad_to(lam, padded_b, padded_t)
    in_bytes += 4
  else:
    lam_spec = pl.BlockSpec((1, block_b), lambda b, j: (0, b))
    lam_in = tiling.pad_to(lam[None, :], 1, padded_b)
  call = pl.pallas_call(
      functools.partial(_gae_kernel, per_token_lam=per_token_lam),
      out_shape=(out_shape, out_shape),
      grid=(padded_b // block_b, num_t),
      in_specs=[
          pl.BlockSpec(memory_space=pltpu.SMEM), lam_spec,
          block, block, block,
      ],
      out_specs=(block, block),
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary'),
          vmem_limit_bytes=tiling.VMEM_LIMIT_BYTES,
          allow_input_fusion=[False, True, True, True, True]),
      cost_estimate=pl.CostEstimate(
          flops=40 * padded_b * padded_t, transcendentals=0,
          bytes_accessed=(in_bytes + 8) * padded_b * padded_t),
      interpret=interpret,
  )
  pad = functools.partial(tiling.pad_to, rows=padded_b, cols=padded_t)
  adv, ret = call(
      jnp.reshape(jnp.asarray(gamma, _F32), (1,)), lam_in,
      pad(rewards), pad(values), pad(mask_i8))
  return adv[:batch, :length], ret[:batch, :length]
