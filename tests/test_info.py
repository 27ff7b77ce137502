"""``fastforward info`` and the facts behind it (fastforward/machine_facts.py): the JSON keys, the cost curve as
cached (age, t(1), t(8)/t(1), measured under load or not), nothing measured or compiled, llama.cpp's AMX build
problem said in one line by info and by the benchmark's llama.cpp peer, and the server's /v1/models card."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import one_line_exit_2, run_cli
from tiny_chat_model import write_tiny_chat_gguf

import fastforward as ff
from fastforward import kernels, machine_facts
from fastforward.costs import curve_path

MACHINE_KEYS = {"fastforward", "python", "torch", "cpu", "kernels", "llama_cpp"}
CPU_KEYS = {"model", "architecture", "features", "logical_cpus", "usable_cpus", "torch_threads",
            "last_level_cache_bytes"}
MODEL_KEYS = {"name", "loaded", "backend", "arithmetic", "kv_cache", "matmul", "max_context", "row_exact_rows",
              "weights", "cost_curve", "drafters", "load_seconds"}
AMX_INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 | REPACK = 1 |"


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    """The tiny chat model's file, loaded once here first (which builds the native kernels if no earlier test did,
    so that info finds them built and loads the model)."""
    path = write_tiny_chat_gguf(tmp_path_factory.mktemp("info") / "chat.gguf")
    target = ff.load(str(path))
    if kernels.load_native() is None:
        pytest.skip("the native kernels are not available here")
    return str(path), target


def info_json(capsys, *argv) -> dict:
    code, out, err = run_cli(capsys, "info", "--json", *argv)
    assert code == 0, err
    assert "measuring" not in err and "compiling" not in err, err
    return json.loads(out)


def write_curve(target, ms: dict, **reading) -> Path:
    path = curve_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"ms": ms, "kv": 256, **reading}))
    return path


def test_info_json_keys(capsys, chat_gguf):
    path, target = chat_gguf
    facts = info_json(capsys, "--model", path)
    assert MACHINE_KEYS | {"caches", "model"} <= set(facts)
    assert CPU_KEYS <= set(facts["cpu"])
    assert set(facts["cpu"]["features"]) == set(machine_facts.CPU_FEATURES)
    assert facts["cpu"]["features"]["avx2"] == ("avx2" in kernels.cpu_flags())
    k = facts["kernels"]
    assert k["status"] == "built" and k["isa"] == kernels.load_native().isa
    assert set(k["paths"]) == {"q8", "exact", "fp32"} and k["paths"]["q8"] == f"q8-{kernels.load_native().q8_dot}"
    m = facts["model"]
    assert MODEL_KEYS <= set(m) and m["loaded"] is True
    assert (m["backend"], m["arithmetic"], m["kv_cache"]) == (target.backend_name, target.arithmetic,
                                                              target.kv_precision)
    assert m["matmul"] == target.backend.matmul_kernel  # what `fastforward profile` prints as "matmul"
    # every weight matrix of the forward, by format: the tiny model's are all Q8_0, multiplied in q8
    assert [(w["format"], w["arithmetic"], w["kernel"]) for w in m["weights"]] == [
        ("Q8_0", "q8", f"q8-{kernels.load_native().q8_dot}")]
    assert m["weights"][0]["matrices"] == len(target.backend.matmul_weights())
    assert m["cost_curve"]["path"] == str(curve_path(target))
    assert {"cache", "bytes", "parts", "data"} <= set(facts["caches"])
    assert facts["caches"]["cache"] == os.environ["FASTFORWARD_CACHE"]
    # the shipped drafters are listed, none of them trained for this tiny model
    assert {d["method"] for d in m["drafters"]} == {"eagle", "fasteagle", "falcon", "sps"}
    assert not any(d["for_this_model"] for d in m["drafters"])


def test_the_cached_cost_curve_as_stored(capsys, chat_gguf):
    path, target = chat_gguf
    file = write_curve(target, {"1": 2.0, "2": 2.2, "8": 5.0, "16": 9.0}, wait_share=0.02, cpu_share=0.97)
    os.utime(file, (time.time() - 7200, time.time() - 7200))
    try:
        c = info_json(capsys, "--model", path)["model"]["cost_curve"]
        assert c["cached"] and c["t1_ms"] == 2.0 and c["t8_over_t1"] == 2.5 and c["kv"] == 256
        assert c["under_load"] is False and c["plausible"] and 1.9 < c["age_hours"] < 2.2
        file.write_text(json.dumps({"ms": {"1": 2.0, "8": 5.0}, "kv": 256, "wait_share": 0.4, "cpu_share": 0.5}))
        assert info_json(capsys, "--model", path)["model"]["cost_curve"]["under_load"] is True
        file.write_text(json.dumps({"ms": {"1": 2.0, "8": 5.0}, "kv": 256, "wait_share": None, "cpu_share": 0.3}))
        assert info_json(capsys, "--model", path)["model"]["cost_curve"]["under_load"] is True  # no schedstat
        code, out, err = run_cli(capsys, "info", "--model", path)
        assert code == 0 and "cost curve   t(1) 2.00 ms, t(8)/t(1) 2.50" in out and "UNDER LOAD" in out
    finally:
        file.unlink()
    c = info_json(capsys, "--model", path)["model"]["cost_curve"]
    assert c["cached"] is False and "not measured yet" in c["note"]


def test_info_measures_and_compiles_nothing(capsys, chat_gguf, monkeypatch):
    """No curve is measured, and kernels not built for this source are reported, not compiled: the model is then
    described from its file, not loaded (loading would compile them)."""
    import fastforward.costs as costs

    path, _ = chat_gguf

    def refuse(*a, **k):
        raise AssertionError("info measured or compiled something")

    monkeypatch.setattr(costs, "measure_forward_costs", refuse)
    monkeypatch.setattr(kernels, "_compile", refuse)
    assert info_json(capsys, "--model", path)["model"]["loaded"] is True  # built: loaded, and nothing measured
    monkeypatch.setattr(kernels, "_build_id", lambda isa, flags: ("ff_native_never_built", "0000000000000000"))
    monkeypatch.setattr(ff, "load", refuse)
    facts = info_json(capsys, "--model", path)
    assert facts["kernels"]["status"] == "not built yet" and "compiles" in facts["kernels"]["note"]
    m = facts["model"]
    assert m["loaded"] is False and m["kind"] == "gguf" and m["bytes"] == Path(path).stat().st_size
    code, out, _ = run_cli(capsys, "info", "--model", path)
    assert code == 0 and "not built yet" in out and "not loaded" in out


def test_no_model_is_the_machine_alone(capsys, no_load):
    facts = info_json(capsys, "--no-model")
    assert MACHINE_KEYS | {"caches"} <= set(facts) and "model" not in facts
    code, out, _ = run_cli(capsys, "info", "--no-model")
    assert code == 0 and out.startswith("fastforward ") and "\nkernels" in out and "\ncache" in out
    assert max(len(line) for line in out.splitlines()) <= 120


@pytest.mark.parametrize("argv,match", [
    (["--model", "/no/such/model.gguf"], "unknown model"),
    (["--no-model", "--model", "smollm2-135m"], "--no-model and --model"),
    (["--threads", "0"], "--threads"),
    (["--arithmetic", "fast"], "--arithmetic"),
])
def test_bad_input_is_one_line_before_any_load(capsys, no_load, argv, match):
    one_line_exit_2(capsys, "info", *argv, match=match)


# ----------------------------------------------------------------------------------------------------------------
# llama.cpp: present or not, and the AMX build that dies
# ----------------------------------------------------------------------------------------------------------------


def test_amx_problem_only_for_an_amx_build_on_an_amx_cpu():
    problem = machine_facts.llama_cpp_amx_problem(AMX_INFO, {"avx512f", "amx_tile", "amx_int8"}, "0.3.36")
    assert problem is not None and "\n" not in problem
    assert "dies on prompts of a few hundred tokens" in problem
    assert "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" in problem
    assert problem.endswith("pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36")
    assert machine_facts.llama_cpp_amx_problem(AMX_INFO, {"avx512f", "avx512_vnni"}) is None  # no AMX here
    assert machine_facts.llama_cpp_amx_problem(AMX_INFO.replace("AMX_INT8 = 1", "AMX_INT8 = 0"),
                                               {"amx_tile", "amx_int8"}) is None
    assert machine_facts.llama_cpp_amx_problem(None, {"amx_tile", "amx_int8"}) is None


class FakeLlamaCpp:
    """llama-cpp-python as far as the facts read it: built with its AMX backend."""

    __version__ = "0.3.36"

    @staticmethod
    def llama_print_system_info():
        return AMX_INFO.encode()


def test_info_and_the_peer_say_the_same_line(capsys, monkeypatch):
    from fastforward.bench import peers

    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "amx_tile", "amx_int8"})
    monkeypatch.setitem(sys.modules, "llama_cpp", FakeLlamaCpp)
    monkeypatch.setattr(machine_facts.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(machine_facts, "llama_cpp_version", lambda: "0.3.36")
    monkeypatch.setattr(peers, "llama_cpp_version", lambda: "0.3.36")
    facts = machine_facts.llama_cpp_facts()
    assert facts["installed"] and facts["system_info"] == AMX_INFO.strip() and facts["version"] == "0.3.36"
    line = machine_facts.llama_cpp_amx_problem(AMX_INFO, version="0.3.36")
    assert facts["problem"] == line
    code, out, _ = run_cli(capsys, "info", "--no-model")
    assert code == 0 and "PROBLEM: llama.cpp (llama-cpp-python 0.3.36) runs its AMX backend" in out
    monkeypatch.setattr(peers, "_warned_amx", False)
    peers.warn_if_llama_cpp_dies_here()
    peers.warn_if_llama_cpp_dies_here()  # once a process
    assert capsys.readouterr().err.splitlines() == [f"fastforward: {line}"]


def test_llama_cpp_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp fails, find_spec finds nothing
    facts = machine_facts.llama_cpp_facts()
    assert facts == {"installed": False, "note": f"not installed: {machine_facts.LLAMACPP_INSTALL}"}


# ----------------------------------------------------------------------------------------------------------------
# The server's model card
# ----------------------------------------------------------------------------------------------------------------


def test_the_model_card_carries_the_facts(chat_gguf):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import urllib.request

    from fastforward.server import BackgroundServer, create_app

    path, target = chat_gguf
    app = create_app(target, model_name="tiny-chat", max_batch_tokens=64)
    with BackgroundServer(app) as url:
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as response:
            card = json.loads(response.read())["data"][0]
    facts = card["fastforward"]["machine"]
    assert MACHINE_KEYS <= set(facts) and "caches" not in facts  # the server's folders are its own business
    assert CPU_KEYS <= set(facts["cpu"]) and facts["kernels"]["status"] == "built"
    assert MODEL_KEYS - {"load_seconds"} <= set(facts["model"])
    assert facts["model"]["weights"] == machine_facts.weight_facts(target)
    text = json.dumps(facts)
    for folder in (Path(path).parent, os.environ["FASTFORWARD_CACHE"], Path.home()):
        assert str(folder) not in text  # no server paths
