"""The one range table (amp_cli/dtypes.py) against numpy's and ml_dtypes' own numbers, and the
rounding helper the sensitivity analysis uses."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from amp_cli import dtypes


@pytest.mark.parametrize("name,info", [("float16", np.finfo(np.float16)),
                                       ("bfloat16", ml_dtypes.finfo(ml_dtypes.bfloat16)),
                                       ("float32", np.finfo(np.float32))])
def test_ranges_match_the_libraries(name, info):
    r = dtypes.type_range(name)
    assert r.max == float(info.max)
    assert r.smallest_normal == float(info.tiny)
    assert r.smallest_subnormal == float(info.smallest_subnormal)
    assert dtypes.lowest(name) == -float(info.max)


def test_round_to_keeps_what_the_type_keeps():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32) * 100
    for name in ("float16", "bfloat16"):
        r = dtypes.round_to(x, name)
        rel = np.abs(r - x) / np.abs(x)
        assert rel.max() <= (2.0 ** -11 if name == "float16" else 2.0 ** -8)  # half an ulp
        assert rel.max() > 0
    assert np.isinf(dtypes.round_to(np.float32([70000.0]), "float16")).all()


def test_unknown_type_is_an_error():
    with pytest.raises(ValueError, match="int8"):
        dtypes.type_range("int8")
