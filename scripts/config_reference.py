r"""Writes docs/configuration.md, the reference of every config key.

  python scripts/config_reference.py           # (re)writes the page
  python scripts/config_reference.py --check   # exit 1 when it is stale

The page is generated from the recipe files, never edited by hand:

- every key of `configs/default.py` (flattened as `section.key`), its default
  from `get_config()`, and its meaning: an environment's options
  (`task.<name>.*`) from the help of their `EnvSpec` (`registry.meanings`),
  every other key from the comments of `configs/default.py`:
  the trailing `# ...` comment of the assignment, or the comment block right
  above it. Keys set in `ml_collections.ConfigDict(dict(key=value, ...))` take
  the trailing comment of their line (a comment ending a line of several keys
  belongs to the last of them), a comment line right above their line, or a
  line `#   key: meaning` in the comment block above the statement. Keys set in
  a `for` loop over a literal (the `optim.actor` / `optim.critic` optimisers)
  are expanded for each iteration;
- the paper symbol of a key, from `PAPER_SYMBOLS`;
- what each `algorithm=<name>` preset changes from SAO, by loading the recipe
  for every algorithm and diffing it against `algorithm=sao`;
- what each other recipe in `configs/` changes from `configs/default.py`.

The output depends on the config files only (no timestamps, stable order).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import os
import re
import sys
import tokenize
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections

from sao_jax import config_lib
from sao_jax.envs import registry
from sao_jax.rl import algorithms

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = 'configs'
DEFAULT_CONFIG = 'configs/default.py'
OUTPUT = 'docs/configuration.md'
REGENERATE = 'python scripts/config_reference.py'
STALE_MESSAGE = f'{OUTPUT} is out of date; run {REGENERATE}'

# Key -> the symbol SAO.md (and the paper) writes for it.
PAPER_SYMBOLS = {
    'batch_size': 'B',
    'group_size': 'G',
    'policy_loss.eps_low': 'epsilon_low',
    'policy_loss.eps_high': 'epsilon_high',
    'policy_loss.dual_clip': 'c (dual clip)',
    'policy_loss.behavior_kl_coef': 'beta (to mu)',
    'policy_loss.ref_kl_coef': 'beta (to pi_ref)',
    'policy_loss.behavior_weight_cap': 'C',
    'advantage.gamma': 'gamma',
    'advantage.alpha': 'alpha',
    'advantage.lam': 'lambda_policy (fixed)',
    'advantage.running_mean_window': 'W',
    'advantage.running_mean_global_window': 'W (global)',
    'optim.policy_epochs': 'E',
    'optim.policy_minibatches': 'M',
    'critic.steps_per_policy_step': 'K',
    'critic.lam': 'lambda_critic',
    'rollout.max_sequence_length': 'T',
}

# `#   key: meaning` in a comment block above a ConfigDict(dict(...)).
_KEY_LINE = re.compile(r'^ {2,}([A-Za-z_]\w*): (.+)$')


@dataclasses.dataclass
class Entry:
  """What the source says about one key (a leaf or a ConfigDict section)."""
  path: str
  section: bool
  meaning: str


class _Comments:
  """The comments of a source file by line: trailing ones and whole lines."""

  def __init__(self, source: str):
    self.trailing: dict[int, str] = {}
    self.whole: dict[int, str] = {}  # After '#', leading spaces kept.
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
      if token.type != tokenize.COMMENT:
        continue
      row, col = token.start
      text = token.string[1:]
      if lines[row - 1][:col].strip():
        self.trailing[row] = text.strip()
      else:
        self.whole[row] = text.rstrip()

  def block_above(self, lineno: int, stop: int = 0) -> list[str]:
    """The contiguous comment-only lines right above `lineno` (after `stop`)."""
    block = []
    row = lineno - 1
    while row > stop and row in self.whole:
      block.append(self.whole[row])
      row -= 1
    return block[::-1]


def _split_block(block: Sequence[str]) -> tuple[str, dict[str, str]]:
  """A comment block as (its prose, its `key: meaning` lines)."""
  prose, keys, current = [], {}, None
  for raw in block:
    match = _KEY_LINE.match(raw)
    indent = len(raw) - len(raw.lstrip())
    if match:
      current = match.group(1)
      keys[current] = match.group(2).strip()
    elif current is not None and indent > 3:
      keys[current] += ' ' + raw.strip()
    else:
      current = None
      prose.append(raw.strip())
  return _join(prose), keys


def _join(parts: Iterable[str], sep: str = ' ') -> str:
  return sep.join(p for p in (p.strip() for p in parts) if p)


class _Alias:
  """A local ConfigDict (`o = ml_collections.ConfigDict()`) before it is stored."""

  def __init__(self):
    self.entries: list[Entry] = []


def _is_configdict(node: ast.AST) -> bool:
  return (isinstance(node, ast.Call) and (
      (isinstance(node.func, ast.Attribute) and node.func.attr == 'ConfigDict')
      or (isinstance(node.func, ast.Name) and node.func.id == 'ConfigDict')))


def _dict_keywords(node: ast.Call) -> list[ast.keyword] | None:
  """The keywords of `ConfigDict(dict(k=v, ...))`, else None."""
  if (len(node.args) == 1 and isinstance(node.args[0], ast.Call)
      and isinstance(node.args[0].func, ast.Name)
      and node.args[0].func.id == 'dict'):
    return [k for k in node.args[0].keywords if k.arg is not None]
  return None


class _Parser:
  """Maps every assignment of `get_config` in a recipe file to its comment."""

  def __init__(self, source: str, root: str = 'c'):
    self.source = source
    self.comments = _Comments(source)
    self.root = root
    self.entries: dict[str, Entry] = {}

  def parse(self) -> dict[str, Entry]:
    tree = ast.parse(self.source)
    for node in tree.body:
      if isinstance(node, ast.FunctionDef) and node.name == 'get_config':
        self._walk(node.body, {})
    return self.entries

  def _walk(self, statements: Sequence[ast.stmt], env: dict[str, Any]):
    for statement in statements:
      if isinstance(statement, ast.For):
        try:
          items = ast.literal_eval(statement.iter)
        except ValueError:
          continue
        for item in items:
          inner = dict(env)
          self._bind(statement.target, item, inner)
          self._walk(statement.body, inner)
      elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        self._assign(statement, env)

  def _bind(self, target: ast.AST, value: Any, env: dict[str, Any]):
    if isinstance(target, ast.Name):
      env[target.id] = value
    elif isinstance(target, ast.Tuple):
      for t, v in zip(target.elts, value):
        self._bind(t, v, env)

  def _path(self, node: ast.AST, env: dict[str, Any]):
    """(holder, dotted parts) of an assignment target; holder None: the root."""
    if isinstance(node, ast.Name):
      if node.id == self.root:
        return None, ()
      if isinstance(env.get(node.id), _Alias):
        return env[node.id], ()
      return False
    if isinstance(node, ast.Attribute):
      parent = self._path(node.value, env)
      return parent and (parent[0], parent[1] + (node.attr,))
    if isinstance(node, ast.Subscript):
      parent = self._path(node.value, env)
      key = node.slice
      if isinstance(key, ast.Constant) and isinstance(key.value, str):
        name = key.value
      elif isinstance(key, ast.Name) and isinstance(env.get(key.id), str):
        name = env[key.id]
      else:
        return False
      return parent and (parent[0], parent[1] + (name,))
    return False

  def _assign(self, statement: ast.Assign, env: dict[str, Any]):
    target, value = statement.targets[0], statement.value
    if isinstance(target, ast.Name) and _is_configdict(value):
      env[target.id] = _Alias()
      return
    located = self._path(target, env)
    if not located or not located[1]:
      return
    holder, parts = located
    path = '.'.join(parts)
    if isinstance(value, ast.Name) and isinstance(env.get(value.id), _Alias):
      self._record(holder, Entry(path, True, ''))
      for entry in env[value.id].entries:
        self._record(holder, Entry(f'{path}.{entry.path}', entry.section,
                                   entry.meaning))
      return
    block = self.comments.block_above(statement.lineno)
    prose, key_lines = _split_block(block)
    if not _is_configdict(value):
      self._record(holder, Entry(path, False,
                                 self._leaf_meaning(statement, prose)))
      return
    keywords = _dict_keywords(value) or []
    claimed = set()
    for keyword in keywords:
      claimed.add(keyword.value.end_lineno)
    trailing = [self.comments.trailing.get(row, '')
                for row in range(statement.lineno, statement.end_lineno + 1)
                if row not in claimed]
    self._record(holder, Entry(path, True, _join([prose] + trailing)))
    for i, keyword in enumerate(keywords):
      end = keyword.value.end_lineno
      last_on_line = (i + 1 == len(keywords)
                      or keywords[i + 1].value.end_lineno != end)
      start = keyword.lineno
      first_on_line = i == 0 or keywords[i - 1].value.end_lineno != start
      inner = (self.comments.block_above(start, stop=statement.lineno - 1)
               if first_on_line and start > statement.lineno else [])
      meaning = _join([key_lines.get(keyword.arg, ''), _join(inner),
                       self.comments.trailing.get(end, '')
                       if last_on_line else ''], '; ')
      self._record(holder, Entry(f'{path}.{keyword.arg}', False, meaning))

  def _leaf_meaning(self, statement: ast.Assign, prose: str) -> str:
    rows = range(statement.lineno, statement.end_lineno + 1)
    trailing = _join(self.comments.trailing.get(row, '') for row in rows)
    # A sentence carried over two assignments: `# stop after ...` then
    # `# ... this much gain` belongs to both.
    after = self.comments.trailing.get(statement.end_lineno + 1, '')
    if trailing and after.startswith('...'):
      trailing = f'{trailing} {after}'
    if trailing.startswith('...'):
      before = self.comments.trailing.get(statement.lineno - 1, '')
      trailing = f'{before} {trailing}' if before else trailing[3:].strip()
    value = statement.value
    if (trailing.startswith('|') and isinstance(value, ast.Constant)
        and isinstance(value.value, str)):
      trailing = f'{value.value} {trailing}'  # `'x'  # | y | z`: x | y | z
    if prose and trailing:
      return f'{prose.rstrip(".")}: {trailing}'
    return prose or trailing

  def _record(self, holder, entry: Entry):
    if holder is None:
      self.entries[entry.path] = entry
    else:
      holder.entries.append(entry)


def parse_comments(path: str) -> dict[str, Entry]:
  """Key -> Entry for every assignment in `get_config` of the recipe `path`."""
  with open(path, encoding='utf-8') as f:
    return _Parser(f.read()).parse()


def flatten(config: ml_collections.ConfigDict, prefix: str = '') -> dict[str, Any]:
  """`{'section.key': value}` of every leaf (ConfigDict children included)."""
  flat = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if isinstance(value, ml_collections.ConfigDict):
      flat.update(flatten(value, name + '.'))
    else:
      flat[name] = value
  return flat


def _load(spec: str) -> ml_collections.ConfigDict:
  path, sep, arg = spec.partition(':')
  return config_lib.load_config(os.path.join(REPO_ROOT, path) + sep + arg)


def _recipes() -> list[str]:
  names = sorted(n for n in os.listdir(os.path.join(REPO_ROOT, CONFIG_DIR))
                 if n.endswith('.py') and not n.startswith('_'))
  return [f'{CONFIG_DIR}/{n}' for n in names
          if f'{CONFIG_DIR}/{n}' != DEFAULT_CONFIG]


def _summary(path: str) -> str:
  """The first line of a recipe file's docstring."""
  with open(os.path.join(REPO_ROOT, path), encoding='utf-8') as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ''
  return doc.strip().splitlines()[0] if doc.strip() else ''


def _value(value: Any) -> str:
  text = repr(value)
  if '`' in text:
    return text
  return f'`{text}`'


def _cell(text: str) -> str:
  return text.replace('|', '\\|').replace('\n', ' ')


def _diff(base: dict[str, Any], other: dict[str, Any],
          order: Sequence[str]) -> list[tuple[str, Any, Any]]:
  """(key, base value, other value) of every differing key, in `order`."""
  missing = object()
  keys = list(order) + sorted((set(base) | set(other)) - set(order))
  rows = []
  for key in keys:
    a, b = base.get(key, missing), other.get(key, missing)
    if a is missing or b is missing or a != b or type(a) is not type(b):
      rows.append((key, '(absent)' if a is missing else a,
                   '(absent)' if b is missing else b))
  return rows


def _ordered_keys(flat: dict[str, Any], entries: dict[str, Entry]) -> list[str]:
  """Keys in the order the source assigns them; any others after, sorted."""
  order = [p for p, e in entries.items() if not e.section and p in flat]
  return order + sorted(set(flat) - set(order))


def missing_meanings(entries: dict[str, Entry], flat: dict[str, Any]) -> list[str]:
  """Keys of the default config without a meaning in configs/default.py."""
  return [k for k in _ordered_keys(flat, entries)
          if not (k in entries and entries[k].meaning)]


def with_task_options(entries: dict[str, Entry]) -> dict[str, Entry]:
  """`entries` with each environment's options (`registry.meanings`) placed
  right after the `task` section's entry; the recipe's comments win."""
  merged = {}
  for path, entry in entries.items():
    merged[path] = entry
    if path == 'task':
      for key, text in registry.meanings().items():
        merged.setdefault(key, Entry(key, section=False, meaning=text))
  merged.update({p: e for p, e in entries.items() if p.startswith('task.')})
  return merged


def render() -> str:
  """The text of docs/configuration.md."""
  entries = with_task_options(
      parse_comments(os.path.join(REPO_ROOT, DEFAULT_CONFIG)))
  default = flatten(_load(DEFAULT_CONFIG))
  keys = _ordered_keys(default, entries)
  out = []
  w = out.append
  w('# Configuration reference')
  w('')
  w(f'<!-- Generated by `{REGENERATE}` from configs/*.py: do not edit.'
    f' `{REGENERATE} --check` fails when it is stale. -->')
  w('')
  w('Every entry point (`sao_jax.train`, `sao_jax.serve`, `sao_jax.tools.show_config`,'
    ' `sao_jax.tools.aot_compile`) takes a recipe file, a Python file in'
    ' `configs/` whose `get_config(arg)` returns an `ml_collections.ConfigDict`.'
    ' `configs/default.py` holds every key and its default; the other recipes'
    ' load it and change a few keys. This page lists every key with its default,'
    ' its meaning (from the comments of `configs/default.py`) and, where the'
    ' paper has one, its symbol (SAO.md); then what each `algorithm` preset and'
    ' each other recipe changes.')
  w('')
  w('## Choosing and overriding values')
  w('')
  w('```bash')
  w('# A recipe, and its argument: algorithm (sao | grpo | grpo_dis | vapo |'
    ' running_mean | ppo) and seed')
  w('python -m sao_jax.train --config=configs/default.py:algorithm=grpo,seed=1'
    ' --workdir=runs/grpo')
  w('# Any key, after the presets: --config.<section>.<key>=<value>')
  w('python -m sao_jax.train --config=configs/default.py'
    ' --config.critic.steps_per_policy_step=1 --config.optim.actor.learning_rate=1e-5'
    ' --workdir=runs/k1')
  w('# The resolved config and mesh, without running anything')
  w('python -m sao_jax.tools.show_config --config=configs/default.py:algorithm=vapo'
    ' --config.batch_size=32 --num_devices=8')
  w('```')
  w('')
  w('The recipe argument is applied first (`algorithm=` selects a preset below),'
    ' then the `--config.x.y=value` overrides, in order. The config is locked: an'
    ' unknown key, a value of the wrong type or an inconsistent setting stops the'
    ' program with one line naming the key (exit status 2); see'
    ' [troubleshooting.md](troubleshooting.md). Tuples are written as'
    ' `--config.task.word_target.switch_steps="(10, 20)"`; strings need no quotes'
    ' (`--config.model.source=/path/to/hf_dir`).')
  w('')
  w('## Keys of configs/default.py')
  w('')
  w('Defaults are those of `algorithm=sao`. "Symbol" is the paper\'s name for'
    ' the value.')
  sections: dict[str, list[str]] = {}
  for key in keys:
    head = key.split('.', 1)[0] if '.' in key else ''
    sections.setdefault(head, []).append(key)
  for head, members in sections.items():
    w('')
    w(f'### {head or "Top level"}')
    w('')
    notes = [(p, e.meaning) for p, e in entries.items()
             if e.section and e.meaning and (p == head or p.startswith(head + '.'))]
    for path, note in notes:
      note = note.rstrip(':')
      w(f'`{path}`: {note}' if path != head else note)
      w('')
    w('| key | default | symbol | meaning |')
    w('|---|---|---|---|')
    for key in members:
      meaning = entries[key].meaning if key in entries else ''
      w(f'| `{key}` | {_cell(_value(default[key]))} |'
        f' {_cell(PAPER_SYMBOLS.get(key, ""))} | {_cell(meaning)} |')
  w('')
  w('## Algorithm presets')
  w('')
  w('`--config=<recipe>:algorithm=<name>` applies the preset of a baseline of'
    ' the paper (SAO.md §3) before any override; each is written beside the'
    ' algorithm\'s parts, in `ALGORITHMS` of `sao_jax/rl/algorithms.py`.'
    ' Changes from `algorithm=sao`:')
  sao = flatten(_load(f'{DEFAULT_CONFIG}:algorithm=sao'))
  for name in algorithms.ALGORITHMS:
    if name == 'sao':
      continue
    parts = algorithms.ALGORITHMS[name]
    preset = flatten(_load(f'{DEFAULT_CONFIG}:algorithm={name}'))
    rows = [r for r in _diff(sao, preset, keys) if r[0] != 'algorithm']
    w('')
    w(f'### algorithm={name}')
    w('')
    w(f'Advantage estimator `{parts.estimator}`, policy loss `{parts.loss}`,'
      f' {"a critic" if parts.critic else "no critic"}.')
    w('')
    w(f'| key | sao | {name} |')
    w('|---|---|---|')
    for key, a, b in rows:
      w(f'| `{key}` | {_cell(_value(a))} | {_cell(_value(b))} |')
  w('')
  w('## Recipes')
  w('')
  w('Each recipe loads `configs/default.py` (or another recipe) and changes the'
    ' keys below; it takes the same `algorithm=` and `seed=` argument.')
  for recipe in _recipes():
    rows = _diff(default, flatten(_load(recipe)), keys)
    w('')
    w(f'### {recipe}')
    w('')
    summary = _summary(recipe)
    if summary:
      w(summary)
      w('')
    w(f'| key | default.py | {os.path.basename(recipe)} |')
    w('|---|---|---|')
    for key, a, b in rows:
      w(f'| `{key}` | {_cell(_value(a))} | {_cell(_value(b))} |')
  w('')
  w('## Paper symbols')
  w('')
  w('| symbol | key |')
  w('|---|---|')
  for key, symbol in PAPER_SYMBOLS.items():
    w(f'| {_cell(symbol)} | `{key}` |')
  return '\n'.join(out) + '\n'


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog=REGENERATE, description=f'Writes {OUTPUT} from the config files.')
  parser.add_argument('--check', action='store_true',
                      help=f'exit 1 when {OUTPUT} differs from the output')
  args = parser.parse_args(argv)
  text = render()
  path = os.path.join(REPO_ROOT, OUTPUT)
  if args.check:
    try:
      with open(path, encoding='utf-8') as f:
        current = f.read()
    except FileNotFoundError:
      current = None
    if current != text:
      print(STALE_MESSAGE, file=sys.stderr)
      return 1
    return 0
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'wrote {OUTPUT}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
