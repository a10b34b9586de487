"""Experiment 6 analysed (docs/DESIGN.md §4.6, §5): long decode, KL against the decoded position,
free-running divergence, passkey retrieval and the noise floor. Torch-free.

Comparisons pair settings on the texts they share (each seed decodes another text)."""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean
from typing import Any, Iterable

from kvqbench.metrics import experiment_of
from kvqbench.report.stats.aggregate import setting_key
from kvqbench.report.stats.intervals import mean_ci
from kvqbench.report.stats.paired import ALPHA, holm, mcnemar_exact
from kvqbench.report.stats.ranking import budget_point

__all__ = ["EXPERIMENT", "summarize", "long_decode_points", "passkey_mcnemar", "LONG_PREDICTIVITY_TARGETS"]

#: the long-decode experiment
EXPERIMENT = experiment_of("long_kl_nats")

#: the predictivity targets this module reports beside the short-window KL (see
#: :data:`kvqbench.report.stats.predictivity.PREDICTIVITY_TARGETS`)
LONG_PREDICTIVITY_TARGETS = ("long_kl_nats", "passkey_logp_drop_nats")


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``long_decode`` entry of one source from its exp6 records (``None`` when none passed).

    Returns ``{"kl_curve": {method: {setting: {"start", "stop", "mean", "ci95", "n"}}}, "fp16_share_at_T":
    {method: {setting: share}}, "passkey_reference": {"lengths", "depths", "accuracy", "rank_worst", "n_seeds", "floor"},
    "passkey_accuracy": {method: {setting: [share or None per length]}}, "passkey_mcnemar"
    (:func:`passkey_mcnemar`), "text_tokens", "prefill_tokens", "bin"}``: the KL curve's bins (decoded positions ``[start, stop)``) with the mean over seeds of each
    bin's mean KL and its 95 % half-width (seeds whose bins differ from the first seed's are left out);
    the share of the cache held in fp16 at T (mean of K and V, mean over seeds); the unquantized model's
    exact-match share per passkey length and its worst key-token rank (means over seeds); a method's
    exact-match share per length over the prompts the unquantized model retrieves, mean over the seeds
    where that length counts (``None``: it counts at no seed).
    """
    recs = sorted((r for r in records if r.get("experiment") == EXPERIMENT and r.get("status") == "passed"),
                  key=lambda r: (r["method"], setting_key(r), r["seed"]))
    if not recs:
        return None
    curves: dict[tuple[str, str], list[dict]] = defaultdict(list)
    shares: dict[tuple[str, str], list[float]] = defaultdict(list)
    acc: dict[tuple[str, str], list[list]] = defaultdict(list)
    trials: dict[tuple[str, str], dict[tuple, bool]] = defaultdict(dict)
    ref_acc: dict[int, list[list[float]]] = defaultdict(list)
    ref_rank: dict[int, list[list[float]]] = defaultdict(list)
    lengths: list[int] | None = None
    floor: float | None = None
    depths: list[float] = []
    for r in recs:
        key = (r["method"], setting_key(r))
        series, extra = r.get("series") or {}, r.get("extra") or {}
        c = series.get("kl_curve")
        if c and c.get("mean"):
            curves[key].append(c)
        fs = extra.get("fp16_share_at_T")
        if isinstance(fs, dict) and fs:
            shares[key].append(fmean([float(v) for v in fs.values()]))
        pk = series.get("passkey")
        if pk and pk.get("lengths"):
            lengths, depths = lengths or list(pk["lengths"]), depths or list(pk.get("depths") or [])
            if list(pk["lengths"]) == lengths:
                acc[key].append(list(pk.get("accuracy") or [None] * len(lengths)))
                trials[key].update({(r["seed"], n): bool(a) for n, a in zip(lengths, pk.get("accuracy") or [])
                                    if a is not None})
                ref_acc[r["seed"]].append([float(a) for a in pk["ref_accuracy"]])
                ref_rank[r["seed"]].append([fmean([float(x) for x in row]) for row in pk["rank_worst_ref"]])
                floor = (extra.get("passkey") or {}).get("reference_floor", floor)
    out: dict[str, Any] = {"kl_curve": {}, "fp16_share_at_T": {}, "passkey_accuracy": {}}
    for (m, s), cs in curves.items():
        same = [c for c in cs if c["start"] == cs[0]["start"] and c["stop"] == cs[0]["stop"]]
        cols = [mean_ci([float(c["mean"][i]) for c in same]) for i in range(len(same[0]["mean"]))]
        out["kl_curve"].setdefault(m, {})[s] = {"start": list(same[0]["start"]), "stop": list(same[0]["stop"]),
                                                "mean": [c[0] for c in cols], "ci95": [c[1] for c in cols],
                                                "n": len(same)}
    for (m, s), v in shares.items():
        out["fp16_share_at_T"].setdefault(m, {})[s] = fmean(v)
    for (m, s), rows in acc.items():
        per_len = [[row[i] for row in rows if row[i] is not None] for i in range(len(lengths or []))]
        out["passkey_accuracy"].setdefault(m, {})[s] = [fmean(v) if v else None for v in per_len]
    if lengths:
        seeds = sorted(ref_acc)
        per_seed = [[fmean(col) for col in zip(*ref_acc[sd])] for sd in seeds]  # every record of a seed
        per_seed_rank = [[fmean(col) for col in zip(*ref_rank[sd])] for sd in seeds]  # scores the same prompts
        out["passkey_reference"] = {"lengths": lengths, "accuracy": [fmean(c) for c in zip(*per_seed)],
                                    "rank_worst": [fmean(c) for c in zip(*per_seed_rank)],
                                    "n_seeds": len(seeds), "floor": floor, "depths": depths}
        out["passkey_mcnemar"] = passkey_mcnemar(trials)
    first = recs[0].get("extra") or {}
    out.update(text_tokens=first.get("text_tokens"), prefill_tokens=first.get("prefill_tokens"),
               bin=((recs[0].get("series") or {}).get("kl_curve") or {}).get("bin"))
    return out


def long_decode_points(stats6: dict[str, Any]) -> list[dict[str, Any]]:
    """The budget points of the long decode (``stats[source][EXPERIMENT]``): per plain, quantizing setting its
    long-decode KL (mean, 95 % half-width, and per text: ``units`` = seed → KL) and the bits billed at T,
    for :func:`~kvqbench.report.stats.ranking.paired_at_budgets`."""
    return [p for m, by in stats6.items() for s, e in by.items()
            if (p := budget_point(m, s, e.get("long_kl_nats"), (e.get("long_bits_billed") or {}).get("mean")))]


def passkey_mcnemar(trials: dict[tuple[str, str], dict[tuple, bool]]) -> dict[str, Any]:
    """Passkey exact match against the unquantized model, trial by trial.

    ``trials``: ``(method, setting)`` → ``{(seed, length): exact match}`` over its counted trials (prompts the
    unquantized model retrieves: it passes all). Each method is compared with it on the same prompts by
    McNemar's exact one-sided test (:func:`~kvqbench.report.stats.paired.mcnemar_exact`), Holm over the
    methods of a setting at :data:`~kvqbench.report.stats.paired.ALPHA`. Returns ``{setting: {method:
    {"n_trials", "lost" (trials only the reference passed), "p", "p_holm", "separated", "min_p"}}}``;
    ``min_p`` = 0.5 ** n_trials, the smallest p the trials allow: above α nothing can be separated.
    """
    out: dict[str, Any] = {}
    for s in sorted({s for _, s in trials}):
        ms = sorted(m for m, s2 in trials if s2 == s)
        tests = [mcnemar_exact([True] * len(trials[(m, s)]), list(trials[(m, s)].values())) for m in ms]
        out[s] = {m: {"n_trials": t["n_trials"], "lost": t["best_only"], "p": t["p"], "p_holm": ph,
                      "separated": ph <= ALPHA, "min_p": 0.5 ** t["n_trials"]}
                  for m, t, ph in zip(ms, tests, holm([t["p"] for t in tests]))}
    return out
