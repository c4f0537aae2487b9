"""A tiny random Llama (or Qwen3-MoE) with a word-level tokenizer, for tests
and quick runs.

Words `w0 .. wN` are the vocabulary; `<|im_start|>` / `<|im_end|>` are special
tokens and `<|im_end|>` is the EOS, so chat prompts, stop tokens and the rollout
path behave as with a real chat model, at a size that compiles and runs in
seconds on a CPU. `with_stop=False` renames the markers and drops the EOS, so
every generation runs to its token budget (deterministic lengths for
throughput and timing measurements).
"""

from __future__ import annotations

import tokenizers

from sao_jax.models import model_config
from sao_jax.models import tokenizer as tokenizer_lib
from sao_jax.models import transformer

VOCAB = 64
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


def make(seed: int = 0, with_stop: bool = True, vocab: int = VOCAB,
         hidden: int = 32, layers: int = 2, experts: int = 0):
  """`(model, tokenizer)`: a random tiny Llama and its word-level tokenizer.

  With `experts` > 0 the model is a Qwen3-MoE of the same shape (q/k norms,
  `experts` routed experts of width `hidden`, two per token).
  """
  start, end = (('<|im_start|>', '<|im_end|>') if with_stop
                else ('<|s|>', '<|e|>'))
  specials = ['<unk>', start, end]
  words = {t: i for i, t in enumerate(specials)}
  for i in range(vocab - len(specials)):
    words[f'w{i}'] = len(words)
  backend = tokenizers.Tokenizer(
      tokenizers.models.WordLevel(words, unk_token='<unk>'))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.decoder = tokenizers.decoders.WordPiece()  # joins words by spaces
  backend.add_special_tokens(specials)
  template = _CHAT_TEMPLATE.replace('<|im_start|>', start).replace(
      '<|im_end|>', end)
  tok = tokenizer_lib.Tokenizer(backend, eos_token=end if with_stop else None,
                                pad_token='<unk>', unk_token='<unk>',
                                chat_template=template)
  moe = dict(qk_norm=True, num_experts=experts, num_experts_per_tok=2,
             moe_intermediate_size=hidden, norm_topk_prob=True) if experts \
      else {}
  cfg = model_config.ModelConfig(
      'qwen3_moe' if experts else 'llama', vocab, hidden, 2 * hidden, layers,
      4, 2, hidden // 4, eos_token_id=words[end] if with_stop else None,
      **moe)
  return transformer.init_causal_lm(cfg, seed=seed), tok

