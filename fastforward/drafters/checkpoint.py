"""Drafter checkpoints in the native EAGLE-3 layout -- the one format fastforward, vLLM (``eagle3``) and SGLang
(``EAGLE3``) all load: ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``,
``tie_word_embeddings: false``; fastforward adds a ``fastforward`` section naming the target, which the servers
ignore) and ``model.safetensors`` with ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``
``[draft_vocab, hidden]``, ``d2t`` (int64) and ``t2d`` (bool), no ``embed_tokens`` (the target's is shared).
Drafters trained elsewhere in that layout load too (their extra tensors, e.g. an ``embed_tokens`` copy, are
ignored)."""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
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
    if not folder.is_dir():
        raise UsageError(f"drafter {folder}: not a folder (expected {kind} drafter folder)")
    if not (folder / CONFIG).is_file():
        raise UsageError(f"drafter {folder}: no {CONFIG} (expected {kind} drafter folder)")
    try:
        raw = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"drafter {folder}: unreadable {CONFIG} ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"drafter {folder}: {CONFIG} is not a JSON object")
    with refusals(folder):
        cfg = parse_config(raw)
        check_config(cfg)
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


@contextmanager
def refusals(folder):
    """Every failure inside is one line naming ``folder``: a refusal gets the folder in front; an error a malformed
    checkpoint provokes in torch (a shape, a dtype) becomes a refusal too -- never a traceback, never mid-decode."""
    prefix = f"drafter {folder}: "
    try:
        yield
    except UsageError as exc:
        msg = " ".join(str(exc).split())
        raise UsageError(msg if msg.startswith(prefix) else prefix + msg) from None
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, OverflowError, ZeroDivisionError) as exc:
        msg = " ".join(str(exc).split())[:300]
        raise UsageError(f"{prefix}not a usable drafter ({type(exc).__name__}: {msg})") from None


POSITIVE = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "draft_vocab_size", "target_hidden_size")
MAX_BLOCK_SIZE = 64  # Falcon: tokens drafted per pass (training allows 1..8)


def check_config(cfg) -> None:
    """Refuse (one line) a parsed drafter config whose numbers cannot describe a working drafter: sizes not
    positive, a draft vocabulary larger than the vocabulary, heads that do not group, an odd RoPE head_dim, a norm
    epsilon or RoPE base not positive and finite, negative tap layers, no layers, an absurd Falcon block."""
    for name in POSITIVE:
        if getattr(cfg, name) < 1:
            raise UsageError(f"{CONFIG}: {name} must be a positive integer, got {getattr(cfg, name)}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise UsageError(f"{CONFIG}: draft_vocab_size {cfg.draft_vocab_size} is larger than vocab_size "
                         f"{cfg.vocab_size}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UsageError(f"{CONFIG}: num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        raise UsageError(f"{CONFIG}: head_dim must be even (RoPE), got {cfg.head_dim}")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{CONFIG}: {name} must be a positive number, got {value}")
    if any(a < 0 for a in cfg.aux_layers):
        raise UsageError(f"{CONFIG}: tap layer ids must be >= 0, got {list(cfg.aux_layers)}")
    if getattr(cfg, "num_layers", 1) < 1:
        raise UsageError(f"{CONFIG}: num_layers must be a positive integer, got {cfg.num_layers}")
    if not 1 <= getattr(cfg, "block_size", 1) <= MAX_BLOCK_SIZE:
        raise UsageError(f"{CONFIG}: block_size must be an integer in 1..{MAX_BLOCK_SIZE}, got {cfg.block_size}")


def read_vocab(cfg, tensors: dict) -> DraftVocab:
    """The draft vocabulary of a drafter's tensors: ``d2t`` 1-D integer [draft_vocab_size] and ``t2d`` 1-D bool
    [vocab_size], mapping into the vocabulary and marking exactly the tokens ``d2t`` maps to (one-line refusals)."""
    if "d2t" not in tensors or "t2d" not in tensors:
        raise UsageError("missing tensors " + ", ".join(k for k in ("d2t", "t2d") if k not in tensors))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dim() != 1 or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise UsageError(f"d2t must be a 1-D integer tensor, got {d2t.dtype} of shape {tuple(d2t.shape)}")
    if t2d.dim() != 1 or t2d.is_floating_point():
        raise UsageError(f"t2d must be a 1-D bool tensor, got {t2d.dtype} of shape {tuple(t2d.shape)}")
    if d2t.numel() != cfg.draft_vocab_size:
        raise UsageError(f"d2t has {d2t.numel()} entries, config says draft_vocab_size {cfg.draft_vocab_size}")
    if t2d.numel() != cfg.vocab_size:
        raise UsageError(f"t2d has {t2d.numel()} entries, config says vocab_size {cfg.vocab_size}")
    ids = d2t.long() + torch.arange(d2t.numel())
    if d2t.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        raise UsageError(f"d2t maps draft ids to target ids outside [0, {cfg.vocab_size})")
    return DraftVocab(d2t, t2d)


def build_checked(folder, module_cls, cfg, vocab: DraftVocab, tensors: dict, skip=()):
    """``module_cls(cfg, vocab)`` with ``tensors`` loaded (fp32) -- first built on the meta device, so a config that
    does not match its tensors (or asks for absurd sizes) is refused before anything is allocated."""
    layers = getattr(cfg, "num_layers", None)
    if layers is not None:  # a FastEagle stack: count before building (a config may claim millions)
        found = len({k.split(".")[1] for k in tensors if k.startswith("layers.")})
        if found != layers:
            raise UsageError(f"config says num_layers {layers}, the weights hold {found} layers")
    with torch.device("meta"):
        expected = {k: v for k, v in module_cls(cfg, vocab).state_dict().items() if k not in skip}
    _check_tensors(folder, expected, tensors)
    drafter = module_cls(cfg, vocab)
    state = drafter.state_dict()
    drafter.load_state_dict({k: tensors[k].to(state[k].dtype) for k in expected}, strict=not skip)
    return drafter


def save_headless(drafter, folder, dtype: str = "float16", head: str = "lm_head.weight") -> Path:
    """Write a drafter saved without its frozen head (FastEagle, Falcon) into ``folder`` (created): its config's
    ``to_json()`` and every tensor but the head; files replaced atomically."""
    return write_folder(drafter.state_dict(), drafter.cfg.to_json(), folder, dtype, skip=(head,))


def load_headless(folder, target, kind: str, parse_config, module_cls, head: str = "lm_head.weight"):
    """A drafter saved without its frozen head (FastEagle, Falcon): ``module_cls(cfg, vocab)`` from ``folder`` (fp32),
    checked to belong to ``target``, every other tensor present with its shape, the head rebuilt from the target's
    rows (``load_head``). Each failure is a one-line refusal."""
    folder, cfg, tensors = read_folder(folder, kind, parse_config)
    with refusals(folder):
        cfg.check_target(target)
        drafter = build_checked(folder, module_cls, cfg, read_vocab(cfg, tensors), tensors, skip=(head,))
        drafter.load_head(target)
    return drafter.eval()


def _check_tensors(folder, state: dict, tensors: dict) -> None:
    """Every tensor of ``state`` in ``tensors`` with its shape; weights floating-point and finite."""
    for name in state:
        if name not in tensors:
            raise UsageError(f"drafter {folder}: missing tensor {name}")
        t = tensors[name]
        if tuple(t.shape) != tuple(state[name].shape):
            raise UsageError(f"drafter {folder}: {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(state[name].shape)}")
        if state[name].is_floating_point():
            if not t.is_floating_point():
                raise UsageError(f"drafter {folder}: {name} is {t.dtype}, expected a floating-point tensor")
            if not bool(torch.isfinite(t).all()):
                raise UsageError(f"drafter {folder}: {name} holds NaN or infinite values")


def save_eagle3(drafter: Eagle3Drafter, folder, dtype: str = "float16") -> Path:
    """Write ``drafter`` into ``folder`` (created); floating tensors in ``dtype``; files replaced atomically."""
    return write_folder(drafter.state_dict(), drafter.cfg.to_hf(), folder, dtype)


def load_eagle3(folder, target=None) -> Eagle3Drafter:
    """An EAGLE-3 drafter from ``folder`` (fp32); with ``target``, checked to belong to it (one-line refusals)."""
    folder, cfg, tensors = read_folder(folder, "an EAGLE-3", lambda raw: Eagle3Config.from_hf(raw, target))
    with refusals(folder):
        missing = [k for k in SERVING_KEYS if k not in tensors]
        if missing:
            raise UsageError(f"missing tensors {', '.join(missing)}")
        vocab = read_vocab(cfg, tensors)
        if target is not None:
            cfg.check_target(target)
        drafter = build_checked(folder, Eagle3Drafter, cfg, vocab, tensors)
    return drafter.eval()
