"""docs/configuration.md is the generator's output and documents every key."""

import importlib.util
import os
import re
import sys

import pytest

from sao_jax import config_lib

# A repository script, not part of the installed package.
_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'scripts', 'config_reference.py')
_spec = importlib.util.spec_from_file_location('config_reference', _SCRIPT)
ref = sys.modules['config_reference'] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


@pytest.fixture(scope='module')
def rendered():
  return ref.render()


@pytest.fixture(scope='module')
def default_keys():
  return ref.flatten(config_lib.load_config(
      os.path.join(ref.REPO_ROOT, ref.DEFAULT_CONFIG)))


def _rows(text):
  """`key` -> the cells of its row, for the key tables of the page."""
  keys_part = text.split('## Algorithm presets')[0]
  rows = {}
  for line in keys_part.splitlines():
    match = re.match(r'^\| `([^`]+)` \|(.*)\|$', line)
    if match:
      cells = [c.strip() for c in re.split(r'(?<!\\)\|', match.group(2))]
      rows[match.group(1)] = cells
  return rows


def test_committed_page_is_up_to_date(rendered):
  path = os.path.join(ref.REPO_ROOT, ref.OUTPUT)
  assert os.path.exists(path), ref.STALE_MESSAGE
  with open(path, encoding='utf-8') as f:
    assert f.read() == rendered, ref.STALE_MESSAGE


def test_check_flag(tmp_path, monkeypatch, capsys):
  assert ref.main(['--check']) == 0
  monkeypatch.setattr(ref, 'REPO_ROOT', str(tmp_path))
  (tmp_path / 'configs').mkdir()
  for name in os.listdir(os.path.join(os.path.dirname(__file__), '..',
                                      'configs')):
    if name.endswith('.py'):
      with open(os.path.join(os.path.dirname(__file__), '..', 'configs', name),
                encoding='utf-8') as f:
        (tmp_path / 'configs' / name).write_text(f.read())
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'configuration.md').write_text('stale\n')
  assert ref.main(['--check']) == 1
  err = capsys.readouterr().err.strip()
  assert err == ('docs/configuration.md is out of date; run'
                 ' python scripts/config_reference.py')
  assert ref.main([]) == 0
  assert ref.main(['--check']) == 0


def test_every_key_has_a_meaning(default_keys):
  entries = ref.with_task_options(
      ref.parse_comments(os.path.join(ref.REPO_ROOT, ref.DEFAULT_CONFIG)))
  missing = ref.missing_meanings(entries, default_keys)
  assert not missing, (
      'keys without a meaning: add a trailing # comment in configs/default.py,'
      ' or a "#   key: meaning" line above a ConfigDict(dict(...)); an'
      " environment's option gets its meaning from its EnvSpec's Option: "
      + ', '.join(missing))


def test_every_key_is_documented(rendered, default_keys):
  rows = _rows(rendered)
  assert set(rows) == set(default_keys)
  for key, cells in rows.items():
    default, _, meaning = cells
    assert default, key
    assert meaning, f'{key} has no meaning in {ref.OUTPUT}'


def test_paper_symbols_name_real_keys(default_keys):
  assert set(ref.PAPER_SYMBOLS) <= set(default_keys)


def _section(text, heading):
  """The text under `heading` up to the next heading."""
  return re.split(r'\n#{2,3} ', text.split(heading + '\n', 1)[1])[0]


def test_spot_checks(rendered):
  rows = _rows(rendered)
  assert rows['critic.steps_per_policy_step'][:2] == ['`2`', 'K']
  assert rows['policy_loss.eps_low'][:2] == ['`0.3`', 'epsilon_low']
  assert rows['advantage.alpha'][:2] == ['`1.5`', 'alpha']
  assert rows['critic.lam'][:2] == ['`1.0`', 'lambda_critic']
  assert rows['batch_size'][1] == 'B' and rows['group_size'][1] == 'G'
  assert rows['optim.actor.learning_rate'][0] == '`2e-05`'
  assert rows['optim.critic.learning_rate'][0] == '`0.0001`'
  assert 'Monte-Carlo' in rows['critic.lam'][2]

  grpo = _section(rendered, '### algorithm=grpo')
  assert '| `group_size` | `1` | `8` |' in grpo
  assert "| `advantage.estimator` | `'skip_observation_gae'` | `'grpo'` |" in grpo
  assert '`algorithm`' not in grpo
  ppo = _section(rendered, '### algorithm=ppo')
  assert '| `critic.pretrain_steps` | `12` | `0` |' in ppo

  tiny = _section(rendered, '### configs/tiny.py')
  assert "| `model.source` | `'smollm2-135m-instruct'` | `'tiny-random'` |" in tiny
  assert '`batch_size`' not in tiny  # tiny.py sets it to the default's 16
  assert '### configs/llama3_8b_v5p.py' in rendered
  assert '--config=configs/default.py:algorithm=grpo,seed=1' in rendered
  assert 'python -m sao_jax.tools.show_config' in rendered


def test_parser_forms():
  source = '''
import ml_collections

def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.a = 1  # trailing
  # block
  # above
  c.b = 2
  # Section note:
  #   x: the x
  c.s = ml_collections.ConfigDict(dict(
      x=1, y=2,  # the y
      z=3))
  for role, lr in (('p', 1.0), ('q', 2.0)):
    o = ml_collections.ConfigDict()
    o.lr = lr  # rate
    c[role] = o
  return c
'''
  entries = ref._Parser(source).parse()  # pylint: disable=protected-access
  meanings = {k: e.meaning for k, e in entries.items() if not e.section}
  assert meanings == {'a': 'trailing', 'b': 'block above', 's.x': 'the x',
                      's.y': 'the y', 's.z': '', 'p.lr': 'rate',
                      'q.lr': 'rate'}
  assert entries['s'].section and entries['s'].meaning == 'Section note:'
