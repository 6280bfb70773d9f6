"""What a run tells its user: logging, progress and metrics (logs), TensorBoard event files written without
TensorBoard (tensorboard_events), loss curves as a PNG (plot), MLflow and Weights & Biases (trackers)."""
