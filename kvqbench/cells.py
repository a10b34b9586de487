"""Benchmark cells: one (method × experiment × bit-width × seed × data source × size) each.

Torch-free. The pytest plugin turns each :class:`Cell` into one parametrized case whose id names the
method, the bits, the seed, the source and the size, e.g. ``kvarn-k2v2-seed0-synthetic-full``.

A real data source names its model: ``real`` is the default model's (:data:`DEFAULT_MODEL`, SmolLM2),
``real-<model>`` another's (``real-gemma3-270m``, :func:`real_source`), so the model is part of every real
cell's id, record, result file and leaderboard section; synthetic data depends on no model.

This module is the one place that builds and reads back cell ids, node ids and settings:
:func:`setting_tag` / :meth:`Setting.parse` for a setting (``k2v2``, ``k2v2-group_size64``),
:attr:`Cell.id` / :func:`parse_cell_id` for a cell id, :func:`parse_nodeid` for a pytest node id
(``tests/bench/test_x.py::test_x[<cell id>]``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Cell", "CellId", "NodeId", "Setting", "SIZES", "DEFAULT_BITS", "BUDGETS", "SOURCES", "parse_bits", "parse_cell_id",
           "is_exact_setting", "is_plain_setting", "parse_methods", "parse_nodeid", "parse_seeds", "parse_setting",
           "setting_order", "setting_tag", "DEFAULT_MODEL", "real_source", "source_kind", "source_model"]

DEFAULT_BITS: tuple[int, ...] = (2, 3, 4, 8, 16)
#: the bits/element budgets of the matched-budget tables; a method whose nominal bits exceed the largest
#: is not a budget point (the plugin leaves such settings out of the budget cells)
BUDGETS: tuple[float, ...] = (2.25, 2.5, 3.0, 4.25, 8.25)
#: the kinds of data source; a real source's name carries its model (:func:`real_source`)
SOURCES: tuple[str, ...] = ("synthetic", "real")
#: the model of the ``real`` source (``--kvq-model``'s default)
DEFAULT_MODEL = "smollm2"


def real_source(model: str) -> str:
    """The data-source name of real cells captured from ``model`` (a registry name, HF id or path): the
    model's label — its name in lower case with every run of characters other than letters, digits, ``.``
    and ``-`` as one ``_`` — after ``"real-"`` (``"real-gemma3-270m"``); ``"real"`` for
    :data:`DEFAULT_MODEL`."""
    label = re.sub(r"[^a-z0-9.-]+", "_", str(model).lower()).strip("_-")
    return "real" if label == DEFAULT_MODEL else f"real-{label}"


def source_kind(source: str) -> str:
    """``"real"`` for every real source (``"real"``, ``"real-gemma3-270m"``), else ``source`` itself."""
    return "real" if source == "real" or str(source).startswith("real-") else source


def source_model(source: str) -> str | None:
    """The model of a real source as :func:`real_source` names it (``"smollm2"`` for ``"real"``,
    ``"gemma3-270m"`` for ``"real-gemma3-270m"``); ``None`` for a source that is not real."""
    if source == "real":
        return DEFAULT_MODEL
    return source[len("real-"):] if source_kind(source) == "real" else None


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
        return setting_tag(self.k_bits, self.v_bits)

    @property
    def id(self) -> str:
        """``<method>-k<K>v<V>[-<axis><value>…]-seed<N>-<source>-<size>`` (read back by :func:`parse_cell_id`)."""
        return CellId(self.method, self.k_bits, self.v_bits, self.seed, self.source, self.size, self.variant).id

    def variant_dict(self) -> dict[str, Any]:
        return dict(self.variant)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["variant"] = dict(self.variant)
        d["bits_tag"] = self.bits_tag
        return d


def parse_seeds(text: str, option: str = "--kvq-seeds") -> list[int]:
    """``"3"`` → ``[0, 1, 2]``; ``"0,5,7"`` → ``[0, 5, 7]``.

    Raises:
        ValueError: not a positive count or a comma list of non-negative ints (the message names ``option``,
            the command-line option being parsed).
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
            f"{option} expects a count of at least 1 (e.g. 3: seeds 0, 1, 2) or a comma list of distinct "
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


# ------------------------------------------------------------------------------------------------
# settings, cell ids and node ids: built here, read back here
_SETTING = re.compile(r"k(?P<k>\d+)v(?P<v>\d+)(?P<variant>(?:-[A-Za-z_]+\d[^-\[\]]*)*)")
_AXIS = re.compile(r"-(?P<axis>[A-Za-z_]+)(?P<value>\d[^-\[\]]*)")
_CELL_ID = re.compile(r"(?P<method>[^\[\]]+?)-(?P<setting>" + _SETTING.pattern.replace("?P<", "?P<s_") +
                      r")-seed(?P<seed>\d+)-(?P<source>[a-z_]+(?:-[a-z0-9._-]+?)?)-(?P<size>[a-z_]+)")


def setting_tag(k_bits: int, v_bits: int, variant: Any = ()) -> str:
    """A setting's name: ``k<K>v<V>`` plus ``-<axis><value>`` per variant axis, in the order given
    (``variant`` is a tuple of ``(axis, value)`` pairs or a dict), e.g. ``"k2v2-group_size64"``."""
    items = variant.items() if isinstance(variant, dict) else variant
    return f"k{k_bits}v{v_bits}" + "".join(f"-{k}{v}" for k, v in items)


def _value(text: str) -> Any:
    return int(text) if text.isdigit() else text


@dataclass(frozen=True)
class Setting:
    """One setting: K and V bits and the variant axes, read back from its name by :meth:`parse`
    (``"k2v2-group_size64"``). Variant values made of digits are ints."""

    k_bits: int
    v_bits: int
    variant: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def parse(text: str | None) -> Setting | None:
        """``"k2v4"`` → ``Setting(2, 4)``; ``"k2v2-group_size64"`` → ``Setting(2, 2, (("group_size", 64),))``;
        ``None`` for anything that is not a whole setting name (e.g. ``"pooled"``). A variant axis is
        letters and underscores, its value starts with a digit. Each name is parsed once (cached)."""
        return _parse_setting(str(text or ""))

    @property
    def label(self) -> str:
        """The setting's name (:func:`setting_tag`): ``"k2v2"``, ``"k2v2-group_size64"``."""
        return setting_tag(self.k_bits, self.v_bits, self.variant)

    tag = label

    @property
    def bits(self) -> tuple[int, int]:
        """``(k_bits, v_bits)``."""
        return self.k_bits, self.v_bits

    @property
    def exact(self) -> bool:
        """Both K and V at 16 bits or more: an exact passthrough."""
        return self.k_bits >= 16 and self.v_bits >= 16

    @property
    def plain(self) -> bool:
        """No variant axes (``k2v2``, not ``k2v2-group_size64``)."""
        return not self.variant


@functools.lru_cache(maxsize=4096)
def _parse_setting(text: str) -> Setting | None:
    m = _SETTING.fullmatch(text)
    if m is None:
        return None
    variant = tuple((a.group("axis"), _value(a.group("value"))) for a in _AXIS.finditer(m.group("variant")))
    return Setting(int(m.group("k")), int(m.group("v")), variant)


def parse_setting(text: str | None) -> Setting | None:
    """:meth:`Setting.parse`."""
    return Setting.parse(text)


def setting_order(text: str) -> tuple:
    """Sort key of setting names: by K bits, V bits and the variant values that are numbers, then by
    name; a name that is not a setting (``"pooled"``) sorts before every setting."""
    parsed = Setting.parse(text)
    nums = [] if parsed is None else [parsed.k_bits, parsed.v_bits,
                                      *(v for _, v in parsed.variant if isinstance(v, int))]
    return (nums, text)


def is_exact_setting(text: str | None) -> bool:
    """Whether ``text`` names an exact setting (K and V at 16 bits or more, any variant)."""
    parsed = Setting.parse(text)
    return parsed is not None and parsed.exact


def is_plain_setting(text: str | None) -> bool:
    """Whether ``text`` names a setting without variant axes (``k2v2``, not ``k2v2-group_size64``)."""
    parsed = Setting.parse(text)
    return parsed is not None and parsed.plain


@dataclass(frozen=True)
class CellId:
    """What a cell id says (:attr:`Cell.id`): everything of the cell but its experiment, which the test
    function names."""

    method: str
    k_bits: int
    v_bits: int
    seed: int
    source: str
    size: str
    variant: tuple[tuple[str, Any], ...] = ()

    @property
    def setting(self) -> str:
        return setting_tag(self.k_bits, self.v_bits, self.variant)

    @property
    def id(self) -> str:
        return f"{self.method}-{self.setting}-seed{self.seed}-{self.source}-{self.size}"


def parse_cell_id(text: str) -> CellId | None:
    """A cell id (``"kvarn-k2v2-seed0-synthetic-full"``, ``"kivi-k2v2-group_size64-seed1-real-smoke"``,
    ``"kivi-k2v2-seed0-real-gemma3-270m-smoke"``) read back into a :class:`CellId`; ``None`` when ``text`` is
    not one. The method is everything before the first ``-k<K>v<V>``, the size the last ``-`` part, the
    source what lies between the seed and the size."""
    m = _CELL_ID.fullmatch(text)
    if m is None:
        return None
    setting = Setting.parse(m.group("setting"))
    assert setting is not None  # the same pattern matched
    return CellId(m.group("method"), setting.k_bits, setting.v_bits, int(m.group("seed")), m.group("source"),
                  m.group("size"), setting.variant)


@dataclass(frozen=True)
class NodeId:
    """A pytest node id taken apart: ``path::name[params]``. ``cell`` is the parsed cell id when the
    parameters are one (a benchmark cell), else ``None``."""

    path: str
    name: str
    params: str
    cell: CellId | None

    @property
    def base(self) -> str:
        """The node id without its parameters: ``path::name``."""
        return f"{self.path}::{self.name}" if self.name else self.path

    @property
    def function(self) -> str:
        """The test function's own name (the last ``::`` part of ``name``)."""
        return self.name.rsplit("::", 1)[-1]


def parse_nodeid(nodeid: str) -> NodeId:
    """``"tests/bench/test_x.py::test_x[kivi-k2v2-seed0-synthetic-smoke]"`` →
    ``NodeId("tests/bench/test_x.py", "test_x", "kivi-k2v2-seed0-synthetic-smoke", CellId(...))``.
    Any string parses: without ``::`` the name is empty, without ``[...]`` the parameters are."""
    base, bracket, params = str(nodeid).partition("[")
    if bracket and params.endswith("]"):
        params = params[:-1]
    path, _, name = base.partition("::")
    return NodeId(path, name, params, parse_cell_id(params) if bracket else None)
