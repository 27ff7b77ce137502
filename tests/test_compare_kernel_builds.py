"""scripts/compare_kernel_builds.py: what it times (every packed weight of a forward, once) and its bounds (bad
options end before any model loads or kernel builds)."""

import importlib.util
from pathlib import Path

import pytest

from fastforward import kernels
from fastforward.testing import tiny_gguf_target

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_kernel_builds.py"
spec = importlib.util.spec_from_file_location("compare_kernel_builds", SCRIPT)
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


@pytest.mark.skipif(kernels.load_native() is None, reason="the native kernels are unavailable here")
def test_it_times_every_packed_weight_of_a_forward_once(tmp_path):
    target, _ = tiny_gguf_target(tmp_path / "tiny.gguf", arithmetic="q8")
    linears = compare.packed_linears(target)
    assert linears and len({id(lin) for lin in linears}) == len(linears)
    assert all(lin.data is not None and lin.native is not None for lin in linears)


@pytest.mark.parametrize("argv, fragment", [
    (["--build", "a=/no/such/folder"], "folder of kernel sources"),
    (["--build", "a=", "--build", "a="], "a new name"),
    (["--build", "=x"], "NAME=SOURCE_DIR"),
    (["--build", "a=", "--m", "0"], "rows per call"),
    (["--build", "a=", "--m", "5000"], "rows per call"),
    (["--build", "a=", "--rounds", "0"], "--rounds"),
])
def test_bad_options_end_before_any_work(argv, fragment, capsys, monkeypatch):
    import fastforward

    monkeypatch.setattr(fastforward, "load", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exit_:
        compare.main(["--model", "smollm2-135m", *argv])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err
