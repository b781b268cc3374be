"""Training (§5): the config checked and built into mesh, model and optimiser (`config_checks`, `experiment`),
the training state (`state`), the train step and the resumable loop (`train`), the loss (`losses`), Adam and its
schedule (`optim`), the metrics it writes (`metrics`), what it measures (`goodput`, `flops`, `memory`) and
multi-host start-up (`distributed`)."""
