"""The paper's configs compiled for Cloud TPU slices: the table in configs/base.py's and configs/big.py's docstrings.

  python benchmarks/tpu_fit_table.py --output=/tmp/tpu_fit.jsonl            # base and big x 5 slices
  python benchmarks/tpu_fit_table.py --configs=base --slices=v5e-8,v6e-8 --output=/tmp/tpu_fit.jsonl

Runs `aot.compile_for_slice` (what `--mode=compile --config.compile.topology=<slice>` runs) for each config and
slice with the TPU compiler on this machine (the `tpu` extra; no TPU needed), at the paper's batch (25,000
tokens per side) with bf16 compute (`model.dtype=bfloat16`, the setting for TPUs), appends one JSON line per
compile to --output (a rerun skips the pairs already there: compiles take minutes on a small CPU), and prints
a Markdown table: mesh and grad_accum_steps that fit, memory per chip against its HBM, the compile time, and the
roofline estimate of the step time and of the paper's 100k (base) or 300k (big) steps.
"""
import json
import pathlib
import sys
import time

from absl import app
from absl import flags

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from configs import base  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import big  # pylint: disable=g-import-not-at-top,wrong-import-position
from transformer_jax.tools import aot  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIGS = {'base': base.get_config, 'big': big.get_config}

_CONFIGS = flags.DEFINE_multi_enum('configs', ['base', 'big'], ['base', 'big'], 'The paper configs to compile.')
_SLICES = flags.DEFINE_list('slices', ['v4-8', 'v5e-8', 'v5p-8', 'v6e-8', 'v5e-64'], 'Cloud TPU slices.')
_OUTPUT = flags.DEFINE_string('output', None, 'JSON lines file the figures are appended to.', required=True)
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'model.dtype to compile with.')
# The paper's step counts (§5.3 base; Table 3 big): what the estimated total time is for.
PAPER_STEPS = {'base': 100_000, 'big': 300_000}
PAPER_TIME = {'base': '12 hours on 8 P100s', 'big': '3.5 days on 8 P100s'}


def _compile(config_name: str, slice_name: str) -> dict:
  config = CONFIGS[config_name]()
  config.model.dtype = _DTYPE.value
  config.compile.topology = slice_name
  start = time.perf_counter()
  figures = aot.compile_for_slice(config)
  return {'config': config_name, 'slice': slice_name, 'dtype': _DTYPE.value,
          'wall_seconds': time.perf_counter() - start, 'figures': figures}


def _row(entry: dict) -> str:
  f, name = entry['figures'], entry['config']
  fit = f.get('fit') or {}
  accum = fit.get('overrides', {}).get('train.grad_accum_steps', f['grad_accum_steps'])
  mesh = dict(f['mesh'])
  if 'mesh.fsdp' in fit.get('overrides', {}):
    mesh = {'data': f['devices'] // fit['overrides']['mesh.fsdp'], 'fsdp': fit['overrides']['mesh.fsdp'], 'tensor': 1}
  mesh_text = ' '.join(f'{k}={v}' for k, v in mesh.items() if v != 1 or k == 'data')
  total = f['memory_per_device']['total_in_bytes'] if f['fits'] else fit.get('total_in_bytes')
  memory = f"{total / 2**30:.2f} / {f['hbm_bytes'] / 2**30:.0f}" if total else 'does not fit'
  estimate = ''
  if f['fits'] and 'roofline' in f:
    step = f['roofline']['step_seconds']
    hours = step * PAPER_STEPS[name] / 3600
    estimate = f"{step * 1e3:.0f} ms, {f['roofline']['mfu']:.0%} | {hours:.1f} h"
  else:
    estimate = 'see fit | '
  return (f"| {entry['slice']} | {f['devices']} | {mesh_text} | {accum} | {memory} | {estimate} | "
          f"{entry['wall_seconds'] / 60:.1f} |")


def main(argv):
  del argv
  output = pathlib.Path(_OUTPUT.value)
  done = set()
  if output.exists():
    done = {(e['config'], e['slice'], e['figures']['dtype']) for e in map(json.loads, output.read_text().splitlines())}
  for config_name in _CONFIGS.value:
    for slice_name in _SLICES.value:
      if (config_name, slice_name, _DTYPE.value) in done:
        continue
      entry = _compile(config_name, slice_name)
      print(aot.format_report(entry['figures']), flush=True)
      with output.open('a') as f:
        f.write(json.dumps(entry) + '\n')
  entries = [json.loads(line) for line in output.read_text().splitlines()]
  for config_name in _CONFIGS.value:
    print(f'\n{config_name} ({_DTYPE.value}), paper: {PAPER_TIME[config_name]}, {PAPER_STEPS[config_name]:,} steps')
    print('| slice | chips | mesh | grad_accum_steps | GiB per chip / HBM | est. step, MFU (roofline) | '
          f'est. {PAPER_STEPS[config_name] // 1000}k steps | compile min |')
    print('|---|---|---|---|---|---|---|---|')
    for entry in entries:
      if entry['config'] == config_name and entry['figures']['dtype'] == _DTYPE.value:
        print(_row(entry))


if __name__ == '__main__':
  app.run(main)
