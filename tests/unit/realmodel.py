"""The ``real`` marker of unit tests that need the real model: skipped, with the reason, when its
dependencies (the ``real`` extra and the default model's package) are missing."""

from __future__ import annotations

import pytest


def missing() -> str | None:
    """Why the real model cannot be loaded here (one line), or ``None``."""
    from kvqbench.data.capture import MissingDependencyError, _require_real_deps, default_model_path

    try:
        _require_real_deps(gguf=True, default_model=True)
        default_model_path()
    except MissingDependencyError as e:
        return str(e)
    return None


MISSING = missing()


def real(fn):
    """Mark a test as needing the real model; skip it with the reason when the deps are missing."""
    return pytest.mark.real(pytest.mark.skipif(MISSING is not None, reason=str(MISSING))(fn))
