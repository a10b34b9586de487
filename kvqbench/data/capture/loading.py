"""Loading a model once per process, and the GGUF conversion cache.

:func:`load_model` keeps up to four ``(model, tokenizer)`` instances per process, keyed by the resolved
model, device and dtype; a capture uses such an instance when there is one and otherwise loads a model
that it does not keep (:func:`_model_for_capture`). A GGUF model's weights are dequantized by transformers on load; with a
``cache_dir`` the converted weights and tokenizer are kept there as a plain safetensors folder
(:func:`_converted_dir`, written atomically, checked on load), so later processes load them instead of
converting the GGUF file again. Like captures, they are loaded only from a folder of the user's own
(:func:`kvqbench.data.capture.store._trusted_dir`), from files no other user can write.

Importing this module does not import transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from kvqbench import privdir
from kvqbench.data.capture.errors import CaptureCacheWarning
from kvqbench.data.capture.models import (
    DEFAULT_MODEL,
    _dtype_kw,
    _ModelRef,
    _require_real_deps,
    _resolve,
    _torch_dtype,
)
from kvqbench.data.capture.store import _trusted_dir
from kvqbench.data.memory import release_freed

__all__ = ["load_model"]


def load_model(model: str = DEFAULT_MODEL, *, device: torch.device | str = "cpu",
               dtype: str = "float32", cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in ``dtype`` (default fp32), eval mode, parameters frozen, on ``device``.

    Cached per process on the resolved model, device and dtype, so repeated captures reuse one instance.
    Do not mutate the returned model.

    Args:
        model: a registered name (``"smollm2"``, the default, or ``"gemma3-270m"``; see
            :mod:`kvqbench.data.capture.registry`), a Hugging Face id, a local model folder or a local
            ``.gguf`` file.
        device: torch device for the weights.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` — the weights' and activations' dtype.
        cache_dir: for a GGUF model, a folder (the capture cache) where its dequantized weights and
            tokenizer are kept after the first load, so later processes load that folder instead of
            converting the GGUF file again; the very same weights and token ids (tested). ``None``:
            convert every time. A folder another user could write is refused in one
            :class:`CaptureCacheWarning` line (a private folder of this process is used instead).

    Raises:
        MissingDependencyError: transformers (and, for GGUF, gguf/accelerate) or a registered model's
            package missing.
        ModelFileError: a registered model's file truncated or not of its pinned SHA-256.
        FileNotFoundError: a local path that does not exist.
        ValueError: an unknown ``dtype``.
    """
    ref = _resolve(model)
    _require_real_deps(gguf=ref.gguf_file is not None, default_model=model == DEFAULT_MODEL)
    return _load_resolved(ref, str(torch.device(device)), _torch_dtype(dtype), cache_dir)


#: models loaded in this process: (ref, device, dtype) → (model, tokenizer); at most 4 kept
_MODELS: dict[tuple, tuple[Any, Any]] = {}
_MODELS_LOCK = threading.Lock()


def _load_resolved(ref: _ModelRef, device: str, dtype: torch.dtype = torch.float32,
                   cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """The process-wide instance of ``ref`` on ``device`` in ``dtype`` (loaded on first use; see
    :func:`load_model` for ``cache_dir``, which does not take part in the key)."""
    key = (ref, device, dtype)
    with _MODELS_LOCK:
        if key not in _MODELS:
            if len(_MODELS) >= 4:
                _MODELS.pop(next(iter(_MODELS)))
            _MODELS[key] = _load_fresh(ref, device, dtype, None if cache_dir is None else _trusted_dir(cache_dir))
            release_freed()  # a GGUF file's conversion buffers
        return _MODELS[key]


def _model_for_capture(ref: _ModelRef, device: str, dtype: torch.dtype = torch.float32,
                       cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """The process-wide instance of ``ref`` when one is loaded (:func:`load_model`), else a fresh one that
    is not kept: a capture runs the model once, and its weights are freed when the capture returns
    instead of staying resident in a process that does not run the model again. Loaded the same way as
    :func:`_load_resolved` (the same weights)."""
    with _MODELS_LOCK:
        held = _MODELS.get((ref, device, dtype))
    if held is not None:
        return held
    return _load_fresh(ref, device, dtype, None if cache_dir is None else _trusted_dir(cache_dir))


def _load_fresh(ref: _ModelRef, device: str, dtype: torch.dtype, cache_dir: Path | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_kw = _dtype_kw()
    kwargs: dict[str, Any] = {}
    if ref.gguf_file is not None:
        kwargs["gguf_file"] = ref.gguf_file
    if ref.local:
        kwargs["local_files_only"] = True
    converted = _converted_dir(cache_dir, ref, dtype) if cache_dir is not None and ref.gguf_file else None
    loaded = _load_converted(converted, dtype) if converted is not None else None
    if loaded is not None:
        tokenizer, net = loaded
    else:
        tokenizer = AutoTokenizer.from_pretrained(ref.source, **kwargs)
        net = AutoModelForCausalLM.from_pretrained(ref.source, **kwargs, **{dtype_kw: dtype})
        if converted is not None:
            _save_converted(converted, net, tokenizer)
    # GGUF models are flagged "quantized" (their weights are dequantized on load), which forbids
    # `.float()`/`.to(dtype)`; the dtype argument above already gives the dtype asked for.
    if torch.device(device) != next(net.parameters()).device:
        net = net.to(device)
    net.eval()
    net.requires_grad_(False)
    return net, tokenizer


#: version of the converted-model folder layout (part of its cache key)
_CONVERTED_FORMAT = 1
_CONVERTED_MARK = "kvqbench-converted.json"


def _converted_dir(cache_dir: Path, ref: _ModelRef, dtype: torch.dtype) -> Path:
    """The folder of ``ref``'s dequantized GGUF weights and tokenizer in ``cache_dir``, keyed by the GGUF
    file (a registered model's pinned SHA-256, else its path and size), the dtype and the library versions
    that convert it."""
    import transformers

    payload = {"format": _CONVERTED_FORMAT, "model": ref.fingerprint, "gguf_file": ref.gguf_file,
               "dtype": str(dtype), "transformers": transformers.__version__, "torch": torch.__version__}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ref.name)[:48]
    return cache_dir / f"model-{slug}-{key}"


def _load_converted(folder: Path, dtype: torch.dtype) -> tuple[Any, Any] | None:
    """``(tokenizer, model)`` from a converted folder, or ``None`` when it is missing, incomplete,
    unreadable or writable by another user (then the GGUF file is converted again, with a one-line
    warning for a broken or refused folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / _CONVERTED_MARK).is_file():
        return None
    try:
        privdir.private_dir(folder)
        for f in folder.iterdir():
            privdir.check_private_file(f)
        mark = json.loads((folder / _CONVERTED_MARK).read_text())
        weights = folder / "model.safetensors"
        if weights.stat().st_size != int(mark["weights_bytes"]):
            raise ValueError(f"model.safetensors holds {weights.stat().st_size} bytes, expected {mark['weights_bytes']}")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        net = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **{_dtype_kw(): dtype})
    except Exception as e:  # a broken cache entry costs one conversion, never the run
        warnings.warn(f"kvqbench: converted model cache {folder.name} not loaded ({type(e).__name__}: {e}); "
                      "converting the GGUF file again", CaptureCacheWarning, stacklevel=2)
        return None
    return tokenizer, net


def _save_converted(folder: Path, net: Any, tokenizer: Any) -> None:
    """Write the converted model into ``folder`` atomically (a temporary sibling folder renamed at the
    end; a concurrent writer that finished first wins). A failure to write only costs the next load."""
    from safetensors.torch import save_model

    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=str(folder.parent)))
        config = net.config.to_dict()
        config.pop("quantization_config", None)  # the weights are plain (dequantized) tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        save_model(net, str(tmp / "model.safetensors"))  # handles tied weights
        tokenizer.save_pretrained(str(tmp))
        (tmp / _CONVERTED_MARK).write_text(json.dumps(
            {"weights_bytes": (tmp / "model.safetensors").stat().st_size, "format": _CONVERTED_FORMAT}))
        for f in tmp.iterdir():
            f.chmod(0o600)  # only this user's, whatever the umask
        try:
            os.replace(tmp, folder)
            tmp = None
        except OSError:  # another process wrote it first (a non-empty folder cannot be replaced)
            pass
    except Exception as e:
        warnings.warn(f"kvqbench: could not keep the converted model in {folder.parent} "
                      f"({type(e).__name__}: {e})", CaptureCacheWarning, stacklevel=2)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
