"""The two-model section of ``LEADERBOARD.md`` (``board["models"]``, :mod:`kvqbench.report.stats.models`).
Torch-free."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from kvqbench.report.render.text import fmt, rho_text

__all__ = ["models_lines", "render_rank_table", "render_transfer"]


def models_lines(board: dict[str, Any]) -> list[str]:
    """The two-model section (``board["models"]``, :func:`kvqbench.report.board.compare_models`):
    end-to-end ranks on both models and whether the headline metric's choice transfers."""
    mo = board.get("models")
    if not mo:
        return []
    a, b = mo["sources"]
    return [f"## Two models: {a} and {b}", "",
            "Does a method's end-to-end rank carry over from one model to the other, and does the tensor metric "
            "chosen on one predict the other's damage? (figure `kl_models.png`: KL on one model against the "
            "other, one point per method × bits)", "",
            render_rank_table(mo["rank_table"]), "", render_transfer(mo["transfer"]), ""]


def render_rank_table(table: dict[str, Any]) -> str:
    """:func:`kvqbench.report.stats.models.rank_table` as a Markdown table (rank and KL per model and setting) and one line of ρ."""
    names, settings = table["models"], table["settings"]
    heads = ["method"] + [f"{n} {s}" for s in settings for n in names]
    body = []
    for r in table["rows"]:
        row = [f"`{r['method']}`"]
        for s in settings:
            for n in names:
                e = r[n].get(s)
                row.append(f"{e['rank']:g}. {fmt(e['kl'], e['ci95'])}" if e else "—")
        body.append(row)
    rho = "; ".join(f"{s}: ρ = " + (f"{v['rho']:+.2f} over {v['n_methods']} methods" if v["rho"] is not None else "—")
                    for s, v in table["rho"].items())
    return (f"End-to-end KL rank (`{table['target']}`, 1 = least damage; mean ± 95% CI) on each model. "
            f"Spearman ρ between the models: {rho}.\n\n" + tabulate(body, headers=heads, tablefmt="github"))


def render_transfer(tr: dict[str, Any], top: int = 8) -> str:
    """:func:`kvqbench.report.stats.models.predictivity_transfer` as sentences (one per direction) and a table of the ``top`` metrics."""
    lines = []
    for d in tr["directions"]:
        if d["metric"] is None:
            lines.append(f"- Chosen on {d['from']}: nothing (no predictivity there).")
            continue
        verdict = ("it transfers: no metric predicts the damage on {to} better by more than the paired bootstrap"
                   if d["transfers"] else "it does not transfer: on {to} the rule picks `{best}`").format(
            to=d["to"], best=d["best_on_to"])
        lines.append(f"- Chosen on {d['from']}: `{d['metric']}` (ρ = {rho_text(d['rho_from'], d['ci_from'])}); on {d['to']} "
                     f"ρ = {rho_text(d['rho_to'], d['ci_to'])}; {verdict}.")
    names = tr["models"]
    body = [[f"`{r['metric']}`", r["experiment"], *(rho_text(r[n]["rho"], r[n]["ci95"]) for n in names)]
            for r in tr["metrics"][:top]]
    order = "—" if tr["metric_order_rho"] is None else f"{tr['metric_order_rho']:+.2f}"
    return ("\n".join(lines) + f"\n\nMetrics that predict `{tr['target']}` on both models (by the lower of their CI lower "
            f"bounds; Spearman ρ, 95% bootstrap CI). Rank correlation of the metrics' ρ between the models: {order}.\n\n"
            + tabulate(body, headers=["metric", "exp", *[f"ρ {n}" for n in names]], tablefmt="github"))
