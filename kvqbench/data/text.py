"""The text experiment 5 scores: prose from the Python Language Reference, read from the standard library.

Every Python install ships the reference manual's topic texts as data (``pydoc_data.topics``, what
``help("assert")`` prints). kvqbench reads :data:`TOPICS` — 32 topics whose text is the same in CPython
3.10.13, 3.11.7, 3.12.1 and 3.13.0 — joins them in that order with blank lines and checks the SHA-256 of
the result against :data:`TEXT_SHA256` before any exp5 cell runs. The text is never copied into this
repository; its source, hash and each window's hash go into the records' provenance.

A Python whose documentation edited one of these topics gives another hash: :func:`load_text` then
raises :class:`TextMismatchError` with one line naming the Python and the topic, since windows of
another text would not be comparable with anyone else's numbers. The calibration capture (and exp6's
prompts) keep the shipped ``corpus.txt`` (:mod:`kvqbench.data.corpus`), so no scored token is a
calibration token.

Torch- and transformers-free.
"""

from __future__ import annotations

import functools
import hashlib
import platform

__all__ = ["SOURCE", "TOPICS", "TEXT_SHA256", "TextMismatchError", "load_text", "check_text"]

#: what the text is, for provenance
SOURCE = "pydoc_data.topics (Python standard library: Python Language Reference topics)"

#: the topics read, in this order (each identical in CPython 3.10.13, 3.11.7, 3.12.1, 3.13.0)
TOPICS: tuple[str, ...] = (
    "assert", "bitwise", "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object", "bltin-type-objects",
    "booleans", "break", "callable-types", "comparisons", "context-managers", "continue", "del",
    "dynamic-features", "else", "exceptions", "global", "id-classes", "if", "import", "in", "integers", "lambda",
    "pass", "return", "slicings", "typesfunctions", "typesmodules", "unary", "while", "with", "yield")

#: SHA-256 of the joined text (UTF-8), 49 100 characters
TEXT_SHA256 = "5dea3a25bd9547af3c6338cd5460a3a36b758605aee860d70478350f9cde5006"

#: joins the topics
SEPARATOR = "\n\n"


class TextMismatchError(RuntimeError):
    """This Python's ``pydoc_data.topics`` is not the pinned text (a topic missing or edited)."""


def _topic_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_text(text: str, topics: dict[str, str] | None = None) -> str:
    """``text`` if its SHA-256 is :data:`TEXT_SHA256`.

    Args:
        text: the joined topics.
        topics: the topics it was joined from (to name the first that differs in the error).
    Raises:
        TextMismatchError: another hash (one line: the Python, the topic, both hashes).
    """
    got = _topic_hash(text)
    if got != TEXT_SHA256:
        where = ""
        if topics is not None:
            missing = [t for t in TOPICS if t not in topics]
            where = f" (topic {missing[0]!r} is missing)" if missing else ""
        raise TextMismatchError(
            f"kvqbench: exp5's text, pydoc_data.topics of Python {platform.python_version()}{where}, has SHA-256 "
            f"{got[:16]}…, not the pinned {TEXT_SHA256[:16]}… (CPython 3.10.13, 3.11.7, 3.12.1, 3.13.0 carry it): "
            f"this Python's reference manual edited a topic exp5 reads; run the real cells with one of those "
            f"Pythons or deselect them (-k 'not endtoend')")
    return text


@functools.lru_cache(maxsize=1)
def load_text() -> str:
    """The pinned text: :data:`TOPICS` of ``pydoc_data.topics`` joined by :data:`SEPARATOR`, each stripped.

    Raises:
        TextMismatchError: ``pydoc_data`` missing (a Python built without it) or another text.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise TextMismatchError(f"kvqbench: exp5's text needs pydoc_data.topics, which this Python "
                                f"{platform.python_version()} lacks ({e})") from None
    text = SEPARATOR.join(topics[t].strip() for t in TOPICS if t in topics)
    return check_text(text, topics)
