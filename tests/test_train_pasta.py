"""``fastforward train pasta-sft`` on a tiny random model: the annotated records it reads and drops, the grown
vocabulary, LoRA that trains only the adapters and the new tokens' rows, resuming, and the result decoding with
``--method pasta``."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli

import fastforward as ff
from fastforward.pasta.language import PastaVocab, add_pasta_tokens, promise_tag
from fastforward.testing import tiny_hf_folder, tiny_tokenizer_hf
from fastforward.train.pasta.methods import PastaSFT
from fastforward.train.pasta.sft import pasta_batch

ANSWER = (
    "Two tips:\n" + promise_tag("Sleep", 1) + "<async>1. Sleep well every night.\n</async>"
    + promise_tag("Eat", 1) + "<async>2. Eat more greens daily.</async><sync/>\nDone."
)


def weights(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), max_positions=512))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    tok = tiny_tokenizer_hf()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Give tips."}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    rows = [{"prompt_ids": prompt, "pasta": ANSWER, "finish_reason": "eos", "split": "train"} for _ in range(5)]
    rows.append({"prompt_ids": prompt, "pasta": "Plain answer.", "finish_reason": "length", "split": "train"})
    rows.append({"prompt_ids": prompt, "pasta": ANSWER, "finish_reason": "eos", "split": "heldout"})
    rows.append({"prompt_ids": prompt, "pasta": "<async>no promise</async>", "finish_reason": "eos",
                 "split": "train"})
    rows.append({"prompt_ids": prompt, "pasta": "x" * 400, "finish_reason": "eos", "split": "train"})
    path = tmp_path_factory.mktemp("pasta-data") / "pasta.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    return str(path)


def train_args(model, data, out, *extra):
    return ["train", "pasta-sft", "--model", model, "--data", data, "--out", out, "--batch-size", "2",
            "--grad-accum", "2", "--max-length", "256", "--threads", "1", "--quiet", *extra]


def test_lora_sft_grows_the_vocabulary_trains_new_rows_and_decodes(tiny_folder, data_file, tmp_path, capsys):
    out = tmp_path / "sft"
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 3, "--lora", 4,
                                            "--lr", "1e-2", "--save-every", 2))
    assert code == 0, err
    stats = json.loads((out / "fastforward_train.json").read_text())["method_stats"]
    # 5 tagged + 1 plain trained; the held-out one skipped; the promise-less one and the over-long one dropped
    assert stats == {"grammar": 1, "too_long": 1, "tagged": 5, "records": 6, "heldout": 1}
    target = ff.load(str(out))
    vocab = PastaVocab.from_tokenizer(target.tokenizer)
    assert vocab is not None
    w, base = weights(out), weights(tiny_folder)
    emb = w["model.embed_tokens.weight"]
    old = base["model.embed_tokens.weight"]
    assert emb.shape[0] >= old.shape[0] + len(vocab.all_ids) - (old.shape[0] - 259)  # the padded rows are reused
    new_ids = torch.tensor(vocab.all_ids)
    assert torch.equal(emb[:259], old[:259])  # LoRA: the existing tokens' rows stay
    assert not torch.allclose(emb[new_ids], emb[new_ids].mean(0).expand_as(emb[new_ids]))  # trained apart
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    code, stdout, err = run_cli(capsys, "generate", "--model", out, "Give tips.", "--method", "pasta",
                                "--max-new-tokens", 24, "--json")
    assert code == 0, err
    assert len(json.loads(stdout)["token_ids"]) <= 24
    # the same command with more steps resumes the LoRA run (the vocabulary grown again, the adapter reloaded)
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 4, "--lora", 4,
                                            "--lr", "1e-2", "--save-every", 2))
    assert code == 0, err
    assert "step 4/4" in stdout and "1 steps" in stdout


def test_collate_is_the_layout_batch(tiny_folder):
    tok = tiny_tokenizer_hf()
    method = PastaSFT()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    method.prepare_model(model, tok)
    vocab = add_pasta_tokens(tok)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    from fastforward.train.data import Encoded

    batch = method.collate([Encoded([1, 2, 3] + ids, 3)], key=0)
    want = pasta_batch([([1, 2, 3], ids)], vocab, method.eos_ids)
    for k in ("input_ids", "position_ids", "attention_mask", "targets"):
        assert torch.equal(batch[k], want[k])
    assert batch["num_tokens"] == want["num_tokens"] > 0


def test_not_annotated_data_is_refused(tiny_folder, tmp_path, capsys):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "response": "yo"}) + "\n")
    code, _, err = run_cli(capsys, *train_args(tiny_folder, str(path), tmp_path / "o", "--max-steps", 1))
    assert code == 2 and "pasta annotate" in err and "Traceback" not in err
