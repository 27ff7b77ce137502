"""scripts/project_speedups.py: a method's step on the default model, minus the default model's forward at its rows,
plus the larger model's forward at the same rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "project_speedups.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("project_speedups", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile(engine, llama=None):
    return {"ms": {"engine": {str(q): v for q, v in engine.items()},
                   "llama.cpp": None if llama is None else {str(q): v for q, v in llama.items()}}}


def test_interpolation(script):
    points = {1: 10.0, 2: 12.0, 4: 20.0}
    assert script.at(points, 1) == 10.0 and script.at(points, 3) == 16.0 and script.at(points, 6) == 28.0


def test_projection(script, tmp_path, capsys):
    # pld on the default model: tau 2, 4 rows a step, 100 decode tok/s -> 20 ms a step; t_default(4) = 8 -> 12 ms
    # of other work. At "big": t(4) = 48 -> 60 ms a step -> 2000 / 60 tok/s; llama.cpp's t(1) = 40 -> 25 tok/s.
    summary = {"methods": {"ar": {"kind": "method", "tau": 1.0, "decode_tokens_per_s": 125.0},
                           "pld": {"kind": "method", "tau": 2.0, "decode_tokens_per_s": 100.0, "rows_per_step": 4},
                           "llama-cpp": {"kind": "peer", "tau": 1.0, "decode_tokens_per_s": 90.0}}}
    default = profile({1: 5.0, 2: 6.0, 4: 8.0})
    big = profile({1: 30.0, 2: 36.0, 4: 48.0}, {1: 40.0, 2: 60.0})
    rows = script.project(summary, default, {"big": big})
    assert [r["method"] for r in rows] == ["ar", "pld"]
    ar, pld = rows
    assert ar["other_ms"] == pytest.approx(3.0) and ar["sizes"]["big"]["tokens_per_s"] == pytest.approx(1000 / 33)
    assert pld["other_ms"] == pytest.approx(12.0)
    assert pld["sizes"]["big"]["tokens_per_s"] == pytest.approx(2000 / 60)
    assert pld["sizes"]["big"]["vs_llama_cpp_ar"] == pytest.approx((2000 / 60) / 25)
    files = {}
    for name, data in (("summary", summary), ("default", default), ("big", big)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(data))
    assert script.main(["--bench", str(files["summary"]), "--default-profile", str(files["default"]),
                        "--profile", f"big={files['big']}"]) == 0
    assert "| pld | 2.00 | 4.00 | 12.00 | 33.3 (1.33×) |" in capsys.readouterr().out


def test_a_summary_without_rows_is_refused(script):
    summary = {"methods": {"pld": {"kind": "method", "tau": 2.0, "decode_tokens_per_s": 100.0}}}
    with pytest.raises(SystemExit, match="no rows_per_step"):
        script.project(summary, profile({1: 5.0, 2: 6.0}), {})
