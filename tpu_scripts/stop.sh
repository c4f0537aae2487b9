#!/usr/bin/env bash
# Stops the learner (SIGTERM: it checkpoints, then exits) and the servers.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tpu_scripts/stop.sh [--env-file FILE] [--dry-run] [options]

Sends SIGTERM to the learner on every learner worker (the trainer then saves
a checkpoint and exits; launching again with the same RUN_NAME resumes), waits
up to --timeout seconds (default 900) for it to exit, then does the same for
the server on each server VM. The processes are found through the pid files
launch.sh wrote in ~/sao_logs. Nothing running is not an error. The VMs keep
running (and billing): delete.sh removes them.

Options:
  --env-file FILE   variables (default tpu_scripts/sao.env if present)
  --learner-only / --servers-only
  --timeout S       seconds to wait for each process (default 900)
  --force           SIGKILL what is still running after the timeout (the
                    learner's last checkpoint is then the previous periodic one)
  --project, --zone, --learner-name, --server-name-prefix, --num-servers,
  --server-accelerator, --server-zone VALUE
  --dry-run         print the commands (`+ ...`), run nothing
  -h, --help        this text
USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"

do_learner=1
do_servers=1
timeout=900
force=0
set -- ${REST_ARGS[@]+"${REST_ARGS[@]}"}
while [ $# -gt 0 ]; do
  case "$1" in
    --learner-only) do_servers=0 ;;
    --servers-only) do_learner=0 ;;
    --timeout) [ $# -ge 2 ] || usage_error "--timeout needs seconds"; timeout=$2; shift ;;
    --timeout=*) timeout=${1#*=} ;;
    --force) force=1 ;;
    *) usage_error "unknown argument: $1" ;;
  esac
  shift
done
case "$timeout" in ''|*[!0-9]*) usage_error "--timeout takes seconds" ;; esac
require PROJECT ZONE LEARNER_NAME

# stop_cmd ROLE: the remote one-liner stopping ROLE through its pid file.
stop_cmd() {
  local role=$1 pidfile="$R_LOGS/$1.pid" on_timeout
  if [ "$force" = 1 ]; then
    on_timeout="kill -KILL \"\$p\"; rm -f \"$pidfile\"; echo \"\$(hostname): $role killed after ${timeout}s\""
  else
    on_timeout="echo \"\$(hostname): $role still running after ${timeout}s (pid \$p; --force kills it)\""
  fi
  printf '%s' "if [ -f \"$pidfile\" ] && kill -0 \"\$(cat \"$pidfile\")\" 2>/dev/null; then p=\$(cat \"$pidfile\"); kill -TERM \"\$p\"; for i in \$(seq $(( (timeout + 4) / 5 ))); do kill -0 \"\$p\" 2>/dev/null || break; sleep 5; done; if kill -0 \"\$p\" 2>/dev/null; then $on_timeout; else rm -f \"$pidfile\"; echo \"\$(hostname): $role stopped\"; fi; else echo \"\$(hostname): no $role running\"; fi"
}

# The learner first: stopping the servers under it would leave it waiting
# for rollouts instead of reaching its next step, where it sees SIGTERM.
if [ "$do_learner" = 1 ]; then
  info "stopping the learner on every worker of $LEARNER_NAME"
  ssh_vm "$LEARNER_NAME" "$ZONE" all "$(stop_cmd learner)"
fi
if [ "$do_servers" = 1 ]; then
  while IFS= read -r name; do
    info "stopping the server on $name"
    ssh_vm "$name" "$SERVER_ZONE" 0 "$(stop_cmd server)"
  done < <(server_names)
fi
