"""Experiments: each module computes one experiment's metrics for one cell (method × data)."""
