#!/usr/bin/env bash
# Side-by-side training and beam-search speed against the peers of docs/performance.md, alternately, on this machine.
#
#   benchmarks/peers.sh [ROUNDS] > peers.log     # from the repository root, in the project's virtual environment
#
# Needs ../shared/tools (torch_ref.py, flaxwmt/flax_bench.py) and a Python with torch for the PyTorch peer:
# $TORCH_PYTHON (default: python; `pip install torch==2.13.0` into any venv). Each line printed is
# "<name> <JSON of the last line the command printed>"; nothing else should run on the machine meanwhile
# (`cat /proc/loadavg` first: peers with OpenMP threads lose most on a busy CPU). With $BASELINE_TREE set to
# another checkout of this repository (e.g. `git worktree add /tmp/baseline <commit>`), each of our rows is also
# run from there, as <name>_baseline, right after ours.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-1}"
tools=../shared/tools
torch_python="${TORCH_PYTHON:-python}"
# Ours runs under tcmalloc where installed (transformer_jax/cpu/host_allocator.py); PyTorch gets a row with it too.
tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
torch_tcmalloc() {  # name, torch_ref.py arguments...: only where the library is installed.
  local name=$1; shift
  if [[ -e "$tcmalloc" ]]; then LD_PRELOAD="$tcmalloc" run "$name" "$torch_python" "$tools/torch_ref.py" "$@"; fi
}
lscpu | grep -E 'Model name|^CPU\(s\)'
cat /proc/loadavg
run() {  # name, command...: the command's last line (its JSON), prefixed with the name.
  local name=$1; shift
  echo "$name $("$@" 2>/dev/null | tail -1)"
}
ours() {  # config, batch, source length, target length, extra flags...
  local config=$1 batch=$2 src=$3 tgt=$4; shift 4
  python -m transformer_jax.main --config="$config" --mode=benchmark --config.benchmark.batch_size="$batch" \
    --config.benchmark.source_length="$src" --config.benchmark.target_length="$tgt" \
    --config.benchmark.num_steps=10 "$@"
}
run_ours() {  # name, ours's arguments: from this tree, then from $BASELINE_TREE when set.
  local name=$1; shift
  run "$name" ours "$@"
  if [[ -n "${BASELINE_TREE:-}" ]]; then
    echo "${name}_baseline $(cd "$BASELINE_TREE" && ours "$@" 2>/dev/null | tail -1)"
  fi
}
for _ in $(seq "$rounds"); do
  run_ours ours_small configs/multi30k.py 64 32 32
  run torch_f32_small "$torch_python" "$tools/torch_ref.py" --shape small --steps 10
  run torch_bf16_small "$torch_python" "$tools/torch_ref.py" --shape small --steps 10 --bf16
  torch_tcmalloc torch_bf16_small_tcmalloc --shape small --steps 10 --bf16
  run flax_bf16_small python "$tools/flaxwmt/flax_bench.py" --shape small --steps 10 --dtype bfloat16 --decode
  run_ours ours_main_job_shape configs/multi30k.py 32 64 64
  run_ours ours_base configs/base.py 32 64 64 --config.model.dtype=bfloat16 --config.benchmark.decode_sentences=1
  run torch_f32_base "$torch_python" "$tools/torch_ref.py" --shape base --steps 5 --warmup 1
  run torch_bf16_base "$torch_python" "$tools/torch_ref.py" --shape base --steps 5 --warmup 1 --bf16
  torch_tcmalloc torch_bf16_base_tcmalloc --shape base --steps 5 --warmup 1 --bf16
done
