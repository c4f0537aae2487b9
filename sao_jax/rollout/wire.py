"""How a generation step travels in JetStream's `token_ids`, for both sides.

SAO needs, per sampled token, the behaviour log-prob mu_t and the policy
version that sampled it; JetStream's protocol carries only token ids. The
engine therefore streams each step of a token-content request as columns of
int32 ids, `[token, float32 bits of mu_t, version] * k` (k samples of a slot),
and the client splits them again with `decode_step`. Both import the layout
from here; this module imports neither JAX nor JetStream, so the client does
not either.

A prompt longer than the server's `max_prefill_length` (which JetStream would
truncate silently) is answered with one step whose version is
`PROMPT_TOO_LONG`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Column of each value in a streamed step, and how many there are.
TOKEN, LOGPROB_BITS, VERSION = range(3)
NUM_COLUMNS = 3
# Version column value when a prompt did not fit max_prefill_length.
PROMPT_TOO_LONG = -2


def decode_step(ids: Sequence[int]
                ) -> tuple[list[int], list[float], list[int]]:
  """Splits one streamed step `[token, bits, version] * k` into its parts.

  Returns:
    The k tokens, their log-probs mu_t and their policy versions.
  """
  ids_Kx3 = np.asarray(ids, np.int32).reshape(-1, NUM_COLUMNS)
  logprobs_K = ids_Kx3[:, LOGPROB_BITS].view(np.float32)
  return (ids_Kx3[:, TOKEN].tolist(), logprobs_K.tolist(),
          ids_Kx3[:, VERSION].tolist())
