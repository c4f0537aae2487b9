r"""SAO on the embedded default model and task: every default of sao_jax lives here.

Run (the README's main job, `make demo`):

  python -m sao_jax.train --config=configs/default.py --workdir=runs/demo

SAO on SmolLM2-135M-Instruct and reasoning-gym's one-digit, two-term chain sums,
with one local JetStream server on loopback, sized for a 2-core CPU: about 13
minutes, held-out accuracy before and after printed side by side, learning
curves plotted to workdir/learning_curves.png. Print the resolved config with
`python -m sao_jax.tools.show_config --config=configs/default.py`.

Baselines of the paper (SAO.md §3) are selected with the recipe argument, which
applies their presets (sampling, advantage estimator, policy loss, clip widths):

  --config=configs/default.py:algorithm=grpo        # vanilla GRPO, clip-higher
  --config=configs/default.py:algorithm=grpo_dis    # GRPO groups + DIS
  --config=configs/default.py:algorithm=vapo        # 1 rollout, GAE critic, PPO
  --config=configs/default.py:algorithm=running_mean
  --config=configs/default.py:algorithm=ppo         # fixed-lambda GAE, PPO clip

Any value can then be overridden, e.g. `--config.critic.steps_per_policy_step=1`.
Paper symbols are named next to each field.
"""

import ml_collections

from sao_jax import config_lib
from sao_jax.envs import registry
from sao_jax.rl import algorithms


def get_config(arg=None):
  """Returns the default config; `arg` is "algorithm=<name>[,seed=<n>]"."""
  arg = config_lib.parse_arg(arg, algorithm='sao', seed=0)
  if arg.algorithm not in algorithms.ALGORITHMS:
    raise config_lib.ConfigError(
        f'unknown algorithm {arg.algorithm!r}; expected one of'
        f' {", ".join(algorithms.ALGORITHMS)}'
        f'{config_lib.did_you_mean(arg.algorithm, algorithms.ALGORITHMS)}')
  c = ml_collections.ConfigDict()
  c.algorithm = arg.algorithm  # sao | grpo | grpo_dis | vapo | running_mean | ppo
  c.seed = arg.seed  # RNG of rollout sampling and of sampled evaluation

  c.model = ml_collections.ConfigDict()
  # 'smollm2-135m-instruct' (embedded), 'tiny-random' (tests), or a Hugging
  # Face checkpoint directory.
  c.model.source = 'smollm2-135m-instruct'
  c.model.dtype = 'float32'  # compute dtype: float32 | bfloat16
  c.model.param_dtype = 'float32'  # parameter (and AdamW state) dtype
  # The LM head's operands: '' = model.dtype | float32. float32 under
  # bfloat16 compute keeps the vocabulary-wide matmul (the logsumexp is
  # always float32) out of bf16 rounding, on the learner and the servers
  # alike: the train/inference log-prob mismatch it causes shows in the
  # parity/* metrics (BENCHMARKS.md, log-prob parity).
  c.model.logits_dtype = ''
  # Full-sequence self-attention (learner passes, server prefill):
  # auto | dense | blockwise | splash | cudnn. auto: JAX's splash kernel on
  # TPU; elsewhere blockwise (online softmax, memory linear in T) past 512
  # tokens, dense (the definition) below. cudnn: NVIDIA's fused kernel via
  # jax.nn.dot_product_attention, for unpacked rows only (one trajectory per
  # row: batching.pack_sequences='off').
  c.model.attention = 'auto'
  # Recompute layer activations in the backward pass. The demo's three
  # 30-layer backward passes (K = 2 critic updates, one policy update) would
  # otherwise hold every layer's activations; with the two settings below it
  # sets the demo's peak memory (BENCHMARKS.md, "Memory").
  c.model.remat = True
  # The layer stack: scan (compile time independent of depth) | unroll (the
  # scan unrolled: faster off TPU for shallow stacks) | auto (unroll off TPU
  # up to 32 layers, scan on TPU; BENCHMARKS.md, "Learner"). The demo scans:
  # with remat an unrolled stack's temporaries grow faster per layer, and a
  # scanned stack compiles once per function, not once per layer.
  c.model.layer_loop = 'scan'
  # Sequence positions per chunk of the learner's LM head: the [B, C, V]
  # logits of one chunk at a time, recomputed in the backward pass, never the
  # whole [B, T, V] (0: the whole sequence at once): with SmolLM2's 49152
  # words the whole logits are the largest buffers of the backward pass.
  c.model.logits_chunk_size = 16
  # MoE policies only. moe_routing: learn (the learner's routers pick each
  # token's experts) | replay (tokens the engine generated go to the experts
  # it recorded, so pi and mu are computed on the same experts; the router
  # still gets its gradient through the probabilities of those experts).
  # Either way policy/routing_disagreement reports the share of recorded
  # (token, layer, slot) picks the learner's routers would not make.
  c.model.moe_routing = 'learn'
  # The routers' load-balancing loss (HF router_aux_loss_coef; Qwen3-MoE
  # pretrained with 0.001) added to the policy loss; 0 leaves it out.
  c.model.router_aux_loss_coef = 0.0

  # The task: its name, seed, answer format and held-out count, and a section
  # of options per environment, `task.<name>` (each environment's own, listed
  # in docs/configuration.md): arith_chain_sum | arith_countdown | calculator
  # (multi-turn tool use) | humaneval (code in a sandbox) | jsonl (local
  # prompts through TFDS) | word_target (the tiny model's task); any other
  # name is a reasoning-gym dataset, whose options are `task.reasoning_gym`.
  c.task = registry.task_config(name='chain_sum', seed=0,
                                answer_format='plain', held_out=200)
  # reasoning-gym dataset parameters (the demo: 2 one-digit terms).
  #   min_terms: fewest terms of a chain sum
  #   max_terms: most terms of a chain sum
  #   min_digits: fewest digits of a term
  #   max_digits: most digits of a term
  c.task.reasoning_gym.dataset_kwargs = ml_collections.ConfigDict(
      dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))

  c.total_steps = 22  # policy steps of the run
  c.batch_size = 16  # B: trajectories per policy step (prompts x G)
  c.group_size = 1  # G: samples per prompt; 1 is SAO's single rollout

  # Policy loss. DIS: ratio_t = exp(logp_t - mu_t) against the rollout
  # engine's logprob mu_t; tokens outside (1 - eps_low, 1 + eps_high) get no
  # gradient (SAO.md §1.2). PPO: clip against a recomputed old policy.
  c.policy_loss = ml_collections.ConfigDict()
  c.policy_loss.name = 'dis'  # dis | ppo
  c.policy_loss.eps_low = 0.3  # epsilon_low (paper, math: 0.3; coding: 0.8)
  c.policy_loss.eps_high = 5.0  # epsilon_high (paper, math: 5.0; coding: 3.0)
  c.policy_loss.dual_clip = 0.0  # PPO dual-clip c > 1; 0 disables it
  c.policy_loss.aggregation = 'token_mean'  # token_mean | seq_mean_token_mean
  # PPO's old policy (DIS ignores it: its ratio is always against mu_t).
  # recompute = the weights at the start of the batch (PPO; verl and
  # OpenRLHF's default; the engine-learner lag is not corrected); behavior =
  # the engine's mu_t (verl's rollout-correction "bypass"); decoupled = AReaL's
  # decoupled PPO: clip against the recomputed proximal policy, each token
  # weighted by min(pi_prox / mu, C) (C truncates where AReaL masks the tokens
  # above it, as verl's truncated importance sampling does).
  c.policy_loss.old_logprobs = 'recompute'  # recompute | behavior | decoupled
  c.policy_loss.behavior_weight_cap = 2.0  # C of `decoupled` (verl TIS: 2)
  # beta of a k3 KL(mu || pi) penalty towards the rollout engine's policy
  # (not the reference model); off in SAO.
  c.policy_loss.behavior_kl_coef = 0.0
  # beta of GRPO's KL(pi || pi_ref) penalty to the frozen initial policy; off by
  # default. Costs one more copy of the policy's parameters in the learner
  # state and one more forward pass per batch.
  c.policy_loss.ref_kl_coef = 0.0
  c.policy_loss.ref_kl_estimator = 'k3'  # k1 | k3 (GRPO's, verl low_var_kl)
  c.policy_loss.entropy_coef = 0.0  # entropy bonus; off in SAO

  # Advantage A_t. Skip-observation GAE runs over action tokens only
  # (SAO.md §1.4) with the length-adaptive lambda_policy = 1 - 1/(alpha l).
  c.advantage = ml_collections.ConfigDict()
  c.advantage.estimator = 'skip_observation_gae'  # | grpo | dr_grpo | running_mean
  # True: GAE's recursion skips observation tokens (SAO). False runs it through
  # every response token, observations included, as the paper's ablation
  # "naive GAE" (the critic then also fits values on observations).
  c.advantage.skip_observations = True
  c.advantage.gamma = 1.0  # gamma
  c.advantage.adaptive_lambda = True  # lambda_policy = 1 - 1/(alpha * l)
  c.advantage.alpha = 1.5  # alpha of the length-adaptive lambda
  c.advantage.lam = 0.95  # lambda_policy when adaptive_lambda is False
  # Whiten A over the batch's action tokens: (A - mean) / sqrt(var + 1e-8),
  # var with Bessel's correction (verl's masked_whiten). SAO: off (DIS's
  # advantages are the critic's raw GAE); ppo/vapo presets: on, as verl's GAE.
  c.advantage.normalize = False
  # The critic's values behind A: pre_update (before the batch's K critic
  # updates, as verl computes them) | post_update (after them: the baseline
  # has regressed onto each trajectory's own return; an ablation).
  c.advantage.values_from = 'pre_update'
  # Running-mean baseline, per question (a digest of the prompt tokens) or
  # global; a question with no history yet uses the global window's mean.
  c.advantage.running_mean_scope = 'prompt'  # prompt | global
  c.advantage.running_mean_window = 8  # W per question (paper: 8)
  c.advantage.running_mean_global_window = 128  # W global (paper online: 128)
  c.advantage.running_mean_slots = 65536  # distinct questions tracked

  # Critic V_phi: same backbone, scalar head, trained K times per policy step.
  c.critic = ml_collections.ConfigDict()
  # K passes over each batch, each in M_c shuffled mini-batches, one critic
  # optimizer step per mini-batch. SAO: K = 2 full-batch steps (M_c = 1).
  # 0 follows the actor's optim.policy_minibatches, as verl's critic
  # defaults to the actor's mini-batch size (the ppo/vapo presets; their K is
  # set to the actor's E = 1, and does not follow a later override of E).
  c.critic.steps_per_policy_step = 2  # K (paper: 2)
  c.critic.minibatches = 1  # M_c; 0: the actor's M
  c.critic.frozen_attention = True  # attention parameters not trained in RL
  c.critic.lam = 1.0  # lambda_critic: Monte-Carlo returns
  # PPO value clip: V_old + clip(V - V_old, +-eps) against the values before
  # the batch's updates; 0 disables it. SAO: off (its K updates regress fixed
  # Monte-Carlo returns); ppo/vapo presets: 0.5 (verl's cliprange_value).
  c.critic.value_clip = 0.0
  # Value pretraining on the initial policy's rollouts: stops when the
  # critic's R^2 = 1 - MSE / Var(R) (explained variance that also counts an
  # offset from the mean return; measured on each new batch before training
  # on it) has not gained pretrain_min_delta for pretrain_patience batches
  # (batches of equal rewards, where it is undefined, do not count), or after
  # pretrain_steps batches. The critic's optimizer then starts afresh, so
  # RL's warm-up begins at RL step 0. On the demo the rule stops it before
  # the cap (BENCHMARKS.md, "Value pretraining").
  c.critic.pretrain_steps = 12  # at most this many batches
  c.critic.pretrain_patience = 3  # batches without gain before stopping
  c.critic.pretrain_min_delta = 0.01  # the R^2 gain that counts

  # Optimisers (AdamW). Paper (30B MoE): actor 1e-6, critic 5e-6 (5x),
  # 10-step warm-up; the demo's 135M model over 30 steps needs faster rates.
  c.optim = ml_collections.ConfigDict()
  # Policy updates per batch (SAO.md §2): values, advantages and old
  # log-probs are computed once, then E passes over the batch, each in M
  # shuffled mini-batches, one optimizer step per mini-batch. SAO: E = M = 1
  # (DIS compares with mu_t); the PPO-clipped presets use verl's default M = 4.
  c.optim.policy_epochs = 1  # E: passes over each batch
  c.optim.policy_minibatches = 1  # M: mini-batches per pass
  # Gradient accumulation inside one optimizer step: each mini-batch in this
  # many parts.
  c.optim.microbatches = 1
  for role, lr in (('actor', 2e-5), ('critic', 1e-4)):
    o = ml_collections.ConfigDict()
    o.learning_rate = lr  # peak learning rate, after the warm-up
    # Linear warm-up over this many policy steps (batches, not optimizer
    # steps: M = 4 presets warm up over as many batches as SAO): batch b
    # trains at (b + 1) / (warmup_steps + 1) of the rate, above 0 from the
    # first batch (a warm-up from 0 wastes the first update).
    o.warmup_steps = 3
    # After the warm-up: constant | cosine (decay to min_lr_ratio x the
    # rate at the run's last batch; verl's and OpenRLHF's cosine).
    o.schedule = 'constant'
    o.min_lr_ratio = 0.1  # the cosine's floor, a fraction of learning_rate
    o.grad_clip_norm = 1.0  # global gradient-norm clip
    o.b1 = 0.9  # AdamW beta1
    o.b2 = 0.999  # AdamW beta2
    o.weight_decay = 0.0  # AdamW decoupled weight decay
    # AdamW's first moment: float32 | bfloat16 (half its memory; the
    # second moment stays float32, as in MaxText's `mu_dtype`).
    o.mu_dtype = 'float32'
    c.optim[role] = o
  # The demo's actor rate decays (cosine to 0.1x by the last step): its
  # training stream repeats a few dozen distinct questions (the held-out set
  # takes most of the task's one-digit sums), and at a constant rate the
  # answers drifted late in a run while the training reward held
  # (BENCHMARKS.md, "Held-out: cut replies earn nothing, the actor's rate
  # decays"). The critic's rate stays constant: its targets move with the
  # policy. So the critic/actor
  # rate ratio is the spec's 5x at the peak and grows to 50x at the last
  # step (a deliberate deviation; `--config.optim.critic.schedule=cosine`
  # keeps 5x throughout). tiny.py and the TPU presets keep a constant rate.
  c.optim.actor.schedule = 'cosine'

  # Kernels for the DIS loss and GAE: auto = Pallas on TPU, XLA elsewhere;
  # xla | pallas force one (pallas runs in interpret mode off TPU).
  c.kernels = ml_collections.ConfigDict()
  c.kernels.implementation = 'auto'  # auto | xla | pallas

  # Device mesh: data x fsdp x expert x sequence x tensor; -1 takes the
  # devices the others leave.
  #   data: data parallel (batch rows; parameters replicated)
  #   fsdp: fully sharded data parallel (batch rows and parameters)
  #   expert: expert parallel (a routed layer's experts split; batch rows
  #     too, data parallel for the rest; must divide the expert count)
  #   sequence: context parallel (each row's tokens split; for trajectories
  #     one chip cannot hold: activations and saved residuals split, while
  #     attention gathers the keys and values of the whole row)
  #   tensor: tensor parallel (within each layer)
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1,
                                          sequence=1, tensor=1))

  # Rollouts: JetStream servers, sampling, asynchrony (SAO.md §2).
  c.rollout = ml_collections.ConfigDict()
  c.rollout.max_staleness = 2  # learner_version - oldest token version bound
  c.rollout.sync_every = 1  # push weights to servers every N policy steps
  # Servers: '' starts num_servers local ones on loopback; otherwise a comma
  # separated list of host:port of running `python -m sao_jax.serve`.
  c.rollout.server_addresses = ''
  c.rollout.num_servers = 1  # the demo shares 2 CPU cores with the learner
  c.rollout.bind_host = '127.0.0.1'  # where serve listens (0.0.0.0 for pods)
  c.rollout.admin_secret_file = ''  # else $SAO_ADMIN_SECRET
  # Engine shape (per server).
  c.rollout.max_concurrent_decodes = 16  # decode slots
  # The servers' weights: '' keeps model.param_dtype | float32 | bfloat16.
  # bfloat16 halves the stored weights and computes in model.dtype from the
  # rounded weights: mu_t then differs from the learner's log-probs by that
  # rounding, which the DIS ratio pi/mu_t sees and corrects, as it does an
  # inference engine's kernels in the paper. On XLA:CPU with a float32
  # model.dtype it costs more memory than it saves: the weights are
  # converted on every call (BENCHMARKS.md, "Memory").
  c.rollout.param_dtype = ''
  # The servers' compute dtype: '' keeps model.dtype | float32 | bfloat16.
  # Apart from model.dtype it is an inference engine whose kernels differ
  # from the learner's (the log-prob parity benchmark sets the two apart).
  c.rollout.dtype = ''
  c.rollout.max_prefill_length = 128  # a JetStream padding bucket
  c.rollout.max_target_length = 160  # KV cache per slot: prompt + generation
  # Device memory per server for finished rows' keys/values: a multi-turn
  # episode's next turn extends its last and prefills only the new tokens
  # (LRU, invalidated by a weight swap). 0: off, every turn prefills whole;
  # off here because single-turn tasks never reuse a row (multi-turn
  # recipes, e.g. llama3_8b_agent_32k.py, turn it on).
  c.rollout.prefix_cache_gib = 0.0
  # GRPO groups of single-turn tasks as one request with samples_per_slot = G
  # (one prefill for the group); multi-turn episodes need separate requests.
  c.rollout.group_in_one_request = False
  # Sampling distribution; the learner recomputes log-probs under the same.
  c.rollout.temperature = 0.8
  c.rollout.top_k = 0  # 0: off
  c.rollout.top_p = 1.0  # 1: off
  # Client.
  c.rollout.max_in_flight_per_server = 16  # the server never refuses load
  c.rollout.request_deadline_s = 300.0  # seconds one generation may take
  c.rollout.max_retries = 3  # re-sends to another live server on UNAVAILABLE
  c.rollout.get_batch_timeout_s = 1800.0  # learner gives up waiting for data
  # Supervision: servers are health-checked every health_interval_s; one that
  # misses health_timeout_s or push_timeout_s is routed around until it answers
  # and serves the current weights again. No live server for no_server_grace_s
  # ends the run with an error (a local server restart fits in it).
  c.rollout.health_interval_s = 2.0  # seconds between health checks
  c.rollout.health_timeout_s = 5.0  # a slower answer marks a server sick
  c.rollout.push_timeout_s = 120.0  # one server loading one weight version
  # How weights reach the servers: 'stream' sends them in checksummed buckets
  # of weight_bucket_mib, in the servers' param dtype, straight into their
  # device arrays (no file): the admin gRPC call authenticates the push and
  # hands out a one-time token, and the bytes go over a TCP connection to the
  # server's weight_data_port (gRPC in Python copies each message several
  # times: BENCHMARKS.md, "Weight sync"). A push overlaps the next learner
  # step. 'files' writes an orbax checkpoint per version under
  # <workdir>/weights for servers that share storage with the learner.
  c.rollout.weight_transport = 'stream'
  # A bucket is read whole, checked and copied into place; each costs a few
  # GIL round trips on either side, so fewer, larger ones go faster under
  # decode load (BENCHMARKS.md, "Weight sync": 16 MiB).
  c.rollout.weight_bucket_mib = 16.0
  # Per bucket: sum64 (64-bit word sum; catches changed, zeroed or missing
  # bytes, at memory speed) | crc32 (also reordered bytes, at several times
  # the cost: a large share of a push on a few cores; "Weight sync").
  c.rollout.weight_checksum = 'sum64'
  c.rollout.weight_bucket_timeout_s = 30.0  # either side, per bucket
  # True: a streamed push starts while the parameters are still being copied
  # to the host, each piece sent once it is there: the push ends sooner, but
  # where copy and send share the cores the copy (which the learner waits
  # for) takes longer (BENCHMARKS.md, "Weight sync"). False: copy, then
  # send during the next step.
  c.rollout.weight_send_while_copying = False
  # True: on both ends of a push each version goes into the host pages of
  # one no longer held, instead of fresh ones (faulting fresh pages in is
  # most of the learner's wait for a push on a few cores, and a large part
  # of a server's receive: "Reused host pages"). The cost is one more copy of
  # the weights kept between pushes on each side: on a TPU host that is
  # host RAM beside the HBM; on CPU (the demo) it raises the learner's
  # peak, which the training step sets, and each server's resident set.
  c.rollout.weight_reuse_host_buffers = False
  # 'sparse': a server that acknowledged the last version gets only the
  # elements whose bits (in its dtype) changed since, as indices and values,
  # piece by piece where that is smaller (docs/design/weight_sync.md,
  # "Deltas"); the learner keeps one more host copy of the weights. Pays in
  # bf16, where most of a small step's changes round away; an f32 Adam step
  # changes nearly every element. 'off': every version whole.
  c.rollout.weight_delta = 'off'
  # > 0: an element is sent only once it moved by more than this fraction of
  # its served value (so servers hold weights within it of the learner's);
  # every weight_delta_anchor_every-th version then goes whole and exact.
  c.rollout.weight_delta_rtol = 0.0
  c.rollout.weight_delta_anchor_every = 16  # 0: only the first version whole
  # The server's data port for streamed pushes, on its bind_host: 0 a free
  # one at each start; fix it where a firewall must let it through.
  c.rollout.weight_data_port = 0
  c.rollout.no_server_grace_s = 180.0  # no live server this long: error
  c.rollout.max_restart_backoff_s = 30.0  # local servers: 1, 2, 4, ... s up to this
  # Host-side queue between workers and the learner.
  c.rollout.queue_capacity = 0  # finished trajectories held per host; 0: admission bounds it
  c.rollout.logprob_tolerance = 1e-3  # mu_t > this is a malformed trajectory
  # Rewards here are O(1); one of larger magnitude is an environment bug,
  # rejected and counted (queue/rejected/reward_out_of_range), not trained on.
  c.rollout.max_abs_reward = 1e6
  c.rollout.num_workers = 32  # concurrent episodes per host (admission-gated)
  # Episodes.
  c.rollout.max_new_tokens = 12  # per model turn
  # Whether a last reply cut by max_new_tokens keeps the environment's
  # reward. The demo's chain-sum grader scores a reply's last number, and a
  # cut reply ("3 + 8 = 11. The answer to") often ends on the right one: with
  # the reward kept, runs drift to run-on replies (BENCHMARKS.md, "Held-out:
  # cut replies earn nothing"). False: such a reply earns 0, as an unfinished
  # answer does in verifiable-reward graders that need a complete answer.
  c.rollout.reward_cut_replies = False
  c.rollout.max_sequence_length = 64  # T of a batch: prompt+actions+observations

  # Sequence packing: a batch's trajectories laid back to back in rows of
  # T = rollout.max_sequence_length by first-fit decreasing, each a segment
  # with positions from 0 that attention, GAE and the per-trajectory loss
  # mean never cross. Agent trajectories vary by an order of magnitude in
  # length, so one per row is mostly padding. Rows are fixed (packed_rows),
  # so the step compiles once; a batch that does not fit them is packed into
  # batch_size rows instead (one more compile, nothing dropped).
  # auto = on for a task whose episodes can take more than one turn (its
  # EnvSpec's max_turns: calculator, word_target with turns > 1, humaneval
  # with max_turns > 1) on one process, off for single-turn ones, which
  # rarely share a row (BENCHMARKS.md, "Packing").
  c.batching = ml_collections.ConfigDict()
  c.batching.pack_sequences = 'auto'  # auto | on | off (auto: multi-turn)
  # R, rows a packed batch fills; 0: 3/8 of batch_size (what calculator-like
  # batches needed; "Packing"), rounded up to whole mini- and micro-batches
  # on every data-parallel shard.
  c.batching.packed_rows = 0

  # Evaluation on the held-out set (greedy decoding, extracted answers).
  c.eval = ml_collections.ConfigDict()
  c.eval.every = 11  # also every N policy steps; 0: at the start and end only
  c.eval.at_start = True  # evaluate the untrained policy first
  # Per held-out reply: the rollouts' budget, so that the held-out score
  # judges replies as training rewarded them: a longer budget scores a
  # run-on reply by a later number than the one training rewarded
  # (BENCHMARKS.md, "The main job").
  c.eval.max_new_tokens = 12
  # 0: greedy, accuracy of the policy's mode. > 0 samples each held-out reply
  # at this temperature (key from seed and step): the accuracy of the policy's
  # distribution, which keeps moving after the mode is already right.
  c.eval.temperature = 0.0
  c.eval.batch_size = 64  # held-out prompts decoded together

  # Orbax checkpoints in workdir/checkpoints; a workdir resumes where it was.
  #   every: save every N policy steps (and on SIGTERM)
  #   max_to_keep: newest checkpoints kept
  #   write_concurrent_gb: most GB of the state being written at once (the
  #     background write's encode buffers, unbounded, raise the learner's
  #     peak for the seconds of a save: BENCHMARKS.md, "Memory")
  c.checkpoint = ml_collections.ConfigDict(dict(every=10, max_to_keep=2,
                                                write_concurrent_gb=1))
  # Logs (metrics.jsonl is always written):
  #   tensorboard: also write workdir/tensorboard
  #   progress: show a progress bar over policy steps
  c.log = ml_collections.ConfigDict(dict(tensorboard=True, progress=True))
  c.export_hf = False  # write the trained policy to workdir/hf_export

  # Multi-host (TPU pods): join jax.distributed before touching devices.
  #   enabled: call jax.distributed.initialize
  #   coordinator_address: host:port of process 0; '': discover (Cloud TPU)
  #   num_processes: number of processes; -1: discover
  #   process_id: this process's index; -1: discover
  #   local_device_ids: comma-separated local devices; '': all
  c.distributed = ml_collections.ConfigDict(dict(
      enabled=False, coordinator_address='', num_processes=-1, process_id=-1,
      local_device_ids=''))

  # The algorithm's presets (SAO.md §3): `algorithms.ALGORITHMS`, where each
  # baseline's settings are written down beside its parts.
  config_lib.apply_presets(
      c, algorithms.ALGORITHMS[c.algorithm].config_presets())
  return c
