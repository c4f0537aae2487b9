"""The DIS policy loss: reference (XLA) and fused Pallas TPU kernels."""
