"""How a generation step travels in JetStream's `token_ids`, for both sides.

SAO needs, per sampled token, the behaviour log-prob mu_t and the policy
version that sampled it; JetStream's protocol carries only token ids. The
engine therefore streams each step of a token-content request as columns of
int32 ids, `[token, float32 bits of mu_t, version] * k` (k samples of a slot),
and the client splits them again with `decode_step`. Both import the layout
from here; this module imports neither JAX nor JetStream, so the client does
not either.

An MoE engine appends, per sample, the experts it routed the token to
(`RoutingLayout`: each layer's k ids, layer by layer, packed 4 (or 2, past
256 experts) to a column), so that the learner can replay them.

A prompt longer than the server's `max_prefill_length` (which JetStream would
truncate silently) is answered with one step whose version is
`PROMPT_TOO_LONG`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Column of each value in a streamed step, and how many there are.
TOKEN, LOGPROB_BITS, VERSION = range(3)
NUM_COLUMNS = 3
# Version column value when a prompt did not fit max_prefill_length.
PROMPT_TOO_LONG = -2


@dataclasses.dataclass(frozen=True)
class RoutingLayout:
  """How an MoE engine's routing record of one token travels.

  Attributes:
    ids_per_token: R = layers x experts per token (0: a dense model, no
      record).
    num_experts: E, the experts of each layer (0: a dense model).
  """
  ids_per_token: int = 0
  num_experts: int = 0

  @classmethod
  def for_model(cls, num_layers: int, experts_per_token: int,
                num_experts: int) -> 'RoutingLayout':
    if not num_experts:
      return cls()
    # Records are int16 from here to the batch (-1: not recorded).
    if num_experts > 2**15:
      raise ValueError(f'{num_experts} experts do not fit a routing record')
    return cls(num_layers * experts_per_token, num_experts)

  @classmethod
  def for_config(cls, cfg) -> 'RoutingLayout':
    """The layout of a `models.model_config.ModelConfig`'s records."""
    return cls.for_model(cfg.num_layers, cfg.num_experts_per_tok,
                         cfg.num_experts)

  @property
  def bits_per_id(self) -> int:
    """8 for up to 256 experts, 16 beyond."""
    return 8 if self.num_experts <= 2**8 else 16

  @property
  def ids_per_column(self) -> int:
    return 32 // self.bits_per_id

  @property
  def columns(self) -> int:
    """int32 columns the record takes after `[token, bits, version]`."""
    return -(-self.ids_per_token // self.ids_per_column)

  @property
  def width(self) -> int:
    """Columns of one sample's step."""
    return NUM_COLUMNS + self.columns

  def unpack(self, columns_KxC) -> np.ndarray:
    """int16 `[K, R]` expert ids from the packed `[K, columns]` int32s
    (id j of a column in its bits `[j * bits, (j + 1) * bits)`)."""
    words_KxC = np.asarray(columns_KxC, np.int32).view(np.uint32)
    shifts_J = np.arange(self.ids_per_column, dtype=np.uint32) * np.uint32(
        self.bits_per_id)
    ids = (words_KxC[..., None] >> shifts_J) & np.uint32(
        (1 << self.bits_per_id) - 1)
    return ids.reshape(len(words_KxC), -1)[:, :self.ids_per_token].astype(
        np.int16)


def decode_step(ids: Sequence[int], routing: RoutingLayout = RoutingLayout()):
  """Splits streamed steps `[token, bits, version, record...] * k`.

  Returns:
    The k tokens, their log-probs mu_t, their policy versions, and their
    routing records (int16 `[k, R]`; None for a dense model).
  """
  ids_KxW = np.asarray(ids, np.int32).reshape(-1, routing.width)
  logprobs_K = ids_KxW[:, LOGPROB_BITS].copy().view(np.float32)
  experts_KxR = (routing.unpack(ids_KxW[:, NUM_COLUMNS:])
                 if routing.ids_per_token else None)
  return (ids_KxW[:, TOKEN].tolist(), logprobs_K.tolist(),
          ids_KxW[:, VERSION].tolist(), experts_KxR)
