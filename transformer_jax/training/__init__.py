"""Training (§5): the compiled train and validation steps (`step`), what they take (`build`: mesh, model,
optimiser, vocabulary, checkpoints), the training state (`state`), the loss (`losses`), Adam and its schedule
(`optim`), the metrics a run writes (`metrics`), what it measures (`goodput`, `flops`, `memory`) and multi-host
start-up (`distributed`). The loop that runs the steps is `run/train.py`'s."""
