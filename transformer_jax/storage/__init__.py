"""What a run keeps on disk and reads back: the run folder's layout, config record and lock (`workdir`) and
the orbax checkpoints of its state and data position (`checkpoints`). Data, training, evaluation and the tools
all name files through here."""
