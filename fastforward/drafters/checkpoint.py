"""Drafter checkpoints in the native EAGLE-3 layout -- the one format fastforward, vLLM (``eagle3``) and SGLang
(``EAGLE3``) all load: ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
``tie_word_embeddings: false``; fastforward adds a ``fastforward`` section naming the target, which the servers
ignore) and ``model.safetensors`` with ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``
``[draft_vocab, hidden]``, ``d2t`` (int64) and ``t2d`` (bool), no ``embed_tokens`` (the target's is shared).
Drafters trained elsewhere in that layout load too (their extra tensors, e.g. an ``embed_tokens`` copy, are
ignored)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import UsageError
from .eagle import Eagle3Config, Eagle3Drafter
from .vocab import DraftVocab

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SERVING_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def write_folder(state: dict, config: dict, folder, dtype: str = "float16", skip=()) -> Path:
    """A drafter folder: ``config.json`` and ``model.safetensors`` (``state`` without the names in ``skip``, floating
    tensors in ``dtype``); the weights replaced atomically."""
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state.items():
        if name in skip:
            continue
        t = t.detach().cpu()
        tensors[name] = (t.to(DTYPES[dtype]) if t.is_floating_point() else t).contiguous()
    config = dict(config, torch_dtype=dtype)
    tmp = folder / f"{WEIGHTS}.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; a drafter folder is read by servers and copies
    os.replace(tmp, folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_folder(folder, kind: str, parse_config) -> tuple[Path, object, dict]:
    """(folder, ``parse_config(its config.json)``, its tensors) of a drafter folder -- the config checked before the
    weights are read -- every failure a one-line refusal naming ``kind`` (what the folder should have been)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG).is_file():
        raise UsageError(f"drafter {folder}: no {CONFIG} (expected {kind} drafter folder)")
    try:
        raw = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"drafter {folder}: unreadable {CONFIG} ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"drafter {folder}: {CONFIG} is not a JSON object")
    cfg = parse_config(raw)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"drafter {folder}: no *.safetensors weights")
    tensors = {}
    try:
        for f in files:
            tensors.update(load_file(str(f)))
    except (SafetensorError, OSError) as exc:
        raise UsageError(f"drafter {folder}: unreadable weights ({exc})") from None
    return folder, cfg, tensors


def load_headless(folder, target, kind: str, parse_config, module_cls, head: str = "lm_head.weight"):
    """A drafter saved without its frozen head (FastEagle, Falcon): ``module_cls(cfg, vocab)`` from ``folder`` (fp32),
    checked to belong to ``target``, every other tensor present with its shape, the head rebuilt from the target's
    rows (``load_head``). Each failure is a one-line refusal."""
    folder, cfg, tensors = read_folder(folder, kind, parse_config)
    cfg.check_target(target)
    if "d2t" not in tensors or "t2d" not in tensors:
        raise UsageError(f"drafter {folder}: missing tensors d2t/t2d")
    vocab = DraftVocab(tensors["d2t"], tensors["t2d"])
    if vocab.size != cfg.draft_vocab_size:
        raise UsageError(f"drafter {folder}: d2t has {vocab.size} entries, config says draft_vocab_size "
                         f"{cfg.draft_vocab_size}")
    drafter = module_cls(cfg, vocab)
    state = {k: v for k, v in drafter.state_dict().items() if k != head}
    _check_shapes(folder, state, tensors)
    drafter.load_state_dict({k: tensors[k].to(v.dtype) for k, v in state.items()}, strict=False)
    drafter.load_head(target)
    return drafter.eval()


def _check_shapes(folder, state: dict, tensors: dict) -> None:
    for name in state:
        if name not in tensors:
            raise UsageError(f"drafter {folder}: missing tensor {name}")
        if tuple(tensors[name].shape) != tuple(state[name].shape):
            raise UsageError(f"drafter {folder}: {name} has shape {tuple(tensors[name].shape)}, expected "
                             f"{tuple(state[name].shape)}")


def save_eagle3(drafter: Eagle3Drafter, folder, dtype: str = "float16") -> Path:
    """Write ``drafter`` into ``folder`` (created); floating tensors in ``dtype``; files replaced atomically."""
    return write_folder(drafter.state_dict(), drafter.cfg.to_hf(), folder, dtype)


def load_eagle3(folder, target=None) -> Eagle3Drafter:
    """An EAGLE-3 drafter from ``folder`` (fp32); with ``target``, checked to belong to it (one-line refusals)."""
    folder, cfg, tensors = read_folder(folder, "an EAGLE-3", lambda raw: Eagle3Config.from_hf(raw, target))
    missing = [k for k in SERVING_KEYS if k not in tensors]
    if missing:
        raise UsageError(f"drafter {folder}: missing tensors {', '.join(missing)}")
    vocab = DraftVocab(tensors["d2t"], tensors["t2d"])
    if vocab.size != cfg.draft_vocab_size:
        raise UsageError(f"drafter {folder}: d2t has {vocab.size} entries, config says draft_vocab_size "
                         f"{cfg.draft_vocab_size}")
    if target is not None:
        cfg.check_target(target)
    drafter = Eagle3Drafter(cfg, vocab)
    state = drafter.state_dict()
    _check_shapes(folder, state, tensors)
    drafter.load_state_dict({k: tensors[k].to(state[k].dtype) for k in state})
    return drafter.eval()
