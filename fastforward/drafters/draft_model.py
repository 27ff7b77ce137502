"""Draft models for speculative sampling (``--method sps``): the folder format, its loader, and its training
(``fastforward train draft-model``).

The default target (SmolLM2-135M-Instruct: 30 layers, hidden 576, a tied 49152-token embedding) has no smaller
sibling, so fastforward makes one: a Llama of the target's own architecture with a few decoder layers (default 4),
**sharing the target's embedding and LM head** -- frozen during training and never stored: the embedding alone is
56 MB in fp16, more than a shipped drafter may weigh (40 MB), and at decode time the draft multiplies the target's
own head (packed, for a GGUF target) rather than a copy.

**The folder** (what ``-o draft=PATH`` reads):

* ``config.json`` -- the target's HF config with ``num_hidden_layers = n`` (any per-layer lists cut to the kept
  layers), plus ``"fastforward_draft_model": {"format", "target", "shared_embedding": true, "tied_head",
  "layers_from_target", "target_vocab_size", "target_hidden_size", "target_layers", ...}``;
* ``model.safetensors`` -- the draft's own weights in fp16 (decoder layers and final norm; no ``embed_tokens``, no
  ``lm_head``), plus ``fastforward.target_probe``: a few rows of the target's embedding, so a draft model made for
  another target (another embedding) is recognised and refused even when the shapes agree;
* no tokenizer: the draft uses the target's.

**Initialisation** (``--init-layers``): ``spread`` (the default) copies ``n`` target layers evenly spaced from the
first to the last (``0, 10, 19, 29`` for 4 of 30). The first layer is kept because it is the one that reads the
embedding, the last because it writes the residual stream the final norm and the shared head were trained to read;
the layers between them give the rest of the depth in proportion, so the truncated stack starts out as a coarse
version of the whole network. ``first`` keeps layers ``0 .. n-1`` (a model that has never seen the head's input
distribution); an explicit comma list (``0,5,29``) picks any.

**Training** (:func:`train_draft_model`): sequence-level distillation on ``fastforward make-data`` records: the loss
is the cross-entropy of the target's own greedy response tokens given the prompt and the response so far. An
``accelerate`` loop (the same under ``accelerate launch`` / ``ACCELERATE_USE_CPU=1 torchrun``) with AdamW, warmup
then a cosine (or linear/constant) schedule, gradient accumulation (the loss is the mean over every response token
of the step), gradient clipping, ``OUT/train_log.jsonl`` (loss, top-1 agreement with the target's token, lr),
checkpoints every ``--save-every`` steps in ``OUT/checkpoints/step-NNNNNN`` (the trainable weights in fp32 plus the
optimizer/scheduler/RNG states, written into a temporary folder that is then renamed), so re-running the same command
resumes where the last checkpoint left off, and a ``--max-minutes`` budget after which the run checkpoints, writes
the draft folder and stops (the same command continues it); at the end ``OUT/loss.png`` (loss and top-1 curves, when
matplotlib is installed) and ``OUT/fastforward_train.json`` (with held-out loss and top-1 agreement before and after
training). The records a run trains on are fixed when it starts (the first N lines of ``responses.jsonl``), so a
resumed run sees the same data even while ``make-data`` appends. A launcher whose processes did not join one group
is refused (:func:`fastforward.train.launcher.check_launcher`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import UsageError
from ..interrupts import deferred_stops, raise_if_stopped

FORMAT = "fastforward-draft-model/1"
CONFIG_KEY = "fastforward_draft_model"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROBE_KEY = "fastforward.target_probe"
PROBE_ROWS = 16
SHARED_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
MAX_SHIPPED_MB = 40.0  # the largest drafter the project ships (fp16 safetensors)
SAME_TARGET_COSINE = 0.9  # probe rows this similar: the same embedding (quantised or not), so the same target
INIT_CHOICES = ("spread", "first")
DEFAULT_LAYERS = 4
COMMAND = "train draft-model"
TRAINABLE_FILE = "draft_fp32.safetensors"  # a checkpoint's trainable weights, full precision
SUMMARY_FILE = "fastforward_train.json"


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


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def save_draft_model(model, meta: dict, path, probe: torch.Tensor) -> Path:
    """Write the draft folder (``config.json`` + fp16 ``model.safetensors``, see the module docstring); each file
    is written under a temporary name and renamed. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in own_state(model).items()}
    tensors[PROBE_KEY] = probe.detach().to(torch.float16).contiguous()
    tmp = folder / f"{WEIGHTS_FILE}.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt", "fastforward": FORMAT})
    os.replace(tmp, folder / WEIGHTS_FILE)
    config = model.config.to_dict()
    config["dtype"] = "float16"
    config[CONFIG_KEY] = dict(meta)
    _write_json(folder / CONFIG_FILE, config)
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
    """Store a lean draft's decoder-layer weights packed (``Q8_0``: int8 + an fp16 scale per 32 weights), read by
    the native quantised kernel: a quarter of fp32's bytes per drafted token (the draft's numbers change slightly;
    verification, not the draft, decides every token)."""
    from ..kernels import load_native
    from ..linear import FORMAT_IDS, PackedLinear, packed_kernel_name, quantize

    native = load_native()
    for layer in backend.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name).dense()
            packed = PackedLinear(quantize(w, fmt), FORMAT_IDS[fmt], w.shape[1], native=native, owned=True)
            setattr(layer, name, packed)
    backend.matmul_kernel = f"quant-{packed_kernel_name(native)} ({fmt} layers)"


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


def _read_hf_draft(folder: Path, target):
    """(the HF draft model with the target's embedding and head, its metadata) from a draft-model folder, checked
    against ``target``."""
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
    return model.eval(), meta


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
    model, _ = _read_hf_draft(folder, target)
    name = f"{folder.name} ({model.config.num_hidden_layers} layers, draft for {target.name})"
    draft = draft_target(model, target, name, weights)
    if draft.backend_name == "lean":
        # The lean forward holds what it needs (the target's embedding and head objects, its own layers); the HF
        # model -- with a dense copy of a packed target's embedding -- is rebuilt only if something asks for it.
        draft._hf_model = None
        draft._hf_loader = lambda: _read_hf_draft(folder, target)[0]
    return draft


def folder_megabytes(path) -> float:
    file = Path(path) / WEIGHTS_FILE
    return file.stat().st_size / 1e6 if file.is_file() else 0.0


# ------------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class DraftTrainConfig:
    data: str  # a make-data folder (OUT/responses.jsonl) or the responses.jsonl file
    out: str
    layers: int | None = None  # None: DEFAULT_LAYERS, or as many as init_layers lists
    init_layers: str = "spread"
    epochs: int = 1
    max_steps: int | None = None
    max_minutes: float | None = None
    lr: float = 3e-4
    batch_size: int = 4
    grad_accum: int = 4
    max_length: int = 512
    seed: int = 0
    limit: int | None = None
    save_every: int = 50
    keep_checkpoints: int = 1
    warmup: float = 0.03
    schedule: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_records: int = 32
    threads: int | None = None
    quiet: bool = False
    mixed_precision: str = "no"  # "bf16": forward and loss under bf16 autocast (fp32 weights and optimizer)

    def responses_file(self) -> Path:
        from ..train.make_data import RESPONSES

        path = Path(self.data).expanduser()
        file = path / RESPONSES if path.is_dir() else path
        if not file.is_file() or file.name != RESPONSES:
            raise UsageError(f"--data {self.data}: no {RESPONSES} there (make it with 'fastforward make-data')")
        return file

    def validate(self) -> None:
        for name in ("epochs", "max_steps", "batch_size", "grad_accum", "save_every", "keep_checkpoints", "limit",
                     "threads", "layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        from ..train.drafter_train import check_mixed_precision

        check_mixed_precision(self.mixed_precision)
        if not isinstance(self.eval_records, int) or self.eval_records < 0:
            raise UsageError(f"--eval-records must be an integer >= 0, got {self.eval_records}")
        if self.max_length < 2:
            raise UsageError(f"--max-length must be at least 2, got {self.max_length}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < math.inf):
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:
            raise UsageError(f"--max-minutes must be positive, got {self.max_minutes}")
        if not 0.0 <= self.warmup < 1.0:
            raise UsageError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.schedule not in ("linear", "cosine", "constant"):
            raise UsageError(f"--schedule must be linear, cosine or constant, got '{self.schedule}'")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise UsageError("--weight-decay and --max-grad-norm must be >= 0")
        self.responses_file()
        from ..paths import check_output_dir

        check_output_dir(self.out, COMMAND)

    def identity(self, target, layer_ids) -> dict:
        """The settings a resumed run must share with the run it resumes."""
        model = Path(str(target.name)).expanduser()
        return {
            "target": str(model.resolve()) if model.exists() else str(target.name),
            "data": str(self.responses_file().resolve()), "layers": list(layer_ids), "seed": self.seed,
            "limit": self.limit, "max_length": self.max_length, "batch_size": self.batch_size,
            "grad_accum": self.grad_accum, "lr": self.lr, "weight_decay": self.weight_decay,
            "schedule": self.schedule, "warmup": self.warmup, "max_grad_norm": self.max_grad_norm,
        }


@dataclass
class DraftTrainResult:
    out: str
    start_step: int
    steps: int
    total_steps: int
    loss: float | None
    seconds: float
    records: int
    layers: list
    megabytes: float
    heldout: dict
    stopped_by_budget: bool = False
    main_process: bool = True

    def report(self) -> str:
        ran = self.steps - self.start_step
        per = self.seconds / ran if ran else 0.0
        loss = "n/a" if self.loss is None else f"{self.loss:.4f}"
        held = ""
        if self.heldout.get("after"):
            before = self.heldout.get("before")
            after = self.heldout["after"]
            held = (f"; held-out top-1 {before['top1']:.3f} -> {after['top1']:.3f}" if before else
                    f"; held-out loss {after['loss']:.3f}, top-1 {after['top1']:.3f}")
        stop = "; stopped at the --max-minutes budget (re-run to continue)" if self.stopped_by_budget else ""
        return (f"saved draft model {self.out} ({len(self.layers)} layers from target layers {self.layers}, "
                f"{self.megabytes:.1f} MB fp16; step {self.steps}/{self.total_steps}, loss {loss}; {ran} steps in "
                f"{self.seconds:.1f}s, {per:.2f}s/step{held}{stop})")


class DraftLoss(torch.nn.Module):
    """The training objective around the draft LM: summed cross-entropy of the response tokens (and the number of
    them whose argmax is the target's token), the LM head applied to response positions only."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, labels):
        import torch.nn.functional as F

        h = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        targets = labels[:, 1:]
        keep = targets != -100
        rows = h[:, :-1][keep]
        logits = F.linear(rows, self.lm.lm_head.weight).float()
        wanted = targets[keep]
        loss = F.cross_entropy(logits, wanted, reduction="sum")
        correct = (logits.detach().argmax(-1) == wanted).sum()
        return loss, correct


def _encode(records: list[dict], max_length: int):
    from ..train.data import Encoded

    encoded, dropped = [], 0
    for r in records:  # checked by read_training_records
        prompt, response = r["prompt_ids"], r["response_ids"]
        ids = (prompt + response)[:max_length]
        if len(ids) - len(prompt) < 1:
            dropped += 1
            continue
        encoded.append(Encoded(ids, len(prompt)))
    return encoded, dropped


@torch.no_grad()
def _evaluate(lm, encoded, batch_size: int) -> dict | None:
    """Mean loss and top-1 agreement over the response tokens of ``encoded`` (no gradients)."""
    from ..train.trainer import pad_batch

    if not encoded:
        return None
    was_training = lm.training
    lm.eval()
    scorer = DraftLoss(lm)
    loss = correct = tokens = 0.0
    for i in range(0, len(encoded), batch_size):
        batch = pad_batch(encoded[i : i + batch_size], 0)
        s, c = scorer(batch["input_ids"], batch["attention_mask"], batch["labels"])
        loss += float(s)
        correct += float(c)
        tokens += batch["num_tokens"]
    lm.train(was_training)
    return {"loss": round(loss / max(tokens, 1), 5), "top1": round(correct / max(tokens, 1), 5),
            "tokens": int(tokens), "records": len(encoded)}


def _plot(log_path: Path, png: Path) -> bool:
    """The loss (and top-1 agreement) curve of ``train_log.jsonl`` as a PNG, with the drafters' plotting helper;
    False when it or matplotlib is unavailable."""
    try:
        from ..train.drafter_train import plot_losses
    except ImportError:
        return False
    try:
        return bool(plot_losses(log_path, png, "train draft-model"))
    except (OSError, ValueError, ImportError):
        return False


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def train_draft_model(target, cfg: DraftTrainConfig) -> DraftTrainResult:
    """Train (or resume training) a draft model for ``target`` per ``cfg``; the folder is written to ``cfg.out``."""
    cfg.validate()
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from ..paths import mark_output_dir
    from ..train.data import subsample
    from ..train.drafter_train import mixed_precision_autocast
    from ..train.launcher import check_launcher
    from ..train.make_data import read_training_records
    from ..train.trainer import (
        CHECKPOINTS,
        LOG_FILE,
        STATE_FILE,
        BatchSchedule,
        _trim_log,
        checkpoint_dirs,
        latest_checkpoint,
        pad_batch,
        prepare_training,
        to_device,
    )

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    accelerator = Accelerator()
    check_launcher(accelerator)  # a launcher whose processes did not join one group: refused, one line
    main = accelerator.is_main_process
    quiet = cfg.quiet or not main
    world = accelerator.num_processes

    layer_ids = choose_layers(getattr(target.config, "num_hidden_layers", 0), cfg.layers, cfg.init_layers)
    identity = cfg.identity(target, layer_ids)
    resume = latest_checkpoint(out)
    resume_state = None
    if resume is not None:
        resume_state = json.loads((resume / STATE_FILE).read_text())
        saved = resume_state.get("identity", {})
        diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        if diff:
            raise UsageError(f"{out} holds a run with different settings ({', '.join(diff)}); use another --out "
                             "to start anew")
        if resume_state.get("world_size") != world:
            raise UsageError(f"{resume} was written by {resume_state.get('world_size')} processes, this run has "
                             f"{world}; resume with the same number")

    # Data: the records of make-data (a resumed run takes exactly the lines its first run took).
    t_load = time.perf_counter()
    records = read_training_records(cfg.responses_file().parent, target.vocab_size)  # each checked
    n_lines = int(resume_state["data_lines"]) if resume_state else len(records)
    if len(records) < n_lines:
        raise UsageError(f"{cfg.responses_file()} has {len(records)} records, fewer than the {n_lines} the run in "
                         f"{out} trained on; use another --out")
    records = records[:n_lines]
    train_recs = [r for r in records if r.get("split", "train") == "train"]
    held_recs = [r for r in records if r.get("split") == "heldout"]
    train_recs = subsample(train_recs, cfg.limit, cfg.seed)
    encoded, dropped = _encode(train_recs, cfg.max_length)
    held_encoded, _ = _encode(held_recs[: cfg.eval_records], cfg.max_length)
    if not encoded:
        raise UsageError(f"no training record in {cfg.responses_file()} (split 'train', with response tokens "
                         f"within --max-length {cfg.max_length})")
    lengths = [len(e.input_ids) for e in encoded]
    schedule = BatchSchedule(len(encoded), cfg.batch_size * world, cfg.seed, lengths if cfg.batch_size > 1 else None)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * schedule.per_epoch / cfg.grad_accum)
    start_step = int(resume_state["step"]) if resume_state else 0
    if start_step > total_steps:
        raise UsageError(f"{resume} is at step {start_step}, past the {total_steps} steps asked for")

    # Model: the target's layers, its embedding and head shared and frozen.
    set_seed(cfg.seed)
    lm, meta = init_draft_model(target, len(layer_ids), ",".join(map(str, layer_ids)))
    meta["init"] = cfg.init_layers
    probe = target_probe(target)
    if resume is not None:
        lm.load_state_dict(load_file(str(resume / TRAINABLE_FILE)), strict=False)
    lm.train()
    heldout = dict(resume_state.get("heldout", {})) if resume_state else {}
    if main and not resume_state and held_encoded:
        heldout["before"] = _evaluate(lm, held_encoded, cfg.batch_size)
    model = DraftLoss(lm)
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_scheduler("constant_with_warmup" if cfg.schedule == "constant" else cfg.schedule, optimizer,
                              num_warmup_steps=round(cfg.warmup * total_steps), num_training_steps=total_steps)
    # The draft's weights are saved by save_checkpoint (without the shared embedding), not by accelerate.
    model, optimizer = prepare_training(accelerator, model, optimizer, scheduler, resume)

    _log(f"draft-model: {len(encoded)} training records ({len(held_recs)} held out, {dropped} without response "
         f"tokens within --max-length dropped), {total_steps} steps of {cfg.batch_size * cfg.grad_accum * world} "
         f"sequences ({total_steps * cfg.grad_accum / schedule.per_epoch:.2f} epochs); {len(layer_ids)} layers from "
         f"target layers {layer_ids} ({n_trainable / 1e6:.2f}M parameters trained, embedding and head shared), "
         f"lr {cfg.lr:g}; loaded in {time.perf_counter() - t_load:.1f}s"
         + (f"; resuming from step {start_step}" if resume is not None else ""), quiet)

    log_path = out / LOG_FILE
    if main:
        mark_output_dir(out, COMMAND)
        _trim_log(log_path, start_step)

    def state_at(step, loss):
        return {"step": step, "total_steps": total_steps, "loss": loss, "world_size": world, "method": "draft-model",
                "identity": identity, "config": asdict(cfg), "data_lines": n_lines, "records": len(encoded),
                "meta": meta, "heldout": heldout, "time": time.time()}

    def save_checkpoint(step, loss) -> None:
        root = out / CHECKPOINTS
        final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        if main:
            save_file({k: v.detach().contiguous() for k, v in own_state(lm).items()}, str(tmp / TRAINABLE_FILE))
        accelerator.save_state(str(tmp / "accelerate"))
        accelerator.wait_for_everyone()
        if main:
            (tmp / STATE_FILE).write_text(json.dumps(state_at(step, loss), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in checkpoint_dirs(out)[: -cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in root.glob(".step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        accelerator.wait_for_everyone()

    step = last_saved = start_step
    last_loss = resume_state.get("loss") if resume_state else None
    stopped = False
    deadline = None if cfg.max_minutes is None else time.perf_counter() + cfg.max_minutes * 60
    bar = tqdm(total=total_steps, initial=start_step, desc="train draft-model", unit="step", disable=quiet,
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    t0 = time.perf_counter()
    autocast = mixed_precision_autocast(accelerator.device.type, cfg.mixed_precision)
    try:
        with deferred_stops():
            while step < total_steps:
                t_step = time.perf_counter()
                batches = []
                for m in range(step * cfg.grad_accum, (step + 1) * cfg.grad_accum):
                    mine = schedule.batch(m)[accelerator.process_index :: world]
                    batches.append(to_device(pad_batch([encoded[i] for i in mine], 0), accelerator.device))
                local_tokens = torch.tensor(float(sum(b["num_tokens"] for b in batches)))
                total_tokens = float(accelerator.reduce(local_tokens, reduction="sum"))
                loss_sum = torch.zeros(())
                correct = torch.zeros(())
                for i, batch in enumerate(batches):
                    ctx = accelerator.no_sync(model) if i < len(batches) - 1 else nullcontext()
                    with ctx:
                        with autocast:
                            s, c = model(batch["input_ids"], batch["attention_mask"], batch["labels"])
                        # DDP averages gradients over processes: scale by world for the global token mean
                        accelerator.backward(s * (world / max(total_tokens, 1.0)))
                    loss_sum += s.detach().float()
                    correct += c.detach().float()
                if cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                last_loss = float(accelerator.reduce(loss_sum, reduction="sum")) / max(total_tokens, 1.0)
                top1 = float(accelerator.reduce(correct, reduction="sum")) / max(total_tokens, 1.0)
                dt = time.perf_counter() - t_step
                if main:
                    with open(log_path, "a") as f:
                        f.write(json.dumps({"step": step, "loss": round(last_loss, 5), "acc": round(top1, 4), "lr": lr,
                                            "tokens": int(total_tokens), "seconds": round(dt, 3)}) + "\n")
                bar.set_postfix(loss=f"{last_loss:.4f}", top1=f"{top1:.3f}", lr=f"{lr:.2e}", s_step=f"{dt:.1f}",
                                refresh=False)
                bar.update(1)
                over = deadline is not None and time.perf_counter() > deadline
                over = bool(accelerator.reduce(torch.tensor(float(over)), reduction="sum") > 0)  # every process agrees
                if step % cfg.save_every == 0 or step == total_steps or over:
                    save_checkpoint(step, last_loss)
                    last_saved = step
                raise_if_stopped()  # a Ctrl-C or SIGTERM during the step stops here, the step kept
                if over and step < total_steps:
                    stopped = True
                    break
    except KeyboardInterrupt:
        bar.close()
        if step > last_saved:
            save_checkpoint(step, last_loss)
            last_saved = step
        kept = f"checkpoint at step {last_saved} in {out / CHECKPOINTS}" if last_saved else "no step finished"
        raise KeyboardInterrupt(f"{kept}; re-run the same command to resume") from None
    bar.close()
    seconds = time.perf_counter() - t0

    megabytes = 0.0
    if main:
        unwrapped = accelerator.unwrap_model(model).lm
        if held_encoded:
            heldout["after"] = _evaluate(unwrapped, held_encoded, cfg.batch_size)
        meta["trained"] = {"steps": step, "total_steps": total_steps, "loss": last_loss, "records": len(encoded),
                           "data": identity["data"]}
        save_draft_model(unwrapped, meta, out, probe)
        megabytes = folder_megabytes(out)
        _plot(out / LOG_FILE, out / "loss.png")
        summary = state_at(step, last_loss)
        summary.update(trainable_parameters=n_trainable, seconds_this_run=round(seconds, 2),
                       steps_this_run=step - start_step, megabytes_fp16=round(megabytes, 2),
                       stopped_by_budget=stopped)
        _write_json(out / SUMMARY_FILE, summary)
        if megabytes > MAX_SHIPPED_MB:
            _log(f"note: {out / WEIGHTS_FILE} is {megabytes:.1f} MB, more than the {MAX_SHIPPED_MB:.0f} MB a shipped "
                 "drafter may weigh; fewer --layers make it smaller", cfg.quiet)
    accelerator.wait_for_everyone()
    return DraftTrainResult(str(out), start_step, step, total_steps, last_loss, seconds, len(encoded), layer_ids,
                            megabytes, heldout, stopped, main)


__all__ = [
    "DraftTrainConfig", "DraftTrainResult", "choose_layers", "draft_target", "init_draft_model", "is_draft_model",
    "load_draft_model", "read_draft_config", "save_draft_model", "target_embedding", "target_probe",
    "train_draft_model",
]
