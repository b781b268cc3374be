"""Decoding (§6.1): beam and greedy search over a model's step function, the backends a search runs on, and
translating batches of sentences with the decoding cache.

`search` holds what the searches share, `beam` and `greedy` the searches, `backends` the choice of what their
steps run on (XLA, or the CPU kernels of `transformer_jax.cpu`), `translate` the encoder-then-search of a batch
and of a whole split.
"""
