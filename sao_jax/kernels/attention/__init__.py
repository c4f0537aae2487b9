"""Causal self-attention over packed segments: dense definition, blockwise XLA, splash TPU."""
