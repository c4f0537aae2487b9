"""Configs: `get_config(arg)` shorthands, loading, checks, one-line errors.

Every recipe in `configs/` is a Python file with `get_config(arg=None)` returning
an `ml_collections.ConfigDict`. Entry points take it with absl flags,
big_vision style:

  python -m sao_jax.tools.show_config --config=configs/default.py:algorithm=grpo \
      --config.policy_loss.eps_low=0.2

The config is locked, so an override of a key that does not exist fails (with
the key it most likely meant), and `Checker` collects what is wrong with the
values into one error line naming the keys. What the values must be is each
component's own business: `sao_jax.recipe_checks.validate` asks every owner of
a section to check it, with a `Checker`. This module knows no component.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ml_collections
from absl import app
from absl import flags
from ml_collections import config_flags

from sao_jax import errors

DTYPES = ('float32', 'bfloat16')


class ConfigError(errors.UserError):
  """An invalid configuration; the message is one line naming the keys."""


#: What parsing a `--config` command line raises for a user's mistake.
PARSE_ERRORS = (flags.Error, AttributeError, KeyError, OSError, ConfigError)


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses a `get_config` argument `"k1=v1,k2=v2"` against typed defaults.

  Each value is converted to the type of its default (bool accepts
  true/false/1/0). An unknown key fails with the known ones listed.

  Args:
    arg: the text after the colon in `--config=file.py:arg`, or None.
    **defaults: every accepted key with its default value.

  Returns:
    A ConfigDict of all keys, overridden where `arg` says so.
  """
  values = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, sep, text = item.partition('=')
    key = key.strip()
    if not sep:
      raise ConfigError(f'config argument {item!r} is not key=value')
    if key not in defaults:
      raise ConfigError(f'unknown config argument {key!r}{did_you_mean(key, defaults)};'
                        f' known: {", ".join(sorted(defaults))}')
    values[key] = _convert(key, text.strip(), defaults[key])
  return ml_collections.ConfigDict(values)


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads `path.py[:arg]` the way the `--config` flag does (for tests, tools)."""
  path, _, arg = spec.partition(':')
  module = load_module(path)
  return module.get_config(arg or None)


def load_module(path: str):
  """Imports a config file by path (recipes use it to extend a sibling)."""
  if not os.path.isfile(path):
    raise ConfigError(f'config file {path!r} does not exist')
  name = 'sao_jax_config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def sibling(config_file: str, name: str) -> str:
  """Path of config file `name` next to `config_file` (usually `__file__`)."""
  return os.path.join(os.path.dirname(os.path.abspath(config_file)), name)


def write_config_file(config: ml_collections.ConfigDict, path: str) -> None:
  """Writes `config` as a recipe file (`get_config()` returning it as is).

  How a trainer hands the exact config, overrides included, to the rollout
  servers it starts: `--config=<path>`.
  """
  with open(path, 'w') as f:
    f.write('"""Written by sao_jax: the config of a training run."""\n\n'
            'import ml_collections\n\n\n'
            'def get_config(arg=None):\n'
            '  del arg\n'
            f'  return ml_collections.ConfigDict({config.to_dict()!r})\n')


def define_config_flag(name: str = 'config',
                       default: str | None = None) -> flags.FlagHolder:
  """`--config=file.py[:arg]` with locked `--config.a.b=value` overrides."""
  return config_flags.DEFINE_config_file(
      name, default, help_string='recipe file, e.g. configs/default.py[:arg]',
      lock_config=True)


def run(main: Callable[[Sequence[str]], None]) -> None:
  """`absl.app.run` whose user errors are one line on stderr and exit 2.

  Covers a missing or broken config file, an override of an unknown key, a
  value of the wrong type, and, raised from `main`: a `UserError` (such as
  `ConfigError` from `validate`), an `OSError` (a missing file, a workdir that
  is a file) and a `TimeoutError` (see `errors`). `--verbose` shows their
  tracebacks instead; any other exception is a bug and always keeps its
  traceback.
  """
  if 'verbose' not in flags.FLAGS:
    flags.DEFINE_boolean('verbose', False,
                         'show the traceback of an error instead of one line')

  def parse(argv):
    spec = _config_spec(argv)
    if spec is not None and not os.path.isfile(spec.partition(':')[0]):
      _fail(f'config file {spec.partition(":")[0]!r} does not exist')
    try:
      remaining = flags.FLAGS(argv)
      flags.FLAGS['config'].value.keys()  # A failed file load raises here.
      return remaining
    except PARSE_ERRORS as e:
      _fail(parse_message(e, argv))

  def guarded(argv):
    try:
      main(argv)
    except (errors.UserError, OSError, TimeoutError) as e:
      if flags.FLAGS.verbose:
        raise
      _fail(user_message(e))

  app.run(guarded, flags_parser=parse)


def parse_message(e: BaseException, argv: Sequence[str]) -> str:
  """The one line for an error (one of `PARSE_ERRORS`) of parsing the config
  command line `argv`, as `run` prints it after `error:`."""
  if isinstance(e, flags.Error):
    return _config_file_error(e) or str(e)
  if isinstance(e, (AttributeError, KeyError)):
    return _unknown_override(argv) or f'bad config override: {e}'
  return f'could not load the config: {_root_cause(e)}'


def user_message(e: BaseException) -> str:
  """The text after `error:` for an exception `run` reports without trace."""
  if isinstance(e, OSError) and e.filename is not None:
    where = f'{e.filename} -> {e.filename2}' if e.filename2 else e.filename
    return f'{where}: {e.strerror or type(e).__name__}'
  if isinstance(e, TimeoutError):
    return str(e) or 'timed out'
  return str(e) or type(e).__name__


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _config_file_error(e: BaseException) -> str | None:
  """The one-line message of a `ConfigError` raised inside `get_config`.

  ml_collections re-raises errors of `get_config` with the traceback pasted into
  the message; the user needs only its last line.
  """
  while e is not None and not isinstance(e, ConfigError):
    e = e.__cause__ or e.__context__
  if e is None:
    return None
  last = [line for line in str(e).splitlines() if line.strip()][-1]
  return last.split('ConfigError: ', 1)[-1]


def _root_cause(e: BaseException) -> str:
  while e.__cause__ is not None:
    e = e.__cause__
  return f'{type(e).__name__}: {e}'


def _unknown_override(argv: Sequence[str]) -> str | None:
  """Names the first `--config.x.y` override whose key the config lacks."""
  spec = _config_spec(argv)
  overrides = [item[len('--config.'):].split('=', 1)[0]
               for item in argv if item.startswith('--config.')]
  if spec is None:
    return None
  try:
    config = load_config(spec)
  except Exception:  # pylint: disable=broad-except  (reported by the caller)
    return None
  for path in overrides:
    node, walked = config, 'config'
    for part in path.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        return (f'unknown config key --config.{path}: {walked} has no field'
                f' {part!r}{suggest_key(config, path)}')
      node, walked = node[part], f'{walked}.{part}'
  return None


def suggest_key(config: ml_collections.ConfigDict, path: str) -> str:
  """`' (did you mean ...?)'` for a dotted `path` that `config` lacks.

  A key that moved to another section (`task.num_terms` became
  `task.arith_chain_sum.num_terms`, `task.humaneval_max_turns` became
  `task.humaneval.max_turns`) is found by its name; otherwise the closest
  name in the same section, then the closest whole path.
  """
  leaves = list(_paths(config))
  name = path.rsplit('.', 1)[-1]
  flat = path.replace('.', '_')
  moved = ([leaf for leaf in leaves if leaf.rsplit('.', 1)[-1] == name]
           or [leaf for leaf in leaves
               if leaf.replace('.', '_').endswith(flat)])
  if moved:
    return ' (did you mean ' + ' or '.join(f'--config.{m}' for m in moved) + '?)'
  parent = path.rpartition('.')[0]
  siblings = [leaf.rsplit('.', 1)[-1] for leaf in leaves
              if leaf.rpartition('.')[0] == parent]
  close = difflib.get_close_matches(name, siblings, n=1)
  if close:
    return f' (did you mean {close[0]!r}?)'
  close = difflib.get_close_matches(path, leaves, n=1, cutoff=0.8)
  return f' (did you mean --config.{close[0]}?)' if close else ''


def _paths(node: ml_collections.ConfigDict, prefix: str = '') -> Iterable[str]:
  """The dotted paths of every key under `node`, sections included."""
  for key, value in node.items():
    yield prefix + key
    if isinstance(value, ml_collections.ConfigDict):
      yield from _paths(value, f'{prefix}{key}.')


def _config_spec(argv: Sequence[str]) -> str | None:
  """The `path[:arg]` value of `--config` in `argv`, if given."""
  spec = None
  for i, item in enumerate(argv):
    if item.startswith('--config='):
      spec = item.split('=', 1)[1]
    elif item == '--config' and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def did_you_mean(key: str, known) -> str:
  """`' (did you mean ...?)'` naming the closest of `known`, or ''."""
  close = difflib.get_close_matches(key, [str(k) for k in known], n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''


def apply_presets(config: ml_collections.ConfigDict,
                  presets: Mapping[str, Any]) -> None:
  """Sets each dotted key of `presets` in `config` (an algorithm's preset).

  Raises:
    ConfigError: for a key the config does not have, naming it.
  """
  for key, value in presets.items():
    *parents, leaf = key.split('.')
    node = config
    try:
      for part in parents:
        node = node[part]
      node[leaf]  # pylint: disable=pointless-statement  (the key must exist)
    except (KeyError, AttributeError):
      raise ConfigError(f'preset of unknown config key {key!r}'
                        f'{suggest_key(config, key)}') from None
    node[leaf] = value


def set_from_text(config: ml_collections.ConfigDict, key: str,
                  text: str) -> None:
  """Sets dotted `key` from command-line `text`, typed like its present value.

  For scripts that take `key=value` overrides outside absl flags (the
  benchmarks); an unknown key raises ConfigError naming it.
  """
  node = config
  *parents, leaf = key.split('.')
  try:
    for part in parents:
      node = node[part]
    default = node[leaf]
  except (KeyError, AttributeError):
    raise ConfigError(f'unknown config key {key!r}') from None
  node[leaf] = _convert(key, text, default)


def _convert(key: str, text: str, default):
  try:
    if isinstance(default, bool):
      if text.lower() in ('true', '1', 'yes'):
        return True
      if text.lower() in ('false', '0', 'no'):
        return False
      raise ValueError(text)
    if isinstance(default, int):
      return int(text)
    if isinstance(default, float):
      return float(text)
  except ValueError:
    raise ConfigError(f'config argument {key}={text!r}: expected a'
                      f' {type(default).__name__}') from None
  return text


class Checker:
  """Reads dotted config keys and records one problem per bad key.

  The owner of a config section checks it with one of these: each method
  reads a key, records a problem naming it when the value is wrong, and
  returns the value (None when it was wrong or missing), so that checks of
  related keys can go on with good values only. `scope('task.calculator')`
  checks a section by its own key names while problems keep the full path.
  """

  def __init__(self, config: ml_collections.ConfigDict,
               problems: list[str] | None = None, prefix: str = ''):
    self.config = config
    self.problems = [] if problems is None else problems
    self._prefix = prefix

  def scope(self, section: str) -> Checker:
    """A checker of the keys under `section` (a dotted path)."""
    return Checker(self.config, self.problems,
                   f'{self._prefix}{section}.')

  def name(self, key: str) -> str:
    """`config.<section>.<key>`, the way problems name a key."""
    return f'config.{self._prefix}{key}'

  def problem(self, message: str) -> None:
    """Records a problem the methods below do not express."""
    self.problems.append(message)

  def raise_if_any(self) -> None:
    """Raises one `ConfigError` listing every problem recorded."""
    if self.problems:
      # Two owners reading the same missing key record it once each.
      raise ConfigError('invalid config: '
                        + '; '.join(dict.fromkeys(self.problems)))

  def get(self, key):
    key = self._prefix + key
    node = self.config
    for part in key.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        self.problems.append(f'config.{key} is missing')
        return None
      node = node[part]
    return node

  def _number(self, key, integer=False):
    value = self.get(key)
    if value is None:
      return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
      kind = 'an integer' if integer else 'a number'
      self.problems.append(f'config.{self._prefix}{key}={value!r} must be'
                           f' {kind}')
      return None
    return value

  def _require(self, key, ok, text, integer=False):
    value = self._number(key, integer)
    if value is not None and not ok(value):
      self.problems.append(f'config.{self._prefix}{key}={value} must be {text}')
      return None
    return value

  def choice(self, key, options):
    options = tuple(options)
    value = self.get(key)
    if value is not None and value not in options:
      self.problems.append(
          f'config.{self._prefix}{key}={value!r} is not one of'
          f' {", ".join(map(str, options))}{did_you_mean(str(value), options)}')
      return None
    return value
  def open_interval(self, key, lo, hi):
    return self._require(key, lambda v: lo < v < hi, f'in ({lo}, {hi})')

  def closed_interval(self, key, lo, hi):
    return self._require(key, lambda v: lo <= v <= hi, f'in [{lo}, {hi}]')

  def positive(self, key):
    return self._require(key, lambda v: v > 0, 'positive')

  def non_negative(self, key):
    return self._require(key, lambda v: v >= 0, '>= 0')

  def positive_int(self, key):
    return self._require(key, lambda v: v >= 1, '>= 1', integer=True)

  def non_negative_int(self, key):
    return self._require(key, lambda v: v >= 0, '>= 0', integer=True)
