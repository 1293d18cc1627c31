"""A pytest plugin that measures how close each comparison in the tests comes to its bound, for the table in
docs/benchmarks.md ("Comparison bounds in the tests"). Not loaded by default:

    PYTHONPATH=tests BOUND_METER_OUT=bounds.json python -m pytest -p bound_meter tests/test_train.py -q

records, per call site (file:line), the worst |actual - expected| / (atol + rtol |expected|) of
torch.testing.assert_close and pytest.approx, and the worst gap / bound of helpers.assert_within, and merges them
into the JSON file (so runs with and without ATEN_CPU_CAPABILITY=avx2 can go to two files)."""

import json
import math
import os
import sys
from pathlib import Path

import torch
from _pytest import approx as pytest_approx

WORST: dict[str, float] = {}
# torch.testing.assert_close's defaults by dtype: (rtol, atol)
DEFAULT_TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.parent.name == "tests" and path.name not in ("bound_meter.py", "helpers.py"):
            return f"{path.name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _record(site: str, ratio: float) -> None:
    WORST[site] = max(WORST.get(site, 0.0), ratio)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 DTensor


_assert_close = torch.testing.assert_close


def assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
    x, y = torch.as_tensor(_full(actual)).detach(), torch.as_tensor(_full(expected)).detach()
    if x.is_floating_point() and x.shape == y.shape and x.numel():
        r, a = (rtol, atol) if rtol is not None else DEFAULT_TOLERANCES.get(x.dtype, (1.3e-6, 1e-5))
        gap, allowed = (x.double() - y.double()).abs(), a + r * y.double().abs()
        finite = torch.isfinite(gap)
        if finite.any():
            _record(_site(), (gap[finite] / allowed[finite]).max().item())
    return _assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)


_approx_eq = pytest_approx.ApproxScalar.__eq__


def approx_eq(self, actual) -> bool:
    if isinstance(actual, (int, float)) and isinstance(self.expected, (int, float)) \
            and math.isfinite(actual) and math.isfinite(self.expected):
        gap = abs(actual - self.expected)
        _record(_site(), gap / self.tolerance if self.tolerance else (0.0 if gap == 0 else math.inf))
    return _approx_eq(self, actual)


def pytest_configure(config) -> None:
    import helpers

    within = helpers.assert_within

    def assert_within(gap, bound, where=None):
        ratio = gap.double().abs() / torch.as_tensor(bound, dtype=torch.float64)
        if ratio.numel():
            _record(f"{_site()} {where[0] if isinstance(where, tuple) else where}", ratio.max().item())
        return within(gap, bound, where)

    helpers.assert_within = assert_within
    torch.testing.assert_close = assert_close
    pytest_approx.ApproxScalar.__eq__ = approx_eq


def pytest_sessionfinish(session) -> None:
    out = os.environ.get("BOUND_METER_OUT")
    if out:
        old = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        merged = {k: max(old.get(k, 0.0), WORST.get(k, 0.0)) for k in old.keys() | WORST.keys()}
        Path(out).write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
