"""Block sizes for the TPU kernels: alignment, VMEM budget, padding.

TPU vector registers are 8 sublanes x 128 lanes of 32 bits, so a kernel block's
last two dimensions must be multiples of (8, 128) (int8 blocks: (32, 128)). A
block that does not fit the scoped VMEM budget fails deep inside the Mosaic
compiler; checking the budget here turns that into a clear error up front.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

LANES = 128
SUBLANES = 8
INT8_SUBLANES = 32
# Scoped VMEM each kernel asks for. Every TPU since v4 has at least 32 MiB of
# VMEM per core (v5e/v6e 128 MiB, v5p 95 MiB, v4 32 MiB).
VMEM_LIMIT_BYTES = 32 * 1024 * 1024


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def check_block(kernel: str, block_rows: int, block_cols: int,
                row_multiple: int, vmem_bytes: int) -> None:
  """Raises ValueError unless the block is aligned and fits the VMEM budget.

  Args:
    kernel: name for the message.
    block_rows, block_cols: the block's last two dimensions.
    row_multiple: the row alignment the block's dtypes need.
    vmem_bytes: VMEM the kernel needs at this block size (buffers and
      scratch), as computed by the kernel's own accounting.
  """
  if block_rows % row_multiple or block_cols % LANES:
    raise ValueError(
        f'{kernel}: block ({block_rows}, {block_cols}) is not a multiple of the'
        f' TPU tile ({row_multiple}, {LANES})')
  if vmem_bytes > VMEM_LIMIT_BYTES:
    raise ValueError(
        f'{kernel}: block ({block_rows}, {block_cols}) needs'
        f' {vmem_bytes / 2**20:.1f} MiB of VMEM (double-buffered inputs and'
        f' outputs plus scratch), over the {VMEM_LIMIT_BYTES / 2**20:.0f} MiB'
        ' budget; use a smaller block')


def fit_block(size: int, preferred: int, multiple: int) -> int:
  """The block length for an axis of `size`: `preferred`, or less if the axis
  is shorter (rounded up to the alignment `multiple`)."""
  return min(preferred, round_up(max(size, 1), multiple))


def pad_to(x, rows: int, cols: int, value=0):
  """Pads a 2-D array at the end of both axes to `[rows, cols]`."""
  pad_rows, pad_cols = rows - x.shape[0], cols - x.shape[1]
  if pad_rows == 0 and pad_cols == 0:
    return x
  return jnp.pad(x, ((0, pad_rows), (0, pad_cols)), constant_values=value)


def itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def nbytes(shape, dtype) -> int:
  return math.prod(shape) * itemsize(dtype)
