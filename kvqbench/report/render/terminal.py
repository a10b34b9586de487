"""The short table ``kvqbench run`` and ``kvqbench report`` print. Torch-free."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from kvqbench.cells import is_plain_setting, setting_order
from kvqbench.report.render.headline import no_predictivity_reason
from kvqbench.report.render.text import canonical, cells_text, fmt, rank_text

__all__ = ["render_terminal"]


def render_terminal(board: dict[str, Any], max_rows: int = 12) -> str:
    """A short table per source at the lowest bit-width that ran: methods ranked by the end-to-end KL where
    it was measured (as on the first screen of ``LEADERBOARD.md``), else by the board's headline tensor
    metric, with the headline metric and effective bits beside; ranks by the paired rule."""
    board = canonical(board)
    out = []
    comp = board.get("completeness") or {}
    if comp and not comp.get("complete", True):
        out.append(f"kvqbench: {comp.get('summary', 'incomplete')}")
    head = board.get("headline") or {}
    for src_name, src in board.get("sources", {}).items():
        # the headline metric; relative MSE where this source lacks it; a long-decode-only set's KL
        metric = next((m for m in (head.get("metric"), "rel_mse", "long_kl_nats") if m in src["rankings"]), "rel_mse")
        rk = src["rankings"].get(metric)
        if not rk:
            continue
        s = next((s for s in sorted(rk["by_setting"], key=setting_order) if is_plain_setting(s)), None)
        if s is None:
            continue
        target = head.get("target") or "e2e_prefill_kl_nats"
        bits = "bits_effective" if "bits_effective" in src["rankings"] else "long_bits_billed"
        eff, e2e, tensor = ({x["method"]: x for x in src["rankings"].get(name, {}).get("by_setting", {}).get(s, [])}
                            for name in (bits, target, metric))
        ranked = src["rankings"][target]["by_setting"][s] if e2e else rk["by_setting"][s]
        rows = [[rank_text(r), r["method"],
                 *([fmt(r["mean"], r["ci95"])] if e2e else []),
                 fmt(tensor.get(r["method"], {}).get("mean"), tensor.get(r["method"], {}).get("ci95")),
                 fmt(eff.get(r["method"], {}).get("mean"))]
                for r in ranked[:max_rows]]
        flagged = [d["name"] for d in src.get("data_quality", []) if d["ok"] is False]
        label = f"headline {metric}" if metric == head.get("metric") else metric
        why = f"{rk.get('experiment', '?')}"
        if metric == head.get("metric") and head.get("from_predictivity") and head.get("rho") is not None:
            on = f" on {head['source']}" if head.get("source") and head["source"] != src_name else ""
            why += f"; Spearman rho {head['rho']:.2f} with {head.get('target')}{on}"
        by = f"ranked by end-to-end KL ({target}), {label} ({why}) beside it" if e2e else f"{label} ({why})"
        out.append(f"kvqbench [{src_name}] {by} at {s} (cells: {cells_text(src['cells'])})"
                   + (f"  FLAGS: {', '.join(flagged)}" if flagged else ""))
        if not head.get("from_predictivity") and metric == "rel_mse":  # docs/DESIGN.md §4
            out.append(f"  (relative MSE: {no_predictivity_reason(board)}, so it cannot pick the tensor metric that "
                       "predicts model damage; the main job, `kvqbench run`, ranks on that metric)")
        out.append(tabulate(rows, headers=["rank", "method", *(["e2e KL (nats)"] if e2e else []), metric, "bits eff." if bits == "bits_effective" else "bits billed"],
                            tablefmt="simple"))
    return "\n".join(out)
