"""Command-line tools: ahead-of-time compiles for TPU planning."""
