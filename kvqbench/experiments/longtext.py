"""Experiment 6's inputs (docs/DESIGN.md §4): its configuration per cell size, the model's context it needs
(checked before any cell runs), and the long text the model decodes.

**The text** (:func:`long_text`): the unquantized model writes a continuation of a corpus prompt (the
first ``prompt`` tokens of corpus window ``seed``, :meth:`RealSource.window_ids`) up to ``length`` = T
tokens in all, by seeded sampling — temperature 1, top-k 50, special tokens (end of text) excluded so the
text runs to T. Sampling, not greedy: a 135M model's greedy continuation falls into a loop (one sentence
repeated tens of times), which is not text a model decodes in use, while tempered top-k sampling keeps
producing new text; temperature 1 keeps the model's own distribution within its top 50 tokens. The
text is generated once per (model, prompt, seed, T, sampling) and kept on disk with its sha256 in
``kvqbench.privdir.user_cache_dir("longtext")``, under a lock per file (the first process generates, the
others wait and read it), so every run and worker on a machine decodes the very same tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kvqbench.experiments.common import check_positive_ints
from kvqbench.experiments.endtoend import RealSource, _cache_kwarg, quantized_cache

__all__ = ["LongDecodeConfig", "CONFIG_BY_SIZE", "ContextTooShortError", "check_context", "model_context",
           "long_text", "sample_continuation", "ids_sha"]


@dataclass(frozen=True)
class LongDecodeConfig:
    """Knobs of experiment 6.

    Attributes:
        length: tokens of the long text ``T`` (prompt + continuation).
        prompt: corpus tokens the continuation follows (at most the source's window).
        prefill: tokens of the prefill ``P`` (``1 ≤ P < T``).
        block: tokens per forward call after the prefill; ``T − P`` must be a multiple of it.
        bin: positions per bin of the KL curve.
        free_tokens: greedy tokens ``G`` of the free-running continuation (0: none).
        noise_draws: perturbed decodes of each noise row (0: no noise floor).
        noise_rel: relative size of the perturbation.
        temperature, top_k: the sampling of the long text.
        passkey_lengths: token lengths of the passkey prompts (key answer included).
        passkey_depths: where in the filler the key sits, as shares of it.
    Raises:
        ValueError: on values that break the schedule (see each check's message).
    """

    length: int = 2048
    prompt: int = 128
    prefill: int = 256
    block: int = 64
    bin: int = 256
    free_tokens: int = 32
    noise_draws: int = 2
    noise_rel: float = 1e-7
    temperature: float = 1.0
    top_k: int = 50
    passkey_lengths: tuple[int, ...] = (512, 2048)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)

    def __post_init__(self) -> None:
        check_positive_ints(self, "length", "prompt", "prefill", "block", "bin", "top_k")
        if self.free_tokens < 0 or self.noise_draws < 0:
            raise ValueError("free_tokens and noise_draws must be >= 0")
        if not self.prompt < self.length or not self.prefill < self.length:
            raise ValueError(f"prompt ({self.prompt}) and prefill ({self.prefill}) must be shorter than the text "
                             f"({self.length})")
        if (self.length - self.prefill) % self.block:
            raise ValueError(f"length − prefill ({self.length - self.prefill}) must be a multiple of block "
                             f"({self.block}): no short (e.g. one-token) last arrival")
        if not self.temperature > 0 or not self.noise_rel >= 0:
            raise ValueError("temperature must be > 0 and noise_rel >= 0")
        if any(not 0.0 <= d <= 1.0 for d in self.passkey_depths) or not self.passkey_depths:
            raise ValueError(f"passkey_depths must be shares in [0, 1], got {self.passkey_depths!r}")

    def chunks(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` token spans of the teacher-forced forward calls."""
        return [(0, self.prefill)] + [(a, a + self.block) for a in range(self.prefill, self.length, self.block)]

    def scored(self) -> tuple[int, int]:
        """``[first, stop)`` positions whose next-token prediction is scored."""
        return self.prefill - 1, self.length - 1

    @property
    def context(self) -> int:
        """The longest sequence the model sees: the text plus its free-running continuation, or the longest
        passkey prompt."""
        return max(self.length + self.free_tokens, *self.passkey_lengths)


#: the configuration of the cells per cell size (``smoke``: the test suite, every regime on the fewest
#: tokens — one passkey depth, as the passkey prompts are most of a smoke cell's tokens; ``long``: the
#: long tier)
CONFIG_BY_SIZE: dict[str, LongDecodeConfig] = {
    "smoke": LongDecodeConfig(length=64, prompt=16, prefill=32, block=32, bin=16, free_tokens=3, noise_draws=1,
                              passkey_lengths=(64, 80), passkey_depths=(0.5,)),
    "long": LongDecodeConfig(),
}


# --------------------------------------------------------------------------------------------------
# the model's context
class ContextTooShortError(ValueError):
    """The model's context is shorter than the longest sequence a configuration needs."""


def model_context(model: str) -> int | None:
    """The context length (``max_position_embeddings``) of ``model`` (``"smollm2"``, an HF id, a local
    folder or ``.gguf`` file), read from its config or GGUF metadata without loading the weights;
    ``None`` when it does not say."""
    from kvqbench.data.capture.models import _resolve

    ref = _resolve(model)
    if ref.gguf_file is not None:
        return _gguf_context(Path(ref.source) / ref.gguf_file)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ref.source, local_files_only=ref.local)
    n = getattr(cfg, "max_position_embeddings", None)
    return None if n is None else int(n)


#: GGUF metadata value types of a fixed size → their size in bytes (8: string, 9: array)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _gguf_context(path: Path) -> int | None:
    """The ``<arch>.context_length`` of a GGUF file (format 2 or 3), read from its header alone: the
    metadata pairs in order, skipping every other value (the tokenizer's arrays among them)."""
    import struct

    with open(path, "rb") as f:
        def unpack(fmt: str) -> Any:
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(unpack("<Q"), 1)
            elif kind == 9:
                inner, n = unpack("<I"), unpack("<Q")
                if inner in _GGUF_SIZES:
                    f.seek(n * _GGUF_SIZES[inner], 1)
                else:
                    for _ in range(n):
                        skip(inner)
            else:
                f.seek(_GGUF_SIZES[kind], 1)

        if f.read(4) != b"GGUF" or unpack("<I") < 2:
            return None
        unpack("<Q")  # tensors
        for _ in range(unpack("<Q")):
            key = f.read(unpack("<Q")).decode("utf-8", "replace")
            kind = unpack("<I")
            if key.endswith(".context_length") and kind in _GGUF_INTS:
                return int(unpack(_GGUF_INTS[kind]))
            skip(kind)
    return None


def check_context(model: str, tokens: int, context: int | None = None) -> None:
    """Raise :class:`ContextTooShortError` (one line) when ``model``'s context (``context``, else
    :func:`model_context`) is shorter than ``tokens``."""
    n = model_context(model) if context is None else context
    if n is not None and n < tokens:
        raise ContextTooShortError(f"model {model} has a context of {n} tokens, shorter than the {tokens} "
                                   "tokens the long-decode cells need")


# --------------------------------------------------------------------------------------------------
# the text
def _lock(path: Path) -> Any:
    from kvqbench.data.capture.store import _capture_lock

    return _capture_lock(path)


def _text_dir() -> Path:
    from kvqbench.privdir import fallback_dir, user_cache_dir

    try:
        return user_cache_dir("longtext")
    except OSError:
        return fallback_dir("longtext")


def ids_sha(ids: Sequence[int]) -> str:
    """The sha256 (hex) of the token ids as a JSON list: the name of a text."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()


@torch.no_grad()
def sample_continuation(net: Any, prompt: Sequence[int], length: int, *, seed: int, temperature: float = 1.0,
                        top_k: int = 50, banned: Sequence[int] = ()) -> list[int]:
    """``prompt`` continued by ``net`` to ``length`` tokens, one token per forward call, each drawn from
    the ``top_k`` most likely next tokens (``banned`` ids excluded) with probabilities
    ``softmax(logits / temperature)`` renormalized over them (fp64), by a ``torch.Generator`` seeded
    with ``seed``.

    Raises:
        ValueError: ``length`` not longer than the prompt.
    """
    if length <= len(prompt):
        raise ValueError(f"length ({length}) must exceed the prompt ({len(prompt)} tokens)")
    dev = next(net.parameters()).device
    cache, kw = quantized_cache(None), _cache_kwarg(net.forward)
    gen = torch.Generator().manual_seed(int(seed))
    ids = [int(i) for i in prompt]
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    logits = net(input_ids=x, position_ids=torch.arange(len(ids), device=dev)[None], use_cache=True,
                 **{kw: cache}).logits[0, -1]
    ban = torch.tensor(sorted(set(int(b) for b in banned)), dtype=torch.long)
    while True:
        lg = logits.detach().double().cpu() / temperature
        if ban.numel():
            lg[ban] = -math.inf
        top = torch.topk(lg, min(top_k, int(lg.numel())))
        pick = int(torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen))
        ids.append(int(top.indices[pick]))
        if len(ids) == length:
            return ids
        t = len(ids) - 1
        logits = net(input_ids=torch.tensor([[ids[-1]]], device=dev), position_ids=torch.tensor([[t]], device=dev),
                     use_cache=True, **{kw: cache}).logits[0, -1]


def long_text(src: RealSource, seed: int, config: LongDecodeConfig, *, folder: Path | None = None) -> list[int]:
    """The long text of seed ``seed`` (see module doc): ``config.length`` token ids, read from the disk
    cache or generated (under a lock) and stored with its sha256. A cached file that does not hold what
    its name says (length, prompt, hash) is generated again.

    Raises:
        ValueError: ``config.prompt`` longer than the source's window.
    """
    from kvqbench.data.capture.models import _resolve
    from kvqbench.data.corpus import corpus_sha256

    if config.prompt > src.window:
        raise ValueError(f"prompt ({config.prompt}) longer than the source's window ({src.window})")
    prompt = src.window_ids(seed)[:config.prompt]
    import transformers

    key = {"format": 1, "model": _resolve(src.model_name).fingerprint, "prompt_sha256": ids_sha(prompt),
           "corpus_sha256": corpus_sha256(), "seed": seed, "length": config.length, "temperature": config.temperature,
           "top_k": config.top_k, "device_type": torch.device(src.device).type,
           "transformers": transformers.__version__, "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", src.model_name)[:48]
    path = (folder or _text_dir()) / f"text-{slug}-T{config.length}-seed{seed}-{digest}.json"

    def cached() -> list[int] | None:
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
            ids = [int(i) for i in obj["ids"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = obj.get("key") == key and len(ids) == config.length and ids[:config.prompt] == prompt
        return ids if ok and obj.get("sha256") == ids_sha(ids) else None

    with _lock(path):
        ids = cached()
        if ids is None:
            ids = sample_continuation(src.net, prompt, config.length, seed=seed, temperature=config.temperature,
                                      top_k=config.top_k, banned=getattr(src.tokenizer, "all_special_ids", ()))
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "ids": ids, "sha256": ids_sha(ids)}), encoding="utf-8")
            tmp.replace(path)
    return ids
