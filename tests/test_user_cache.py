"""The test suite never writes into the user's cache (``~/.cache/fastforward``): tests/conftest.py points
``$FASTFORWARD_CACHE`` at a folder of the session's own before anything computes a path."""

import os
import subprocess
import sys
from pathlib import Path

from fastforward.paths import cache_root, costs_dir, default_cache_root

ROOT = Path(__file__).resolve().parents[1]


def test_every_cache_path_of_the_session_is_its_own():
    session_cache = Path(os.environ["FASTFORWARD_CACHE"])
    assert cache_root() == session_cache and costs_dir().is_relative_to(session_cache)
    assert not session_cache.resolve().is_relative_to(default_cache_root().resolve())


def test_a_test_that_writes_into_the_cache_leaves_the_users_untouched(tmp_path):
    """A test that measures and stores a cost curve (what once left ``~/.cache/fastforward/costs/-tmp-pytest-...``
    files behind), run by pytest with HOME in a fresh folder and no cache variable set: it passes, and nothing
    appears under that HOME's ``.cache/fastforward``."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("FASTFORWARD_CACHE", "FASTFORWARD_TEST_CACHE")}
    env.update(HOME=str(home), FASTFORWARD_NO_KERNEL="1")
    test = "tests/test_costs.py::test_the_first_measurement_is_not_drafting_time"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
    assert not (home / ".cache" / "fastforward").exists()
