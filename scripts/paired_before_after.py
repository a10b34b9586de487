"""The first screen's answer per model and budget: the published one (95 % CIs that overlap are ties) beside
the paired rule of :mod:`kvqbench.report.stats.paired`, applied to the published per-window exp5 values.

    python scripts/paired_before_after.py [LEADERBOARD_DIR]   (default: leaderboard/)

Reads ``leaderboard.json`` (the published headline rows: budgets and old answers) and every
``exp5_<source>.json`` beside it. Unit = the text window (the cell's ``seed``; its ``extra.window_index``).
Per method the candidate is its setting with the lowest mean log end-to-end prefill KL among those whose
mean bits billed fit the budget (then fewer bits); fp16 and variant settings are not candidates. Prints a
Markdown table per source and the count of the old ties the paired rule separates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvqbench.report.stats.paired import budget_verdict

KL, BITS = "e2e_prefill_kl_nats", "e2e_prefill_bits_billed"


def per_window(cells: list[dict]) -> dict[tuple[str, str], dict]:
    """(method, bits_tag) → {"kl": {window: KL}, "bits": mean bits billed} for passed plain quantizing cells."""
    out: dict[tuple[str, str], dict] = {}
    for r in cells:
        if r.get("status") != "passed" or r["method"] == "fp16" or r.get("variant"):
            continue
        e = out.setdefault((r["method"], r["bits_tag"]), {"kl": {}, "bits": []})
        e["kl"][r["seed"]] = r["metrics"][KL]
        e["bits"].append(r["metrics"][BITS])
    return {k: {"kl": v["kl"], "bits": float(np.mean(v["bits"]))} for k, v in out.items()}


def candidates(settings: dict[tuple[str, str], dict], budget: float) -> dict[tuple[str, str], dict]:
    own: dict[str, tuple[str, str]] = {}
    for key in sorted(settings, key=lambda k: (np.mean(np.log(list(settings[k]["kl"].values()))),
                                               settings[k]["bits"], k)):
        if settings[key]["bits"] <= budget + 1e-9:
            own.setdefault(key[0], key)
    return {k: settings[k]["kl"] for k in own.values()}


def main(folder: Path) -> int:
    board = json.loads((folder / "leaderboard.json").read_text())
    separated_total = old_tied_total = new_tied_total = 0
    for src, body in board["sources"].items():
        path = folder / f"exp5_{src}.json"
        if not path.exists():
            continue
        settings = per_window(json.loads(path.read_text())["cells"])
        print(f"\n### {src}: end-to-end prefill KL, windows {sorted(next(iter(settings.values()))['kl'])}\n")
        print("| budget | old (overlapping 95% CIs) | new best (rank, P(best)) | tied now | separated now |")
        print("|---|---|---|---|---|")
        for row in body["headline"]:
            b = row["budget"]
            old = [row["method"]] + [t["method"] for t in row.get("ties") or []]
            cand = candidates(settings, b)
            if not cand:
                print(f"| ≤ {b} | — | — | — | — |")
                continue
            v = budget_verdict(cand)
            best = v["best"][0]
            lo, hi = v["rank_interval"]

            def fmt(c: dict) -> str:
                ci = c["ratio_ci95"]
                return f"{c['key'][0]} {c['ratio']:.2f}× [{ci[0]:.2f}, {ci[1]:.2f}] p_holm={c['p_holm']:.3g}"

            tied = [c for c in v["comparisons"] if c["tied"]]
            sep = [c for c in v["comparisons"] if not c["tied"]]
            now_tied = {best} | {c["key"][0] for c in tied}
            separated_total += sum(1 for m in old[1:] if m not in now_tied and m != best)
            old_tied_total += len(old) - 1
            new_tied_total += len(tied)
            print(f"| ≤ {b} | {' = '.join(old)} | `{best}` {v['best'][1]} ({lo}–{hi}, {v['p_best']:.2f}) | "
                  f"{'; '.join(fmt(c) for c in tied) or '—'} | {'; '.join(fmt(c) for c in sep) or '—'} |")
    print(f"\nOld ties (pairs best–tied): {old_tied_total}; of them separated by the paired rule: {separated_total}; "
          f"ties under the paired rule: {new_tied_total}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("leaderboard")))
