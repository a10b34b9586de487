"""The real model of experiments 5 and 6 (:mod:`kvqbench.experiments.endtoend`, which re-exports these
names): the model, its tokenizer and calibration capture (:class:`RealSource`, loaded once per process by
:func:`load_source`), the text windows it reads and its RoPE tables per layer."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from kvqbench.data.types import KVData

__all__ = ["RealSource", "load_source", "model_rope", "source_loaded"]


@dataclass
class RealSource:
    """The model, its tokenizer and the calibration capture of one (model, window) setting."""

    model_name: str
    net: Any
    tokenizer: Any
    calibration: KVData
    window: int
    device: str
    _windows: dict[int, list[int]] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _text: list[int] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def n_layers(self) -> int:
        return int(self.calibration.k.shape[0])

    def window_ids(self, index: int) -> list[int]:
        """Tokens ``[(index+1)·W, (index+2)·W)`` of the shipped corpus's token stream (exp6's prompts)."""
        from kvqbench.data.capture import _tokens

        if not isinstance(index, int) or index < 0:
            raise ValueError(f"window index must be an int >= 0, got {index!r}")
        if index not in self._windows:  # tokenizing the corpus is the same work for every cell
            w = self.window
            ids, _ = _tokens(self.tokenizer, (index + 2) * w)
            self._windows[index] = ids[(index + 1) * w:(index + 2) * w]
        return list(self._windows[index])

    def text_ids(self) -> list[int]:
        """The exp5 text (:func:`kvqbench.data.text.load_text`, hash-checked) as token ids, no special tokens.

        Raises:
            kvqbench.data.text.TextMismatchError: this Python's ``pydoc_data`` is not the pinned text.
        """
        if self._text is None:
            from kvqbench.data.text import load_text

            self._text = [int(t) for t in self.tokenizer(load_text(), add_special_tokens=False)["input_ids"]]
        return self._text

    def text_window_ids(self, index: int, width: int | None = None) -> list[int]:
        """Exp5's window ``index``: tokens ``[index·w, (index+1)·w)`` of :meth:`text_ids` (``w`` = ``width``,
        default the source's window).

        Raises:
            ValueError: ``index`` negative, not an int, or beyond the text's whole windows (the count is named).
        """
        w = width or self.window
        ids = self.text_ids()
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(ids) // w:
            raise ValueError(f"exp5 window index must be an int in [0, {len(ids) // w}) (the text holds "
                             f"{len(ids)} tokens, {len(ids) // w} windows of {w}), got {index!r}")
        return ids[index * w:(index + 1) * w]

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE tables per layer ``(layers, length, head_dim)`` fp32 for positions
        ``0 … length−1`` (a model with one table per layer type, e.g. Gemma 3, gives each layer its type's)."""
        return model_rope(self.net, length, self.device)


def model_rope(net: Any, length: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``net``'s RoPE tables per decoder layer ``(layers, length, head_dim)`` fp32 for positions
    ``0 … length−1``, from its own rotary-embedding module (called once per layer type where its config
    has ``layer_types`` and the module takes one)."""
    from kvqbench.data.capture import _decoder

    rotary = _decoder(net).rotary_emb
    pos = torch.arange(length, device=device)[None]
    dummy = torch.zeros(1, length, 1, device=device, dtype=torch.float32)
    n_layers = int(net.config.num_hidden_layers)
    types = getattr(net.config, "layer_types", None)
    if types is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(dummy, pos)
        return cos[0].float().expand(n_layers, -1, -1), sin[0].float().expand(n_layers, -1, -1)
    table = {t: rotary(dummy, pos, t) for t in dict.fromkeys(types)}
    return (torch.stack([table[t][0][0].float() for t in types]),
            torch.stack([table[t][1][0].float() for t in types]))


_SOURCES: dict[tuple, RealSource] = {}


def source_loaded(*, model: str, window: int, device: str = "cpu") -> bool:
    """Whether :func:`load_source` already holds this source in this process (no load to pay)."""
    return (model, window, device) in _SOURCES


def load_source(*, model: str, window: int, device: str = "cpu", cache_dir: str | None = None) -> RealSource:
    """The model (loaded once per process, :func:`kvqbench.data.capture.load_model`) and a calibration
    capture of the first ``window`` tokens (all layers, with Fisher weights; disk-cached in
    ``cache_dir``, like a GGUF model's converted weights). Cached per process.

    Raises:
        MissingDependencyError, FileNotFoundError, ValueError: see :func:`kvqbench.data.capture.capture_kv`.
    """
    key = (model, window, device)
    if key not in _SOURCES:
        from kvqbench.data.capture import capture_kv, load_model

        net, tok = load_model(model, device=device, cache_dir=cache_dir)
        cal = capture_kv(model=model, seq_len=window, with_grads=True, device=device, cache_dir=cache_dir)
        _SOURCES[key] = RealSource(model, net, tok, cal, window, device)
    return _SOURCES[key]
