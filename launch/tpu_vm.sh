#!/usr/bin/env bash
# Create, run on and delete a Cloud TPU VM (single host or a multi-host pod slice).
#
#   TPU_NAME=mt-base ZONE=us-central2-b ACCELERATOR_TYPE=v4-32 launch/tpu_vm.sh create --config=configs/base.py
#   TPU_NAME=mt-base ZONE=us-central2-b launch/tpu_vm.sh run \
#       --config=configs/base.py --workdir=gs://BUCKET/runs/base
#   TPU_NAME=mt-base ZONE=us-central2-b launch/tpu_vm.sh delete
#   ACCELERATOR_TYPE=v5e-8 launch/tpu_vm.sh check --config=configs/big.py
#
# check:  compiles the train step of the run's flags (--config=... and overrides) for ACCELERATOR_TYPE here,
#         with the TPU compiler (`--mode=compile --config.compile.topology=...`, --workdir left out so nothing
#         is written; needs `pip install -e '.[tpu]'` on this machine, minutes on a laptop); exits 1 when the
#         step does not fit the chips or does not compile. Needs neither TPU_NAME nor ZONE.
# create: makes the VM, copies this repository to every worker and installs it with jax[tpu]. Given the run's
#         flags, it runs `check` first and creates nothing when the step does not fit.
# run:    runs `python3 -m transformer_jax.main --multihost ARGS...` on all workers at once (--worker=all),
#         the same command everywhere; jax.distributed finds the other workers through the TPU metadata.
#         On a slice of several hosts the workdir must be shared storage (gs://...): every process writes its
#         checkpoint shards there and reads the vocabulary that process 0 trains.
# delete: deletes the VM.
#
# Environment: TPU_NAME and ZONE (required but for check), ACCELERATOR_TYPE (check, create; default v4-8),
# RUNTIME_VERSION (create; default tpu-ubuntu2204-base), PROJECT (optional, else gcloud's default),
# SPOT=1 (create a preemptible Spot VM), REMOTE_DIR (default transformer_jax), DRY_RUN=1 (print the
# gcloud and compile commands instead of running them), SKIP_COMPILE_CHECK=1 (create without compiling), PYTHON
# (the local interpreter for the check; default python3).
# Hyperparameters live in configs/; this script only passes arguments through.
set -euo pipefail

usage() {
  echo "usage: TPU_NAME=... ZONE=... $0 {check|create|run|delete} [transformer_jax.main flags for check, create and run]" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
action=$1
shift
if [[ $action != check ]]; then
  : "${TPU_NAME:?set TPU_NAME}"
  : "${ZONE:?set ZONE}"
fi
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v4-8}
RUNTIME_VERSION=${RUNTIME_VERSION:-tpu-ubuntu2204-base}
REMOTE_DIR=${REMOTE_DIR:-transformer_jax}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

common=(--zone="${ZONE:-}")
if [[ -n "${PROJECT:-}" ]]; then
  common+=(--project="$PROJECT")
fi

gcloud_tpu() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' gcloud compute tpus tpu-vm "$@"
    echo
  else
    gcloud compute tpus tpu-vm "$@"
  fi
}

# Runs one shell command on every worker of the slice.
on_all_workers() {
  gcloud_tpu ssh "$TPU_NAME" "${common[@]}" --worker=all --command="$1"
}

# Compiles the train step of the given main flags for ACCELERATOR_TYPE on this machine (--workdir left out:
# the check writes nothing); exits when it does not fit or fails.
compile_check() {
  local flags=() skip_next=0 arg
  for arg in "$@"; do
    if [[ $skip_next == 1 ]]; then
      skip_next=0
    elif [[ $arg == --workdir ]]; then
      skip_next=1
    elif [[ $arg != --workdir=* ]]; then
      flags+=("$arg")
    fi
  done
  local cmd=("${PYTHON:-python3}" -m transformer_jax.main "${flags[@]}" --mode=compile
             --config.compile.topology="$ACCELERATOR_TYPE")
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
  elif ! (cd "$REPO_ROOT" && "${cmd[@]}"); then
    echo "the step above does not fit $ACCELERATOR_TYPE or did not compile${TPU_NAME:+: not creating $TPU_NAME}" \
      "(SKIP_COMPILE_CHECK=1 creates it anyway)" >&2
    exit 1
  fi
}

case "$action" in
  check)
    [[ $# -ge 1 ]] || usage
    compile_check "$@"
    ;;
  create)
    if [[ $# -gt 0 && "${SKIP_COMPILE_CHECK:-0}" != 1 ]]; then
      compile_check "$@"
    fi
    extra=()
    if [[ "${SPOT:-0}" == 1 ]]; then
      extra+=(--spot)
    fi
    gcloud_tpu create "$TPU_NAME" "${common[@]}" --accelerator-type="$ACCELERATOR_TYPE" \
      --version="$RUNTIME_VERSION" "${extra[@]}"
    archive=$(mktemp --suffix=.tar.gz)
    trap 'rm -f "$archive"' EXIT
    git -C "$REPO_ROOT" archive --format=tar.gz --output="$archive" HEAD
    gcloud_tpu scp "$archive" "$TPU_NAME:transformer_jax.tar.gz" "${common[@]}" --worker=all
    on_all_workers "mkdir -p $(printf '%q' "$REMOTE_DIR") && tar -xzf transformer_jax.tar.gz -C $(printf '%q' "$REMOTE_DIR") \
&& cd $(printf '%q' "$REMOTE_DIR") && python3 -m pip install -q -e . 'jax[tpu]'"
    ;;
  run)
    [[ $# -ge 1 ]] || usage
    printf -v args '%q ' "$@"
    on_all_workers "cd $(printf '%q' "$REMOTE_DIR") && python3 -m transformer_jax.main --multihost ${args}"
    ;;
  delete)
    gcloud_tpu delete "$TPU_NAME" "${common[@]}" --quiet
    ;;
  *)
    usage
    ;;
esac
