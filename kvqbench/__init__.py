"""kvqbench — a reproducible, method-neutral benchmark of KV-cache quantization at the tensor level.

Importing the top-level package is cheap and torch-free; the quantizers live in
:mod:`kvqbench.quantizers` and need torch.
"""

__version__ = "0.1.0"

LAYOUT = "(batch, kv_heads, seq_len, head_dim)"

__all__ = ["__version__", "LAYOUT"]
