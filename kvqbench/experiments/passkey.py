"""Experiment 6, retrieval from far back: a passkey in synthetic filler (docs/DESIGN.md §4).

A prompt of ``L`` tokens (:func:`passkey_prompt`) is an instruction, filler sentences without digits, one
sentence holding a random 5-digit key at a chosen depth of the filler (a share of it, snapped to a
sentence boundary), more filler, the question and the key's tokens as the answer. Key, filler order and
everything else derive from the seed; the key's digits appear nowhere but in its sentence and the answer.
The filler is cut to make the prompt exactly ``L`` tokens, so the prompts of one length are the rows of
one batch. The task follows the passkey retrieval test of Mohtashami & Jaggi (arXiv 2305.16300, §4.2);
the sentences are kvqbench's own.

Scored teacher-forced (:func:`run_passkey_rows`): the prompt up to the answer's last token goes through
the model in one forward call with the method's cache under its stream policy (what a cache holds after
prefilling the prompt: a method's fp16 windows keep the newest tokens exact, the key far back is
quantized). At the answer's positions: the log-probability of the key's tokens (sum over them, nats), the
rank of each of its tokens (0: the top-1 token) and exact match (every token top-1: greedy decoding
would write the key), for the unquantized model at every length and depth, for a method at one depth per
length that the seed chooses (:func:`scored_depth`: the seeds take the depths in turn). Accuracy of a
method counts only at lengths where the unquantized model itself retrieves (its exact-match share over the
seed's depths ≥ :data:`REFERENCE_FLOOR`); the unquantized model's accuracy per length is always reported.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvqbench.data.memory import release_if_grown
from kvqbench.experiments.endtoend import KVCacheHook, RealSource, RowsHook, run_model_rows
from kvqbench.quantizers.base import Quantizer

__all__ = ["Prompt", "passkey_prompt", "passkey_prompts", "REFERENCE_FLOOR", "PasskeyResult", "answer_scores",
           "scored_depth", "run_passkey_rows"]

#: the unquantized model's exact-match share at a length from which a method's accuracy there counts
REFERENCE_FLOOR = 0.9

_INTRO = "A pass key is hidden somewhere in the long text below. Read it all and keep the pass key in mind."
_FILLER = (
    "The river bends twice before it reaches the old mill.",
    "A light wind moves the tall grass across the field.",
    "Clouds gather slowly over the quiet hills in the west.",
    "The market opens early and closes well before dusk.",
    "Small birds rest on the fence beside the dusty road.",
    "A narrow path climbs through the pine forest to the ridge.",
    "The lamp in the kitchen window stays lit all evening.",
    "Fishing boats drift in the harbour while the tide turns.",
    "Snow lies on the far mountains until late in the spring.",
    "The baker stacks warm loaves on the shelf by the door.",
    "Children walk home along the canal after school.",
    "An old clock in the hall ticks slowly through the night.",
)
_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Prompt:
    """One passkey prompt: ``ids`` (``length`` token ids, the answer's tokens last), the key, the number
    of answer tokens and where the key sentence starts (a token index)."""

    ids: tuple[int, ...]
    key: str
    answer_tokens: int
    key_at: int
    depth: float

    @property
    def length(self) -> int:
        return len(self.ids)


def _enc(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def passkey_prompt(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """A prompt of exactly ``length`` tokens with its key at ``depth`` (a share of the filler, in
    ``[0, 1]``); key and filler order drawn from ``rng``.

    Raises:
        ValueError: ``length`` too short for the instruction, key sentence, question and answer.
    """
    key = str(rng.randint(10000, 99999))
    answer = _enc(tokenizer, " " + key)
    key_sent = _enc(tokenizer, " The pass key is") + answer + _enc(tokenizer, ". Remember it.")
    head, tail = [int(t) for t in _enc(tokenizer, _INTRO)], _enc(tokenizer, _QUESTION)
    budget = length - len(head) - len(key_sent) - len(tail) - len(answer)
    if budget < 1:
        raise ValueError(f"passkey prompt of {length} tokens is too short: {length - budget + 1} at least")
    sents: list[list[int]] = []
    total = 0
    order: list[int] = []
    while total < budget:  # whole sentences until the budget is met, then the last one is cut
        if not order:
            order = list(range(len(_FILLER)))
            rng.shuffle(order)
        s = _enc(tokenizer, " " + _FILLER[order.pop()])
        sents.append(s)
        total += len(s)
    ends = [sum(len(s) for s in sents[:i]) for i in range(len(sents) + 1)]
    cut = min(range(len(ends)), key=lambda i: (abs(ends[i] - depth * budget), i))  # the nearest boundary
    filler = [t for s in sents for t in s][:budget]
    at = min(ends[cut], budget)
    ids = head + filler[:at] + key_sent + filler[at:] + tail + answer
    return Prompt(tuple(ids), key, len(answer), len(head) + at, float(depth))


def passkey_prompts(tokenizer: Any, seed: int, lengths: Sequence[int], depths: Sequence[float]) -> list[Prompt]:
    """The prompts of seed ``seed``: one per length × depth (lengths outer), drawn in that order from one
    ``random.Random`` seeded with the seed."""
    rng = random.Random(f"kvqbench-passkey-{int(seed)}")
    return [passkey_prompt(tokenizer, n, d, rng) for n in lengths for d in depths]


def answer_scores(logits: torch.Tensor, answer: Sequence[int]) -> dict[str, Any]:
    """Scores of the answer tokens ``answer`` (``(A,)`` ids) under ``logits`` ``(A, vocab)`` (row ``i``
    predicts ``answer[i]``): ``logp_nats`` (sum of their log-probabilities, fp64), ``ranks`` (per token,
    how many tokens have a strictly larger logit; 0 = top-1) and ``match`` (every rank 0)."""
    t = torch.tensor(list(answer), dtype=torch.long, device=logits.device)[:, None]
    lp = torch.log_softmax(logits.double(), -1).gather(-1, t)[:, 0]
    ranks = (logits > logits.gather(-1, t)).sum(-1)
    return {"logp_nats": float(lp.sum()), "ranks": [int(r) for r in ranks], "match": bool((ranks == 0).all())}


@dataclass
class PasskeyResult:
    """The passkey part of one row's record: ``metrics``, ``series["passkey"]`` and ``extra``."""

    metrics: dict
    series: dict
    extra: dict


_REFS: dict[tuple, list[dict[str, Any]]] = {}


def _answer_logits(src: RealSource, prompts: Sequence[Prompt], hook: Any) -> list[torch.Tensor]:
    n = prompts[0].length
    a = prompts[0].answer_tokens
    logits = run_model_rows(src.net, [p.ids[:-1] for p in prompts], [(0, n - 1)], hook, first=n - 1 - a)
    return [lg[:a] for lg in logits]


def _reference(src: RealSource, prompts: Sequence[Prompt]) -> list[dict[str, Any]]:
    """The unquantized model's scores of ``prompts``, run as one batch: cached per process under the batch's
    prompts, so a method's batch and the reference's are the same computation (a BLAS may round a row
    differently in a batch of another size: the fp16 control is exact only against the same batch)."""
    batch = tuple(hashlib.sha256(json.dumps(list(p.ids)).encode()).hexdigest() for p in prompts)
    key = (src.model_name, src.device, batch)
    if key not in _REFS:
        _REFS[key] = [answer_scores(lg, p.ids[-p.answer_tokens:])
                      for p, lg in zip(prompts, _answer_logits(src, prompts, None))]
        release_if_grown()  # the batch's cache and activations (kvqbench.data.memory)
    return _REFS[key]


def scored_depth(seed: int, length_index: int, n_depths: int) -> int:
    """The depth (index into the configuration's depths) at which seed ``seed`` scores the methods at its
    ``length_index``-th length: ``(seed + length_index) mod n_depths``, so consecutive seeds take the depths
    in turn and every depth of every length is scored once ``n_depths`` seeds have run."""
    return (int(seed) + int(length_index)) % int(n_depths)


@torch.no_grad()
def run_passkey_rows(per_row: Sequence[Sequence[Quantizer]], src: RealSource, seeds: Sequence[int], config: Any, *,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> list[PasskeyResult]:
    """The passkey scores of each row ``r`` (per-layer methods ``per_row[r]``, prompts of ``seeds[r]``,
    lengths ``config.passkey_lengths`` × depths ``config.passkey_depths``). The unquantized model scores
    every prompt of the seed (cached per process); the method scores one prompt per length, at the depth
    :func:`scored_depth` gives (the seeds take the depths in turn: a third of the method's forward tokens
    with three depths, and every depth is covered from three seeds on). The method's prompts of one length,
    of every row, run as one batch, each with its own cache (:class:`RowsHook`).

    Returns:
        Per row: metrics ``passkey_logp_drop_nats`` (mean over the scored prompts of the unquantized model's
        key log-probability minus the method's), ``passkey_rank_worst`` (mean over them of the worst rank
        among the key's tokens) and ``passkey_match`` (exact-match share over the scored prompts the
        unquantized model retrieves, at lengths where it retrieves a share ≥ :data:`REFERENCE_FLOOR` of the
        seed's prompts of every depth; absent when no prompt qualifies); ``series["passkey"]``: per length
        the unquantized model's accuracy and per-depth values (``ref_accuracy``, ``logp_ref_nats``,
        ``rank_worst_ref``), the scored depth (``scored``, an index into ``depths``) and the method's values
        there (``logp_nats``, ``rank_worst``: one-element lists; ``accuracy``: its match, ``None`` where
        not counted).
    """
    lengths, depths = list(config.passkey_lengths), list(config.passkey_depths)
    nd = len(depths)
    prompts = [passkey_prompts(src.tokenizer, s, lengths, depths) for s in seeds]
    scored = [[scored_depth(s, li, nd) for li in range(len(lengths))] for s in seeds]
    got: list[list[dict]] = [[] for _ in seeds]
    base: list[list[dict]] = [[] for _ in seeds]  # the reference at the scored prompts, in the method's batch
    for li in range(len(lengths)):
        batch = [(r, ps[li * nd + scored[r][li]]) for r, ps in enumerate(prompts)]
        hooks = [KVCacheHook(per_row[r], streaming=True, cos=cos, sin=sin) for r, _ in batch]
        logits = _answer_logits(src, [p for _, p in batch], hooks[0] if len(hooks) == 1 else RowsHook(hooks))
        del hooks  # the rows' caches, before the reference's batch builds its own
        release_if_grown()
        for (r, p), lg, b in zip(batch, logits, _reference(src, [p for _, p in batch])):
            got[r].append(answer_scores(lg, p.ids[-p.answer_tokens:]))
            base[r].append(b)
    out = []
    for r in range(len(seeds)):
        # every prompt of the seed, lengths outer, depths inner (one batch per length: prompts of one length)
        ref = [x for li in range(len(lengths)) for x in _reference(src, prompts[r][li * nd:(li + 1) * nd])]
        table: dict[str, Any] = {"lengths": lengths, "depths": depths, "scored": scored[r], "ref_accuracy": [],
                                 "accuracy": [], "logp_ref_nats": [], "logp_nats": [], "rank_worst": [],
                                 "rank_worst_ref": []}
        drop, worst, hits, asked = [], [], 0, 0
        for li in range(len(lengths)):
            rs, mine, at = list(ref[li * nd:(li + 1) * nd]), got[r][li], base[r][li]
            rs[scored[r][li]] = at  # the scored depth's reference is the one computed in the method's batch
            ref_acc = sum(x["match"] for x in rs) / nd
            counted = ref_acc >= REFERENCE_FLOOR and at["match"]
            table["ref_accuracy"].append(ref_acc)
            table["accuracy"].append(float(mine["match"]) if counted else None)
            hits, asked = hits + int(counted and mine["match"]), asked + int(counted)
            drop.append(at["logp_nats"] - mine["logp_nats"])
            worst.append(max(mine["ranks"]))
            table["logp_ref_nats"].append([x["logp_nats"] for x in rs])
            table["logp_nats"].append([mine["logp_nats"]])
            table["rank_worst"].append([max(mine["ranks"])])
            table["rank_worst_ref"].append([max(x["ranks"]) for x in rs])
        metrics = {"passkey_logp_drop_nats": math.fsum(drop) / len(drop),
                   "passkey_rank_worst": sum(worst) / len(worst)}
        if asked:
            metrics["passkey_match"] = hits / asked
        extra = {"passkey": {"keys": [p.key for p in prompts[r]], "key_at": [p.key_at for p in prompts[r]],
                             "answer_tokens": [p.answer_tokens for p in prompts[r]],
                             "reference_floor": REFERENCE_FLOOR, "counted_prompts": asked}}
        out.append(PasskeyResult(metrics, {"passkey": table}, extra))
    return out
