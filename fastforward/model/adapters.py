"""Shipped adapters: a packaged base model plus LoRA stages and added tokens, merged once into a cached HF folder.

A model such as ``smollm2-135m-pasta`` is not stored whole (the target's weights never ship with the project): its
folder under ``fastforward/adapters/shipped/`` holds

* ``adapter.json`` -- the base alias, the added tokens (in id order, appended after the base vocabulary), and the
  LoRA stages in the order they were trained, each with its ``scaling`` (``lora_alpha / r``);
* ``adapter.safetensors`` (fp16) -- ``stage{i}.{module}.lora_A`` / ``.lora_B`` per adapted linear layer, and
  ``new_token_rows`` (the added tokens' embedding rows; also the head's when they are tied, else
  ``new_head_rows``);
* ``TRAINING.md`` -- the exact commands that produced it.

:func:`build_adapted_model` writes the merged model as a plain HF folder: the base dequantised, its embedding grown
by the new rows, ``W += scaling * B @ A`` for every stage in order. :func:`export_adapter` writes such a folder from
peft adapter folders (``fastforward train ... --lora``) and the final merged model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..errors import UsageError

ADAPTER_FILE = "adapter.json"
WEIGHTS_FILE = "adapter.safetensors"


TRAINING_FILE = "TRAINING.md"


def _peft_factors(adapter_dir: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """{module name: (A [r, in], B [out, r])} and the scaling of a peft LoRA adapter folder."""
    scaling = _lora_scaling(adapter_dir / "adapter_config.json")
    tensors = _read_safetensors(adapter_dir / "adapter_model.safetensors")
    factors: dict[str, list] = {}
    for key, value in tensors.items():
        for part, slot in (("lora_A", 0), ("lora_B", 1)):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0].removeprefix("base_model.model.")
                factors.setdefault(module, [None, None])[slot] = value
    if not factors:
        raise UsageError(f"{adapter_dir}: adapter_model.safetensors holds no LoRA factors")
    bad = [m for m, (a, b) in factors.items() if a is None or b is None]
    if bad:
        raise UsageError(f"{adapter_dir}: LoRA factors incomplete for {bad[0]}")
    return {m: (a, b) for m, (a, b) in factors.items()}, scaling


def _lora_scaling(config_path: Path) -> float:
    """``lora_alpha / r`` of a peft ``adapter_config.json``."""
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{config_path} is not readable JSON ({exc})") from None
    try:
        scaling = float(cfg["lora_alpha"]) / float(cfg["r"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise UsageError(f"{config_path} is not a LoRA adapter's config (no numbers lora_alpha and r > 0)") from None
    if not math.isfinite(scaling):
        raise UsageError(f"{config_path}: lora_alpha / r is not a finite number")
    return scaling


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise UsageError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise UsageError(f"{path} is not a readable safetensors file ({exc})") from None


def adapter_tensors(stages: list[str], merged_model: str, added_tokens: list[str]) -> tuple[dict, list[dict]]:
    """(tensors, per-stage metadata) of a shipped adapter: the LoRA factors of ``stages`` (peft adapter folders, in
    training order) in fp16 and the added tokens' rows taken from ``merged_model`` (the final HF folder). Reads
    and checks everything; writes nothing."""
    tensors, meta = {}, []
    for i, stage in enumerate(stages):
        factors, scaling = _peft_factors(Path(stage))
        for module, (a, b) in factors.items():
            tensors[f"stage{i}.{module}.lora_A"] = a.to(torch.float16).contiguous()
            tensors[f"stage{i}.{module}.lora_B"] = b.to(torch.float16).contiguous()
        meta.append({"scaling": scaling, "modules": len(factors)})
    weights = Path(merged_model) / "model.safetensors"
    merged = _read_safetensors(weights)
    emb = merged.get("model.embed_tokens.weight")
    n_new = len(added_tokens)
    if emb is None or emb.ndim != 2 or emb.shape[0] <= n_new:
        raise UsageError(f"{weights} has no embedding (model.embed_tokens.weight) with the {n_new} added tokens' rows")
    tensors["new_token_rows"] = emb[emb.shape[0] - n_new:].to(torch.float16).contiguous()
    if "lm_head.weight" in merged:  # an untied head has rows of its own
        tensors["new_head_rows"] = merged["lm_head.weight"][-n_new:].to(torch.float16).contiguous()
    return tensors, meta


def write_adapter(out_dir: Path, tensors: dict, info: dict, training: str = "") -> Path:
    """Write :func:`adapter_tensors`' tensors and ``info`` (``adapter.json``) into the existing folder ``out_dir``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    (out_dir / ADAPTER_FILE).write_text(json.dumps(info, indent=1) + "\n")
    if training:
        (out_dir / TRAINING_FILE).write_text(training)
    return out_dir


def export_adapter(base: str, stages: list[str], merged_model: str, added_tokens: list[str], out: str,
                   training: str = "") -> Path:
    """Write a shipped adapter folder (:func:`adapter_tensors`, ``adapter.json`` naming ``base``), everything read and
    checked before the folder is made."""
    tensors, meta = adapter_tensors(stages, merged_model, added_tokens)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_adapter(out_dir, tensors, {"base": base, "added_tokens": added_tokens, "stages": meta}, training)


def is_adapter_folder(folder) -> bool:
    """Whether ``folder`` holds a shipped adapter and nothing else (one :func:`export_adapter` wrote)."""
    folder = Path(folder)
    names = {p.name for p in folder.iterdir()}
    if not {ADAPTER_FILE, WEIGHTS_FILE} <= names <= {ADAPTER_FILE, WEIGHTS_FILE, TRAINING_FILE}:
        return False
    try:
        info = json.loads((folder / ADAPTER_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(info, dict) and {"base", "added_tokens", "stages"} <= set(info)


def read_adapter(folder: Path) -> dict:
    path = Path(folder) / ADAPTER_FILE
    if not path.is_file() or not (Path(folder) / WEIGHTS_FILE).is_file():
        raise UsageError(f"{folder} is not an adapter folder ({ADAPTER_FILE} and {WEIGHTS_FILE})")
    return json.loads(path.read_text())


def build_adapted_model(model, tokenizer, folder: Path):
    """Apply a shipped adapter to an HF ``model`` and ``tokenizer`` in place (see the module docstring)."""
    from safetensors.torch import load_file
    from tokenizers import AddedToken

    info = read_adapter(folder)
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    have = tokenizer.get_vocab()
    new = [AddedToken(t, special=True, normalized=False) for t in info["added_tokens"] if t not in have]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in info["added_tokens"]]
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise UsageError(f"{folder}: the added tokens did not get consecutive ids")
    model.resize_token_embeddings(max(len(vocab), model.get_input_embeddings().weight.shape[0]),
                                  mean_resizing=False)
    modules = dict(model.named_modules())
    with torch.no_grad():
        model.get_input_embeddings().weight[ids] = tensors["new_token_rows"].float()
        head = model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            head.weight[ids] = tensors.get("new_head_rows", tensors["new_token_rows"]).float()
        for i, stage in enumerate(info["stages"]):
            prefix = f"stage{i}."
            names = {k[len(prefix):].rsplit(".", 1)[0] for k in tensors if k.startswith(prefix)}
            for name in sorted(names):
                if name not in modules:
                    raise UsageError(f"{folder}: the base model has no module {name}")
                a = tensors[f"{prefix}{name}.lora_A"].float()
                b = tensors[f"{prefix}{name}.lora_B"].float()
                modules[name].weight += stage["scaling"] * (b @ a)
    return model, tokenizer
