#!/usr/bin/env bash
# States of the VMs, the sao_jax processes on every worker, the ends of logs.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tpu_scripts/status.sh [--env-file FILE] [--dry-run] [-n LINES]

For the learner VM and each server VM: the queued resource's state (when
QUEUED=1), the TPU VM's name, type, state, health and internal IP; then on
every worker: the running `sao_jax.train` / `sao_jax.serve` processes,
whether the bucket is mounted, and the last LINES (default 5) lines of each
log in ~/sao_logs. A VM that is absent or unreachable is reported and
skipped.

Options:
  --env-file FILE   variables (default tpu_scripts/sao.env if present)
  --project, --zone, --learner-name, --server-name-prefix, --num-servers,
  --server-accelerator, --server-zone, --mount-point VALUE
  -n, --lines N     log lines per file (default 5)
  --dry-run         print the commands (`+ ...`), run nothing
  -h, --help        this text
USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"

lines=5
set -- ${REST_ARGS[@]+"${REST_ARGS[@]}"}
while [ $# -gt 0 ]; do
  case "$1" in
    -n|--lines) [ $# -ge 2 ] || usage_error "$1 needs a value"; lines=$2; shift ;;
    --lines=*) lines=${1#*=} ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
case "$lines" in ''|*[!0-9]*) usage_error "--lines takes a number" ;; esac
require PROJECT ZONE LEARNER_NAME

mp=$(quote_args "$MOUNT_POINT")
remote="echo \"== \$(hostname)\"; pgrep -af \"sao_jax[.](train|serve)\" || echo \"no sao_jax process\"; if mountpoint -q $mp; then echo \"bucket mounted at $mp\"; fi; for f in \"$R_LOGS\"/*.log; do [ -f \"\$f\" ] || continue; echo \"-- \$f\"; tail -n $lines \"\$f\"; done; true"

while read -r name zone; do
  info "$name ($zone)"
  if [ "$QUEUED" = 1 ]; then
    run gcloud compute tpus queued-resources describe "$name" "--project=$PROJECT" \
      "--zone=$zone" '--format=value(state.state)' || warn "no queued resource $name"
  fi
  if ! run gcloud compute tpus tpu-vm describe "$name" "--project=$PROJECT" "--zone=$zone" \
      '--format=table(name.basename(),acceleratorType,state,health,networkEndpoints[0].ipAddress)'; then
    warn "TPU VM $name: absent"
    continue
  fi
  run gcloud compute tpus tpu-vm ssh "$name" "--project=$PROJECT" "--zone=$zone" \
    --worker=all "--command=$remote" || warn "ssh to $name failed"
done < <(all_vms)
