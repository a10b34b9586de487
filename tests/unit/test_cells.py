"""kvqbench.cells: the one parser of cell ids, node ids and settings reads back exactly what was built."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvqbench.cells import (
    SIZES,
    SOURCES,
    Cell,
    CellId,
    is_exact_setting,
    is_plain_setting,
    parse_cell_id,
    parse_nodeid,
    parse_setting,
    real_source,
    setting_order,
    setting_tag,
    source_kind,
    source_model,
)

#: a method id: lower-case words joined by ``_`` or ``-`` (no word may read as a setting, ``k2v2``)
method_ids = st.from_regex(r"[a-z][a-z0-9_]{0,10}(-[a-z][a-z0-9_]{0,6}){0,2}", fullmatch=True).filter(
    lambda m: not any(parse_setting(w) for w in m.split("-")))
experiments = st.from_regex(r"exp[0-9]{1,2}", fullmatch=True)
bit_widths = st.integers(min_value=1, max_value=16)
seeds = st.integers(min_value=0, max_value=10**6)
#: a model as --kvq-model takes it: a registry name, an HF id or a path
models = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_./ -]{0,24}", fullmatch=True).filter(lambda m: m[-1].isalnum())
#: a data source: synthetic, the default model's ``real`` or another model's ``real-<model>``
sources = st.one_of(st.sampled_from(SOURCES), models.map(real_source))
variants = st.lists(st.tuples(st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True), st.integers(0, 4096)),
                    max_size=2, unique_by=lambda av: av[0]).map(tuple)


@st.composite
def cells(draw: st.DrawFn) -> Cell:
    """A benchmark cell over every axis its id names."""
    return Cell(draw(experiments), draw(method_ids), draw(bit_widths), draw(bit_widths), draw(seeds),
                draw(sources), draw(st.sampled_from(sorted(SIZES))), draw(variants))


@given(cell=cells())
def test_a_cell_id_parses_back_to_the_cell(cell):
    parsed = parse_cell_id(cell.id)
    assert parsed == CellId(cell.method, cell.k_bits, cell.v_bits, cell.seed, cell.source, cell.size, cell.variant)
    assert parsed.id == cell.id


@given(model=models)
def test_a_real_source_names_its_model_and_reads_back(model):
    src = real_source(model)
    assert source_kind(src) == "real" and src.startswith("real")
    assert real_source(source_model(src)) == src  # the name is its own model label
    assert (src == "real") == (model.lower() == "smollm2")
    cell = Cell("exp1", "kivi", 2, 2, 0, src, "smoke")
    assert parse_cell_id(cell.id).source == src


def test_the_default_model_keeps_the_plain_real_source_and_others_are_apart():
    assert real_source("smollm2") == "real" and source_model("real") == "smollm2"
    assert real_source("gemma3-270m") == "real-gemma3-270m" and source_model("real-gemma3-270m") == "gemma3-270m"
    assert source_kind("synthetic") == "synthetic" and source_model("synthetic") is None
    ids = {Cell("exp1", "kivi", 2, 2, 0, real_source(m), "smoke").id for m in ("smollm2", "gemma3-270m")}
    assert ids == {"kivi-k2v2-seed0-real-smoke", "kivi-k2v2-seed0-real-gemma3-270m-smoke"}


@given(cell=cells(), cls=st.sampled_from(["", "TestCells::"]))
def test_a_node_id_parses_back_to_its_file_test_and_cell(cell, cls):
    path = f"tests/bench/test_{cell.experiment}.py"
    node = parse_nodeid(f"{path}::{cls}test_{cell.experiment}[{cell.id}]")
    assert (node.path, node.name, node.function, node.params) == (
        path, f"{cls}test_{cell.experiment}", f"test_{cell.experiment}", cell.id)
    assert node.base == f"{path}::{cls}test_{cell.experiment}"
    assert node.cell == parse_cell_id(cell.id)


@given(k=bit_widths, v=bit_widths, variant=variants)
def test_a_setting_parses_back(k, v, variant):
    tag = setting_tag(k, v, variant)
    parsed = parse_setting(tag)
    assert (parsed.k_bits, parsed.v_bits, parsed.variant, parsed.tag) == (k, v, variant, tag)
    assert is_exact_setting(tag) == (k >= 16 and v >= 16)
    assert is_plain_setting(tag) == (not variant)
    assert setting_tag(k, v, dict(variant)) == tag


@given(a=st.tuples(bit_widths, bit_widths), b=st.tuples(bit_widths, bit_widths))
def test_settings_sort_by_their_bits(a, b):
    assume(a != b)
    first, second = sorted([setting_tag(*a), setting_tag(*b)], key=setting_order)
    assert (parse_setting(first).k_bits, parse_setting(first).v_bits) == min(a, b)
    assert (parse_setting(second).k_bits, parse_setting(second).v_bits) == max(a, b)


@pytest.mark.parametrize("text", ["", "pooled", "k2", "kv", "k2v", "k2v2-", "k2v2-group_size", "2v2", "k2v2x"])
def test_what_is_not_a_setting(text):
    assert parse_setting(text) is None and not is_exact_setting(text) and not is_plain_setting(text)


@pytest.mark.parametrize("nodeid", [
    "tests/unit/test_cells.py::test_what_is_not_a_setting[pooled]",
    "tests/unit/test_x.py::test_y",
    "tests/unit/test_x.py::test_y[kivi-k2v2-seed0-synthetic]",  # no size
    "tests/unit/test_x.py::test_y[k2v2-seed0-synthetic-smoke]",  # no method
    "tests/unit/test_x.py::test_y[kivi-k2v2-seedx-synthetic-smoke]",
])
def test_other_node_ids_have_no_cell(nodeid):
    assert parse_nodeid(nodeid).cell is None


def test_a_bare_path_is_a_node_id_of_its_own():
    node = parse_nodeid("tests/bench")
    assert (node.path, node.name, node.params, node.cell, node.base) == ("tests/bench", "", "", None, "tests/bench")
