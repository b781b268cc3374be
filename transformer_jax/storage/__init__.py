"""What a run keeps on disk and reads back: the run folder's layout, config record and lock (`workdir`), the
orbax checkpoints of its state and data position (`checkpoints`), the checks around them (`checkpoint_checks`)
and what a run must agree with to resume (`fingerprint`). Data, training, evaluation and the tools all name
files through here."""
