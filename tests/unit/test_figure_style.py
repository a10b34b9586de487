"""Method colours and markers (kvqbench/report/render/figures/style.py), shared by every PNG and the web
page: a colour-blind-safe published palette, one look per method whatever else is listed, and every
method told apart from every other. Torch- and matplotlib-free."""

from __future__ import annotations

import itertools

import pytest

from kvqbench.report.render.figures.style import COLORS, Style
from kvqbench.report.render.svg import Series, chart

#: Paul Tol's qualitative scheme "muted", as published in his technical note SRON/EPS/TN/09-002
#: (https://personal.sron.nl/~pault/): indigo, cyan, teal, green, olive, sand, rose, wine, purple
TOL_MUTED = ("#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499")
#: the methods of the published leaderboard (leaderboard/leaderboard.json), fp16 the reference
PUBLISHED = ["fp16", "kitty", "kivi", "kvarn", "kvquant", "polarquant", "quarot", "rtn_channel", "rtn_tensor",
             "rtn_token", "turboquant"]


def test_method_colours_are_tols_muted_scheme_and_fp16_is_black():
    assert tuple(c.upper() for c in COLORS) == TOL_MUTED
    assert Style(PUBLISHED)("fp16")["color"] == "black"


@pytest.mark.parametrize("at", range(len(PUBLISHED)))
def test_fp16_takes_no_colour_wherever_it_is_listed(at):
    """A method's look depends on the other methods' order only, not on where fp16 sorts (figures that
    leave fp16 out, like kl_models.png, colour every method as those that show it)."""
    others = [m for m in PUBLISHED if m != "fp16"]
    with_fp16 = others[:at] + ["fp16"] + others[at:]
    assert [Style(with_fp16)(m) for m in others] == [Style(others)(m) for m in others]


@pytest.mark.parametrize("n", [10, 14, 18])
def test_every_method_looks_different(n):
    """Each of n methods has its own (colour, marker, line style); figures that encode the bits by the
    marker tell methods apart by colour and fill alone, which holds up to twice the palette (18 methods)."""
    methods = ["fp16"] + [f"m{i:02d}" for i in range(n)]
    style = Style(methods)
    looks = [style(m) for m in methods]
    assert len({(s["color"], s["marker"], s["linestyle"]) for s in looks}) == len(methods)
    assert len({(s["color"], s["facecolor"]) for s in looks}) == len(methods)
    for a, b in itertools.combinations(methods[1:], 2):
        if style(a)["color"] == style(b)["color"]:  # a colour comes back: dash-dotted and hollow
            assert {style(a)["linestyle"], style(b)["linestyle"]} == {"-", "-."}
            assert {style(a)["facecolor"] == style(a)["color"], style(b)["facecolor"] == style(b)["color"]} == {True, False}


def test_an_unlisted_method_takes_the_next_free_look():
    style = Style(PUBLISHED)
    assert style("third_party") == Style(PUBLISHED + ["third_party"])("third_party")
    assert style("third_party")["color"] == COLORS[len(PUBLISHED) - 1 - len(COLORS)]  # 11th non-fp16: 2nd lap
    assert style("third_party")["facecolor"] == "white"


def test_the_page_draws_a_method_as_the_pngs_do():
    """The SVG of the page: the line style as a dash pattern (none for a solid line) and a hollow marker as
    an outline in the method's colour."""
    style = Style(PUBLISHED)

    def svg(m: str) -> str:
        st = style(m)
        return str(chart([Series(m, st["color"], st["marker"], [(1.0, 1.0, "a"), (2.0, 2.0, "b")], True,
                                 st["linestyle"], st["facecolor"] != st["color"])], xlabel="x", ylabel="y", label="t"))

    solid, back, ref = svg("kitty"), svg("turboquant"), svg("fp16")  # turboquant: the 10th colour, kitty's
    assert style("kitty")["color"] == style("turboquant")["color"]
    assert "stroke-dasharray" not in solid and f'fill="{style("kitty")["color"]}"' in solid
    assert 'stroke-dasharray="6 2 1.5 2"' in back and f'fill="#fff" stroke="{style("turboquant")["color"]}"' in back
    assert 'stroke-dasharray="5 3"' in ref and 'fill="black"' in ref
