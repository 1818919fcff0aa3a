"""Data parallel across nodes: gradients averaged on the host."""
