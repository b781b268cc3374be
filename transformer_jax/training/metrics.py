"""Metric sums turned into means, and TensorBoard scalars: what training and evaluation both report.

Steps and evaluations return sums (`losses.smoothed_cross_entropy`: `loss_sum`, `nll_sum`, `correct_sum`,
`token_count`), which add up over batches, steps and devices; `summarize` divides them once at the end.
No JAX: sums arrive as host numbers.
"""
import math


def summarize(sums: dict[str, float]) -> dict[str, float]:
  """Summed metrics as means per real target token: `loss` (label-smoothed, §5.4, what is optimised), `nll`,
  `perplexity` (exp of the nll, capped at exp(50)) and `accuracy`; a count of 0 is taken as 1.

  With a `kl_sum` (R-Drop's training sums, `losses.fused_smoothed_cross_entropy`: token_count counts both passes,
  kl_sum each pair's tokens once), also `kl`: KL(P1‖P2) + KL(P2‖P1) in nats per target token of one pass."""
  count = max(float(sums['token_count']), 1.0)
  nll = float(sums['nll_sum']) / count
  summary = {'loss': float(sums['loss_sum']) / count, 'nll': nll, 'perplexity': math.exp(min(nll, 50.0)),
             'accuracy': float(sums['correct_sum']) / count}
  if 'kl_sum' in sums:
    summary['kl'] = float(sums['kl_sum']) / max(float(sums['token_count']) / 2, 1.0)
  return summary


def write_scalars(writer, step: int, scalars: dict[str, float], prefix: str) -> None:
  """Writes each scalar as TensorBoard tag `<prefix>/<key>` at `step` and flushes; nothing when writer is None
  (processes other than 0)."""
  if writer is not None:
    for key, value in scalars.items():
      writer.add_scalar(f'{prefix}/{key}', value, step)
    writer.flush()
