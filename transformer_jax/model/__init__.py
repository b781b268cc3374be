"""The paper's model (§3): attention, the layers and the encoder-decoder, their numerics and parameter layouts.

`transformer` holds the encoder-decoder (`Transformer`, `ModelConfig`); `layers` the position encodings,
feed-forward network and residual sub-layers; `attention` multi-head attention (§3.2); `numerics` the einsum and
dropout they compute with; `sharding` the logical axis names their parameters and activations carry.
"""
