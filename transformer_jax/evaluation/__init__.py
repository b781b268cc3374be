"""Evaluation (§6.1): validation loss and BLEU (or F1) during training and at its end, the test translation
(`evaluate`), the three BLEUs (`bleu`), which checkpoints are evaluated (`selection`), and §6.3's parsing F1
(`parsing`, `evalb`). The modes that evaluate a trained run are `run/evaluate.py` and `run/tune_decoding.py`."""
