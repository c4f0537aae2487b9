#!/usr/bin/env bash
# Starts the JetStream servers on the server VMs and the learner on every
# worker of the learner VM, under nohup. Skips what is already running.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/launch.sh [--env-file FILE] [--dry-run] [options]
                             [--config.x=y ...] [-- --config.x=y ...]

  1. Output: OUTPUT_MODE=gcsfuse (default) mounts BUCKET with gcsfuse at
     MOUNT_POINT (default /mnt/sao) on every worker; the workdir is
     MOUNT_POINT/runs/RUN_NAME, i.e. BUCKET/runs/RUN_NAME, shared by all
     hosts (checkpoint shards, policy weights the servers load). With
     OUTPUT_MODE=rsync (a single-host learner without server VMs only) the
     workdir is ~/sao_runs/RUN_NAME, restored from the bucket when empty and
     copied there with `gcloud storage rsync` every SYNC_EVERY_S seconds and
     when the learner exits.
  2. With server VMs: an admin secret (made once, kept in
     ~/.config/sao_jax/LEARNER_NAME.admin_secret, mode 600) is copied to
     ~/.sao/admin_secret (mode 600) on every worker; it is never printed nor
     put on a command line.
  3. Starts `python -m sao_jax.serve` on worker 0 of each server VM, bound to
     0.0.0.0:SERVER_PORT (--config.rollout.bind_host=0.0.0.0), with
     --server_index=I for PREFIX-I (folded into its sampling key, so that
     the servers draw different random streams) and
     --weights_root=WORKDIR/weights (the only directory it loads the
     learner's pushed weights from), and waits until each
     prints its ready line (up to SERVER_READY_TIMEOUT_S, default 1800;
     --no-wait skips).
  4. Reads each server VM's internal IP and starts `python -m sao_jax.train`
     on every learner worker (--worker=all) with --config=CONFIG,
     --config.distributed.enabled=True (multi-host slices; jax discovers the
     coordinator and process ids on Cloud TPU), and
     --config.rollout.server_addresses=IP1:PORT,IP2:PORT,...
Every `--config.x=y` argument and everything after `--` is passed verbatim
to the learner and to the servers (after the script's own flags, so they
win). Logs: ~/sao_logs/{learner,server}.log on each worker, copied to
BUCKET/runs/RUN_NAME/logs/<hostname>/ every SYNC_EVERY_S seconds.
Without server VMs the learner starts config.rollout.num_servers servers
on its own hosts, as on a workstation.

Options (each overrides the env file's variable of the same name):
  --env-file FILE       variables (default tpu_scripts/sao.env if present)
  --config FILE[:ARG]   the recipe (CONFIG), e.g. configs/llama3_8b_v5p.py
  --run-name NAME       BUCKET/runs/NAME (RUN_NAME; default LEARNER_NAME);
                        launching the same name again resumes the run
  --project, --zone, --learner-name, --learner-accelerator, --num-servers,
  --server-name-prefix, --server-accelerator, --server-zone, --server-port,
  --bucket, --output-mode, --mount-point, --sync-every-s, --distributed VALUE
  --learner-only        do not start servers (they already run)
  --servers-only        start the servers, not the learner
  --no-wait             do not wait for the servers' ready lines
  --dry-run             print the commands (`+ ...`), run nothing; server
                        IPs are shown as IP_OF_<name>
  -h, --help            this text
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"

do_learner=1
do_servers=1
wait_ready=1
for arg in ${REST_ARGS[@]+"${REST_ARGS[@]}"}; do
  case "$arg" in
    --learner-only) do_servers=0 ;;
    --servers-only) do_learner=0 ;;
    --no-wait) wait_ready=0 ;;
    *) usage_error "unknown argument: $arg (config overrides start with --config.)" ;;
  esac
done
require PROJECT ZONE LEARNER_NAME CONFIG RUN_NAME
require_bucket
SERVER_READY_TIMEOUT_S=${SERVER_READY_TIMEOUT_S:-1800}

if [ "$OUTPUT_MODE" = rsync ]; then
  if [ "$(hosts_of "${LEARNER_ACCELERATOR:-}")" != 1 ] || [ "$NUM_SERVERS" != 0 ]; then
    usage_error "OUTPUT_MODE=rsync needs a single-host learner (set LEARNER_ACCELERATOR, e.g. v6e-8) and no server VMs: multi-host checkpoints and the weights the servers load need one shared directory (OUTPUT_MODE=gcsfuse)"
  fi
fi

workdir=$(remote_workdir)
uri=$(run_uri)
user_overrides=$(quote_args ${CONFIG_OVERRIDES[@]+"${CONFIG_OVERRIDES[@]}"})
config_flag=$(quote_args "--config=$CONFIG")

# -- remote snippets (one line each; $HOME expands on the VM) ----------------

# prepare: the secret's directory, the log directory, the bucket mount.
prepare="set -e; mkdir -p \"\$HOME/.sao\" \"$R_LOGS\"; chmod 700 \"\$HOME/.sao\""
if [ "$OUTPUT_MODE" = gcsfuse ]; then
  mp=$(quote_args "$MOUNT_POINT")
  prepare+="; if ! mountpoint -q $mp; then sudo mkdir -p $mp; sudo chown \"\$(id -u):\$(id -g)\" $mp; gcsfuse --implicit-dirs --rename-dir-limit=1000000 $(quote_args "${BUCKET#gs://}") $mp; fi"
fi

# start_cmd ROLE 'PYTHON ARGS': nohup the process unless its pid file names
# a live one; then a loop copying the logs (and, in rsync mode, the learner's
# workdir) to the bucket while it runs, and once more when it ends.
start_cmd() {
  local role=$1 args=$2
  local pidfile="$R_LOGS/$role.pid" log="$R_LOGS/$role.log" sync
  sync="gcloud storage rsync --recursive \"$R_LOGS\" $(quote_args "$uri")/logs/\"\$(hostname)\" >/dev/null 2>&1"
  if [ "$OUTPUT_MODE" = rsync ] && [ "$role" = learner ]; then
    sync+="; gcloud storage rsync --recursive \"$workdir\" $(quote_args "$uri") >/dev/null 2>&1"
  fi
  local loop="while kill -0 \$0 2>/dev/null; do sleep $SYNC_EVERY_S; $sync; done; $sync"
  printf '%s' "if [ -f \"$pidfile\" ] && kill -0 \"\$(cat \"$pidfile\")\" 2>/dev/null; then echo \"\$(hostname): $role already running (pid \$(cat \"$pidfile\"))\"; else cd \"$R_REPO\"; PYTHONUNBUFFERED=1 nohup \"$R_PY\" $args > \"$log\" 2>&1 < /dev/null & echo \$! > \"$pidfile\"; nohup bash -c $(quote_args "$loop") \"\$(cat \"$pidfile\")\" > /dev/null 2>&1 < /dev/null & echo \"\$(hostname): $role started (pid \$(cat \"$pidfile\"))\"; fi"
}

# -- the admin secret ----------------------------------------------------------

secret=$(secret_file)
servers=()
while IFS= read -r name; do
  servers+=("$name")
done < <(server_names)

distribute_secret() {  # NAME ZONE
  scp_vm "$secret" "$1" "$2" all .sao/admin_secret
}

if [ ${#servers[@]} -gt 0 ]; then
  if [ -f "$secret" ]; then
    info "admin secret: reusing $secret"
  else
    info "admin secret: creating $secret (mode 600)"
    run_sh "umask 077 && mkdir -p $(quote_args "$SECRET_DIR") && od -An -tx1 -N32 /dev/urandom | tr -d ' \\n' > $(quote_args "$secret")"
  fi
fi

# -- servers ---------------------------------------------------------------------

if [ "$do_servers" = 1 ] && [ ${#servers[@]} -gt 0 ]; then
  for i in "${!servers[@]}"; do
    name=${servers[$i]}
    # The index keeps the servers' sampling streams apart; user overrides
    # still come last.
    server_args="-m sao_jax.serve $config_flag --port=$SERVER_PORT --server_index=$i --weights_root=\"$workdir/weights\" --config.rollout.bind_host=0.0.0.0 --config.rollout.admin_secret_file=\"$R_SECRET\"${user_overrides:+ $user_overrides}"
    info "server $name: JetStream on 0.0.0.0:$SERVER_PORT"
    ssh_vm "$name" "$SERVER_ZONE" all "$prepare"
    distribute_secret "$name" "$SERVER_ZONE"
    ssh_vm "$name" "$SERVER_ZONE" 0 "chmod 600 \"$R_SECRET\"; $(start_cmd server "$server_args")"
  done
  if [ "$wait_ready" = 1 ]; then
    tries=$(( (SERVER_READY_TIMEOUT_S + 9) / 10 ))
    for name in "${servers[@]}"; do
      info "waiting for $name to print its ready line (up to ${SERVER_READY_TIMEOUT_S}s)"
      # No retry: a server that fails to start would be waited for again.
      run gcloud compute tpus tpu-vm ssh "$name" "--project=$PROJECT" \
        "--zone=$SERVER_ZONE" --worker=0 "--command=for i in \$(seq $tries); do grep -q \"event.: .ready\" \"$R_LOGS/server.log\" && exit 0; kill -0 \"\$(cat \"$R_LOGS/server.pid\")\" 2>/dev/null || break; sleep 10; done; echo \"\$(hostname): server not ready; end of its log:\"; tail -n 30 \"$R_LOGS/server.log\"; exit 1" \
        || die "server $name is not ready (stop.sh --servers-only, fix, launch.sh again)"
    done
  fi
fi

# -- learner ---------------------------------------------------------------------

if [ "$do_learner" = 1 ]; then
  learner_args="-m sao_jax.train $config_flag --workdir=\"$workdir\""
  if learner_is_distributed; then
    learner_args+=" --config.distributed.enabled=True"
  fi
  if [ ${#servers[@]} -gt 0 ]; then
    addresses=""
    for name in "${servers[@]}"; do
      ip=$(capture "IP_OF_$name" gcloud compute tpus tpu-vm describe "$name" \
        "--project=$PROJECT" "--zone=$SERVER_ZONE" \
        '--format=value(networkEndpoints[0].ipAddress)')
      [ -n "$ip" ] || die "no internal IP for $name (is it READY?)"
      addresses+="${addresses:+,}$ip:$SERVER_PORT"
    done
    learner_args+=" --config.rollout.server_addresses=$addresses --config.rollout.admin_secret_file=\"$R_SECRET\""
  fi
  learner_args+="${user_overrides:+ $user_overrides}"
  info "learner $LEARNER_NAME: every worker, workdir $workdir ($uri)"
  ssh_vm "$LEARNER_NAME" "$ZONE" all "$prepare"
  pre=""
  if [ ${#servers[@]} -gt 0 ]; then
    distribute_secret "$LEARNER_NAME" "$ZONE"
    pre="chmod 600 \"$R_SECRET\"; "
  fi
  if [ "$OUTPUT_MODE" = rsync ]; then
    pre+="mkdir -p \"$workdir\"; if [ ! -d \"$workdir/checkpoints\" ]; then gcloud storage rsync --recursive $(quote_args "$uri") \"$workdir\" >/dev/null 2>&1 || true; fi; "
  fi
  ssh_vm "$LEARNER_NAME" "$ZONE" all "$pre$(start_cmd learner "$learner_args")"
  info "started; follow with tpu_scripts/logs.sh, check with tpu_scripts/status.sh"
fi
