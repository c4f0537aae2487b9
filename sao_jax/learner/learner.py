"""The SAO learner: sharded state and the jitted update of one batch.

Per batch (SAO §1-2): the critic's values of the batch, then K critic updates
towards Monte-Carlo returns (attention frozen); advantages by skip-observation
GAE with the length-adaptive lambda from the values as they were before those
updates; then the policy updates: E passes over the batch, each in M shuffled
mini-batches, one optimizer step per mini-batch (SAO: E = M = 1) with the DIS
loss against the rollout engine's own log-probs. The paper's baselines swap the
parts, which the learner takes once from `algorithms.resolve(config)` (the
estimator and loss registered under the config's names): GRPO's group
advantages, a running-mean baseline, PPO's clipped loss against an old policy
(`policy_loss.old_logprobs`); `advantage.skip_observations=False` ablates the
skip (naive GAE through observation tokens).

Sharding (pjit semantics through `jax.jit`): parameters are laid out over the
`data x fsdp x tensor` mesh by their logical axes (`sao_jax.sharding`), the
optimiser states follow their parameters, batches split over `data x fsdp`,
and the state is donated to each step so it is updated in place. Gradients
accumulate over micro-batches (`config.optim.microbatches`) so large batches
fit; a non-finite gradient skips its update (`optimizers`).

The learner is functional: it holds the mesh, shardings and jitted steps, and
the caller owns the `types.LearnerState`:

  learner = Learner(config, policy, mesh)
  state = learner.init_state()
  state, metrics = learner.train_step(state, learner.device_batch(batch))
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sao_jax import sharding
from sao_jax import types
from sao_jax.learner import optimizers
from sao_jax.models import critic as critic_lib
from sao_jax.models import model_config
from sao_jax.models import sampling
from sao_jax.models import transformer
from sao_jax.rl import advantages
from sao_jax.rl import algorithms
from sao_jax.rl import logprob_parity
from sao_jax.rollout import wire

_F32 = jnp.float32
class Learner:
  """Owns the mesh, the shardings and the jitted steps of one training run."""

  def __init__(self, config, policy: transformer.CausalLM, mesh,
               rules=sharding.DEFAULT_RULES, init_state: bool = True):
    """Lays out the policy (and a critic copied from it) on `mesh`.

    Args:
      config: a validated sao_jax config.
      policy: the initial policy (its weights become the critic's backbone).
      mesh: a mesh with the `sharding.MESH_AXES`.
      rules: logical-axis rules.
      init_state: keep the initial parameters for `init_state()` (False:
        only shapes, for AOT compiles and restores).
    """
    self.config = config
    self.mesh = mesh
    self.rules = rules
    self.algorithm = algorithms.resolve(config)
    self.uses_critic = self.algorithm.uses_critic
    self.uses_ref_policy = bool(config.policy_loss.ref_kl_coef)
    self.sampling = sampling.SamplingParams(config.rollout.temperature,
                                            config.rollout.top_k,
                                            config.rollout.top_p)
    self.logits_chunk = config.model.logits_chunk_size
    # An MoE policy's batches carry the engine's routing records: each
    # token's experts, R = layers x k of them (`types.TrainBatch`).
    self.routing_width = wire.RoutingLayout.for_config(
        policy.config).ids_per_token
    self.replay = model_config.MOE_ROUTINGS[
        config.model.get('moe_routing', 'learn')]
    self.actor_tx = optimizers.make(
        config.optim.actor, config.total_steps,
        config.optim.policy_epochs * config.optim.policy_minibatches)
    # The critic's optimizer restarts after value pretraining: RL's updates
    # (K passes of M_c mini-batches per batch) and pretraining's (one
    # full-batch update per batch) share its state's structure.
    self.critic_passes = config.critic.steps_per_policy_step
    self.critic_minibatches = algorithms.critic_minibatches(config)
    self.critic_tx = optimizers.make(
        config.optim.critic, config.total_steps,
        self.critic_passes * self.critic_minibatches)
    # Value pretraining's schedule spans its batches (at least one).
    self._pretrain_batches = max(config.critic.pretrain_steps, 1)
    self.pretrain_critic_tx = optimizers.make(config.optim.critic,
                                              self._pretrain_batches)
    self._policy_def, policy_params = nnx.split(policy, nnx.Param)
    critic_params = frozen_params = None
    if self.uses_critic:
      value_model = (critic_lib.from_policy(policy) if init_state else
                     nnx.eval_shape(lambda: critic_lib.ValueModel(
                         policy.config, rngs=nnx.Rngs(0))))
      self._critic_def, critic_params, frozen_params = nnx.split(
          value_model,
          critic_lib.trainable_filter(config.critic.frozen_attention), ...)
    # [B, T] fields: rows over the batch axes, tokens over `sequence` (XLA
    # gathers what a whole-row op needs: attention's keys and values, the
    # GAE scan).
    self.batch_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(
            sharding.BATCH_AXES,
            sharding.SEQUENCE_AXIS if mesh.shape.get(sharding.SEQUENCE_AXIS,
                                                     1) > 1 else None))
    self.row_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES))
    # [B, T, R] fields: as [B, T], the last axis whole.
    self.token_record_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*self.batch_sharding.spec, None))
    # A batch field's sharding by its rank (`types.field_rank`).
    self._sharding_by_rank = {1: self.row_sharding, 2: self.batch_sharding,
                              3: self.token_record_sharding}
    self._param_shardings = {
        name: sharding.state_shardings(params, mesh, rules)
        for name, params in (('policy', policy_params),
                             ('critic', critic_params),
                             ('critic_frozen', frozen_params))
        if params is not None}
    self._param_shardings['ref_policy'] = self._param_shardings['policy']
    abstract_params = self._params(policy_params, critic_params,
                                   frozen_params, abstract=True)
    abstract = jax.eval_shape(self._init_state, *abstract_params)
    # Read the layout of the whole state (moments pinned like their
    # parameters, counters replicated) from the compiled initialiser.
    self.state_shardings = jax.jit(self._init_state).lower(
        *abstract_params).compile().output_shardings
    self._init = jax.jit(self._init_state, out_shardings=self.state_shardings)
    self.abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, self.state_shardings)
    self._initial_params = ((policy_params, critic_params, frozen_params)
                            if init_state else None)
    self.train_step = jax.jit(
        self._on_mesh(self._train_step),
        in_shardings=(self.state_shardings, self._batch_shardings()),
        out_shardings=(self.state_shardings, None), donate_argnums=(0,))
    self.critic_step = jax.jit(
        self._on_mesh(self._critic_only_step),
        in_shardings=(self.state_shardings, self._batch_shardings()),
        out_shardings=(self.state_shardings, None), donate_argnums=(0,))
    # After value pretraining: RL's critic warm-up starts at RL step 0.
    self.reset_critic_optimizer = jax.jit(
        self._reset_critic_optimizer, in_shardings=(self.state_shardings,),
        out_shardings=self.state_shardings, donate_argnums=(0,))

  def _on_mesh(self, step):
    """`step`, traced with the mesh known to the model's attention kernel
    (a Mosaic kernel and routed experts run per shard: `sharding.mesh_context`)."""
    def traced(*args):
      with sharding.mesh_context(self.mesh):
        return step(*args)
    return traced

  # -- state ------------------------------------------------------------------

  def init_state(self) -> types.LearnerState:
    """The initial state on the mesh; the caller owns it from here on.

    Every step donates the state it is given and returns the next one:
    `state, metrics = learner.train_step(state, batch)`. It can be made once:
    the learner lets go of the initial parameters (the critic's copy of the
    backbone among them) so that they do not stay resident beside the state.
    """
    if self._initial_params is None:
      raise ValueError('the learner has no initial parameters: it was built'
                       ' with init_state=False (only the state\'s shapes,'
                       ' abstract_state: restore a checkpoint), or'
                       ' init_state() was already called')
    initial, self._initial_params = self._initial_params, None
    # Wait for it: XLA:CPU can deadlock when a sharded program with
    # collectives starts on some devices while another still runs on the
    # rest (jax 0.10, fake CPU devices); the first step would be that one.
    return jax.block_until_ready(self._init(*self._params(*initial)))

  def _params(self, policy, critic, frozen, abstract=False):
    """The parameter states placed with their shardings."""
    out = []
    for name, params in (('policy', policy), ('critic', critic),
                         ('critic_frozen', frozen)):
      if params is None:
        out.append(None)
        continue
      shardings = self._param_shardings[name]
      if abstract:
        out.append(jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
            params, shardings))
      else:
        out.append(jax.device_put(params, shardings))
    return out

  def _init_state(self, policy, critic, frozen) -> types.LearnerState:
    cfg = self.config
    running_mean = self.algorithm.estimator.init_state(cfg)
    return types.LearnerState(
        policy=policy, critic=critic, critic_frozen=frozen,
        actor_opt=self._sharded_opt_state(self.actor_tx, policy, 'policy'),
        critic_opt=(None if critic is None else
                    self._sharded_opt_state(self.critic_tx, critic, 'critic')),
        running_mean=running_mean,
        # A copy, not the same buffers: the state is donated to every step.
        ref_policy=(jax.tree.map(jnp.copy, policy) if self.uses_ref_policy
                    else None),
        step=jnp.zeros((), jnp.int32), critic_step=jnp.zeros((), jnp.int32))

  def _reset_critic_optimizer(self, state: types.LearnerState) -> types.LearnerState:
    """The critic's optimizer as new: its warm-up starts again from 0."""
    return state._replace(critic_opt=self._sharded_opt_state(
        self.critic_tx, state.critic, 'critic'))

  def _sharded_opt_state(self, tx, params, name):
    """`tx.init(params)` with every moment sharded like its parameter.

    The moments are zeros, which carry no data dependence on the parameters:
    left to propagation they come out replicated, a full f32 copy of the
    model per moment on every device.
    """
    return optax.tree_map_params(
        tx, jax.lax.with_sharding_constraint, tx.init(params),
        self._param_shardings[name])

  def abstract_batch(self, batch_size: int, length: int,
                     rows: int = 0) -> types.TrainBatch:
    """A global batch's shapes, dtypes and shardings (for AOT compiles).

    `batch_size` trajectories (N) in `rows` rows of `length` (0: one per row).
    """
    rows = rows or batch_size
    shapes = {1: (batch_size,), 2: (rows, length),
              3: (rows, length, self.routing_width)}
    return jax.tree.map(
        lambda name, s: jax.ShapeDtypeStruct(
            shapes[types.field_rank(name)], types.TRAIN_BATCH_DTYPES[name],
            sharding=s),
        self._batch_fields(), self._batch_shardings())

  def compile_train_step(self, batch_size: int, length: int,
                         rows: int = 0) -> None:
    """Compiles `train_step` for global batches of this shape, ahead of time.

    A later `train_step` on such a batch reuses the executable (jit's cache).
    The trainer compiles while the first batch is still being generated, and
    returns the compiler's freed memory to the system before the first step
    allocates its buffers: compiled inside that step instead, the demo's
    first step ran on top of ~0.3 GiB the compiler had left in the
    allocator's arenas, and set the Colab quickstart's peak.
    """
    self.train_step.lower(self.abstract_state,
                          self.abstract_batch(batch_size, length, rows)
                          ).compile()

  def _batch_fields(self) -> types.TrainBatch:
    """Each field's name, None for the routing records of a dense policy
    (the step's batch has exactly these fields)."""
    return types.TrainBatch(**{
        name: (None if types.field_rank(name) == 3 and not self.routing_width
               else name) for name in types.TRAIN_BATCH_DTYPES})

  def _batch_shardings(self) -> types.TrainBatch:
    return jax.tree.map(
        lambda name: self._sharding_by_rank[types.field_rank(name)],
        self._batch_fields())

  def _with_routing_records(self, batch: types.TrainBatch) -> types.TrainBatch:
    """`batch` with the routing field the step expects: an MoE policy's
    batch without records gets `NOT_RECORDED` everywhere (its routers pick
    every token's experts); a dense policy's drops any."""
    records = batch.routed_experts_BxTxR
    if not self.routing_width:
      return batch.replace(routed_experts_BxTxR=None)
    if records is None:
      records = np.full(np.shape(batch.tokens_BxT) + (self.routing_width,),
                        types.NOT_RECORDED, np.int16)
    elif np.shape(records)[-1] != self.routing_width:
      raise ValueError(
          f'routing records of width {np.shape(records)[-1]}; the policy'
          f' routes {self.routing_width} (layers x experts per token)')
    return batch.replace(routed_experts_BxTxR=records)

  # -- models ------------------------------------------------------------------

  def policy_model(self, state: types.LearnerState) -> transformer.CausalLM:
    """The policy pi_theta with the parameters of `state`."""
    return nnx.merge(self._policy_def, state.policy)

  def critic_model(self, state: types.LearnerState) -> critic_lib.ValueModel:
    """The critic V_phi with the parameters of `state`."""
    return nnx.merge(self._critic_def, state.critic, state.critic_frozen)

  # -- batches -----------------------------------------------------------------

  def device_batch(self, batch: types.TrainBatch) -> types.TrainBatch:
    """This process's rows (numpy) as one batch of sharded global arrays.

    On several processes each contributes its rows and trajectories; the
    global batch is their concatenation in process order, so each process's
    segment ids (1 + a trajectory's local index) move past the trajectories
    of the processes before it.
    """
    batch = self._with_routing_records(batch)
    if jax.process_count() > 1:
      ids = np.asarray(batch.segment_ids_BxT)
      offset = jax.process_index() * len(batch.reward_N)
      batch = batch.replace(segment_ids_BxT=np.where(ids > 0, ids + offset,
                                                     0).astype(np.int32))
    return jax.tree.map(_global_array, batch, self._batch_shardings())

  # -- steps -------------------------------------------------------------------

  def _critic_updates(self, state: types.LearnerState, batch, passes: int,
                      minibatches: int, tx, learning_rate):
    """Critic updates towards fixed returns: `passes` over the batch, each in
    `minibatches` shuffled mini-batches, one optimizer step (of `tx`) each.

    SAO: K full-batch passes (`critic.steps_per_policy_step`, M_c = 1). The
    PPO-family presets follow the actor's E x M, as verl's critic does.

    Returns:
      `(state, metrics, values_before_BxT)`: the critic's values of the batch
      before the updates. With Monte-Carlo returns (SAO's lambda_critic = 1,
      gamma = 1, no value clip) and full-batch updates they come from the
      first update's own forward pass, so the pre-update values cost no pass
      of their own; otherwise they are computed first, as the GAE bootstrap
      of the returns and the value clip's anchor. `metrics`: the fit of
      those pre-update values (`critic/loss`, `explained_variance`,
      `r_squared`: what the advantages are computed from, before the
      critic has seen this batch), the last update's own forward pass under
      `critic/last_update/`, and token-weighted means over the updates
      (`grad_norm`, `value_clip_frac`).
    """
    cfg = self.config
    monte_carlo = (minibatches == 1 and cfg.critic.lam == 1.0
                   and cfg.advantage.gamma == 1.0 and not cfg.critic.value_clip)
    zeros_BxT = jnp.zeros(batch.rewards_BxT.shape, _F32)
    if monte_carlo:
      # The returns do not depend on V; the loss never reads old values.
      values_for_returns = zeros_BxT
    else:
      values_for_returns = self._values(self.critic_model(state), batch)
    _, returns = algorithms.gae(cfg, batch, values_for_returns,
                                cfg.critic.lam, self.mesh)
    returns = jax.lax.stop_gradient(returns)

    def loss_fn(trainable, micro, totals):
      model = nnx.merge(self._critic_def, trainable, state.critic_frozen)
      values = algorithms.critic_values(model, micro['batch'])
      loss, metrics = algorithms.value_loss(
          cfg, values, micro['returns_BxT'], micro['batch'],
          micro['values_before_BxT'])
      mask = algorithms.gae_mask(cfg, micro['batch'])
      weight = algorithms.microbatch_weight(
          mask, micro['batch'].segment_ids_BxT, totals,
          cfg.policy_loss.aggregation)
      return loss * weight, (dict(metrics, loss=loss),
                             jax.lax.stop_gradient(values),
                             _token_share(mask, totals))

    # The batch's rows and the constants of its updates, split together.
    data = {'batch': types.row_fields(batch), 'returns_BxT': returns,
            'values_before_BxT': values_for_returns}

    def one_update(carry, update):
      params, opt_state, first_values = carry
      micro_data = self._minibatch(data, state.step, update, minibatches,
                                   stream=1)
      totals = algorithms.batch_totals(
          algorithms.gae_mask(cfg, micro_data['batch']),
          micro_data['batch'].segment_ids_BxT)
      grads, (metrics, values, _) = _accumulate(
          lambda p, m: loss_fn(p, m, totals), params, micro_data,
          cfg.optim.microbatches, self._param_shardings['critic'])
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if monte_carlo:
        # Update 0's forward pass saw the critic before any update. A select
        # in the loop body, not update 0 peeled off: that would compile the
        # whole update twice.
        first_values = jnp.where(update == 0, values, first_values)
      return (params, opt_state, first_values), dict(
          metrics, grad_norm=optax.tree.norm(grads),
          _tokens=totals['tokens'])

    steps = passes * minibatches
    opt_before = state.critic_opt
    (params, opt_state, first_values), per_step = jax.lax.scan(
        one_update, (state.critic, state.critic_opt,
                     zeros_BxT if monte_carlo else None), jnp.arange(steps))
    state = state._replace(critic=params, critic_opt=opt_state,
                           critic_step=state.critic_step + steps)
    values_before = first_values if monte_carlo else values_for_returns
    pre_loss, pre = algorithms.value_loss(cfg, values_before, returns, batch,
                                          values_before)
    last = {k: v[-1] for k, v in per_step.items()}
    over_steps = _reduce_metrics(per_step, per_step.pop('_tokens'))
    metrics = {
        'loss': pre_loss, 'num_tokens': pre['num_tokens'],
        **{k: pre[k] for k in ('value_mean', 'return_mean',
                               'explained_variance', 'r_squared')},
        **{f'last_update/{k}': last[k] for k in (
            'loss', 'value_mean', 'explained_variance', 'r_squared')},
        'grad_norm': over_steps['grad_norm'],
        'value_clip_frac': over_steps['value_clip_frac'],
        'optimizer_steps': jnp.asarray(steps, _F32),
        'learning_rate': learning_rate,
    }
    metrics = {f'critic/{k}': v for k, v in metrics.items()}
    metrics.update(_skip_counts('critic', opt_before, opt_state))
    return state, metrics, values_before

  def _critic_only_step(self, state: types.LearnerState, batch):
    """Value pretraining: one full-batch critic update, the policy untouched.

    Its own schedule over `critic.pretrain_steps` batches (the critic's
    optimizer restarts for RL afterwards); `critic_step` counts its batches.
    """
    rate = optimizers.schedule(self.config.optim.critic,
                               self._pretrain_batches)
    return self._critic_updates(state, batch, 1, 1, self.pretrain_critic_tx,
                                rate(state.critic_step))[:2]

  def _values(self, critic, batch):
    """V_phi `[B, T]` of the batch, a micro-batch at a time (no gradient)."""
    return jax.lax.stop_gradient(map_microbatches(
        lambda rows: algorithms.critic_values(critic, rows),
        types.row_fields(batch), self.config.optim.microbatches))

  def _logprobs(self, policy, batch):
    """log pi `[B, T]` of the batch's tokens under `policy`, a micro-batch
    at a time (no gradient): the proximal, reference and parity passes."""
    return jax.lax.stop_gradient(map_microbatches(
        lambda rows: algorithms.policy_logprobs(
            policy, rows, self.sampling, chunk_size=self.logits_chunk,
            replay=self.replay)[0],
        types.row_fields(batch), self.config.optim.microbatches))

  def _minibatch(self, data, version, update, minibatches: int,
                 stream: int = 0):
    """Mini-batch `update % M` of pass `update // M` over `data`'s rows.

    Rows `perm_e[m::M]` of the batch, `perm_e` from `minibatch_permutation`
    (no shuffle when M = 1); strided so that, like micro-batches, each takes
    the same number of rows from every batch shard. `stream` keeps the
    critic's shuffles apart from the actor's.
    """
    if minibatches == 1:
      return data
    num_rows = data['batch'].action_mask_BxT.shape[0]
    perm = minibatch_permutation(self.config.seed, version,
                                 update // minibatches, num_rows, stream)
    rows = perm.reshape(num_rows // minibatches, minibatches)[
        :, update % minibatches]
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            jnp.take(x, rows, axis=0),
            self._sharding_by_rank[x.ndim]),
        data)

  def _train_step(self, state: types.LearnerState, batch):
    cfg = self.config
    metrics = {}
    values = None  # the critic's, for an estimator that reads them
    if self.uses_critic:
      state, critic_metrics, values = self._critic_updates(
          state, batch, self.critic_passes, self.critic_minibatches,
          self.critic_tx,
          optimizers.schedule(cfg.optim.critic, cfg.total_steps)(state.step))
      metrics.update(critic_metrics)
      # Pre-update values by default (verl's order): after K updates on this
      # very batch the baseline has regressed onto each trajectory's own
      # return, and A = R - V shrinks towards 0.
      if cfg.advantage.values_from == 'post_update':
        values = self._values(self.critic_model(state), batch)
    adv, running_mean = self.algorithm.estimator.advantages(
        cfg, batch, values, state.running_mean, self.mesh)
    if cfg.advantage.normalize:
      adv = advantages.normalize_advantages(adv, batch.action_mask_BxT)
    adv = jax.lax.stop_gradient(adv)
    mask = batch.action_mask_BxT
    count = jnp.maximum(jnp.sum(mask), 1)
    metrics['advantage/mean'] = jnp.sum(jnp.where(mask, adv, 0.0)) / count
    metrics['advantage/abs_mean'] = jnp.sum(jnp.where(mask, jnp.abs(adv),
                                                      0.0)) / count
    # Everything the updates treat as constants, computed once per batch;
    # mini-batches take rows, so the per-trajectory fields stay behind.
    data = {'batch': types.row_fields(batch), 'advantages_BxT': adv}
    if self.algorithm.needs_proximal_logprobs:
      data['prox_logp_BxT'] = self._logprobs(self.policy_model(state), batch)
    if self.uses_ref_policy:
      data['ref_logp_BxT'] = self._logprobs(
          nnx.merge(self._policy_def, state.ref_policy), batch)
    policy, actor_opt, policy_metrics, old_logp = self._policy_updates(
        state, data)
    metrics.update({f'policy/{k}': v for k, v in policy_metrics.items()})
    # log pi_old against mu, token by token: the proximal pass where the
    # loss made one, the single step's own forward pass, or (several steps
    # against mu: `behavior` mode, DIS with M > 1) a pass of its own.
    if 'prox_logp_BxT' in data:
      old_logp = data['prox_logp_BxT']
    elif old_logp is None:
      old_logp = self._logprobs(self.policy_model(state), batch)
    parity = logprob_parity.parity_metrics(
        old_logp, batch.behavior_logprobs_BxT, batch.action_mask_BxT,
        state.step - batch.versions_BxT, cfg.rollout.max_staleness)
    metrics.update({f'parity/{k}': v for k, v in parity.items()})
    metrics.update(_skip_counts('policy', state.actor_opt, actor_opt))
    state = state._replace(policy=policy, actor_opt=actor_opt,
                           running_mean=running_mean, step=state.step + 1)
    return state, metrics

  def _policy_updates(self, state: types.LearnerState, data):
    """E passes of M shuffled mini-batches, one optimizer step each (SAO §2).

    Mini-batches are `_minibatch`'s. Every step's loss is its mini-batch's
    own mean (as verl and OpenRLHF do); micro-batches accumulate inside a
    step.

    Returns:
      `(policy, actor_opt, metrics, old_logp_BxT)`: `old_logp_BxT` is the
      one step's log pi_old when E x M = 1, else None; metrics are
      token-weighted means over
      the steps, except `*_min` / `*_max` (extremes over the steps), token
      counts (per pass over the batch), `loss_first` (the first step's loss,
      before the policy moved), `optimizer_steps` and `learning_rate` (the
      batch's: schedules count batches).
    """
    cfg = self.config
    epochs, minibatches = cfg.optim.policy_epochs, cfg.optim.policy_minibatches
    steps = epochs * minibatches
    with_entropy = bool(cfg.policy_loss.entropy_coef)

    def loss_fn(params, micro, totals):
      model = nnx.merge(self._policy_def, params)
      batch = micro['batch']
      logp, entropy, routing = algorithms.policy_logprobs(
          model, batch, self.sampling, with_entropy, self.logits_chunk,
          self.replay)
      loss, loss_metrics = algorithms.policy_loss(
          cfg, logp, batch, micro['advantages_BxT'], micro.get('prox_logp_BxT'),
          entropy, micro.get('ref_logp_BxT'), self.mesh)
      router_loss, router_metrics = algorithms.routing_terms(cfg, routing)
      loss = loss + router_loss
      loss_metrics.update(router_metrics)
      weight = algorithms.microbatch_weight(
          batch.action_mask_BxT, batch.segment_ids_BxT, totals,
          cfg.policy_loss.aggregation)
      # The log-probs come back (rows): with one step per batch they are
      # log pi_old, the parity metrics' left side, at no extra pass.
      return loss * weight, (dict(loss_metrics, loss=loss),
                             jax.lax.stop_gradient(logp) if steps == 1
                             else None,
                             _token_share(batch.action_mask_BxT, totals))

    def one_update(carry, update):
      params, opt_state = carry
      micro_data = self._minibatch(data, state.step, update, minibatches)
      totals = algorithms.batch_totals(micro_data['batch'].action_mask_BxT,
                                       micro_data['batch'].segment_ids_BxT)
      grads, (step_metrics, logp, _) = _accumulate(
          lambda p, m: loss_fn(p, m, totals), params, micro_data,
          cfg.optim.microbatches, self._param_shardings['policy'])
      updates, opt_state = self.actor_tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return (params, opt_state), (dict(step_metrics,
                                        grad_norm=optax.tree.norm(grads),
                                        _tokens=totals['tokens']), logp)

    (policy, actor_opt), (per_step, logp_SxBxT) = jax.lax.scan(
        one_update, (state.policy, state.actor_opt), jnp.arange(steps))
    loss_first = per_step['loss'][0]
    metrics = _reduce_metrics(per_step, per_step.pop('_tokens'))
    # Counts add up over the steps: report them per pass over the batch.
    for name in _COUNT_METRICS & set(metrics):
      metrics[name] = metrics[name] / epochs
    metrics['loss_first'] = loss_first
    metrics['optimizer_steps'] = jnp.asarray(steps, _F32)
    metrics['learning_rate'] = optimizers.schedule(
        cfg.optim.actor, cfg.total_steps)(state.step)
    return policy, actor_opt, metrics, (None if logp_SxBxT is None
                                        else logp_SxBxT[0])


def minibatch_permutation(seed: int, version, epoch, num_rows: int,
                          stream: int = 0):
  """The row order of one pass over a batch: fixed by seed, version, pass
  (and `stream`: 0 the actor's, 1 the critic's)."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), version),
                           epoch)
  if stream:
    key = jax.random.fold_in(key, stream)
  return jax.random.permutation(key, num_rows)


# Metrics that count tokens: summed over micro-batches and steps.
_COUNT_METRICS = frozenset({'num_tokens', 'nonfinite_tokens'})


def _token_share(mask_BxT, totals):
  """A micro-batch's share of its mini-batch's loss tokens (metric weight)."""
  return jnp.sum(mask_BxT).astype(_F32) / jnp.maximum(totals['tokens'], 1.0)


def _reduce_metrics(metrics_S, weights_S):
  """One value per metric from `[S]` stacked ones (micro-batches or steps).

  `*_min` / `*_max`: the extreme over the parts that had tokens; counts
  (`_COUNT_METRICS`): the sum; every other metric: the mean weighted by
  `weights_S` (the parts' tokens), so a micro-batch of few tokens counts for
  few, as it does in the full-batch loss.
  """
  has_tokens_S = weights_S > 0
  # No part had tokens: the extremes fall back to the first part's value.
  any_tokens = jnp.any(has_tokens_S)
  total = jnp.maximum(jnp.sum(weights_S), 1e-30)
  out = {}
  for name, values_S in metrics_S.items():
    if name.endswith('_min'):
      out[name] = jnp.where(
          any_tokens, jnp.min(jnp.where(has_tokens_S, values_S, jnp.inf)),
          values_S[0])
    elif name.endswith('_max'):
      out[name] = jnp.where(
          any_tokens, jnp.max(jnp.where(has_tokens_S, values_S, -jnp.inf)),
          values_S[0])
    elif name in _COUNT_METRICS:
      out[name] = jnp.sum(values_S)
    else:
      # where(): a part without tokens may report NaN (explained variance).
      out[name] = jnp.sum(jnp.where(has_tokens_S, values_S * weights_S,
                                    0.0)) / total
  return out


def _skip_counts(role: str, opt_before, opt_after) -> dict:
  """`<role>/nonfinite_skips`: the updates this step skipped (a non-finite
  gradient or norm); `<role>/nonfinite_skips_total`: since the optimizer
  state was made."""
  total = optimizers.nonfinite_count(opt_after)
  return {f'{role}/nonfinite_skips':
              total - optimizers.nonfinite_count(opt_before),
          f'{role}/nonfinite_skips_total': total}


def _accumulate(loss_fn, params, data, microbatches: int, shardings):
  """Sum of gradients (and token-weighted metrics) over micro-batches.

  `loss_fn(params, micro) -> (weighted_loss, (metrics, rows, share))` returns
  each micro-batch's share of the full-batch loss, so the sum is the
  full-batch gradient; its metrics are combined by `_reduce_metrics` with
  `share` (its share of the tokens) as weight. `rows` (a pytree of per-row
  arrays, or None) is what the forward pass computed for the micro-batch's
  rows; it comes back in the batch's row order. Gradients are pinned to
  `shardings` (the parameters' FSDP layout): left to propagation, a
  loop-carried sum can come out replicated, and then every device holds a
  full copy of the model's gradients.

  Returns:
    `(grads, (metrics, rows, share))`.
  """
  pin = lambda tree: jax.lax.with_sharding_constraint(tree, shardings)
  grad_fn = jax.grad(loss_fn, has_aux=True)
  if microbatches == 1:
    grads, aux = grad_fn(params, data)
    return pin(grads), aux

  def body(summed, micro):
    grads, aux = grad_fn(params, micro)
    return pin(jax.tree.map(jnp.add, summed, pin(grads))), aux

  zeros = pin(jax.tree.map(jnp.zeros_like, params))
  grads, (metrics_M, rows_M, share_M) = jax.lax.scan(
      body, zeros, _split_rows(data, microbatches))
  metrics = _reduce_metrics(metrics_M, share_M)
  return grads, (metrics, _merge_rows(rows_M), jnp.sum(share_M))


def _split_rows(tree, microbatches: int):
  """`[B, ...]` leaves -> `[M, B/M, ...]`, micro-batch m = rows m, m + M, ...

  Strided, not contiguous, so that each micro-batch takes the same number of
  rows from every batch shard (the rows are sharded in contiguous blocks) and
  none idles devices.
  """
  return jax.tree.map(
      lambda x: jnp.swapaxes(
          x.reshape((x.shape[0] // microbatches, microbatches)
                    + x.shape[1:]), 0, 1), tree)


def _merge_rows(tree_M):
  """`_split_rows` undone: `[M, B/M, ...]` -> `[B, ...]` in the row order."""
  return jax.tree.map(
      lambda x: jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:]), tree_M)


def map_microbatches(fn, data, microbatches: int):
  """`fn(data)` computed `microbatches` row blocks at a time (`lax.map`).

  For the forward-only passes over a whole batch (the critic's values, the
  proximal and reference log-probs): one micro-batch's activations are live
  at a time, as in the gradient passes, instead of the whole batch's. `fn`
  maps rows to rows (`[b, ...]` leaves in, `[b, ...]` leaves out), so the
  result equals `fn(data)`.
  """
  if microbatches == 1:
    return fn(data)
  return _merge_rows(jax.lax.map(fn, _split_rows(data, microbatches)))


def _global_array(local, target_sharding):
  """A global jax.Array from this process's rows (single- or multi-host)."""
  local = np.asarray(local)
  if jax.process_count() == 1:
    return jax.device_put(local, target_sharding)
  global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  return jax.make_array_from_process_local_data(target_sharding, local,
                                                global_shape)


def mesh_from_config(config, devices=None):
  """The learner's mesh: config.mesh resolved against the devices."""
  devices = jax.devices() if devices is None else devices
  sizes = sharding.mesh_shape(dict(config.mesh), len(devices))
  return sharding.make_mesh(sizes, devices)
