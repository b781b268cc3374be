#!/usr/bin/env bash
# One training run per row of Table 3 (configs/table3.py ROWS), each with its own workdir.
#
#   launch/sweep_table3.sh --dry-run                       # print the command of every row
#   launch/sweep_table3.sh A1 B1 C3                        # run chosen rows, one after another, here
#   launch/sweep_table3.sh --launcher=slurm                # one sbatch job per row (launch/slurm.sbatch)
#   launch/sweep_table3.sh --launcher=tpu --workdir-root=gs://BUCKET/table3 A1
#                                                          # on TPU VM "$TPU_PREFIX-<row>" (created beforehand)
#   launch/sweep_table3.sh C1 -- --config.train.num_train_steps=1000   # flags after -- go to every run
#
# Options: --dry-run, --launcher={local,slurm,tpu} (default local), --workdir-root=DIR (default runs/table3;
# row R trains in DIR/R). Rows default to all of ROWS, in table order. The rows and their hyperparameters
# come from configs/table3.py only. PYTHON picks the interpreter (default python3); TPU_PREFIX (default
# table3) names the TPU VMs.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
dry_run=0
launcher=local
workdir_root=runs/table3
rows=()
extra=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --launcher=*) launcher=${1#*=} ;;
    --workdir-root=*) workdir_root=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) rows+=("$1") ;;
  esac
  shift
done

case "$launcher" in
  local|slurm|tpu) ;;
  *) echo "--launcher must be local, slurm or tpu, got '$launcher'" >&2; exit 2 ;;
esac

cd "$REPO_ROOT"
mapfile -t all_rows < <("$PYTHON" -c 'from configs import table3; print("\n".join(table3.ROWS))')
if [[ ${#rows[@]} -eq 0 ]]; then
  rows=("${all_rows[@]}")
fi
for row in "${rows[@]}"; do
  if [[ ! " ${all_rows[*]} " == *" $row "* ]]; then
    echo "unknown Table 3 row '$row'; valid rows: ${all_rows[*]}" >&2
    exit 2
  fi
done

status=0
for row in "${rows[@]}"; do
  args=(--config="configs/table3.py:$row" --workdir="$workdir_root/$row" "${extra[@]}")
  case "$launcher" in
    local) cmd=("$PYTHON" -m transformer_jax.main "${args[@]}") ;;
    slurm) cmd=(sbatch --job-name="table3-$row" launch/slurm.sbatch "${args[@]}") ;;
    tpu) cmd=(env TPU_NAME="${TPU_PREFIX:-table3}-${row,,}" launch/tpu_vm.sh run "${args[@]}") ;;
  esac
  if [[ $dry_run == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
  elif ! "${cmd[@]}"; then
    echo "row $row failed" >&2
    status=1
  fi
done
exit "$status"
