import pytest
import torch

from fastforward.testing import tiny_target

torch.set_num_threads(1)


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
    """The default model (SmolLM2-135M-Instruct); converted once and cached."""
    import fastforward as ff

    return ff.load()
