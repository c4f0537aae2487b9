# shellcheck shell=bash
# shellcheck disable=SC2034  # globals set here are read by the scripts that source this
#
# Shared by every tpu_scripts/*.sh (sourced, never run): the env file, flags,
# --dry-run, `run`, retries around ssh/scp, `require`, and the names derived
# from the configuration. Works with bash >= 3.2 (macOS): no associative
# arrays, empty arrays expanded as ${a[@]+"${a[@]}"}.
#
# A script defines `usage` (its --help text), sources this file and calls
# `sao_init "$@"`; afterwards its own arguments are in REST_ARGS and the
# `--config.x=y` overrides (and everything after `--`) in CONFIG_OVERRIDES.

SAO_SCRIPTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SAO_REPO_ROOT=$(cd "$SAO_SCRIPTS_DIR/.." && pwd)

DRY_RUN=0
ASSUME_YES=0
ENV_FILE=""
REST_ARGS=()
CONFIG_OVERRIDES=()
_FLAG_NAMES=()
_FLAG_VALUES=()

# -- messages and errors ------------------------------------------------------

info() { printf '==> %s\n' "$*" >&2; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
usage_error() { printf 'error: %s (see --help)\n' "$*" >&2; exit 2; }

# flag_of VAR: the command-line flag that sets VAR (PROJECT -> --project).
flag_of() {
  printf -- '--%s' "$(printf '%s' "$1" | tr '[:upper:]_' '[:lower:]-')"
}

# require VAR...: exits 2 naming the first unset or empty variable.
require() {
  local var
  for var in "$@"; do
    if [ -z "${!var:-}" ]; then
      printf 'error: set %s (in the env file or %s)\n' "$var" "$(flag_of "$var")" >&2
      exit 2
    fi
  done
}

# -- quoting, run, retry -------------------------------------------------------

# quote_args ARG...: one line a shell parses back into the same words.
quote_args() {
  local out="" arg
  for arg in "$@"; do
    if [ -n "$arg" ] && [ -z "$(printf '%s' "$arg" | tr -d 'A-Za-z0-9_@%+=:,./-')" ]; then
      out+="$arg "
    else
      out+="'${arg//\'/\'\\\'\'}' "
    fi
  done
  printf '%s' "${out% }"
}

# run CMD ARG...: prints `+ CMD ...`; executes it unless --dry-run. In dry
# run the line goes to stdout (the plan), otherwise to stderr (a trace).
run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s\n' "$(quote_args "$@")"
    return 0
  fi
  printf '+ %s\n' "$(quote_args "$@")" >&2
  "$@"
}

# run_sh 'SHELL TEXT': like run, for a pipeline (printed as written).
run_sh() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s\n' "$1"
    return 0
  fi
  printf '+ %s\n' "$1" >&2
  bash -c "$1"
}

# retry CMD ARG...: `run` up to SSH_RETRIES times, waiting SSH_RETRY_DELAY_S,
# then twice as long, ... between attempts (ssh to a fresh TPU VM fails
# until its keys propagate; a pod's many workers make one failure likely).
retry() {
  local attempt=1 delay="$SSH_RETRY_DELAY_S"
  while true; do
    if run "$@"; then
      return 0
    fi
    if [ "$attempt" -ge "$SSH_RETRIES" ]; then
      die "failed after $attempt attempts: $(quote_args "$@")"
    fi
    warn "attempt $attempt of $SSH_RETRIES failed; retrying in ${delay}s"
    sleep "$delay"
    attempt=$((attempt + 1))
    delay=$((delay * 2))
  done
}

# -- arguments and the env file -----------------------------------------------

# The flags every script takes: --flag=VALUE or --flag VALUE sets VAR.
_var_of_flag() {
  case "$1" in
    --project) echo PROJECT ;;
    --zone) echo ZONE ;;
    --learner-name) echo LEARNER_NAME ;;
    --learner-accelerator) echo LEARNER_ACCELERATOR ;;
    --runtime-version) echo RUNTIME_VERSION ;;
    --server-name-prefix) echo SERVER_NAME_PREFIX ;;
    --num-servers) echo NUM_SERVERS ;;
    --server-accelerator) echo SERVER_ACCELERATOR ;;
    --server-runtime-version) echo SERVER_RUNTIME_VERSION ;;
    --server-zone) echo SERVER_ZONE ;;
    --server-port) echo SERVER_PORT ;;
    --bucket) echo BUCKET ;;
    --run-name) echo RUN_NAME ;;
    --repo-url) echo REPO_URL ;;
    --branch) echo BRANCH ;;
    --config) echo CONFIG ;;
    --output-mode) echo OUTPUT_MODE ;;
    --mount-point) echo MOUNT_POINT ;;
    --sync-every-s) echo SYNC_EVERY_S ;;
    --service-account) echo SERVICE_ACCOUNT ;;
    --distributed) echo DISTRIBUTED ;;
    --python) echo PYTHON ;;
    --ssh-retries) echo SSH_RETRIES ;;
    *) return 1 ;;
  esac
}

_set_flag() { _FLAG_NAMES+=("$1"); _FLAG_VALUES+=("$2"); }

_parse_args() {
  local arg name var
  while [ $# -gt 0 ]; do
    arg=$1
    case "$arg" in
      --) shift; CONFIG_OVERRIDES+=("$@"); break ;;
      --config.*) CONFIG_OVERRIDES+=("$arg") ;;
      -h|--help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      -y|--yes) ASSUME_YES=1 ;;
      --queued) _set_flag QUEUED 1 ;;
      --no-queued) _set_flag QUEUED 0 ;;
      --spot) _set_flag SPOT 1 ;;
      --no-spot) _set_flag SPOT 0 ;;
      --copy-local) _set_flag COPY_LOCAL 1 ;;
      --env-file=*) ENV_FILE=${arg#*=} ;;
      --env-file)
        [ $# -ge 2 ] || usage_error "--env-file needs a value"
        ENV_FILE=$2; shift ;;
      --*=*)
        name=${arg%%=*}
        if var=$(_var_of_flag "$name"); then
          _set_flag "$var" "${arg#*=}"
        else
          REST_ARGS+=("$arg")
        fi ;;
      --*)
        if var=$(_var_of_flag "$arg"); then
          [ $# -ge 2 ] || usage_error "$arg needs a value"
          _set_flag "$var" "$2"; shift
        else
          REST_ARGS+=("$arg")
        fi ;;
      *) REST_ARGS+=("$arg") ;;
    esac
    shift
  done
}

# sao_init "$@": flags, then the env file (sourced: KEY=value lines), then
# the flags again on top, then defaults. Precedence: flag > env file >
# the caller's environment > default.
sao_init() {
  exec 3>&1  # the plan's stdout, also from inside $(capture ...)
  _parse_args "$@"
  if [ -z "$ENV_FILE" ] && [ -f "$SAO_SCRIPTS_DIR/sao.env" ]; then
    ENV_FILE="$SAO_SCRIPTS_DIR/sao.env"
  fi
  if [ -n "$ENV_FILE" ]; then
    [ -f "$ENV_FILE" ] || usage_error "env file not found: $ENV_FILE"
    # shellcheck disable=SC1090
    source "$ENV_FILE"
  fi
  local i
  for ((i = 0; i < ${#_FLAG_NAMES[@]}; i++)); do
    printf -v "${_FLAG_NAMES[$i]}" '%s' "${_FLAG_VALUES[$i]}"
  done
  _defaults
}

_defaults() {
  PROJECT=${PROJECT:-}
  ZONE=${ZONE:-}
  LEARNER_NAME=${LEARNER_NAME:-}
  LEARNER_ACCELERATOR=${LEARNER_ACCELERATOR:-}
  RUNTIME_VERSION=${RUNTIME_VERSION:-}
  SERVER_NAME_PREFIX=${SERVER_NAME_PREFIX:-${LEARNER_NAME:+$LEARNER_NAME-server}}
  NUM_SERVERS=${NUM_SERVERS:-0}
  SERVER_ACCELERATOR=${SERVER_ACCELERATOR:-}
  SERVER_RUNTIME_VERSION=${SERVER_RUNTIME_VERSION:-$RUNTIME_VERSION}
  SERVER_ZONE=${SERVER_ZONE:-$ZONE}
  SERVER_PORT=${SERVER_PORT:-9000}
  BUCKET=${BUCKET:-}
  BUCKET=${BUCKET%/}
  RUN_NAME=${RUN_NAME:-$LEARNER_NAME}
  REPO_URL=${REPO_URL:-}
  BRANCH=${BRANCH:-main}
  COPY_LOCAL=${COPY_LOCAL:-0}
  QUEUED=${QUEUED:-0}
  SPOT=${SPOT:-0}
  CONFIG=${CONFIG:-configs/default.py}
  OUTPUT_MODE=${OUTPUT_MODE:-gcsfuse}
  MOUNT_POINT=${MOUNT_POINT:-/mnt/sao}
  SYNC_EVERY_S=${SYNC_EVERY_S:-600}
  SERVICE_ACCOUNT=${SERVICE_ACCOUNT:-}
  DISTRIBUTED=${DISTRIBUTED:-auto}
  PYTHON=${PYTHON:-python3.11}
  SSH_RETRIES=${SSH_RETRIES:-5}
  SSH_RETRY_DELAY_S=${SSH_RETRY_DELAY_S:-10}
  REMOTE_DIR=${REMOTE_DIR:-sao_jax}
  REMOTE_VENV=${REMOTE_VENV:-sao_venv}
  SECRET_DIR=${SECRET_DIR:-${XDG_CONFIG_HOME:-$HOME/.config}/sao_jax}
  if [ -z "$REPO_URL" ]; then
    COPY_LOCAL=1
  fi
  case "$NUM_SERVERS" in
    ''|*[!0-9]*) usage_error "NUM_SERVERS must be a number, got '$NUM_SERVERS'" ;;
  esac
  if [ -z "$SERVER_ACCELERATOR" ]; then
    NUM_SERVERS=0
  fi
  case "$OUTPUT_MODE" in
    gcsfuse|rsync) ;;
    *) usage_error "OUTPUT_MODE must be gcsfuse or rsync, got '$OUTPUT_MODE'" ;;
  esac
  # Paths on the VMs. \$HOME is expanded there, not here.
  R_REPO="\$HOME/$REMOTE_DIR"
  R_PY="\$HOME/$REMOTE_VENV/bin/python"
  R_LOGS="\$HOME/sao_logs"
  R_SECRET="\$HOME/.sao/admin_secret"
}

# require_bucket: BUCKET set and of the form gs://NAME.
require_bucket() {
  require BUCKET
  case "$BUCKET" in
    gs://*/*|gs://) usage_error "BUCKET must be a bucket, gs://NAME (runs go to gs://NAME/runs/RUN_NAME), got '$BUCKET'" ;;
    gs://*) ;;
    *) usage_error "BUCKET must start with gs://, got '$BUCKET'" ;;
  esac
}

# -- names and topology ---------------------------------------------------------

# server_names: one name per server VM, PREFIX-0 ... PREFIX-(N-1).
server_names() {
  local i
  for ((i = 0; i < NUM_SERVERS; i++)); do
    printf '%s-%d\n' "$SERVER_NAME_PREFIX" "$i"
  done
}

# hosts_of ACCELERATOR: how many hosts (TPU VM workers) the slice has; 0 if
# the type is unknown. v2/v3/v4/v5p count TensorCores (8 per host); v5e
# (v5litepod) and v6e count chips (up to 8 on one host, then 4 per host).
hosts_of() {
  local n=${1##*-}
  case "$n" in ''|*[!0-9]*) echo 0; return ;; esac
  case "$1" in
    v2-*|v3-*|v4-*|v5p-*) if [ "$n" -le 8 ]; then echo 1; else echo $((n / 8)); fi ;;
    v5litepod-*|v5e-*|v6e-*) if [ "$n" -le 8 ]; then echo 1; else echo $((n / 4)); fi ;;
    *) echo 0 ;;
  esac
}

# learner_is_distributed: whether the learner joins jax.distributed
# (DISTRIBUTED=auto: when the slice has more than one host, or is unknown).
learner_is_distributed() {
  case "$DISTRIBUTED" in
    1|true|True|yes) return 0 ;;
    0|false|False|no) return 1 ;;
    auto) [ "$(hosts_of "$LEARNER_ACCELERATOR")" != 1 ] ;;
    *) usage_error "DISTRIBUTED must be auto, 1 or 0, got '$DISTRIBUTED'" ;;
  esac
}

# Remote paths of the run's output (see docs/tpu_vm.md, "Where output goes").
run_uri() { printf '%s/runs/%s' "$BUCKET" "$RUN_NAME"; }
remote_workdir() {
  if [ "$OUTPUT_MODE" = gcsfuse ]; then
    printf '%s/runs/%s' "$MOUNT_POINT" "$RUN_NAME"
  else
    printf '%s' "\$HOME/sao_runs/$RUN_NAME"
  fi
}
secret_file() { printf '%s/%s.admin_secret' "$SECRET_DIR" "$LEARNER_NAME"; }

# -- gcloud ---------------------------------------------------------------------

# tpu_vm SUBCOMMAND NAME ZONE [ARG...]: gcloud compute tpus tpu-vm ... with
# the project and zone (printed or run).
tpu_vm() {
  local sub=$1 name=$2 zone=$3
  shift 3
  run gcloud compute tpus tpu-vm "$sub" "$name" "--project=$PROJECT" "--zone=$zone" "$@"
}

# ssh_vm NAME ZONE WORKER 'REMOTE COMMAND': ssh with retries.
ssh_vm() {
  retry gcloud compute tpus tpu-vm ssh "$1" "--project=$PROJECT" "--zone=$2" \
    "--worker=$3" "--command=$4"
}

# scp_vm LOCAL NAME ZONE WORKER REMOTE_PATH: scp with retries.
scp_vm() {
  retry gcloud compute tpus tpu-vm scp "$1" "$2:$5" "--project=$PROJECT" \
    "--zone=$3" "--worker=$4"
}

# exists_cmd CMD ARG...: whether a `describe` command succeeds. In dry run
# (no gcloud runs) it is printed and the resource assumed absent, so the plan
# shows every create; delete.sh sets DRY_RUN_ASSUME_EXISTS=1 to show every
# delete instead.
DRY_RUN_ASSUME_EXISTS=0
exists_cmd() {
  if [ "$DRY_RUN" = 1 ]; then
    if [ "$DRY_RUN_ASSUME_EXISTS" = 1 ]; then
      printf '+ %s  # dry run: assumed present\n' "$(quote_args "$@")"
      return 0
    fi
    printf '+ %s  # dry run: assumed absent\n' "$(quote_args "$@")"
    return 1
  fi
  "$@" >/dev/null 2>&1
}

# exists KIND NAME ZONE: whether the TPU VM (KIND=tpu-vm) or queued resource
# (KIND=queued-resources) exists.
exists() {
  exists_cmd gcloud compute tpus "$1" describe "$2" "--project=$PROJECT" \
    "--zone=$3" '--format=value(name)'
}

# capture PLACEHOLDER CMD ARG...: the command's stdout; in dry run the
# command is printed and PLACEHOLDER returned.
capture() {
  local placeholder=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s\n' "$(quote_args "$@")" >&3
    printf '%s' "$placeholder"
    return 0
  fi
  "$@"
}

# vm_state NAME ZONE: READY, CREATING, ... ("" if absent; "READY" in dry run).
vm_state() {
  capture READY gcloud compute tpus tpu-vm describe "$1" "--project=$PROJECT" \
    "--zone=$2" '--format=value(state)' 2>/dev/null || true
}

# confirm 'QUESTION': yes with --yes; otherwise asks on the terminal.
confirm() {
  [ "$ASSUME_YES" = 1 ] && return 0
  [ "$DRY_RUN" = 1 ] && return 0
  if [ ! -t 0 ]; then
    die "$1 -- refusing without a terminal; pass --yes"
  fi
  local answer
  read -r -p "$1 [y/N] " answer
  case "$answer" in y|Y|yes|YES) return 0 ;; *) die "aborted" ;; esac
}

# no_rest_args: the script takes no arguments of its own.
no_rest_args() {
  if [ ${#REST_ARGS[@]} -gt 0 ]; then
    usage_error "unknown argument: ${REST_ARGS[0]}"
  fi
}

# vms WITH_LEARNER WITH_SERVERS (each 0 or 1): "NAME ZONE" per line of the
# learner VM and / or the server VMs, learner first.
vms() {
  if [ "$1" = 1 ]; then
    printf '%s %s\n' "$LEARNER_NAME" "$ZONE"
  fi
  if [ "$2" = 1 ]; then
    local name
    while IFS= read -r name; do
      printf '%s %s\n' "$name" "$SERVER_ZONE"
    done < <(server_names)
  fi
}

# all_vms: "NAME ZONE" per line, learner first.
all_vms() { vms 1 1; }
