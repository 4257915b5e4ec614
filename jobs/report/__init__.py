"""What a run says as it trains: the run log's reporter, the step metrics and MFU (metrics.py), and the trackers it
also logs to (trackers.py: W&B, MLflow)."""
