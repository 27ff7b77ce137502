"""Peers: what users run today, timed in the same process, on the same prompts, the same way as our methods.

* ``hf-generate``   -- ``transformers`` ``model.generate`` (greedy, or sampling at temperature > 0).
* ``hf-pld``        -- the same with HF's prompt lookup decoding (``prompt_lookup_num_tokens=10`` by default).
* ``llama-cpp``     -- llama.cpp's autoregressive decoding (through llama-cpp-python) of the GGUF file the target was
  loaded from, fed the same prompt token ids.
* ``llama-cpp-pld`` -- the same with llama-cpp-python's prompt lookup draft model (``num_pred_tokens=10``).

The HF peers get a clean ``GenerationConfig`` (nothing inherited from the model's, such as a repetition penalty),
the target's EOS tokens, and the same thread count; ``decoding_steps`` counts the HF model's forward calls.

The llama.cpp peers get the target's EOS tokens, ``n_threads = n_threads_batch =`` the run's torch threads, an empty
KV cache per turn, and plain sampling (greedy at temperature 0; else that temperature with top-k/top-p/min-p off);
``decoding_steps`` counts ``Llama.eval`` calls (one per llama_decode of a batch; the prefill counts as one). llama.cpp
computes with 8-bit-quantised activations, so its text is not expected to be token-identical to ours: these peers
are not *exact* (``exact = False``) and the benchmark records their *agreement* with our AR (the identical prefix)
instead of counting mismatches.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from .. import machine_facts
from ..errors import FastForwardError, UsageError
from ..machine_facts import LLAMACPP_INSTALL, llama_cpp_amx_problem, llama_cpp_version
from ..model import resolve_model
from .spec import MethodSpec, TurnOutcome


@dataclass(frozen=True)
class PeerInfo:
    name: str
    summary: str
    options: dict = field(default_factory=dict)
    library: str = "transformers"  # "transformers" or "llama.cpp"


PEERS = {
    "hf-generate": PeerInfo("hf-generate", "transformers model.generate (greedy)"),
    "hf-pld": PeerInfo(
        "hf-pld", "transformers model.generate with prompt lookup decoding",
        {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": None},
    ),
    "llama-cpp": PeerInfo("llama-cpp", "llama.cpp (llama-cpp-python) on the target's GGUF file",
                          library="llama.cpp"),
    "llama-cpp-pld": PeerInfo(
        "llama-cpp-pld", "llama.cpp (llama-cpp-python) with its prompt lookup draft model",
        {"num_pred_tokens": 10, "max_ngram_size": 2}, library="llama.cpp",
    ),
}


def is_llama_cpp(spec: MethodSpec) -> bool:
    return spec.kind == "peer" and spec.method in PEERS and PEERS[spec.method].library == "llama.cpp"


def require_llama_cpp():
    """The ``llama_cpp`` module, or a one-line :class:`UsageError` saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise UsageError(f"llama-cpp peers need llama-cpp-python: {LLAMACPP_INSTALL}") from None
    except (OSError, RuntimeError) as exc:  # installed, but its shared library does not load
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"llama-cpp-python is installed but does not load ({first}); reinstall it: "
                         f"{LLAMACPP_INSTALL}") from None
    return llama_cpp


def llama_cpp_system_info() -> str | None:
    """llama.cpp's own account of the build it runs (``llama_print_system_info``: the CPU features it was compiled
    for and found -- AVX2, AVX512, AMX_INT8, OPENMP ... -- and its backends), or None when llama-cpp-python is not
    imported (it is never imported here just to ask). Recorded with every llama.cpp number: its speed depends on
    which of its kernels this build has."""
    return machine_facts.llama_cpp_system_info(import_it=False)


_warned_amx = False


def warn_if_llama_cpp_dies_here() -> None:
    """Before llama.cpp loads a model: when its build is the one that dies on this CPU (its AMX backend on a CPU with
    AMX, :func:`fastforward.machine_facts.llama_cpp_amx_problem`, the line ``fastforward info`` shows too), say so
    once on stderr -- the last line before the run stops there, with the command that rebuilds it."""
    global _warned_amx
    problem = llama_cpp_amx_problem(llama_cpp_system_info(), version=llama_cpp_version())
    if problem and not _warned_amx:
        _warned_amx = True
        print(f"fastforward: {problem}", file=sys.stderr, flush=True)


def gguf_path(model_name: str):
    """The GGUF file ``model_name`` (an alias or a path, as given to ``fastforward.load``) was loaded from, or a
    one-line :class:`UsageError` when it is not a GGUF model."""
    need = "llama-cpp peers need a .gguf model (an alias such as smollm2-135m, or a .gguf file)"
    try:
        kind, path = resolve_model(model_name)
    except FastForwardError as exc:
        raise UsageError(f"{need}; the target '{model_name}' is not one ({exc})") from None
    if kind != "gguf":
        raise UsageError(f"{need}; '{model_name}' is a Hugging Face folder")
    return path


def llama_cpp_options(spec: MethodSpec) -> dict:
    """A llama.cpp peer's options, defaults included, checked."""
    options = {**PEERS[spec.method].options, **spec.options}
    for key, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"peer '{spec.label}': {key} must be a positive integer, got {value!r}")
    return options


def check_peers(peers: list[MethodSpec], model_name: str) -> None:
    """What the peers need, checked before any work (and before the model loads): llama.cpp peers need a GGUF model,
    valid options and llama-cpp-python."""
    llama = [s for s in peers if is_llama_cpp(s)]
    if llama:
        for spec in llama:
            llama_cpp_options(spec)
        gguf_path(model_name)
        require_llama_cpp()


def make_peer_runner(spec: MethodSpec):
    if is_llama_cpp(spec):
        return LlamaCppRunner(spec)
    return PeerRunner(spec)


class PeerRunner:
    """The Hugging Face ``transformers`` peers."""

    exact = True  # same weights, same float32 arithmetic: compared token by token with AR

    def __init__(self, spec: MethodSpec):
        self.spec = spec
        self.lossless = True
        self.options = {**PEERS[spec.method].options, **spec.options}

    def _config(self, target, max_new_tokens: int, temperature: float):
        from transformers import GenerationConfig

        eos = sorted(target.eos_token_ids)
        pad = eos[0] if eos else 0
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        if self.spec.method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = int(self.options["prompt_lookup_num_tokens"])
            if self.options.get("max_matching_ngram_size"):
                kw["max_matching_ngram_size"] = int(self.options["max_matching_ngram_size"])
        return GenerationConfig(**kw)

    def generate(self, target, prompt_ids, *, max_new_tokens: int, temperature: float, seed) -> TurnOutcome:
        model = target.hf_model
        config = self._config(target, max_new_tokens, temperature)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        mask = torch.ones_like(ids)
        if seed is not None:
            torch.manual_seed(seed)
        calls = [0]
        first_done = [0.0]  # when the first forward (the prefill) returned

        def count(module, args, kwargs):
            calls[0] += 1

        def done(module, args, kwargs, output):
            if not first_done[0]:
                first_done[0] = time.perf_counter()

        handle = model.register_forward_pre_hook(count, with_kwargs=True)
        handle_done = model.register_forward_hook(done, with_kwargs=True)
        try:
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            wall = time.perf_counter() - t0
        finally:
            handle.remove()
            handle_done.remove()
        new = out[0, ids.shape[1]:].tolist()
        eos = target.eos_token_ids
        reason = "eos" if new and new[-1] in eos else "length"
        steps = calls[0]
        return TurnOutcome(token_ids=new, wall_time=wall, decoding_steps=steps, finish_reason=reason,
                           prefill_time=first_done[0] - t0 if first_done[0] else 0.0)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python: one ``Llama`` per runner (recreated only for a longer context or another
    thread count), its KV cache emptied before every turn."""

    exact = False  # 8-bit activations: agreement with AR is recorded, mismatches are not counted
    lossless = False  # it does not claim to reproduce our AR's tokens

    def __init__(self, spec: MethodSpec):
        self.spec = spec
        self.options = llama_cpp_options(spec)
        self.pld = spec.method == "llama-cpp-pld"
        self._llm = None
        self._n_ctx = 0
        self._threads = 0
        self._path = None
        self._model_name = None
        self._evals = 0

    def check(self, target) -> None:
        """Fail before any work when the target is not a GGUF model or llama-cpp-python is missing."""
        self._path = gguf_path(target.name)
        self._model_name = target.name
        require_llama_cpp()

    def _model(self, target, needed: int):
        threads = torch.get_num_threads()
        if self._model_name != target.name:
            self.check(target)
        if self._llm is not None and needed <= self._n_ctx and threads == self._threads:
            return self._llm
        from llama_cpp import Llama

        self.close()
        n_ctx = max(2048, -(-needed // 1024) * 1024)
        kw = dict(model_path=str(self._path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                  verbose=False, logits_all=False)
        if self.pld:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # verifying a draft samples at every drafted position, so llama-cpp-python needs every position's logits
            kw.update(logits_all=True, draft_model=LlamaPromptLookupDecoding(
                max_ngram_size=int(self.options["max_ngram_size"]),
                num_pred_tokens=int(self.options["num_pred_tokens"])))
        warn_if_llama_cpp_dies_here()
        llm = Llama(**kw)
        evaluate = llm.eval

        def counted_eval(tokens):
            self._evals += 1
            return evaluate(tokens)

        llm.eval = counted_eval  # Llama.generate calls self.eval: one call per decode step
        self._llm, self._n_ctx, self._threads = llm, n_ctx, threads
        return llm

    def close(self) -> None:
        if self._llm is not None:
            close = getattr(self._llm, "close", None)
            if close is not None:
                close()
            self._llm = None

    def generate(self, target, prompt_ids, *, max_new_tokens: int, temperature: float, seed) -> TurnOutcome:
        prompt = [int(t) for t in prompt_ids]
        extra = int(self.options["num_pred_tokens"]) if self.pld else 0
        llm = self._model(target, len(prompt) + max_new_tokens + extra + 1)  # loaded outside the timing
        eos = target.eos_token_ids
        llm.reset()  # an empty KV cache: no prefix reuse across turns or questions
        if seed is not None:
            llm.set_seed(int(seed) & 0xFFFFFFFF)
        sampling = dict(temp=float(temperature), top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                        frequency_penalty=0.0, presence_penalty=0.0)
        new: list[int] = []
        step_of_token: list[int] = []
        reason = "length"
        first = 0.0
        self._evals = 0
        t0 = time.perf_counter()
        stream = llm.generate(prompt, reset=True, **sampling)
        try:
            for token in stream:
                if not new:
                    first = time.perf_counter() - t0
                new.append(int(token))
                step_of_token.append(self._evals)
                if token in eos:
                    reason = "eos"
                    break
                if len(new) >= max_new_tokens:
                    break
        finally:
            stream.close()
        wall = time.perf_counter() - t0
        steps = self._evals
        accept = [0] * steps
        for s in step_of_token:
            if 1 <= s <= steps:
                accept[s - 1] += 1
        return TurnOutcome(token_ids=new, wall_time=wall, decoding_steps=steps, accept_lengths=accept,
                           prefill_time=first, finish_reason=reason)


def llama_cpp_forward_costs(gguf, qs, kv: int = 300, repeats: int = 7, threads: int | None = None) -> dict:
    """Median milliseconds of one ``Llama.eval`` (llama.cpp's ``llama_decode``) of q tokens on a kv-token cache of
    the same GGUF file, for each q: llama.cpp's own cost curve, measured the way
    :func:`fastforward.costs.measure_forward_costs` measures ours."""
    require_llama_cpp()
    from llama_cpp import Llama

    threads = threads or torch.get_num_threads()
    warn_if_llama_cpp_dies_here()
    llm = Llama(model_path=str(gguf), n_ctx=kv + max(qs) + 16, n_batch=max(512, max(qs)), n_threads=threads,
                n_threads_batch=threads, verbose=False, logits_all=False)
    g = torch.Generator().manual_seed(0)
    vocab = llm.n_vocab()
    llm.eval(torch.randint(0, vocab, (kv,), generator=g).tolist())
    samples = {q: [] for q in qs}
    for _ in range(3):
        for q in qs:
            tokens = torch.randint(0, vocab, (q,), generator=g).tolist()
            for i in range(max(1, repeats // 3 + 1) + 1):
                llm.n_tokens = kv  # eval() drops cache entries from n_tokens on: back to the kv-token prefix
                t0 = time.perf_counter()
                llm.eval(tokens)
                if i:
                    samples[q].append((time.perf_counter() - t0) * 1000)
    llm.close()
    return {q: statistics.median(v) for q, v in samples.items()}
