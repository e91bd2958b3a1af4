"""The training harness: configs, data, the optimizer, the loop, checkpoints and metrics."""
