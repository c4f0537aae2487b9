"""What a run reports: metrics files, step metrics, the progress bar, plots.

  metrics_log.py    metrics.jsonl and TensorBoard event files
  event_file.py     TensorBoard event files written without TensorFlow
  train_metrics.py  host-side metrics of a step (batch, timing, plateaus)
  progress.py       the progress bar
  plots.py          learning curves from metrics.jsonl
"""
