"""Data sources: seeded synthetic K/V/Q and real KV captured from a causal LM."""

from kvqbench.data.capture import (  # noqa: F401  (no transformers import at module load)
    MissingDependencyError,
    capture_kv,
    default_model_path,
    load_model,
)
from kvqbench.data.corpus import corpus_sha256, corpus_text, load_corpus  # noqa: F401
from kvqbench.data.synthetic import make_synthetic  # noqa: F401
from kvqbench.data.types import KVData, apply_rope  # noqa: F401
