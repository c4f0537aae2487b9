"""Skip-observation GAE: reference (XLA) and Pallas TPU kernel."""
