#!/usr/bin/env bash
# Creates the bucket, the learner TPU VM (one host or a multi-host slice) and
# the JetStream server VMs. Idempotent: what exists is skipped.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/create.sh [--env-file FILE] [--dry-run] [options]

Creates, skipping whatever already exists (checked with `describe`):
  - the bucket BUCKET (in ZONE's region);
  - the learner TPU VM LEARNER_NAME (LEARNER_ACCELERATOR, e.g. v5p-32: a
    4-host slice; v6e-8: one host), with `tpu-vm create`, or with
    `queued-resources create` when QUEUED=1 / --queued;
  - NUM_SERVERS server VMs SERVER_NAME_PREFIX-0.. (SERVER_ACCELERATOR, one
    host each, e.g. v5litepod-8). With SERVER_ACCELERATOR empty none are
    created and the learner starts its rollout servers on its own hosts.

Options (each overrides the env file's variable of the same name):
  --env-file FILE          variables (default tpu_scripts/sao.env if present;
                           see tpu_scripts/sao.env.example)
  --project, --zone, --learner-name, --learner-accelerator, --runtime-version,
  --server-name-prefix, --num-servers, --server-accelerator,
  --server-runtime-version, --server-zone, --bucket, --service-account VALUE
  --queued / --no-queued   request the VMs as queued resources (QUEUED)
  --spot / --no-spot       Spot VMs (SPOT)
  --learner-only           the bucket and the learner, no server VMs
  --servers-only           only the server VMs
  --dry-run                print the commands (`+ ...`), run nothing; every
                           describe is printed and assumed to find nothing
  -h, --help               this text
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"

do_learner=1
do_servers=1
do_bucket=1
for arg in ${REST_ARGS[@]+"${REST_ARGS[@]}"}; do
  case "$arg" in
    --learner-only) do_servers=0 ;;
    --servers-only) do_learner=0; do_bucket=0 ;;
    *) usage_error "unknown argument: $arg" ;;
  esac
done
if [ ${#CONFIG_OVERRIDES[@]} -gt 0 ]; then
  usage_error "config overrides go to launch.sh, not create.sh"
fi

require PROJECT ZONE LEARNER_NAME
if [ "$do_learner" = 1 ]; then
  require LEARNER_ACCELERATOR RUNTIME_VERSION
fi
if [ "$do_bucket" = 1 ]; then
  require_bucket
fi

# create_tpu NAME ZONE ACCELERATOR RUNTIME_VERSION
create_tpu() {
  local name=$1 zone=$2 accelerator=$3 runtime=$4
  local extra=(--scopes=https://www.googleapis.com/auth/cloud-platform)
  if [ "$SPOT" = 1 ]; then
    extra+=(--spot)
  fi
  if [ -n "$SERVICE_ACCOUNT" ]; then
    extra+=("--service-account=$SERVICE_ACCOUNT")
  fi
  if exists tpu-vm "$name" "$zone"; then
    info "TPU VM $name exists: skipped"
    return
  fi
  if [ "$QUEUED" = 1 ]; then
    if exists queued-resources "$name" "$zone"; then
      info "queued resource $name exists: skipped (status.sh shows its state)"
      return
    fi
    run gcloud compute tpus queued-resources create "$name" "--node-id=$name" \
      "--project=$PROJECT" "--zone=$zone" "--accelerator-type=$accelerator" \
      "--runtime-version=$runtime" "${extra[@]}"
    info "queued $name: it is usable once status.sh shows it ACTIVE / READY"
  else
    run gcloud compute tpus tpu-vm create "$name" "--project=$PROJECT" \
      "--zone=$zone" "--accelerator-type=$accelerator" "--version=$runtime" \
      "${extra[@]}"
  fi
}

if [ "$do_bucket" = 1 ]; then
  region=${ZONE%-*}
  if exists_cmd gcloud storage buckets describe "$BUCKET" "--project=$PROJECT" \
      '--format=value(name)'; then
    info "bucket $BUCKET exists: skipped"
  else
    run gcloud storage buckets create "$BUCKET" "--project=$PROJECT" \
      "--location=$region" --uniform-bucket-level-access
  fi
fi

if [ "$do_learner" = 1 ]; then
  hosts=$(hosts_of "$LEARNER_ACCELERATOR")
  [ "$hosts" != 0 ] || hosts="an unknown number of"
  info "learner $LEARNER_NAME: $LEARNER_ACCELERATOR ($hosts host(s))"
  create_tpu "$LEARNER_NAME" "$ZONE" "$LEARNER_ACCELERATOR" "$RUNTIME_VERSION"
fi

if [ "$do_servers" = 1 ]; then
  if [ "$NUM_SERVERS" = 0 ]; then
    info "no server VMs (SERVER_ACCELERATOR empty or NUM_SERVERS=0): the learner starts its servers itself"
  else
    require SERVER_NAME_PREFIX SERVER_RUNTIME_VERSION SERVER_ZONE
    if [ "$(hosts_of "$SERVER_ACCELERATOR")" -gt 1 ]; then
      usage_error "a server VM runs one single-host JetStream server; $SERVER_ACCELERATOR has $(hosts_of "$SERVER_ACCELERATOR") hosts (use e.g. v5litepod-8 or v6e-8)"
    fi
    while IFS= read -r name; do
      create_tpu "$name" "$SERVER_ZONE" "$SERVER_ACCELERATOR" "$SERVER_RUNTIME_VERSION"
    done < <(server_names)
  fi
fi
