#!/usr/bin/env bash
# Deletes the learner and server VMs (or their queued resources).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tpu_scripts/delete.sh [--env-file FILE] [--dry-run] [--yes] [options]

Deletes the learner TPU VM and the server VMs (with QUEUED=1, their queued
resources, with --force so that the VMs in them go too), after asking for
confirmation unless --yes. What is already gone is skipped. The bucket and
everything in it (checkpoints, metrics, logs) is kept, and so is the local
admin secret, unless --forget-secret. Stop the run first (stop.sh) to get a
final checkpoint.

Options:
  --env-file FILE   variables (default tpu_scripts/sao.env if present)
  -y, --yes         do not ask
  --learner-only / --servers-only
  --forget-secret   also remove ~/.config/sao_jax/LEARNER_NAME.admin_secret
  --queued          delete queued resources (QUEUED=1)
  --project, --zone, --learner-name, --server-name-prefix, --num-servers,
  --server-accelerator, --server-zone VALUE
  --dry-run         print the commands (`+ ...`), run nothing; every
                    describe is printed and assumed to find the resource
  -h, --help        this text
USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"
DRY_RUN_ASSUME_EXISTS=1

do_learner=1
do_servers=1
forget_secret=0
for arg in ${REST_ARGS[@]+"${REST_ARGS[@]}"}; do
  case "$arg" in
    --learner-only) do_servers=0 ;;
    --servers-only) do_learner=0 ;;
    --forget-secret) forget_secret=1 ;;
    *) usage_error "unknown argument: $arg" ;;
  esac
done
require PROJECT ZONE LEARNER_NAME

targets=()
while IFS= read -r target; do
  targets+=("$target")
done < <(vms "$do_learner" "$do_servers")
[ ${#targets[@]} -gt 0 ] || die "nothing to delete"

names=""
for target in "${targets[@]}"; do
  names+="${names:+, }${target% *}"
done
confirm "delete $names in project $PROJECT?"

for target in "${targets[@]}"; do
  name=${target% *}
  zone=${target#* }
  if [ "$QUEUED" = 1 ] && exists queued-resources "$name" "$zone"; then
    run gcloud compute tpus queued-resources delete "$name" "--project=$PROJECT" \
      "--zone=$zone" --force --quiet
  elif exists tpu-vm "$name" "$zone"; then
    run gcloud compute tpus tpu-vm delete "$name" "--project=$PROJECT" \
      "--zone=$zone" --quiet
  else
    info "$name: already gone"
  fi
done
if [ "$forget_secret" = 1 ]; then
  run rm -f "$(secret_file)"
fi
[ -z "$BUCKET" ] || info "the bucket $BUCKET is kept"
