"""Named architectures against the parameter counts their publishers give."""

import math

import pytest
from flax import nnx

from sao_jax.models import architectures
from sao_jax.models import pretrained

# (total, without the input embedding), as the model cards state them:
# exact where the card (or its safetensors index) gives the count, else to
# the digits given (Qwen3's cards: 0.6B / 0.44B non-embedding, 8.2B / 6.95B,
# 30.5B / 29.9B).
PUBLISHED = {
    'smollm2-135m': ((134_515_008, 0),),
    'llama3.2-1b': ((1_235_814_400, 0),),
    'llama3.1-8b': ((8_030_261_248, 0),),
    'qwen2.5-1.5b': ((1_543_714_304, 0),),
    'qwen2.5-7b': ((7_615_616_512, 0),),
    'qwen3-0.6b': ((0.6e9, 0.05e9), (0.44e9, 0.005e9)),
    'qwen3-8b': ((8.2e9, 0.05e9), (6.95e9, 0.005e9)),
    'qwen3-30b-a3b': ((30.5e9, 0.05e9), (29.9e9, 0.05e9)),
}


def _counts(name):
  model = pretrained.abstract_model(f'arch:{name}')
  state = nnx.state(model, nnx.Param)
  sizes = {'/'.join(map(str, path)): math.prod(var.shape)
           for path, var in nnx.to_flat_state(state)}
  total = sum(sizes.values())
  # "Non-embedding" leaves out an untied LM head too.
  return total, total - sizes['decoder/embed'] - sizes.get('lm_head', 0)


@pytest.mark.parametrize('name', sorted(architectures.ARCHITECTURES))
def test_parameter_counts_match_the_model_cards(name):
  got = _counts(name)
  for value, (want, tolerance) in zip(got, PUBLISHED[name]):
    assert abs(value - want) <= tolerance, (name, got)


def test_every_architecture_has_a_published_count():
  assert set(PUBLISHED) == set(architectures.ARCHITECTURES)
