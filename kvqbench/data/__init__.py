"""Data sources: seeded synthetic K/V/Q and real KV captured from a causal LM."""

from kvqbench.data.types import KVData, apply_rope  # noqa: F401
