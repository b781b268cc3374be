#!/usr/bin/env bash
# One training run per row of Table 3 (configs/table3.py ROWS), each with its own workdir, then the report.
#
#   launch/sweep_table3.sh --dry-run                       # print the command of every row
#   launch/sweep_table3.sh A1 B1 C3                        # run chosen rows, one after another, here
#   launch/sweep_table3.sh --table=multi30k -- --config.data.manual_dir=../shared/data/multi30k
#                                                          # configs/table3_multi30k.py: every row on a CPU
#   launch/sweep_table3.sh --launcher=slurm                # one sbatch job per row (launch/slurm.sbatch)
#   launch/sweep_table3.sh --launcher=tpu --workdir-root=gs://BUCKET/table3 A1
#                                                          # on TPU VM "$TPU_PREFIX-<row>" (created beforehand),
#                                                          # each row first compiled for $ACCELERATOR_TYPE here
#   launch/sweep_table3.sh C1 -- --config.train.num_train_steps=1000   # flags after -- go to every run
#   launch/sweep_table3.sh --table=multi30k --seeds=1,2 base -- ...  # base again with seeds 1 and 2
#
# Options: --dry-run, --seeds=K[,K...] (default 0: each row once; seed k > 0 trains in <root>/<row>.seed<k>
# with train.seed = data.shuffle_seed = k, and the report gives mean +- std over a row's seeds),
# --launcher={local,slurm,tpu} (default local), --skip-compile-check (tpu: launch without
# first compiling every chosen row's train step for ACCELERATOR_TYPE, default v4-8, with the TPU compiler on
# this machine; the check needs `pip install -e '.[tpu]'` and stops the sweep before any row is launched when a
# row does not fit), --table={paper,multi30k,recipes} (the rows of configs/table3.py, configs/table3_multi30k.py
# or the main job's candidate recipes, configs/multi30k_recipes.py; default paper), --workdir-root=DIR (default
# runs/table3, runs/table3_multi30k or runs/multi30k_recipes; row R trains in DIR/R), --rerun (also rows that finished). Rows default to all of ROWS,
# in table order; a row whose workdir holds final_metrics.json has finished and is skipped, so an interrupted
# sweep completes on the next invocation (a partly trained row resumes from its checkpoints). Local runs
# record their exit status in DIR/R/sweep_status.json, and the sweep ends with `python -m
# transformer_jax.report DIR`. The rows and their hyperparameters come from the configs only. PYTHON picks
# the interpreter (default python3); TPU_PREFIX (default table3) names the TPU VMs.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
dry_run=0
rerun=0
compile_check=1
seeds=(0)
launcher=local
table=paper
workdir_root=
rows=()
extra=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --rerun) rerun=1 ;;
    --skip-compile-check) compile_check=0 ;;
    --seeds=*) IFS=, read -r -a seeds <<< "${1#*=}" ;;
    --launcher=*) launcher=${1#*=} ;;
    --table=*) table=${1#*=} ;;
    --workdir-root=*) workdir_root=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $1 (--help lists them)" >&2; exit 2 ;;
    *) rows+=("$1") ;;
  esac
  shift
done

case "$launcher" in
  local|slurm|tpu) ;;
  *) echo "--launcher must be local, slurm or tpu, got '$launcher'" >&2; exit 2 ;;
esac

normalised=()
for seed in "${seeds[@]}"; do
  if [[ ! $seed =~ ^[0-9]+$ ]]; then
    echo "--seeds takes non-negative integers separated by commas, got '$seed'" >&2
    exit 2
  fi
  seed=$((10#$seed))  # 01 is seed 1: one workdir per seed.
  if [[ " ${normalised[*]} " == *" $seed "* ]]; then
    echo "--seeds names seed $seed twice" >&2
    exit 2
  fi
  normalised+=("$seed")
done
if [[ ${#normalised[@]} -eq 0 ]]; then
  echo "--seeds is empty; e.g. --seeds=0,1,2" >&2
  exit 2
fi
seeds=("${normalised[@]}")

case "$table" in
  paper) config_file=configs/table3.py; module=table3 ;;
  multi30k) config_file=configs/table3_multi30k.py; module=table3_multi30k ;;
  recipes) config_file=configs/multi30k_recipes.py; module=multi30k_recipes ;;
  *) echo "--table must be paper, multi30k or recipes, got '$table'" >&2; exit 2 ;;
esac
workdir_root=${workdir_root:-runs/$module}

cd "$REPO_ROOT"
mapfile -t all_rows < <("$PYTHON" -c "from configs import $module; print('\n'.join($module.ROWS))")
if [[ ${#rows[@]} -eq 0 ]]; then
  rows=("${all_rows[@]}")
fi
for row in "${rows[@]}"; do
  if [[ ! " ${all_rows[*]} " == *" $row "* ]]; then
    echo "unknown Table 3 row '$row'; valid rows: ${all_rows[*]}" >&2
    exit 2
  fi
done

if [[ $launcher == tpu && $compile_check == 1 ]]; then
  # Every row is compiled for the slice before any is launched: a row that does not fit costs minutes here.
  for row in "${rows[@]}"; do
    if ! DRY_RUN=$dry_run PYTHON=$PYTHON launch/tpu_vm.sh check --config="$config_file:$row" "${extra[@]}"; then
      echo "row $row does not fit ${ACCELERATOR_TYPE:-v4-8} or did not compile: nothing launched" \
        "(--skip-compile-check launches anyway)" >&2
      exit 1
    fi
  done
fi

status=0
for row in "${rows[@]}"; do
  for seed in "${seeds[@]}"; do
    # Seed 0 trains in <root>/<row> with the config's seeds; seed k in <root>/<row>.seed<k> with train.seed and
    # data.shuffle_seed (initialisation, dropout and data order) set to k. transformer_jax.report merges them.
    run_name=$row
    seed_args=()
    if [[ $seed != 0 ]]; then
      run_name="$row.seed$seed"
      seed_args=(--config.train.seed="$seed" --config.data.shuffle_seed="$seed")
    fi
    workdir="$workdir_root/$run_name"
    if [[ $rerun == 0 && -f "$workdir/final_metrics.json" ]]; then
      echo "row $run_name: finished ($workdir/final_metrics.json); skipped (--rerun runs it again)" >&2
      continue
    fi
    args=(--config="$config_file:$row" --workdir="$workdir" "${seed_args[@]}" "${extra[@]}")
    case "$launcher" in
      local) cmd=("$PYTHON" -m transformer_jax.main "${args[@]}") ;;
      slurm) cmd=(sbatch --job-name="table3-$run_name" launch/slurm.sbatch "${args[@]}") ;;
      # Cloud TPU names take lowercase letters, digits and hyphens: base.seed1 runs on table3-base-seed1.
      tpu) cmd=(env TPU_NAME="${TPU_PREFIX:-table3}-${run_name,,}" launch/tpu_vm.sh run "${args[@]}")
           cmd[1]=${cmd[1]//./-} ;;
    esac
    if [[ $dry_run == 1 ]]; then
      printf '%q ' "${cmd[@]}"
      echo
      continue
    fi
    exit_status=0
    "${cmd[@]}" || exit_status=$?
    if [[ $launcher == local && -d "$workdir" ]]; then
      printf '{"exit_status": %d, "finished_at": "%s"}\n' "$exit_status" "$(date -u +%FT%TZ)" \
        > "$workdir/sweep_status.json"
    fi
    if [[ $exit_status != 0 ]]; then
      echo "row $run_name failed (exit status $exit_status)" >&2
      status=1
    fi
  done
done
if [[ $dry_run == 0 && $launcher == local ]]; then
  "$PYTHON" -m transformer_jax.report "$workdir_root" --rows="$config_file" || status=1
fi
exit "$status"
