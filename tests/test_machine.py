"""The machine's read bandwidth and the bytes a forward reads (``fastforward/machine.py``), and how ``fastforward
profile`` reports them."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli

import fastforward.cli.profile as profile_cli
from fastforward.errors import UsageError
from fastforward.machine import (
    MIN_BUFFER_BYTES,
    Bandwidth,
    achieved_bandwidth,
    forward_read_bytes,
    measure_read_bandwidth,
)
from fastforward.testing import tiny_gguf_target, tiny_hf_folder


def test_read_bandwidth_is_measured_with_the_given_threads():
    before = torch.get_num_threads()
    bw = measure_read_bandwidth(MIN_BUFFER_BYTES, repeats=2, threads=1)
    assert bw.threads == 1 and bw.repeats == 2 and bw.buffer_bytes == MIN_BUFFER_BYTES
    assert 0.05 < bw.gb_per_s < 5000  # any real memory system
    assert torch.get_num_threads() == before  # the caller's thread count is left as it was
    assert json.loads(json.dumps(bw.as_dict()))["gb_per_s"] == bw.gb_per_s


@pytest.mark.parametrize("kw, match", [({"buffer_bytes": 1 << 20}, "buffer must be"),
                                       ({"buffer_bytes": 1 << 40}, "buffer must be"),
                                       ({"repeats": 0}, "repeats must be"), ({"repeats": 10**6}, "repeats must be")])
def test_read_bandwidth_bounds(kw, match):
    with pytest.raises(UsageError, match=match):
        measure_read_bandwidth(**kw)


def test_achieved_bandwidth():
    assert achieved_bandwidth(10**9, 100.0) == pytest.approx(10.0)  # 1 GB in 0.1 s


def _kv_bytes(backend, tokens: int) -> int:
    return 2 * backend.n_layers * backend.n_kv_heads * backend.head_dim * 4 * tokens


def test_tied_embedding_is_read_in_full_as_the_head(tmp_path):
    target, _ = tiny_gguf_target(tmp_path / "tied.gguf", tied=True)
    backend = target.backend
    reads = forward_read_bytes(backend, q=1, kv=10)
    assert backend.embed is backend.head
    assert reads["weights"] == backend.weight_bytes  # every weight once, the table (= the head) in full
    assert reads["kv_cache"] == _kv_bytes(backend, 11) and reads["total"] == reads["weights"] + reads["kv_cache"]


def test_untied_embedding_reads_only_its_rows(tmp_path):
    target, _ = tiny_gguf_target(tmp_path / "untied.gguf", tied=False, vocab_size=96)
    backend = target.backend
    assert backend.embed is not backend.head
    row = backend.embed.nbytes // 96
    one, three = forward_read_bytes(backend, q=1), forward_read_bytes(backend, q=3)
    assert one["weights"] == backend.weight_bytes - backend.embed.nbytes + row
    assert three["weights"] == one["weights"] + 2 * row


def test_a_backend_without_weights_is_not_counted():
    assert forward_read_bytes(object()) is None


def test_profile_prints_the_bandwidth_and_puts_it_in_json(tmp_path, capsys, monkeypatch):
    """The table gets a GB/s row and a line on the measured bandwidth; --json a "memory" object (measured here with
    a small buffer: the command's own is 1 GiB)."""
    monkeypatch.setattr(profile_cli, "measure_read_bandwidth",
                        lambda: Bandwidth(10.0, MIN_BUFFER_BYTES, 1, 1, "torch.sum over float32"))
    folder = tiny_hf_folder(tmp_path / "tiny", max_positions=128)
    argv = ["profile", "--model", folder, "--q", "1,2", "--kv", "8", "--repeats", "1", "--no-hf", "--threads", "1"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "| fastforward weights read, GB/s (% of measured) |" in out
    assert "memory read bandwidth 10.0 GB/s" in out and "t(1) reads" in out
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert memory["read_bandwidth"]["gb_per_s"] == 10.0
    reads = memory["forward_read_bytes"]["1"]
    assert reads["weights"] > 0 and reads["kv_cache"] > 0
    assert memory["weight_fraction_of_bandwidth"]["1"] == pytest.approx(memory["weight_gb_per_s"]["1"] / 10.0)


def test_profile_measures_the_arithmetic_and_cache_asked_for(capsys, monkeypatch):
    """--arithmetic and --kv-cache reach the model profile measures, and the header and JSON name them."""
    monkeypatch.setattr(profile_cli, "measure_read_bandwidth",
                        lambda: Bandwidth(10.0, MIN_BUFFER_BYTES, 1, 1, "torch.sum over float32"))
    base = ["profile", "--q", "1", "--kv", "8", "--repeats", "1", "--no-hf", "--threads", "1"]
    code, out, err = run_cli(capsys, *base, "--arithmetic", "exact")
    assert code == 0, err
    assert "arithmetic exact" in out.splitlines()[0] and "(fp32)" in out.splitlines()[0]
    code, out, err = run_cli(capsys, *base, "--arithmetic", "exact", "--kv-cache", "fp16", "--json")
    assert code == 0, err
    info = json.loads(out)["info"]
    assert info["arithmetic"] == "exact" and info["kv_cache"] == "fp16"


def test_profile_context_reads_long_prompts_and_decodes_after_them(tmp_path, capsys):
    """--context N: a prefill tokens/s and a decode tokens/s per prompt length (ours; llama.cpp's with --llama-cpp)."""
    folder = tiny_hf_folder(tmp_path / "tiny", max_positions=512)
    argv = ["profile", "--model", folder, "--context", "300,400", "--repeats", "1", "--threads", "1"]
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    rows = json.loads(out)["context"]
    assert [r["prompt_tokens"] for r in rows] == [300, 400]
    for r in rows:
        ours = r["fastforward"]
        assert ours["prefill_tokens_per_s"] > 0 and ours["decode_tokens_per_s"] > 0
        assert ours["prefill_tokens_per_s"] == pytest.approx(r["prompt_tokens"] / ours["prefill_s"], rel=0.05)
        assert r["llama.cpp"] is None
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "| 300 |" in out and "| 400 |" in out


def test_profile_context_longer_than_the_model_is_one_line(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path / "tiny", max_positions=128)
    code, out, err = run_cli(capsys, "profile", "--model", folder, "--context", "120", "--threads", "1")
    assert code == 2 and err.count("\n") == 1 and "exceeds the model's context 128" in err, err


def test_row_costs_are_the_marginal_ms_and_the_rate_it_reaches():
    """profile's extra-row figures: (t(q) - t(q_prev)) / (q - q_prev), and the weight products' multiply-adds a row
    over that time, this clock and the threads."""

    class Weight:
        out_features, in_features = 1000, 500

    class Backend:
        matmul_kernel = "plain"

        def matmul_weights(self):
            return [Weight(), Weight()]

    class Target:
        arithmetic, backend = "exact", Backend()

    rows = profile_cli.row_costs(Target(), [1, 2, 4], {1: 1.0, 2: 1.5, 4: 2.5}, None, threads=2)
    assert rows["macs_per_row"] == 1_000_000
    assert rows["fastforward"]["ms_per_row"] == {2: 0.5, 4: 0.5}
    assert "llama.cpp" not in rows and rows["kernel"] == {1: "plain", 2: "plain", 4: "plain"}
    if rows["ghz"]:
        assert rows["fastforward"]["macs_per_cycle"][2] == pytest.approx(1e6 / 0.5e-3 / (rows["ghz"] * 1e9) / 2)
    text = profile_cli.describe_row_costs(rows, [1, 2, 4], with_llama=False)
    assert "| fastforward ms per extra row (from the previous q) | – | 0.500 | 0.500 |" in text
    assert "1.0 M multiply-adds a row" in text
