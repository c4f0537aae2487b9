"""A text tokenizer for the policy: ids, special tokens and the chat template.

`Tokenizer` wraps a Rust `tokenizers.Tokenizer` and adds what generation and
prompt building need on top of raw ids: the BOS/EOS/pad ids, the set of ids that
end a generation, and the model's Jinja chat template rendered the way Hugging
Face renders it, so that a prompt built here tokenizes exactly like one built by
`transformers`.

It loads from a Hugging Face tokenizer directory (`tokenizer.json` and friends)
or from the metadata of a llama.cpp GGUF file, which carries no `tokenizer.json`
and has to be rebuilt from its vocabulary, merges and pre-tokenizer name. `save`
writes a Hugging Face directory, so a GGUF tokenizer can be handed to code that
only knows `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
from jinja2 import ext as jinja2_ext
from jinja2 import nodes as jinja2_nodes
from jinja2 import sandbox as jinja2_sandbox
import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import processors

# Tokens that end a turn or a document in common chat vocabularies. Chat models
# stop on them even where the configured EOS is another token (a base model's
# `<|endoftext|>` next to an instruct model's `<|im_end|>`), so generation must
# too or it runs on into an invented next turn.
_STOP_TOKENS = ('<|im_end|>', '<|endoftext|>', '<|eot_id|>', '<|eom_id|>',
                '<|end_of_text|>', '<end_of_turn>')

# llama.cpp's token types (`tokenizer.ggml.token_type`, enum llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# The GPT-2 split: contractions, letter runs, digit runs, other-symbol runs,
# each with at most one leading space, then whitespace runs that leave their
# last space to the word that follows.
_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
               r'|\s+(?!\S)|\s+')
# Llama 3 (tiktoken cl100k): case-insensitive contractions, numbers in groups
# of at most three digits, newlines kept apart from other whitespace.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r'|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)'
                 r'|\s+')
# Qwen2: the Llama 3 split with every digit on its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                r'|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+')

# `tokenizer.ggml.pre` -> (pre-tokenizer family, BPE ignore_merges). The names
# and their meaning are llama.cpp's (`llama_vocab::impl::load`, and the regex
# lists of `tokenizer_st_partition`'s caller in `llama-vocab.cpp`). 'smollm' is
# the StarCoder family: llama.cpp first isolates every `\p{N}` character, then
# applies the GPT-2 split to what is left, which is exactly what SmolLM2's own
# `tokenizer.json` does with `Digits(individual_digits=True)` followed by
# `ByteLevel(use_regex=True)`.
_GGUF_PRE_TOKENIZERS = {
    'gpt-2': ('gpt2', False),
    'phi-2': ('gpt2', False),
    'smollm': ('digits+gpt2', False),
    'starcoder': ('digits+gpt2', False),
    'refact': ('digits+gpt2', False),
    'codeshell': ('digits+gpt2', False),
    'llama3': ('llama3', True),
    'llama-v3': ('llama3', True),
    'llama-bpe': ('llama3', True),
    'qwen2': ('qwen2', False),
    'deepseek-r1-qwen': ('qwen2', False),
}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table of byte-level BPE vocabularies.

  Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls,
  space, ...) are moved to U+0100 onwards, so that every vocabulary entry is a
  plain printable string (a leading space shows as 'Ġ', a newline as 'Ċ').
  """
  printable = (list(range(ord('!'), ord('~') + 1)) +
               list(range(ord('¡'), ord('¬') + 1)) +
               list(range(ord('®'), ord('ÿ') + 1)))
  table = {b: chr(b) for b in printable}
  shift = 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + shift)
      shift += 1
  return table


def _byte_level_pre_tokenizer(family: str):
  """The `tokenizers` pre-tokenizer for a family of `_GGUF_PRE_TOKENIZERS`."""
  if family == 'gpt2':
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if family == 'digits+gpt2':
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
  split = {'llama3': _LLAMA3_SPLIT, 'qwen2': _QWEN2_SPLIT}[family]
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(split), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])


def gguf_metadata(reader, key: str, default: Any = KeyError) -> Any:
  """A GGUF metadata value as a Python object; `default` when absent.

  Without a default a missing key is a ValueError naming it: a GGUF that lacks
  a field a loader needs is a malformed or foreign file, not a code bug.
  """
  field = reader.fields.get(key)
  if field is None:
    if default is KeyError:
      raise ValueError(f'GGUF metadata field {key!r} is missing')
    return default
  return field.contents()


def _read_json(path: str) -> dict[str, Any]:
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _token_content(value: Any) -> str | None:
  """A special token from a HF config: a string or a serialized AddedToken."""
  if isinstance(value, dict):
    return value.get('content')
  return value


def _as_id_list(value: Any) -> list[int]:
  if value is None:
    return []
  if isinstance(value, int):
    return [value]
  return [int(v) for v in value]


def _raise_exception(message):
  raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
  # Jinja's own `tojson` escapes HTML characters (`<` becomes `\u003c`), which
  # would change what tool-calling templates render compared with Hugging Face.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2_ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` and renders the body.

  Hugging Face templates use the tag to mark assistant tokens for training
  masks; rendering needs only the body, but without the tag the template would
  not compile.
  """
  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2_nodes.CallBlock(
        self.call_method('_render'), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template in the environment Hugging Face renders it in.

  The template comes from a downloaded file, so it runs sandboxed. trim_blocks
  and lstrip_blocks change the rendered whitespace, and the globals and the
  tojson filter are ones templates call; all of them match
  `transformers.utils.chat_template_utils` so the prompts agree to the byte.
  """
  env = jinja2_sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2_ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  return env.from_string(source)


class Tokenizer:
  """Text <-> token ids, the special ids generation needs, and chat prompts.

  Attributes:
    backend: the wrapped `tokenizers.Tokenizer`.
    bos_token, eos_token, pad_token, unk_token: the special token strings (or
      None); the chat template sees them as `bos_token` etc.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *,
               bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None, unk_token: str | None = None,
               chat_template: str | None = None,
               extra_stop_ids: tuple[int, ...] = ()):
    """Wraps `backend`.

    Args:
      backend: a `tokenizers.Tokenizer` with its special tokens registered as
        added tokens, so that they are matched whole in text.
      bos_token: the BOS token string, or None if the model has none.
      eos_token: the EOS token string.
      pad_token: the padding token string.
      unk_token: the unknown token string.
      chat_template: the Jinja chat template, or None.
      extra_stop_ids: ids besides EOS that end a generation (from a
        `generation_config.json`); the well-known end-of-turn tokens of
        `_STOP_TOKENS` are added on top when the vocabulary has them.

    Raises:
      ValueError: a given special token is not in the vocabulary.
    """
    self.backend = backend
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.pad_token = pad_token
    self.unk_token = unk_token
    self._chat_template = chat_template
    self._compiled_template = None
    self._bos_id = self._token_id('bos_token', bos_token)
    self._eos_id = self._token_id('eos_token', eos_token)
    self._pad_id = self._token_id('pad_token', pad_token)
    stop = [self._eos_id] + [int(i) for i in extra_stop_ids]
    stop += [backend.token_to_id(t) for t in _STOP_TOKENS]
    # Ordered and unique, EOS first: callers may take stop_ids[0] as "the" end.
    self._stop_ids = tuple(dict.fromkeys(i for i in stop if i is not None))
    self._plain = None  # built on first use by _plain_backend

  def _token_id(self, name: str, token: str | None) -> int | None:
    if token is None:
      return None
    token_id = self.backend.token_to_id(token)
    if token_id is None:
      raise ValueError(f'{name} {token!r} is not in the vocabulary')
    return token_id

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included (may be < the embedding)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  @property
  def pad_id(self) -> int | None:
    return self._pad_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a generation: EOS first, then end-of-turn tokens."""
    return self._stop_ids

  @property
  def chat_template(self) -> str | None:
    return self._chat_template

  def encode(self, text: str, add_bos: bool = False,
             allow_special: bool = True) -> list[int]:
    """Token ids of `text`.

    Special tokens written in the text (e.g. `<|im_start|>`) become their ids,
    as in Hugging Face, which is what lets a rendered chat prompt be encoded.
    With `allow_special=False` they are tokenized as plain text instead: text
    from an environment (a tool result, a web page) must not be able to
    inject an end-of-turn or a fake role marker. Nothing is added around the
    text unless `add_bos` is set and the model has a BOS token.
    """
    backend = self.backend if allow_special else self._plain_backend()
    ids = backend.encode(text, add_special_tokens=False).ids
    if add_bos and self._bos_id is not None:
      ids = [self._bos_id] + ids
    return ids

  def _plain_backend(self) -> tokenizers.Tokenizer:
    """A copy of the backend that splits special-token strings as text."""
    if self._plain is None:
      plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
      plain.encode_special_tokens = True
      self._plain = plain
    return self._plain

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    """The text of `ids` (a list or 1-D array of ints)."""
    return self.backend.decode([int(i) for i in ids],
                               skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, Any]],
                          add_generation_prompt: bool = True,
                          **template_kwargs) -> str:
    """Renders a conversation with the model's chat template.

    Args:
      messages: `[{'role': ..., 'content': ...}, ...]`. Keys whose value is None
        are dropped first, as Hugging Face does, since templates test for a
        key's presence.
      add_generation_prompt: end with the header of an assistant turn, so that
        the model's continuation is the reply.
      **template_kwargs: further template variables (e.g. `tools`).

    Returns:
      The prompt text, byte-identical to `transformers`'
      `apply_chat_template(..., tokenize=False)`.

    Raises:
      ValueError: the model has no chat template.
      jinja2.TemplateError: the template rejected the conversation (its
        `raise_exception`).
    """
    if self._chat_template is None:
      raise ValueError(
          'this tokenizer has no chat template (no chat_template in its'
          ' tokenizer_config.json / chat_template.jinja, or no'
          ' tokenizer.chat_template in the GGUF); it is probably a base model')
    if self._compiled_template is None:
      self._compiled_template = _compile_chat_template(self._chat_template)
    messages = [{k: v for k, v in m.items() if v is not None}
                for m in messages]
    special = {name: getattr(self, name) for name in
               ('bos_token', 'eos_token', 'pad_token', 'unk_token')
               if getattr(self, name) is not None}
    return self._compiled_template.render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        **special, **template_kwargs)

  def encode_chat(self, messages: list[dict[str, Any]],
                  add_generation_prompt: bool = True,
                  **template_kwargs) -> list[int]:
    """Ids of the rendered conversation; the template writes its own markers."""
    return self.encode(self.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt,
        **template_kwargs))

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
    """Loads a Hugging Face tokenizer directory (fast tokenizers only).

    Reads `tokenizer.json`, then `tokenizer_config.json` for the special token
    strings and the chat template (`chat_template.jinja`, which newer
    `transformers` write instead, wins when present); `special_tokens_map.json`
    fills special tokens the config lacks, and `generation_config.json` adds
    its EOS ids to `stop_ids` (and supplies BOS/EOS when no config names them).

    Raises:
      FileNotFoundError: there is no `tokenizer.json` (a slow-only tokenizer).
    """
    path = os.fspath(path)
    json_path = os.path.join(path, 'tokenizer.json')
    if not os.path.exists(json_path):
      raise FileNotFoundError(
          f'{json_path} not found: only fast (tokenizer.json) tokenizers are'
          ' supported')
    backend = tokenizers.Tokenizer.from_file(json_path)

    def optional_json(name):
      file = os.path.join(path, name)
      return _read_json(file) if os.path.exists(file) else {}

    config = optional_json('tokenizer_config.json')
    special_map = optional_json('special_tokens_map.json')
    generation = optional_json('generation_config.json')

    special = {}
    for name in ('bos_token', 'eos_token', 'pad_token', 'unk_token'):
      special[name] = (_token_content(config.get(name)) or
                       _token_content(special_map.get(name)))
    gen_bos = _as_id_list(generation.get('bos_token_id'))
    gen_eos = _as_id_list(generation.get('eos_token_id'))
    if special['bos_token'] is None and gen_bos:
      special['bos_token'] = backend.id_to_token(gen_bos[0])
    if special['eos_token'] is None and gen_eos:
      special['eos_token'] = backend.id_to_token(gen_eos[0])

    template = config.get('chat_template')
    if isinstance(template, list):
      # The older multi-template form: [{'name': ..., 'template': ...}, ...].
      named = {t['name']: t['template'] for t in template}
      template = named.get('default')
    jinja_path = os.path.join(path, 'chat_template.jinja')
    if os.path.exists(jinja_path):
      with open(jinja_path, encoding='utf-8') as f:
        template = f.read()
    return cls(backend, chat_template=template, extra_stop_ids=tuple(gen_eos),
               **special)

  @classmethod
  def from_gguf(cls, reader_or_path) -> Tokenizer:
    """Rebuilds the byte-level BPE tokenizer described by a GGUF's metadata.

    A GGUF has no `tokenizer.json`; llama.cpp stores the vocabulary, merges,
    token types and special ids under `tokenizer.ggml.*`, and names the
    pre-tokenizer (`tokenizer.ggml.pre`) instead of describing it. The name is
    mapped to the pre-tokenizer llama.cpp runs for it (see
    `_GGUF_PRE_TOKENIZERS`); control and user-defined tokens become added
    tokens, so that they are matched whole in text.

    Args:
      reader_or_path: a `gguf.GGUFReader` or the path of a .gguf file.

    Raises:
      ValueError: the tokenizer model (`tokenizer.ggml.model`) is not 'gpt2'
        (byte-level BPE), the pre-tokenizer (`tokenizer.ggml.pre`) is unknown,
        or a required field is missing or malformed.
    """
    if isinstance(reader_or_path, (str, os.PathLike)):
      import gguf  # pylint: disable=g-import-not-at-top
      reader = gguf.GGUFReader(os.fspath(reader_or_path))
    else:
      reader = reader_or_path

    kind = gguf_metadata(reader, 'tokenizer.ggml.model')
    if kind != 'gpt2':
      raise ValueError(
          f'unsupported GGUF tokenizer.ggml.model {kind!r}: only \'gpt2\''
          ' (byte-level BPE) is supported')
    pre = gguf_metadata(reader, 'tokenizer.ggml.pre', None)
    if pre not in _GGUF_PRE_TOKENIZERS:
      raise ValueError(
          f'unsupported GGUF tokenizer.ggml.pre {pre!r}; supported:'
          f' {sorted(_GGUF_PRE_TOKENIZERS)}')
    family, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]

    tokens = list(gguf_metadata(reader, 'tokenizer.ggml.tokens'))
    token_types = list(gguf_metadata(reader, 'tokenizer.ggml.token_type',
                                   [1] * len(tokens)))
    merges = []
    for merge in gguf_metadata(reader, 'tokenizer.ggml.merges'):
      parts = merge.split(' ')
      if len(parts) != 2:
        raise ValueError(
            f'malformed GGUF tokenizer.ggml.merges entry {merge!r}')
      merges.append((parts[0], parts[1]))

    # Normal tokens are stored in the byte alphabet already; one that is not
    # is re-spelled so that BPE can reach it. Control and user-defined tokens
    # are matched as raw text by the added-token pass, so they keep their text.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    added = []
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
      if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED):
        added.append(tokenizers.AddedToken(
            token, special=token_type == _TOKEN_TYPE_CONTROL,
            normalized=False))
      elif not set(token) <= alphabet:
        token = ''.join(spelling[b] for b in token.encode('utf-8'))
      vocab.setdefault(token, index)
      tokens[index] = token

    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
        ignore_merges=ignore_merges))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(family)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Each added token's content is already in the vocabulary, so registering
    # it reuses that id rather than appending a new one.
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])

    def special(key):
      token_id = gguf_metadata(reader, f'tokenizer.ggml.{key}', None)
      if token_id is None:
        return None
      if not 0 <= token_id < len(tokens):
        raise ValueError(f'GGUF tokenizer.ggml.{key} = {token_id} is outside'
                         f' the vocabulary of {len(tokens)} tokens')
      return tokens[token_id]

    return cls(backend,
               bos_token=special('bos_token_id'),
               eos_token=special('eos_token_id'),
               pad_token=special('padding_token_id'),
               unk_token=special('unknown_token_id'),
               chat_template=gguf_metadata(reader, 'tokenizer.chat_template',
                                         None))

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes a Hugging Face tokenizer directory.

    `tokenizer.json` holds the pipeline and vocabulary; `tokenizer_config.json`
    the special token strings and chat template. Both `from_hf_dir` and
    `transformers.AutoTokenizer.from_pretrained` load the result. Extra stop
    ids that came from a `generation_config.json` are not written (that file
    belongs to the model); the well-known end-of-turn tokens are re-derived.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    self.backend.save(os.path.join(path, 'tokenizer.json'))
    config = {
        # The generic fast-tokenizer class: the pipeline is all in
        # tokenizer.json, and a model-specific class could rebuild it.
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'add_bos_token': False,
        'add_eos_token': False,
        # Decoding must give back the text, not a "cleaned" variant of it.
        'clean_up_tokenization_spaces': False,
    }
    for name in ('bos_token', 'eos_token', 'pad_token', 'unk_token'):
      if getattr(self, name) is not None:
        config[name] = getattr(self, name)
    if self._chat_template is not None:
      config['chat_template'] = self._chat_template
    with open(os.path.join(path, 'tokenizer_config.json'), 'w',
              encoding='utf-8') as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
      f.write('\n')
