"""The registry: one place to register, clear errors, entry points."""

import pytest
import torch

from kvqbench.quantizers import base
from kvqbench.quantizers.base import Quantizer, UnknownMethodError, create, get, register, registry

BUILTINS = ["fp16", "rtn_tensor", "rtn_token", "rtn_channel", "kivi"]


def test_builtins_registered():
    reg = registry()
    for m in BUILTINS:
        assert m in reg and reg[m].id == m


def test_unknown_id_suggests_close_match():
    with pytest.raises(UnknownMethodError) as ei:
        get("kiv")
    msg = str(ei.value)
    assert "'kivi'" in msg and "Registered:" in msg


def test_duplicate_id_rejected_and_non_quantizer_rejected():
    class Dup(Quantizer):
        id = "kivi"

        def _quantize(self, x, kind, bits):  # pragma: no cover
            raise NotImplementedError

        def _dequantize(self, qt):  # pragma: no cover
            raise NotImplementedError

        def nominal_bits_for(self, kind, bits, shape):  # pragma: no cover
            return 0.0

    with pytest.raises(ValueError, match="already registered"):
        register(Dup)
    with pytest.raises(TypeError):
        register(int)  # type: ignore[arg-type]


def test_bad_inputs_raise_clear_errors():
    q = create("kivi", 2)
    with pytest.raises(ValueError, match="rank 4"):
        q.quantize(torch.randn(10, 64), "k")
    bad = torch.randn(1, 1, 8, 8)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        q.quantize(bad, "k")
    with pytest.raises(TypeError, match="floating"):
        q.quantize(torch.ones(1, 1, 4, 4, dtype=torch.int32), "k")
    with pytest.raises(ValueError, match="kind"):
        q.quantize(torch.randn(1, 1, 4, 4), "q")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k_bits"):
        create("kivi", 0)
    with pytest.raises(ValueError, match="group_size"):
        create("kivi", 2, group_size=0)


def test_entry_point_methods_are_loaded(monkeypatch):
    class ThirdParty(Quantizer):
        id = "third_party_test_method"

        def _quantize(self, x, kind, bits):
            qt = self._new_qt(x, kind, bits)
            qt.fields["passthrough"] = base.Stored(x.clone(), 16)
            return qt

        def _dequantize(self, qt):  # pragma: no cover
            return qt["passthrough"]

        def nominal_bits_for(self, kind, bits, shape):
            return 16.0

    class EP:
        name = "third_party"

        def load(self):
            return ThirdParty

    monkeypatch.setattr(base, "_ENTRY_POINTS_LOADED", False)
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: [EP()] if group == base.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    assert "third_party_test_method" in registry()
    assert get("third_party_test_method") is ThirdParty


def test_check_group_size_accepts_positive_ints_only() -> None:
    from kvqbench.quantizers.base import check_group_size

    assert check_group_size(8) == 8
    for bad in (0, -1, True, 2.0, None, "8"):
        with pytest.raises(ValueError, match="group_size must be a positive int"):
            check_group_size(bad)
