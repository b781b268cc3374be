"""The input side (§5.1): reading parallel text (`multi30k`, `tfds_downloads`), the shared SentencePiece
vocabulary (`tokenizer`), tokenised splits (`input_pipeline`) and the token-budget batches the model reads
(`batching`). No module here imports the model or training."""
