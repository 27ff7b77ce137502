"""Draft models for speculative sampling (``--method sps``): the folder format and its loader. Their training
(``fastforward train draft-model``) is :mod:`fastforward.train.draft_model`.

The default target (SmolLM2-135M-Instruct: 30 layers, hidden 576, a tied 49152-token embedding) has no smaller
sibling, so fastforward makes one: a Llama of the target's own architecture with a few decoder layers (default 4),
**sharing the target's embedding and LM head** -- frozen during training and never stored: the embedding alone is
56 MB in fp16, more than a shipped drafter may weigh (40 MB). At decode time the draft reads the target's own
embedding, and multiplies the target's head rows repacked as a drafter weight (``Q4_0`` on the native integer kernel:
half the bytes of the default target's ``Q8_0`` head, which is most of a draft token's cost; ``weights="fp32"`` keeps
the target's head object itself).

**The folder** (what ``-o draft=PATH`` reads):

* ``config.json`` -- the target's HF config with ``num_hidden_layers = n`` (any per-layer lists cut to the kept
  layers), plus ``"fastforward_draft_model": {"format", "target", "shared_embedding": true, "tied_head",
  "layers_from_target", "target_vocab_size", "target_hidden_size", "target_layers", ...}``;
* ``model.safetensors`` -- the draft's own weights in fp16 (decoder layers and final norm; no ``embed_tokens``, no
  ``lm_head``), plus ``fastforward.target_probe``: a few rows of the target's embedding, so a draft model made for
  another target (another embedding) is recognised and refused even when the shapes agree; and optionally
  ``fastforward.draft_vocab``: the target ids the draft may propose (the most frequent of its training responses).
  With it the draft multiplies only those rows of the target's head at decode time (8,192 of the default target's
  49,152: the head is most of a small draft's cost per token) and every other token gets probability 0 -- its
  drafts and draft probabilities come from that distribution, so verification stays exact;
* no tokenizer: the draft uses the target's.

**Initialisation** (``--init-layers``): ``spread`` (the default) copies ``n`` target layers evenly spaced from the
first to the last (``0, 10, 19, 29`` for 4 of 30). The first layer is kept because it is the one that reads the
embedding, the last because it writes the residual stream the final norm and the shared head were trained to read;
the layers between them give the rest of the depth in proportion, so the truncated stack starts out as a coarse
version of the whole network. ``first`` keeps layers ``0 .. n-1`` (a model that has never seen the head's input
distribution); an explicit comma list (``0,5,29``) picks any.

"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import UsageError

FORMAT = "fastforward-draft-model/1"
CONFIG_KEY = "fastforward_draft_model"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROBE_KEY = "fastforward.target_probe"
DRAFT_VOCAB_KEY = "fastforward.draft_vocab"
PROBE_ROWS = 16
SHARED_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
MAX_SHIPPED_MB = 40.0  # the largest drafter the project ships (fp16 safetensors)
SAME_TARGET_COSINE = 0.9  # probe rows this similar: the same embedding (quantised or not), so the same target
INIT_CHOICES = ("spread", "first")
DEFAULT_LAYERS = 4


# ------------------------------------------------------------------------------------------------------------------
# The target's shared pieces
# ------------------------------------------------------------------------------------------------------------------


def target_embedding(target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(embedding, head) of ``target`` as dense ``[vocab, hidden]`` tensors in the target's float type; ``head`` is
    None when the head is the embedding (tied). For a GGUF target these are its packed blocks dequantised."""
    if target.backend_name == "lean":
        backend = target.backend
        embed = backend.embed.dense()
        head = None if backend.head is backend.embed else backend.head.dense()
        return embed, head
    hf = target.hf_model
    embed = hf.get_input_embeddings().weight
    out = hf.get_output_embeddings().weight
    return embed.detach(), (None if out is embed else out.detach())


def probe_ids(vocab_size: int) -> torch.Tensor:
    return torch.linspace(0, vocab_size - 1, PROBE_ROWS).round().long().unique()


def target_probe(target) -> torch.Tensor:
    """A few rows of the target's embedding (fp32), spread over the vocabulary: its fingerprint."""
    ids = probe_ids(target.vocab_size)
    if target.backend_name == "lean":
        with torch.inference_mode():
            return target.backend.embed.rows(ids).float().clone()
    return target.hf_model.get_input_embeddings().weight[ids].detach().float().clone()


def choose_layers(n_target: int, layers: int | None = DEFAULT_LAYERS, init: str = "spread") -> list[int]:
    """Which target layers initialise the draft's ``layers`` layers (see the module docstring); ``init`` may also be
    an explicit comma-separated list of layer indices (then ``layers``, when given, must be its length; None means
    :data:`DEFAULT_LAYERS` for ``spread``/``first``)."""
    init = str(init).strip()
    if init not in INIT_CHOICES:
        try:
            ids = [int(x) for x in init.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--init-layers must be spread, first or a comma list of layer indices, got "
                             f"'{init}'") from None
        if not ids or any(i < 0 or i >= n_target for i in ids) or ids != sorted(set(ids)):
            raise UsageError(f"--init-layers {init}: give increasing layer indices in 0..{n_target - 1}")
        if layers is not None and layers != len(ids):
            raise UsageError(f"--init-layers lists {len(ids)} layers but --layers is {layers}")
        return ids
    if layers is None:
        layers = min(DEFAULT_LAYERS, n_target)
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= n_target:
        raise UsageError(f"--layers must be an integer in [1, {n_target}] (the target has {n_target}), got {layers}")
    if init == "first" or layers == 1:
        return list(range(layers))
    return [round(i * (n_target - 1) / (layers - 1)) for i in range(layers)]


# ------------------------------------------------------------------------------------------------------------------
# Building, saving, loading
# ------------------------------------------------------------------------------------------------------------------


def _cut_config(config_dict: dict, layer_ids: list[int]) -> dict:
    d = dict(config_dict)
    d["num_hidden_layers"] = len(layer_ids)
    for key, value in list(d.items()):  # per-layer settings (layer_types, ...) follow the kept layers
        if isinstance(value, list) and len(value) == config_dict.get("num_hidden_layers") and key != "architectures":
            d[key] = [value[i] for i in layer_ids]
    if isinstance(d.get("max_window_layers"), int):
        d["max_window_layers"] = min(d["max_window_layers"], len(layer_ids))
    d.pop(CONFIG_KEY, None)
    return d


def _hf_from_config(config_dict: dict, dtype, device=None):
    """The HF model of a draft config (``device="meta"``: its shapes only, nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model import _quiet_transformers

    _quiet_transformers()
    d = {k: v for k, v in config_dict.items() if k != CONFIG_KEY}
    model_type = d.pop("model_type", None)
    if not model_type:
        raise UsageError("the draft model's config.json has no model_type")
    try:
        config = AutoConfig.for_model(model_type, **d)
        if device is None:
            return AutoModelForCausalLM.from_config(config).to(dtype)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers' config validators raise many kinds (and ZeroDivisionError on 0 heads)
        msg = " ".join(str(exc).split())[:300]
        raise UsageError(f"the draft model's config.json is not a usable HF config ({type(exc).__name__}: {msg})"
                         ) from None


def _share(model, embed: torch.Tensor, head: torch.Tensor | None) -> None:
    """Put the target's embedding (and head) into ``model`` as frozen parameters sharing the target's memory."""
    dtype = model.model.norm.weight.dtype
    emb = torch.nn.Parameter(embed.detach().to(dtype), requires_grad=False)
    model.model.embed_tokens.weight = emb
    model.lm_head.weight = emb if head is None else torch.nn.Parameter(head.detach().to(dtype), requires_grad=False)


def init_draft_model(target, layers: int | None = DEFAULT_LAYERS, init: str = "spread"):
    """A new draft model for ``target``: (HF causal LM in fp32, its metadata). Its decoder layers and final norm are
    copies of target layers (:func:`choose_layers`); its embedding and head are the target's (frozen, shared)."""
    hf = target.hf_model
    ids = choose_layers(hf.config.num_hidden_layers, layers, init)
    config = _cut_config(hf.config.to_dict(), ids)
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    config["tie_word_embeddings"] = tied
    model = _hf_from_config(config, torch.float32)
    with torch.no_grad():
        for j, i in enumerate(ids):
            model.model.layers[j].load_state_dict(hf.model.layers[i].state_dict())
        model.model.norm.load_state_dict(hf.model.norm.state_dict())
    embed = hf.get_input_embeddings().weight
    _share(model, embed, None if tied else hf.get_output_embeddings().weight)
    model.float()
    from .eagle import target_fingerprint

    meta = {
        "format": FORMAT, "kind": "draft-model", "target": str(target.name),
        "target_fingerprint": target_fingerprint(target), "shared_embedding": True, "tied_head": tied,
        "layers_from_target": ids, "init": str(init), "target_vocab_size": int(target.vocab_size),
        "target_hidden_size": int(hf.config.hidden_size), "target_layers": int(hf.config.num_hidden_layers),
    }
    return model, meta


def own_state(model) -> dict[str, torch.Tensor]:
    """The draft's own weights: everything but the shared embedding and head."""
    return {k: v for k, v in model.state_dict().items() if k not in SHARED_KEYS}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def save_draft_model(model, meta: dict, path, probe: torch.Tensor, draft_vocab: torch.Tensor | None = None) -> Path:
    """Write the draft folder (``config.json`` + fp16 ``model.safetensors``, see the module docstring), with the
    target ids ``draft_vocab`` the draft may propose when given; each file is written under a temporary name and
    renamed. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in own_state(model).items()}
    tensors[PROBE_KEY] = probe.detach().to(torch.float16).contiguous()
    if draft_vocab is not None:
        tensors[DRAFT_VOCAB_KEY] = torch.as_tensor(draft_vocab, dtype=torch.int64).sort().values.contiguous()
    tmp = folder / f"{WEIGHTS_FILE}.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt", "fastforward": FORMAT})
    os.replace(tmp, folder / WEIGHTS_FILE)
    config = model.config.to_dict()
    config["dtype"] = "float16"
    config[CONFIG_KEY] = dict(meta)
    write_json(folder / CONFIG_FILE, config)
    return folder


def read_draft_config(path) -> dict | None:
    """The config of a draft-model folder, or None when ``path`` is not one (no config.json naming the format)."""
    folder = Path(path).expanduser()
    file = folder / CONFIG_FILE
    if not (folder.is_dir() and file.is_file()):
        return None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or CONFIG_KEY not in config:
        return None
    meta = config[CONFIG_KEY]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else meta
        raise UsageError(f"{folder} is a draft model of format {fmt!r}; this version reads {FORMAT}")
    return config


def is_draft_model(path) -> bool:
    return read_draft_config(path) is not None


def check_for_target(meta: dict, probe: torch.Tensor | None, target, where) -> None:
    """Refuse (one line) a draft model made for another target: another vocabulary, hidden size or embedding."""
    made_for = meta.get("target", "?")
    why = None
    try:
        vocab, hidden = int(meta.get("target_vocab_size", -1)), int(meta.get("target_hidden_size", -1))
    except (TypeError, ValueError):
        raise UsageError(f"{where}: malformed '{CONFIG_KEY}' section (target_vocab_size "
                         f"{meta.get('target_vocab_size')!r}, target_hidden_size {meta.get('target_hidden_size')!r})"
                         ) from None
    if vocab != int(target.vocab_size):
        why = f"vocabulary {meta.get('target_vocab_size')}, this target's is {target.vocab_size}"
    elif hidden != int(target.config.hidden_size):
        why = f"hidden size {meta.get('target_hidden_size')}, this target's is {target.config.hidden_size}"
    elif probe is not None:
        mine = target_probe(target)
        if mine.shape != probe.shape:
            why = "another embedding"
        else:
            a, b = mine.double().flatten(), probe.double().flatten()
            denom = float(a.norm() * b.norm())
            cos = float(a @ b) / denom if denom > 0 else (1.0 if float((a - b).abs().max()) == 0 else 0.0)
            if cos < SAME_TARGET_COSINE:
                why = f"another embedding (similarity {cos:.2f})"
    if why is not None:
        raise UsageError(f"{where} is a draft model for target '{made_for}' ({why}); it cannot draft for "
                         f"'{target.name}'")


def _pack_layers(backend, fmt: str = "Q8_0") -> None:
    """Store a lean draft's decoder-layer weights packed (``Q8_0``: int8 + an fp16 scale per 32 weights), multiplied
    by the native integer kernel (the ``q8`` arithmetic: activations rounded to 8-bit blocks, integer block dots): a
    quarter of fp32's bytes per drafted token, and about four times faster than fp32 activations at a draft's row
    counts (the draft's numbers change slightly; verification, not the draft, decides every token)."""
    from ..kernels import load_native
    from ..linear import FORMAT_IDS, PackedLinear, packed_kernel_name, quantize

    native = load_native()
    arithmetic = "q8" if hasattr(native, "q8_pack") else "exact"
    for layer in backend.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name).dense()
            packed = PackedLinear(quantize(w, fmt), FORMAT_IDS[fmt], w.shape[1], native=native, owned=True,
                                  arithmetic=arithmetic)
            setattr(layer, name, packed)
    backend.matmul_kernel = f"quant-{packed_kernel_name(native, arithmetic)} ({fmt} layers)"


def draft_target(model, target, name: str, weights: str = "auto"):
    """The draft HF model ``model`` (embedding and head = the target's) as a :class:`TargetModel` the proposer
    drives: the target's tokenizer; the lean backend when the target has it, with the target's own embedding and
    head objects (packed for a GGUF target) and, with ``weights='auto'``, the draft's layers packed as Q8_0 when the
    native kernels run fp32 activations (``'fp32'`` keeps them dense)."""
    from ..kernels import load_native
    from ..model import TargetModel

    backend = "lean" if target.backend_name == "lean" else "hf"
    draft = TargetModel(name, model, target.tokenizer, backend=backend)
    if backend == "lean":
        draft.backend.embed = target.backend.embed
        draft.backend.head = target.backend.head
        native = load_native()
        if weights == "auto" and draft.backend.dtype == torch.float32 and native is not None \
                and hasattr(native, "quant_mm"):
            _pack_layers(draft.backend)
    draft.eos_token_ids = set(target.eos_token_ids)
    return draft


def _checked_draft_vocab(ids, target, file) -> torch.Tensor | None:
    """The draft vocabulary of a draft-model file: sorted distinct target ids, or a one-line refusal."""
    if ids is None:
        return None
    n = target.vocab_size
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= n \
            or not bool((ids[1:] > ids[:-1]).all()):
        raise UsageError(f"{file}: {DRAFT_VOCAB_KEY} must be distinct target ids in increasing order, within the "
                         f"target's {n} tokens")
    return ids


class DraftVocabHead:
    """A draft model's head over its draft vocabulary: the target's head rows of those ids (packed like a drafter's
    weights), the other logits -inf -- [r, vocab] logits as the full head gives them, so the proposer needs no
    change, at a fraction of the cost."""

    def __init__(self, target, ids: torch.Tensor, weights: str = "auto"):
        from .pieces import decode_linear_factory, target_head_rows

        self.ids, self.vocab_size = ids, target.vocab_size
        self.linear = decode_linear_factory(weights)(target_head_rows(target, ids))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), dtype=h.dtype)
        out[:, self.ids] = self.linear(h.float().contiguous()).to(h.dtype)  # fp32 rows, as a drafter's
        return out


def _packed_head(target, weights: str):
    """The target's head as a drafter weight (``Q4_0`` blocks on the integer kernel with ``auto``: half the bytes of
    the default target's ``Q8_0`` head, which a draft token otherwise reads whole -- most of its cost), or the
    target's own head object where the native kernels are not there to pack it."""
    from .pieces import decode_linear_factory, target_head_rows

    linear = decode_linear_factory(weights)
    if linear.layer_ops is None:
        return target.backend.head
    return linear(target_head_rows(target, torch.arange(target.vocab_size)))


def _read_hf_draft(folder: Path, target):
    """(the HF draft model with the target's embedding and head, its metadata, its draft vocabulary or None) from a
    draft-model folder, checked against ``target``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_draft_config(folder)
    if config is None:
        raise UsageError(f"{folder} is not a fastforward draft model (no config.json with '{CONFIG_KEY}')")
    meta = config[CONFIG_KEY]
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise UsageError(f"{folder} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise UsageError(f"{file} is not readable safetensors: {exc}") from None
    probe = tensors.pop(PROBE_KEY, None)
    check_for_target(meta, probe, target, folder)
    draft_vocab = _checked_draft_vocab(tensors.pop(DRAFT_VOCAB_KEY, None), target, file)
    try:
        if config.get("hidden_size", target.config.hidden_size) != target.config.hidden_size:
            raise UsageError(f"config.json says hidden_size {config.get('hidden_size')!r}; the draft shares the "
                             f"embedding of '{target.name}', whose hidden size is {target.config.hidden_size}")
        _check_draft_tensors(_hf_from_config(config, None, device="meta"), tensors)
    except UsageError as exc:
        raise UsageError(f"{folder}: {exc}") from None
    dtype = target.dtype
    model = _hf_from_config(config, dtype)
    embed, head = target_embedding(target)
    _share(model, embed, head)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if k not in SHARED_KEYS]
    if missing or unexpected:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise UsageError(f"{file} does not match its config.json ({what})")
    return model.eval(), meta, draft_vocab


def _check_draft_tensors(shapes_model, tensors: dict) -> None:
    """The draft's own tensors against the shapes its config.json describes: each present, no stranger, the same
    shape, floating-point and finite (checked before the real model is built)."""
    expected = {k: v for k, v in shapes_model.state_dict().items() if k not in SHARED_KEYS}
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected and k not in SHARED_KEYS]
    if missing or unexpected:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise UsageError(f"{WEIGHTS_FILE} does not match its config.json ({what})")
    for name, want in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(want.shape):
            raise UsageError(f"{WEIGHTS_FILE}: {name} has shape {tuple(t.shape)}, config.json says {tuple(want.shape)}")
        if want.is_floating_point() and not (t.is_floating_point() and bool(torch.isfinite(t).all())):
            raise UsageError(f"{WEIGHTS_FILE}: {name} is not a finite floating-point tensor")


def load_draft_model(path, target, weights: str = "auto"):
    """A draft-model folder (see the module docstring) as a :class:`TargetModel` for ``target``: its embedding and
    head filled from the target. A folder made for another target is refused with a one-line :class:`UsageError`."""
    folder = Path(path).expanduser()
    model, _, draft_vocab = _read_hf_draft(folder, target)
    name = f"{folder.name} ({model.config.num_hidden_layers} layers, draft for {target.name})"
    draft = draft_target(model, target, name, weights)
    if draft.backend_name == "lean":
        if draft_vocab is not None:  # the target's head rows of the draft vocabulary only
            draft.backend.head = DraftVocabHead(target, draft_vocab, weights)
        elif weights != "fp32" and draft.backend.dtype == torch.float32:
            draft.backend.head = _packed_head(target, weights)
        # The lean forward holds what it needs (the target's embedding and head objects, its own layers); the HF
        # model -- with a dense copy of a packed target's embedding -- is rebuilt only if something asks for it.
        draft._hf_model = None
        draft._hf_loader = lambda: _read_hf_draft(folder, target)[0]
    return draft


def folder_megabytes(path) -> float:
    file = Path(path) / WEIGHTS_FILE
    return file.stat().st_size / 1e6 if file.is_file() else 0.0


__all__ = [
    "choose_layers", "draft_target", "init_draft_model", "is_draft_model", "load_draft_model", "own_state",
    "read_draft_config", "save_draft_model", "target_embedding", "target_probe", "write_json",
]
