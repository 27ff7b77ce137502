"""What the tests of the native drafter calls share: the native module (or a skip), and a runner beside its
Python-path twin."""

from __future__ import annotations

import copy

import pytest

from fastforward.kernels import load_native


def native_or_skip(*names: str):
    """The native kernels' module when it built and has every one of ``names``; else the test is skipped."""
    native = load_native()
    if native is None or not all(hasattr(native, name) for name in names):
        pytest.skip("the native kernels did not build on this machine")
    return native


def with_python_twin(runner):
    """``runner`` (skipped when it has no native call) and a copy of it that takes the Python path, with caches of its
    own holding the same values."""
    if runner.native is None:
        pytest.skip("the native kernels did not build on this machine")
    plain = copy.copy(runner)
    plain.native = None
    plain.k, plain.v = runner.k.clone(), runner.v.clone()
    return runner, plain
