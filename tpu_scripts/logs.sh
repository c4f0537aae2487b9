#!/usr/bin/env bash
# Follows the learner's or a server's log on one worker.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tpu_scripts/logs.sh [--env-file FILE] [--dry-run]
                           [--learner | --server N] [--worker=N] [-n LINES] [--no-follow]

Runs `tail -F` on ~/sao_logs/learner.log of learner worker N (default 0;
on a multi-host slice each worker logs its own process, worker 0 is JAX
process 0 in practice, the one that prints progress and evaluations), or on
~/sao_logs/server.log of server VM SERVER_NAME_PREFIX-N. Ctrl-C stops it;
the processes keep running. The logs are also copied to
BUCKET/runs/RUN_NAME/logs/<hostname>/ every SYNC_EVERY_S seconds.

Options:
  --env-file FILE   variables (default tpu_scripts/sao.env if present)
  --learner         the learner's log (default)
  --server N        the log of server VM N (0-based)
  --worker=N        which worker of the VM (default 0)
  -n, --lines N     start with the last N lines (default 100)
  --no-follow       print them and exit
  --project, --zone, --learner-name, --server-name-prefix, --server-zone VALUE
  --dry-run         print the command (`+ ...`), run nothing
  -h, --help        this text
USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"

role=learner
server=""
worker=0
lines=100
follow=1
set -- ${REST_ARGS[@]+"${REST_ARGS[@]}"}
while [ $# -gt 0 ]; do
  case "$1" in
    --learner) role=learner ;;
    --server) [ $# -ge 2 ] || usage_error "--server needs a number"; role=server; server=$2; shift ;;
    --server=*) role=server; server=${1#*=} ;;
    --worker) [ $# -ge 2 ] || usage_error "--worker needs a number"; worker=$2; shift ;;
    --worker=*) worker=${1#*=} ;;
    -n|--lines) [ $# -ge 2 ] || usage_error "$1 needs a number"; lines=$2; shift ;;
    --lines=*) lines=${1#*=} ;;
    --no-follow) follow=0 ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
for value in "$worker" "$lines" ${server:+"$server"}; do
  case "$value" in ''|*[!0-9]*) usage_error "--worker, --server and --lines take numbers, got '$value'" ;; esac
done
require PROJECT ZONE LEARNER_NAME

if [ "$role" = learner ]; then
  name=$LEARNER_NAME
  zone=$ZONE
else
  require SERVER_NAME_PREFIX
  name="$SERVER_NAME_PREFIX-$server"
  zone=$SERVER_ZONE
fi
tail_flags="-n $lines"
if [ "$follow" = 1 ]; then
  tail_flags+=" -F"
fi
run gcloud compute tpus tpu-vm ssh "$name" "--project=$PROJECT" "--zone=$zone" \
  "--worker=$worker" "--command=tail $tail_flags \"$R_LOGS/$role.log\""
