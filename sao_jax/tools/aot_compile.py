r"""Plans a TPU run without TPUs: compiles the sharded train step for a topology.

  python -m sao_jax.tools.aot_compile --config=configs/llama3_8b_v5p.py \
      --topology=v5p:4x4x4
  python -m sao_jax.tools.aot_compile --config=configs/llama3_8b_agent_32k.py \
      --topology=v5p:2x2x1 --program=prefill   # a rollout server's prefill

libtpu's compile-only devices stand in for the slice: the learner's mesh is
built over them from `config.mesh`, the SAO train step (critic and policy
updates, Pallas kernels) is lowered with abstract state and batch, and the
full XLA:TPU compile reports per-device memory (parameters, optimiser state,
activations and temporaries) and the compiler's cost estimate. A config that
does not fit fails here, in minutes, instead of on the pod.

`--program=prefill` compiles a rollout server's prefill instead: the engine's
model tensor-parallel over the topology's chips (as `rollout.engine` places
it), one prompt of `rollout.max_prefill_length` tokens through splash
attention, and reports it with the decode state and prefix cache the server
would also hold.

Needs `libtpu` (the test extras install the version jax pins).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

# Compile-only devices never open a TPU; other processes may hold libtpu.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sao_jax import config_lib
from sao_jax import platforms
from sao_jax import recipe_checks
from sao_jax import sharding
from sao_jax.models import model_config
from sao_jax.rollout import batching
from flax import nnx

from sao_jax.learner import learner as learner_lib
from sao_jax.models import pretrained
from sao_jax.rollout import engine as engine_lib
from sao_jax.rollout import weight_stream
from sao_jax.tools import tpu_aot
# pylint: enable=g-import-not-at-top,wrong-import-position

_CONFIG = config_lib.define_config_flag()
_TOPOLOGY = flags.DEFINE_string('topology', 'v5p:4x4x4',
                                'TPU topology, e.g. v5p:4x4x4, v6e:2x4')
_JSON = flags.DEFINE_string('json', None, 'also write the report here')
_PROGRAM = flags.DEFINE_enum('program', 'train', ['train', 'prefill'],
                             "the learner's train step, or a server's prefill")


@dataclasses.dataclass
class Report:
  """What one compile says about memory and cost, per device."""
  topology: str
  devices: int
  mesh: dict[str, int]
  model: str
  parameters: int
  batch_tokens: int
  compile_seconds: float
  params_bytes_per_device: int
  optimizer_bytes_per_device: int
  argument_bytes_per_device: int
  output_bytes_per_device: int
  temp_bytes_per_device: int
  peak_bytes_per_device: int
  hbm_bytes_per_device: int
  fits: bool
  analytic_flops: float
  compiler_flops: float | None
  compiler_optimal_seconds: float | None


class DoesNotFit(RuntimeError):
  """The compiler found that the step needs more HBM than a chip has."""


def _device_bytes(abstract_tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
  return total


def compile_train_step(config, topology: str) -> Report:
  """Compiles `config`'s SAO step for `topology`; returns the report."""
  devices = tpu_aot.devices(topology)
  sizes = recipe_checks.validate(config, num_devices=len(devices))
  mesh = sharding.make_mesh(sizes, devices)
  policy = pretrained.abstract_model(
      config.model.source, **model_config.overrides(config.model))
  with platforms.compile_target('tpu'):
    learner = learner_lib.Learner(config, policy, mesh, init_state=False)
    batch_size, length = config.batch_size, config.rollout.max_sequence_length
    batch = learner.abstract_batch(batch_size, length,
                                   batching.packed_rows(config, sizes))
    start = time.perf_counter()
    lowered = learner.train_step.lower(learner.abstract_state, batch)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      # XLA:TPU refuses a program that cannot fit HBM; say so in one line.
      raise DoesNotFit(f'{config.model.source} on {topology} (mesh {sizes},'
                       f' batch {config.batch_size} x'
                       f' {config.rollout.max_sequence_length} tokens,'
                       f' {config.optim.microbatches} micro-batches):'
                       f' {str(e).splitlines()[0]}') from e
    seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  state = learner.abstract_state
  params = _device_bytes((state.policy, state.critic, state.critic_frozen))
  optimizer = _device_bytes((state.actor_opt, state.critic_opt))
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.policy))
  tokens = batch_size * length
  # cost_analysis counts a scanned layer body once; count it by hand:
  # 6 N T for the policy update, and per critic update 6 N T, plus forwards.
  k = config.critic.steps_per_policy_step if learner.uses_critic else 0
  analytic = 6 * n_params * tokens * (1 + k) + 2 * n_params * tokens * (
      1 if learner.uses_critic else 0)
  hbm_bytes = _hbm_bytes(topology)
  peak = memory.argument_size_in_bytes + memory.temp_size_in_bytes + max(
      memory.output_size_in_bytes - memory.alias_size_in_bytes, 0)
  seconds_estimate = cost.get('optimal_seconds')
  return Report(
      topology=topology, devices=len(devices), mesh=sizes,
      model=config.model.source, parameters=n_params, batch_tokens=tokens,
      compile_seconds=seconds, params_bytes_per_device=params,
      optimizer_bytes_per_device=optimizer,
      argument_bytes_per_device=memory.argument_size_in_bytes,
      output_bytes_per_device=memory.output_size_in_bytes,
      temp_bytes_per_device=memory.temp_size_in_bytes,
      peak_bytes_per_device=peak, hbm_bytes_per_device=hbm_bytes,
      fits=peak <= hbm_bytes, analytic_flops=float(analytic),
      compiler_flops=cost.get('flops'),
      compiler_optimal_seconds=(seconds_estimate if seconds_estimate and
                                seconds_estimate > 0 else None))


@dataclasses.dataclass
class PrefillReport:
  """A rollout server's prefill on one slice, per device."""
  topology: str
  devices: int
  model: str
  prompt_tokens: int
  compile_seconds: float
  params_bytes_per_device: int
  temp_bytes_per_device: int
  output_bytes_per_device: int
  decode_state_bytes_per_device: int  # slots x max_target_length KV cache
  prefix_cache_bytes_per_device: int  # rollout.prefix_cache_gib, sharded
  peak_bytes_per_device: int  # all of the above at once
  hbm_bytes_per_device: int
  fits: bool


def compile_engine_prefill(config, topology: str) -> PrefillReport:
  """Compiles a server's prefill of `rollout.max_prefill_length` tokens."""
  devices = tpu_aot.devices(topology)
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=len(devices)),
                            devices)
  model = pretrained.abstract_model(
      config.model.source, dtype=engine_lib.serving_dtype(config),
      param_dtype=weight_stream.serving_param_dtype(config),
      attention=config.model.attention)
  graphdef, state = nnx.split(model)
  shardings = sharding.state_shardings(state, mesh)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      state, shardings)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
  length = config.rollout.max_prefill_length
  tokens = jax.ShapeDtypeStruct((1, length), jnp.int32, sharding=replicated)
  with platforms.compile_target('tpu'), sharding.mesh_context(mesh):
    start = time.perf_counter()
    compiled = engine_lib._prefill.lower(  # pylint: disable=protected-access
        graphdef, state, tokens, scalar(jnp.int32), scalar(jnp.int32),
        scalar(jnp.bool_)).compile()
    seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cfg = model.config
  # The cache's K/V heads split over `tensor` where they divide (the
  # engine's rules), else replicated.
  kv_split = len(devices) if cfg.num_kv_heads % len(devices) == 0 else 1
  kv_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                        * jnp.dtype(cfg.compute_dtype).itemsize) // kv_split
  decode = (config.rollout.max_concurrent_decodes
            * config.rollout.max_target_length * kv_bytes_per_token)
  prefix = int(config.rollout.prefix_cache_gib * 2**30) // kv_split
  params = _device_bytes(state)
  peak = (params + memory.temp_size_in_bytes + memory.output_size_in_bytes
          + decode + prefix)
  hbm_bytes = _hbm_bytes(topology)
  return PrefillReport(
      topology=topology, devices=len(devices), model=config.model.source,
      prompt_tokens=length, compile_seconds=seconds,
      params_bytes_per_device=params,
      temp_bytes_per_device=memory.temp_size_in_bytes,
      output_bytes_per_device=memory.output_size_in_bytes,
      decode_state_bytes_per_device=decode,
      prefix_cache_bytes_per_device=prefix, peak_bytes_per_device=peak,
      hbm_bytes_per_device=hbm_bytes, fits=peak <= hbm_bytes)


def format_prefill_report(r: PrefillReport) -> str:
  gib = lambda b: f'{b / 2**30:.2f} GiB'
  return '\n'.join([
      f'{r.model} prefill of {r.prompt_tokens} tokens on {r.topology}'
      f' ({r.devices} devices, tensor parallel); compiled in'
      f' {r.compile_seconds:.0f} s',
      'per device:',
      f'  parameters                   {gib(r.params_bytes_per_device)}',
      f'  prefill temporaries          {gib(r.temp_bytes_per_device)}',
      f'  prefill output (prompt KV)   {gib(r.output_bytes_per_device)}',
      f'  decode state (slots x cache) {gib(r.decode_state_bytes_per_device)}',
      f'  prefix cache                 {gib(r.prefix_cache_bytes_per_device)}',
      f'  peak                         {gib(r.peak_bytes_per_device)} of'
      f' {gib(r.hbm_bytes_per_device)} HBM: '
      + ('fits' if r.fits else 'DOES NOT FIT'),
  ])


# HBM per chip (GiB) by generation, from Cloud TPU documentation.
_HBM_GIB = {'v4': 32, 'v5e': 16, 'v5p': 95, 'v6e': 32}


def _hbm_bytes(topology: str) -> int:
  generation = topology.split(':')[0]
  return _HBM_GIB.get(generation, 16) * 2**30


def format_report(r: Report) -> str:
  gib = lambda b: f'{b / 2**30:.2f} GiB'
  lines = [
      f'{r.model} ({r.parameters / 1e9:.2f} B parameters) on {r.topology}'
      f' ({r.devices} devices), mesh {r.mesh}',
      f'batch: {r.batch_tokens} tokens per step; compiled in'
      f' {r.compile_seconds:.0f} s',
      'per device:',
      f'  parameters (policy + critic)  {gib(r.params_bytes_per_device)}',
      f'  optimiser states             {gib(r.optimizer_bytes_per_device)}',
      f'  arguments (all state + batch) {gib(r.argument_bytes_per_device)}',
      f'  temporaries (activations)    {gib(r.temp_bytes_per_device)}',
      f'  peak                         {gib(r.peak_bytes_per_device)} of'
      f' {gib(r.hbm_bytes_per_device)} HBM: '
      + ('fits' if r.fits else 'DOES NOT FIT'),
      f'flops per step: {r.analytic_flops:.3e} (analytic, 6NT per update);'
      f' compiler: {r.compiler_flops or 0:.3e} (counts a scanned layer once)',
  ]
  if r.compiler_optimal_seconds:
    lines.append(f'compiler time estimate: {r.compiler_optimal_seconds:.3f} s'
                 ' (like its flops, one pass of each scanned layer)')
  return '\n'.join(lines)


def main(argv: Sequence[str]) -> None:
  del argv
  if _PROGRAM.value == 'prefill':
    report = compile_engine_prefill(_CONFIG.value, _TOPOLOGY.value)
    print(format_prefill_report(report))
    if _JSON.value:
      with open(_JSON.value, 'w') as f:
        json.dump(dataclasses.asdict(report), f, indent=2)
    sys.exit(0 if report.fits else 1)
  try:
    report = compile_train_step(_CONFIG.value, _TOPOLOGY.value)
  except DoesNotFit as e:
    print(f'DOES NOT FIT: {e}', file=sys.stderr)
    print('try more --config.optim.microbatches, a larger --config.mesh.fsdp'
          ' or topology, or a shorter --config.rollout.max_sequence_length',
          file=sys.stderr)
    sys.exit(1)
  print(format_report(report))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(dataclasses.asdict(report), f, indent=2)
  if not report.fits:
    sys.exit(1)


if __name__ == '__main__':
  config_lib.run(main)
