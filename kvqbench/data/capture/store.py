"""The on-disk capture cache: keys, a lock per file, atomic writes and validation on load.

A capture is stored as one torch file named by a hash of what determines it (model weights, token count,
layers, gradients, corpus, device type, library versions, capture dtype). The file records the shapes,
dtypes, token count and a sha256 over the tensors' bytes; a file that does not match what it records is
reported in one :class:`CaptureCacheWarning` line and captured again. A lock per file (in the folder's
``locks/``) lets concurrent processes on one machine share a capture: the first runs the model, the others
wait and load it.

A capture is trusted as a computed result, so it is loaded only from a folder of the user's own
(:mod:`kvqbench.privdir`): a cache folder or capture file that another user could write (another owner,
or group/world-writable) is refused in one :class:`CaptureCacheWarning` line, and the capture is run
again into a private folder of this process (:func:`~kvqbench.privdir.fallback_dir`, removed when the
process exits).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvqbench import privdir
from kvqbench.data.capture.errors import CaptureCacheWarning, NonFiniteCaptureError
from kvqbench.data.corpus import corpus_sha256
from kvqbench.data.types import KVData

if TYPE_CHECKING:
    from kvqbench.data.capture.models import _ModelRef

_CACHE_FORMAT = 3  # records shapes, dtypes, token count and a content hash; RoPE tables per layer
_TENSOR_FIELDS = ("k", "v", "q", "k_pre", "cos", "sin", "k_grad2", "v_grad2")


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
        **({"capture_dtype": dtype} if dtype != "float32" else {}),  # only a non-fp32 capture dtype enters the key
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ref.name)[:48]
    return cache_dir / f"kv-{slug}-T{seq_len}-{key}.pt"


_REMOVE_AT_EXIT: set[Path] = set()


def _trusted_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """``cache_dir`` when it is a folder only this user can write (created mode 0700 when missing), else a
    private folder of this process after one :class:`CaptureCacheWarning` line saying why."""
    try:
        return privdir.private_dir(cache_dir)
    except privdir.UnsafePathError as e:
        fallback = privdir.fallback_dir("capture")
        if fallback not in _REMOVE_AT_EXIT:  # a capture there is this process's only: nothing left behind
            _REMOVE_AT_EXIT.add(fallback)
            atexit.register(shutil.rmtree, fallback, True)
        warnings.warn(f"kvqbench: capture cache refused: {e}; capturing into {fallback} instead",
                      CaptureCacheWarning, stacklevel=3)
        return fallback


def _capture_lock(path: Path) -> Any:
    """A lock per cache file, shared by every process on this machine (``locks/<name>.lock`` beside it, in
    the same private folder): the first caller captures, the others wait and load."""
    from filelock import FileLock

    locks = privdir.private_dir(path.parent / "locks")
    return FileLock(str(locks / (path.name + ".lock")))


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
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:  # only this user's
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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
        if tuple(obj[name].shape) != (n_layers, t_len, d):
            return f"holds '{name}' of shape {tuple(obj[name].shape)}, expected {(n_layers, t_len, d)}"
    if obj.get("seq_len") != t_len or (seq_len is not None and t_len != seq_len):
        return f"holds {t_len} tokens, expected {seq_len if seq_len is not None else obj.get('seq_len')}"
    if obj.get("content_sha256") != _tensor_digest(obj):
        return "does not match its content hash (modified or damaged)"
    return None


def _load_cached(path: Path, *, seq_len: int | None = None, with_grads: bool | None = None) -> KVData | None:
    """The capture stored at ``path``, or ``None`` when there is none or it is not valid (unreadable,
    another format, a missing tensor, wrong dtypes/shapes/token count, a content-hash mismatch): then a
    one-line :class:`CaptureCacheWarning` names the file and the caller re-captures. A file another user
    could write (another owner, group/world-writable, not a regular file) is refused the same way,
    unread."""
    try:
        privdir.check_private_file(path)
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except privdir.UnsafePathError as e:
        problem: str | None = f"is refused: {e}"
    except Exception as e:  # truncated, not a torch file, written by an incompatible torch …
        problem = f"is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
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
        if not bool(torch.isfinite(t).all()):  # (a count over a bool tensor would widen it to int64 first)
            bad = int(t.numel() - int(torch.isfinite(t).sum()))
            where = f"cache file {path}" if path is not None else "a fresh capture (not cached)"
            raise NonFiniteCaptureError(
                f"real KV of model {model!r} holds {bad} non-finite value(s) in '{name}' ({where}); the model "
                "produced NaN/inf" + (" or the file was altered: delete it to re-capture" if path is not None else ""))
