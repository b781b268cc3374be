#!/usr/bin/env bash
# The accelerator check: on a machine with a GPU (or TPU), one command that installs the project with the
# accelerator extra, runs the tests that need an accelerator, benchmarks base and big, and writes one JSON report.
#
#   launch/accelerator_check.sh                         # on the GPU/TPU machine, from a clone; ~8 min on one H200
#   launch/accelerator_check.sh --dry-run               # the same steps at tiny sizes on a CPU (~1-2 min)
#   launch/accelerator_check.sh --no-install --out=FILE # skip pip; write the report to FILE
#
# Steps: (1) pip install -e '.[cuda,test]' (or '.[tpu,test]' when no nvidia-smi is found; skipped by --dry-run
# and --no-install); (2) pytest -m accelerator (fused attention = einsum path, bf16 step = float32 within
# rounding, sharded = one device on the real devices); (3) --mode=benchmark of base and big in bf16, with the
# einsum and the fused (cuDNN) attention; (4) 200 steps of base on synthetic WMT-shaped batches (~25,000 source +
# 25,000 target tokens, 384 x (64 + 64)). Everything goes to one JSON report (default accelerator_report.json):
# the tests' outcome and each benchmark's JSON line (step time, tokens/s, MFU against the device's peak,
# compile time, beam-search sentences/s).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
dry_run=0
install=1
out=accelerator_report.json

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; install=0 ;;
    --no-install) install=0 ;;
    --out=*) out=${1#*=} ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done

cd "$REPO_ROOT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $install == 1 ]]; then
  if command -v nvidia-smi > /dev/null; then extra=cuda; else extra=tpu; fi
  "$PYTHON" -m pip install -q -e ".[$extra,test]"
fi

if [[ $dry_run == 1 ]]; then
  export ACCELERATOR_CHECK_DRY_RUN=1 JAX_PLATFORMS=cpu
  models=(configs/smoke.py configs/smoke.py)
  sizes=(--config.benchmark.batch_size=8 --config.benchmark.num_steps=2 --config.benchmark.decode_sentences=4)
  long_run=(--config.benchmark.batch_size=8 --config.benchmark.num_steps=3 --config.benchmark.decode_sentences=2)
else
  models=(configs/base.py configs/big.py)
  sizes=(--config.benchmark.batch_size=256 --config.benchmark.source_length=64 --config.benchmark.target_length=64)
  long_run=(--config.benchmark.batch_size=384 --config.benchmark.source_length=64 --config.benchmark.target_length=64
            --config.benchmark.num_steps=200 --config.benchmark.decode_sentences=16)
fi

tests_status=0
"$PYTHON" -m pytest -q -m accelerator tests/test_accelerator.py -p no:cacheprovider \
  --junitxml="$work/tests.xml" > "$work/tests.log" 2>&1 || tests_status=$?
tail -3 "$work/tests.log"

run_benchmark() {  # name, config, flags...: the benchmark's JSON line into $work/<name>.json
  local name=$1 config=$2
  shift 2
  if "$PYTHON" -m transformer_jax.main --config="$config" --mode=benchmark --config.model.dtype=bfloat16 "$@" \
      > "$work/$name.log" 2>&1; then
    tail -1 "$work/$name.log" > "$work/$name.json"
    echo "$name: $(tail -1 "$work/$name.json")"
  else
    echo "{\"error\": \"exit status $?, see the log\"}" > "$work/$name.json"
    echo "$name failed:" >&2
    tail -5 "$work/$name.log" >&2
  fi
}

# Fused attention needs d_k == d_v (true of base and big) and no attention dropout (their default).
names=(base big)
for i in 0 1; do
  run_benchmark "${names[$i]}_xla" "${models[$i]}" "${sizes[@]}" --config.model.attention_impl=xla
  run_benchmark "${names[$i]}_fused" "${models[$i]}" "${sizes[@]}" --config.model.attention_impl=fused
done
run_benchmark base_200_steps "${models[0]}" "${long_run[@]}" --config.model.attention_impl=fused

"$PYTHON" - "$work" "$out" "$tests_status" "$dry_run" <<'PY'
import json, pathlib, sys
import jax
work, out, tests_status, dry_run = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1'
report = {'dry_run': dry_run, 'devices': [str(d) for d in jax.devices()], 'device_kind': jax.devices()[0].device_kind,
          'tests': {'exit_status': tests_status, 'summary': (work / 'tests.log').read_text().strip().splitlines()[-1:]},
          'benchmarks': {}}
for path in sorted(work.glob('*.json')):
  try:
    report['benchmarks'][path.stem] = json.loads(path.read_text())
  except ValueError:
    report['benchmarks'][path.stem] = {'error': 'no JSON line: ' + path.read_text()[-300:]}
pathlib.Path(out).write_text(json.dumps(report, indent=2))
print(f'report: {out}')
PY
exit "$tests_status"
