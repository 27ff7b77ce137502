import os
import shutil
import tempfile

# The suite never writes into the user's cache: before any fastforward module computes a path, every cache path of
# this process (and of the commands it starts) points into a folder of its own -- $FASTFORWARD_TEST_CACHE when set (a
# folder kept for tests between sessions: kernels built once), else a temporary one, removed at the end. Built
# kernels are still read from the default cache (fastforward.kernels looks there too, read-only).
_OWN_CACHE = not os.environ.get("FASTFORWARD_TEST_CACHE")
TEST_CACHE = os.environ.get("FASTFORWARD_TEST_CACHE") or tempfile.mkdtemp(prefix="fastforward-tests-")
os.environ["FASTFORWARD_CACHE"] = TEST_CACHE

import pytest  # noqa: E402
import torch  # noqa: E402

from fastforward.testing import tiny_gguf_target, tiny_target  # noqa: E402

torch.set_num_threads(1)


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


@pytest.fixture
def pin_costs():
    """``pin_costs(target, curve)``: the target's cost model fixed to ``curve`` for this test (no live timings), the
    model it had restored after."""
    from fastforward.costs import CostModel, set_cost_model

    pinned = []

    def pin(target, curve):
        pinned.append((target, set_cost_model(target, CostModel(curve, learn=False))))

    yield pin
    for target, previous in reversed(pinned):
        set_cost_model(target, previous)


@pytest.fixture(scope="session")
def tiny():
    """A tiny random float64 Llama target with the lean backend."""
    return tiny_target(backend="lean")


@pytest.fixture(scope="session")
def tiny_hf():
    """The same tiny model (same seed) through the HF fallback backend."""
    return tiny_target(backend="hf")


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct) as users get it: its GGUF file in the default (q8) arithmetic, with
    the fp16 KV cache that goes with it."""
    import fastforward as ff

    return ff.load()


@pytest.fixture(scope="session")
def default_exact():
    """The default model in the exact arithmetic: the dequantised fp32 model's products, which HF's forward of the
    converted model computes too (tests comparing the two use this one)."""
    import fastforward as ff

    return ff.load(arithmetic="exact")


@pytest.fixture(scope="session")
def packed(tmp_path_factory):
    """A tiny GGUF target on the packed path (native kernels): every row of a shared forward computed as alone."""
    target, _ = tiny_gguf_target(tmp_path_factory.mktemp("packed") / "tiny.gguf", seed=5)
    if target.batch_rows_limit() <= 0:
        pytest.skip("the native kernels are not available: no row-exact shared forward to test")
    return target


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: the error must come before any work. The methods are imported first: one
    that bound ``load`` at import would otherwise keep the stand-in after the test."""
    import fastforward as ff
    import fastforward.model
    from fastforward.proposers import available_methods

    available_methods()

    def load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ff, "load", load)
    monkeypatch.setattr(fastforward.model, "load", load)
