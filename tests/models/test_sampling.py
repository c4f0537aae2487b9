"""The sampling distribution against numpy, and mu_t against recomputation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import decoding
from sao_jax.models import model_config
from sao_jax.models import sampling
from sao_jax.models import transformer


def numpy_distribution(logits, temperature, top_k, top_p):
  """Brute force: scale, keep top-k, then the nucleus of what is left.

  Top-p acts on the renormalised top-k distribution (the order of Hugging
  Face's and vLLM's logits processors).
  """
  z = logits.astype(np.float64) / temperature
  keep = np.ones_like(z, bool)
  order = np.argsort(-z, kind='stable')
  if top_k:
    keep[order[top_k:]] = False
  probs = np.where(keep, np.exp(z - z.max()), 0.0)
  probs /= probs.sum()
  if top_p < 1:
    mass = 0.0
    for i, idx in enumerate(order):
      if mass >= top_p:
        keep[order[i:]] = False
        break
      mass += probs[idx]
  kept = np.where(keep, probs, 0.0)
  return kept / kept.sum()


@pytest.mark.parametrize('temperature, top_k, top_p', [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6),
    (0.5, 4, 0.8)])
def test_sampling_logprobs_match_numpy(temperature, top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(4, 9)).astype(np.float32) * 2
  params = sampling.SamplingParams(temperature, top_k, top_p)
  got = np.exp(np.asarray(sampling.sampling_logprobs(logits, params)))
  for row in range(4):
    np.testing.assert_allclose(got[row], numpy_distribution(
        logits[row], temperature, top_k, top_p), atol=1e-6)


def test_samples_follow_the_distribution_and_report_their_logprob():
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
  params = sampling.SamplingParams(1.0, 0, 0.9)  # drops the 0.05 token
  keys = jax.random.split(jax.random.key(0), 20000)
  tokens, logprobs = jax.vmap(lambda k: sampling.sample(k, logits, params))(keys)
  freq = np.bincount(np.asarray(tokens)[:, 0], minlength=4) / 20000
  np.testing.assert_allclose(freq, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
                             atol=0.015)
  expected = np.log(np.array([0.5, 0.3, 0.15, 1.0]) / 0.95)
  np.testing.assert_allclose(np.asarray(logprobs)[:, 0],
                             expected[np.asarray(tokens)[:, 0]], rtol=1e-5)


def test_greedy_takes_argmax():
  logits = np.array([[0.1, 2.0, -1.0], [3.0, 2.9, 0.0]], np.float32)
  tokens, logprobs = sampling.sample(jax.random.key(0), logits,
                                     sampling.SamplingParams(temperature=0))
  np.testing.assert_array_equal(tokens, [1, 0])
  np.testing.assert_allclose(logprobs, jax.nn.log_softmax(logits)[[0, 1], [1, 0]])


def test_bad_sampling_params_are_rejected():
  with pytest.raises(ValueError, match='top_p must be in'):
    sampling.SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match='temperature must be >= 0'):
    sampling.SamplingParams(temperature=-1.0)


def test_behaviour_logprobs_equal_learner_recomputation():
  cfg = model_config.ModelConfig('llama', 64, 32, 48, 2, 4, 2, 8)
  model = transformer.init_causal_lm(cfg, seed=3)
  params = sampling.SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
  outputs = decoding.generate(model, prompts, 12, params,
                              key=jax.random.key(4))
  for prompt, out in zip(prompts, outputs):
    sequence = jnp.array([prompt + out.tokens])
    logits = model(sequence)
    targets = sequence[:, 1:]
    recomputed = sampling.token_logprobs(logits[:, :-1], targets, params)
    np.testing.assert_allclose(np.asarray(recomputed)[0, len(prompt) - 1:],
                               out.logprobs, atol=1e-4)


@pytest.mark.parametrize('chunk_size', [0, 3, 4, 10])
@pytest.mark.parametrize('temperature, top_k', [(1.0, 0), (0.7, 3)])
def test_chunked_token_logprobs_match_numpy_with_gradients(
    chunk_size, temperature, top_k):
  # T = 10 positions: chunks of 3 pad the last chunk, 4 too, 10 is one chunk.
  rng = np.random.default_rng(1)
  hidden = rng.normal(size=(2, 10, 5)).astype(np.float32)
  head = rng.normal(size=(5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 10))
  params = sampling.SamplingParams(temperature, top_k, 1.0)
  if top_k:  # a target outside the top-k has log-prob -inf: keep it inside
    logits = hidden @ head / temperature
    targets = np.argsort(-logits, axis=-1)[..., rng.integers(0, top_k)]

  def loss(h, w):
    logp, entropy = sampling.chunked_token_logprobs(
        lambda x: x @ w, h, targets, params, chunk_size, with_entropy=True)
    return jnp.sum(logp * jnp.arange(10)) + jnp.sum(entropy), (logp, entropy)

  (_, (logp, entropy)), grads = jax.value_and_grad(
      loss, argnums=(0, 1), has_aux=True)(hidden, head)
  want_p = np.apply_along_axis(
      lambda row: numpy_distribution(row, temperature, top_k, 1.0), -1,
      hidden.astype(np.float64) @ head)
  np.testing.assert_allclose(
      logp, np.log(np.take_along_axis(want_p, targets[..., None], -1)[..., 0]),
      atol=1e-5)
  safe = np.where(want_p > 0, want_p, 1.0)
  np.testing.assert_allclose(entropy, -np.sum(want_p * np.log(safe), -1),
                             atol=1e-5)
  # Without the entropy, log-probs take the logsumexp path where nothing is
  # truncated: same values, and gradients equal the whole sequence's through
  # the log-softmax (chunk_size 0, with entropy).
  def logp_grad(chunk, entropy):
    return jax.grad(lambda h, w: jnp.sum(sampling.chunked_token_logprobs(
        lambda x: x @ w, h, targets, params, chunk, entropy)[0]
                                         * jnp.arange(10)), argnums=(0, 1))
  lean, _ = sampling.chunked_token_logprobs(lambda x: x @ head, hidden,
                                            targets, params, chunk_size)
  np.testing.assert_allclose(lean, logp, atol=1e-5)
  for a, b in zip(logp_grad(0, True)(hidden, head),
                  logp_grad(chunk_size, False)(hidden, head)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert all(np.all(np.isfinite(g)) for g in grads)
