"""The ``Quantizer`` contract and the one registry of methods (docs/DESIGN.md §3).

A method quantizes K and V with its own configuration (``k_bits``, ``v_bits``, group size …):
``quantize(x, kind)`` returns a :class:`QuantizedTensor` (the compact representation: packed codes and
metadata), ``dequantize(qt)`` returns a tensor of the input's shape, dtype and device. Every method
reports bits per element twice:

* **nominal** — the accounting formula under the benchmark budget (scales billed as FP8 = 8 bits,
  zero-points as FP16 = 16 bits, everything else at its stored width);
* **effective** — counted from what the representation holds: every stored field's
  ``numel × bits_per_entry``. Codes are held packed in ``uint8`` (1 byte = 8 bits, so the count is the
  real byte count); metadata (scales, zeros, norms, outlier values, fp16 residual tokens) is *billed at
  the width named on its field* (fp16 = 16 bits) while being held at the working precision so that the
  round-trip numerics are exact (docs/DESIGN.md §3, accounting convention).

``bits >= 16`` is an exact passthrough for every method (billed at 16 bits per element).

Registering: decorate the class with :func:`register`; third-party packages expose their classes
through the ``kvqbench.methods`` entry-point group (see ``docs/ADDING_METHODS.md``).
"""

from __future__ import annotations

import difflib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from kvqbench.numerics.packing import pack_bits, unpack_bits

__all__ = [
    "Kind",
    "Stored",
    "QuantizedTensor",
    "StreamPolicy",
    "Quantizer",
    "register",
    "get",
    "create",
    "available",
    "registry",
    "validate_kv",
    "check_finite",
    "all_finite",
    "check_group_size",
    "UnknownMethodError",
]

Kind = Literal["k", "v"]
KINDS: tuple[str, str] = ("k", "v")
ENTRY_POINT_GROUP = "kvqbench.methods"


@dataclass
class Stored:
    """One field of a representation: a tensor and the width (bits per entry) it is billed at.

    ``bits`` is 8 for a packed ``uint8`` code buffer (its real byte count), 16 for fp16 metadata,
    32 for fp32 values or int32 pointers, and so on.
    """

    tensor: torch.Tensor
    bits: int

    @property
    def total_bits(self) -> int:
        return int(self.tensor.numel()) * int(self.bits)


@dataclass
class QuantizedTensor:
    """The compact representation of one quantized K or V tensor.

    Attributes:
        fields: name → :class:`Stored`; only these are billed in effective bits.
        shape, dtype, device: of the original tensor ``(batch, kv_heads, seq_len, head_dim)``.
        kind: ``"k"`` or ``"v"``.
        bits: the code width used for this tensor.
        meta: small Python values (no tensors) the decoder needs (e.g. the group size).
    """

    fields: dict[str, Stored]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    kind: str
    bits: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name].tensor

    def stored_bits(self) -> int:
        """Total billed bits of every stored field."""
        return sum(f.total_bits for f in self.fields.values())

    def effective_bits(self) -> float:
        """Bits per element as stored: ``stored_bits() / numel``."""
        return self.stored_bits() / max(self.numel, 1)

    def add_codes(self, name: str, codes: torch.Tensor, bits: int) -> None:
        """Pack integer ``codes`` into ``bits`` bits each and store them under ``name``."""
        self.add_packed(name, pack_bits(codes, bits), tuple(codes.shape), bits)

    def add_packed(self, name: str, packed: torch.Tensor, shape: tuple[int, ...], bits: int) -> None:
        """Store codes of ``shape`` that the caller packed itself (:func:`~kvqbench.numerics.packing.pack_bits`
        layout, ``bits`` bits each) under ``name``, as :meth:`add_codes` stores them."""
        self.meta[f"{name}.numel"] = math.prod(shape)
        self.meta[f"{name}.shape"] = tuple(int(s) for s in shape)
        self.meta[f"{name}.bits"] = int(bits)
        self.fields[name] = Stored(packed, 8)

    def codes(self, name: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Unpack the codes stored by :meth:`add_codes` (original shape; int64 by default,
        ``torch.uint8`` for a decoder that only widens them to float)."""
        n = self.meta[f"{name}.numel"]
        return unpack_bits(self.fields[name].tensor, self.meta[f"{name}.bits"], n, dtype).reshape(
            self.meta[f"{name}.shape"]
        )


@dataclass(frozen=True)
class StreamPolicy:
    """How a method behaves as a cache that receives tokens while decoding (pseudo-decode regime).

    Attributes:
        sink_tokens: the first tokens kept in fp16 for good (attention sinks).
        residual_tokens: size of the fp16 window of most recent tokens.
        residual_mode: ``"none"``; ``"chunk"`` — the fp16 tail grows to ``residual_tokens`` and is then
            quantized as a whole chunk (KIVI's K); ``"sliding"`` — the newest ``residual_tokens`` stay
            fp16 and the oldest leaves the window each step (KIVI's V, Kitty's V).
        tile_tokens: a partly filled tile/page of this many tokens stays fp16 until it is full
            (KVarN tiles, Kitty pages); 0 = no tiling.
    Methods without rules use the default: every arriving block is quantized as it arrives.
    """

    sink_tokens: int = 0
    residual_tokens: int = 0
    residual_mode: Literal["none", "chunk", "sliding"] = "none"
    tile_tokens: int = 0


class UnknownMethodError(KeyError):
    """Raised for a method id that is not registered; the message lists what exists."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown method"


def validate_kv(x: torch.Tensor, *, name: str = "x") -> None:
    """Check a K/V tensor: a floating tensor of rank 4 ``(batch, kv_heads, seq_len, head_dim)``,
    non-empty and finite (:func:`check_finite`).

    Raises:
        TypeError: not a tensor, or not a floating dtype.
        ValueError: wrong rank, empty, or NaN/Inf present.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (fp32/fp16/bf16), got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must have rank 4 (batch, kv_heads, seq_len, head_dim), got shape {tuple(x.shape)}; "
            "add the missing dims with x.view(1, 1, T, D) or similar"
        )
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the 'meta' device and holds no data; materialize it on cpu/cuda first")
    check_finite(x, name=name)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite, in one reduction without a full-size temporary: a finite
    sum proves it (a NaN or ±Inf makes the sum NaN or ±Inf); only a non-finite sum — bad data, or finite
    values whose sum overflows — is settled elementwise."""
    if bool(torch.isfinite(x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def check_finite(x: torch.Tensor, *, name: str = "x") -> None:
    """Raise ``ValueError`` naming the NaN/Inf count when ``x`` has a non-finite element.

    Raises:
        ValueError: ``x`` contains NaN or Inf.
    """
    if not all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf values; clean the capture before quantizing")


def _canonical_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a fresh-allocation-aligned contiguous tensor, so that a method's result depends only on
    the values: kernels (matmul, reductions) may round differently for other strides or a misaligned
    start. A contiguous, 64-byte aligned tensor is returned as is (no copy)."""
    if x.is_contiguous() and x.data_ptr() % 64 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _saturate(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp a reconstruction to the finite range of ``dtype`` (a value beyond ``finfo(dtype).max``
    saturates instead of becoming ±Inf when cast; NaN stays NaN)."""
    if not (out.is_floating_point() and dtype.is_floating_point):
        return out
    big = torch.finfo(dtype).max
    if out.dtype == dtype or torch.finfo(out.dtype).max <= big:
        if all_finite(out):  # one reduction, no full-size mask
            return out
    return out.clamp(-big, big)


def check_group_size(group_size: Any) -> int:
    """``group_size`` itself when it is a positive int.

    Raises:
        ValueError: anything else (a bool too).
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return group_size


class Quantizer(ABC):
    """Base class of every method.

    Subclasses set the class metadata below and implement :meth:`_quantize` / :meth:`_dequantize`
    for ``bits < 16`` (the base handles validation and the 16-bit passthrough) and
    :meth:`nominal_bits_for` for the accounting formula. Method-specific knobs are keyword
    arguments of ``__init__`` stored on the instance and reported by :meth:`params`.

    Args:
        k_bits, v_bits: code widths for K and V (``>= 16`` = exact passthrough).
        seed: seed of any randomness (rotations, k-means); recorded in results.
    """

    # --- metadata (class attributes) ---------------------------------------------------------
    id: ClassVar[str] = ""
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    arxiv: ClassVar[str | None] = None
    k_granularity: ClassVar[str] = ""
    v_granularity: ClassVar[str] = ""
    rotation: ClassVar[bool] = False
    fidelity: ClassVar[Literal["faithful", "approximate"]] = "faithful"
    deltas: ClassVar[tuple[str, ...]] = ()
    #: quantizes pre-RoPE keys (KVQuant): the harness gives it pre-RoPE K and re-applies RoPE to its output
    k_pre_rope: ClassVar[bool] = False
    #: its statistics are local to the tensor quantized: no fit, and a codebook-generalization gap of 0
    local_stats: ClassVar[bool] = True
    #: has a ``group_size`` keyword, which the group-size sensitivity cells sweep
    grouped: ClassVar[bool] = False
    #: the seed can change its bits; ``False`` lets the harness compute a real-data cell once for every seed
    seeded: ClassVar[bool] = True
    #: its output and billed bits are the same at every bit-width (the fp16 control); ``True`` lets the
    #: harness compute a seed group of cells once for every bit-width
    bits_free: ClassVar[bool] = False

    def seeded_for(self, shape: tuple[int, ...]) -> bool:
        """Whether this instance's fitted state and output, on K/V (and calibration) tensors of ``shape``
        ``(batch, kv_heads, seq_len, head_dim)`` or fewer tokens, can depend on its seed. Default: the
        class's :attr:`seeded`. A method whose randomness only enters beyond some size (KVQuant's k-means
        subsample) says ``False`` below it; the harness then shares the real-data cells of that shape
        across seeds, as for an unseeded class (checked by a conformance property)."""
        return type(self).seeded

    def __init__(self, k_bits: int = 4, v_bits: int | None = None, *, seed: int = 0) -> None:
        v_bits = k_bits if v_bits is None else v_bits
        for nm, b in (("k_bits", k_bits), ("v_bits", v_bits)):
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise ValueError(f"{nm} must be a positive int, got {b!r}")
            if 8 < b < 16:
                raise ValueError(
                    f"{nm}={b} is not supported: codes are packed up to 8 bits, and 16 or more is the exact "
                    "fp16 passthrough; use 1..8 or >= 16"
                )
        self.k_bits = int(k_bits)
        self.v_bits = int(v_bits)
        self.seed = int(seed)

    # --- public API ---------------------------------------------------------------------------
    def bits_for(self, kind: Kind) -> int:
        if kind not in KINDS:
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        return self.k_bits if kind == "k" else self.v_bits

    def params(self) -> dict[str, Any]:
        """Hyperparameters of this instance (JSON-able), recorded with every result."""
        return {"k_bits": self.k_bits, "v_bits": self.v_bits, "seed": self.seed}

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, kind: Kind) -> QuantizedTensor:
        """Quantize ``x`` ``(batch, kv_heads, seq_len, head_dim)`` (fp32/fp16/bf16) as K or V.

        Raises:
            TypeError / ValueError: see :func:`validate_kv`; a method also raises ``ValueError`` for a
                head_dim it cannot handle.
        """
        bits = self.bits_for(kind)
        validate_kv(x, name=kind.upper() if kind in KINDS else "x")
        if bits >= 16:
            qt = QuantizedTensor({}, tuple(x.shape), x.dtype, x.device, kind, bits)
            qt.fields["passthrough"] = Stored(x.clone(), 16)
            return qt
        return self._quantize(_canonical_layout(x), kind, bits)

    @torch.no_grad()
    def dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        """Decode ``qt`` to a tensor of the original shape, dtype and device. A reconstruction beyond the
        dtype's finite range saturates at ``±finfo(dtype).max``."""
        if "passthrough" in qt.fields:
            return qt["passthrough"].clone()
        out = _saturate(self._dequantize(qt), qt.dtype)
        return out.to(dtype=qt.dtype, device=qt.device).reshape(qt.shape)

    def roundtrip(self, x: torch.Tensor, kind: Kind) -> torch.Tensor:
        """``dequantize(quantize(x, kind))``."""
        return self.dequantize(self.quantize(x, kind))

    def nominal_bits(self, kind: Kind, shape: tuple[int, int, int, int] = (1, 1, 4096, 128)) -> float:
        """Bits/element under the benchmark budget (FP8 scales, FP16 zero-points) for K or V of
        ``shape`` ``(batch, kv_heads, seq_len, head_dim)`` (the default is a 4k-token, D=128 head)."""
        bits = self.bits_for(kind)
        if bits >= 16:
            return 16.0
        return float(self.nominal_bits_for(kind, bits, tuple(int(s) for s in shape)))

    def stream_policy(self, kind: Kind) -> StreamPolicy:
        """This instance's pseudo-decode rules for K or V (fp16 sink/residual windows, tiles);
        the default is none: every arriving block is quantized as it arrives."""
        return StreamPolicy()

    def fit(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None, **calib: Any) -> "Quantizer":
        """Fit data-dependent state (codebooks …) on calibration tensors; no-op for local methods.

        Extra keyword calibration data (``k_grad2``/``v_grad2``: squared gradients of the loss w.r.t. K and V,
        the Fisher information) may be used; methods ignore keywords they do not know.
        Returns ``self``.
        """
        return self

    def describe(self) -> dict[str, Any]:
        """Metadata record for results files."""
        return {
            "id": self.id,
            "name": self.name,
            "paper": self.paper,
            "arxiv": self.arxiv,
            "k_granularity": self.k_granularity,
            "v_granularity": self.v_granularity,
            "rotation": self.rotation,
            "fidelity": self.fidelity,
            "deltas": list(self.deltas),
            "k_pre_rope": self.k_pre_rope,
            "local_stats": self.local_stats,
            "params": self.params(),
        }

    # --- to implement ---------------------------------------------------------------------------
    @abstractmethod
    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        """Quantize a validated tensor at ``bits < 16``."""

    @abstractmethod
    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        """Decode a representation produced by :meth:`_quantize`."""

    @abstractmethod
    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """Accounting formula for ``bits < 16`` (FP8 scales, FP16 zeros) for a tensor of ``shape``."""

    # helpers for subclasses
    def _new_qt(self, x: torch.Tensor, kind: Kind, bits: int, **meta: Any) -> QuantizedTensor:
        return QuantizedTensor({}, tuple(x.shape), x.dtype, x.device, kind, bits, dict(meta))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


# --------------------------------------------------------------------------------------------------
# registry
_REGISTRY: dict[str, type[Quantizer]] = {}
_ENTRY_POINTS_LOADED = False


def register(cls: type[Quantizer]) -> type[Quantizer]:
    """Class decorator: add a :class:`Quantizer` subclass to the registry under ``cls.id``.

    Raises:
        TypeError: ``cls`` is not a Quantizer subclass.
        ValueError: empty id, or the id is already registered to another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Quantizer)):
        raise TypeError(f"only Quantizer subclasses can be registered, got {cls!r}")
    if not cls.id:
        raise ValueError(f"{cls.__name__} has no id")
    prev = _REGISTRY.get(cls.id)
    if prev is not None and prev is not cls and prev.__qualname__ != cls.__qualname__:
        raise ValueError(f"method id {cls.id!r} is already registered to {prev.__module__}.{prev.__name__}")
    _REGISTRY[cls.id] = cls
    return cls


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if isinstance(obj, type) and issubclass(obj, Quantizer) and obj.id not in _REGISTRY:
            register(obj)


def registry() -> dict[str, type[Quantizer]]:
    """id → class for every registered method (built-ins first, then entry points). The built-ins are
    registered by the package ``kvqbench.quantizers``, which Python imports before this module."""
    _load_entry_points()
    return dict(_REGISTRY)


def available() -> list[str]:
    """Registered method ids in registration order."""
    return list(registry())


def get(method_id: str) -> type[Quantizer]:
    """The class registered under ``method_id``.

    Raises:
        UnknownMethodError: with the closest matches and the full list of ids.
    """
    reg = registry()
    if method_id not in reg:
        close = difflib.get_close_matches(method_id, list(reg), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownMethodError(
            f"unknown method id {method_id!r}.{hint} Registered: {', '.join(reg)}"
        )
    return reg[method_id]


def create(method_id: str, k_bits: int = 4, v_bits: int | None = None, *, seed: int = 0, **params: Any) -> Quantizer:
    """Instantiate a registered method."""
    return get(method_id)(k_bits, v_bits, seed=seed, **params)
