"""Evaluation (§6.1): validation loss and BLEU, the test translation and the evaluate/translate modes
(`evaluate`), the three BLEUs (`bleu`), and beam size and length penalty chosen on validation
(`tune_decoding`)."""
