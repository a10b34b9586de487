"""The input text of real-model captures: ``corpus.txt``, shipped with the package.

The text is original prose written for kvqbench (an explainer on KV caches and quantization, a short
story, a dialogue, a numbered list and a short code sketch), so captures are deterministic, offline and
free of third-party text. It is about 2 860 tokens with the SmolLM2 tokenizer (≥ 2048 is guaranteed by a
test). A longer context is served by repeating the whole text, joined by :data:`SEPARATOR`
(:func:`corpus_text` with ``repeats > 1``).

Line endings are normalized to ``"\\n"`` on load, so the text and its SHA-256 do not depend on a git
checkout's newline conversion. This module is torch- and transformers-free.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

__all__ = ["SEPARATOR", "load_corpus", "corpus_text", "corpus_sha256"]

#: placed between repetitions of the corpus when a longer text is asked for.
SEPARATOR = "\n\n"


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
    """The shipped corpus text (UTF-8, ``"\\n"`` line endings, no trailing whitespace).

    Raises:
        FileNotFoundError: the package was installed without its data file (``corpus.txt``).
    """
    raw = resources.files("kvqbench.data").joinpath("corpus.txt").read_bytes()
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip()


def corpus_text(repeats: int = 1) -> str:
    """The corpus repeated ``repeats`` times, joined by :data:`SEPARATOR`.

    Raises:
        ValueError: ``repeats`` is not a positive int.
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    return SEPARATOR.join([load_corpus()] * repeats)


def corpus_sha256() -> str:
    """Hex SHA-256 of :func:`load_corpus`'s text encoded as UTF-8 (recorded in capture metadata)."""
    return hashlib.sha256(load_corpus().encode("utf-8")).hexdigest()
