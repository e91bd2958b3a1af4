"""Balancing: ZERO-resizing priorities, speeds, the cost model, the controller and the policies
that decide, while training, what every device computes. Built on `semijax.core`."""
