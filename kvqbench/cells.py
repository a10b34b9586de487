"""Benchmark cells: one (method × experiment × bit-width × seed × data source × size) each.

Torch-free. The pytest plugin turns each :class:`Cell` into one parametrized case whose id names the
method, the bits, the seed, the source and the size, e.g. ``kvarn-k2v2-seed0-synthetic-full``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Cell", "SIZES", "DEFAULT_BITS", "SOURCES", "parse_seeds", "parse_bits", "parse_methods"]

DEFAULT_BITS: tuple[int, ...] = (2, 3, 4, 8, 16)
SOURCES: tuple[str, ...] = ("synthetic", "real")

#: Tensor sizes per cell size. Synthetic: generator arguments. Real: capture arguments
#: (``layers="smoke"`` = first, middle and last layer).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "smoke": {
        "synthetic": {"batch": 1, "kv_heads": 2, "q_heads": 4, "seq_len": 256, "head_dim": 128},
        "real": {"seq_len": 128, "layers": "smoke"},
    },
    "full": {
        "synthetic": {"batch": 1, "kv_heads": 4, "q_heads": 8, "seq_len": 2048, "head_dim": 128},
        "real": {"seq_len": 1024, "layers": None},
    },
}


@dataclass(frozen=True)
class Cell:
    """One benchmark cell. ``variant`` holds extra axes of an experiment (e.g. a group size)."""

    experiment: str
    method: str
    k_bits: int
    v_bits: int
    seed: int
    source: str
    size: str
    variant: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @property
    def bits_tag(self) -> str:
        return f"k{self.k_bits}v{self.v_bits}"

    @property
    def id(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in self.variant)
        return f"{self.method}-{self.bits_tag}{extra}-seed{self.seed}-{self.source}-{self.size}"

    def variant_dict(self) -> dict[str, Any]:
        return dict(self.variant)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["variant"] = dict(self.variant)
        d["bits_tag"] = self.bits_tag
        return d


def parse_seeds(text: str) -> list[int]:
    """``"3"`` → ``[0, 1, 2]``; ``"0,5,7"`` → ``[0, 5, 7]``.

    Raises:
        ValueError: not a positive count or a comma list of non-negative ints.
    """
    text = str(text).strip()
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
            if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
                raise ValueError
            return seeds
        n = int(text)
        if n < 1:
            raise ValueError
        return list(range(n))
    except ValueError:
        raise ValueError(
            f"--kvq-seeds expects a count of at least 1 (e.g. 3: seeds 0, 1, 2) or a comma list of distinct "
            f"non-negative seeds (e.g. 0,5,7, or 0, for seed 0 alone); got {text!r}"
        ) from None


def parse_bits(text: str) -> list[int]:
    """``"2,3,4,8,16"`` → ``[2, 3, 4, 8, 16]`` (each 1..16).

    Raises:
        ValueError: on anything else.
    """
    try:
        parts = str(text).split(",")
        if any(not b.strip() for b in parts):  # "2,,4" or "2,4,": a typo, not a shorter list
            raise ValueError
        bits = [int(b) for b in parts]
        if not bits or any(b < 1 or b > 16 or 8 < b < 16 for b in bits):
            raise ValueError
        return sorted(set(bits))
    except ValueError:
        raise ValueError(f"--kvq-bits expects a comma list of ints in 1..8 or 16 (e.g. 2,4,16); got {text!r}") from None


def parse_methods(text: str | None, known: list[str], option: str = "--kvq-methods") -> list[str]:
    """``None``/``"all"`` → every known id; else a comma list validated against ``known``.

    Raises:
        ValueError: naming the unknown ids and the registered ones.
    """
    if text is None or str(text).strip() in ("", "all"):
        return list(known)
    asked = [m.strip() for m in str(text).split(",") if m.strip()]
    if not asked:
        raise ValueError(f"{option} got no method id ({text!r}); registered: {', '.join(known)}")
    unknown = [m for m in asked if m not in known]
    if unknown:
        raise ValueError(f"unknown method id(s) {', '.join(unknown)} in {option}; registered: {', '.join(known)}")
    return asked
