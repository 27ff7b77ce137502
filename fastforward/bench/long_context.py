"""Long prompts on this machine: how fast a prompt of n tokens is read (prefill tokens/s) and how fast decoding
goes on once it is in the KV cache (decode tokens/s), ours and llama.cpp's on the same GGUF file and the same
token ids. ``fastforward profile --context 4096,8192 [--llama-cpp]`` prints them."""

from __future__ import annotations

import statistics
import time

import torch

from ..engine import read_prompt

DECODE_TOKENS = 32  # greedy steps timed after the prompt
WARM_UP_TOKENS = 64  # read once, untimed, before the first timed prompt


def prompt_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """``n`` random token ids (a fixed seed): the same prompt for every engine measured."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


def measure_long_context(target, n: int, repeats: int = 2, decode_tokens: int = DECODE_TOKENS) -> dict:
    """Ours: median seconds to read an ``n``-token prompt into a fresh cache (the engine's chunked prefill), and
    median ms of each of ``decode_tokens`` greedy one-token forwards after it."""
    if n + decode_tokens + 1 > target.max_context:
        raise ValueError(f"a {n}-token prompt and {decode_tokens} new tokens exceed the model's context "
                         f"{target.max_context}")
    prompt = torch.tensor(prompt_ids(target.vocab_size, n), dtype=torch.long)
    read_prompt(target, prompt[:WARM_UP_TOKENS], target.new_cache(WARM_UP_TOKENS), ())  # first-use costs aside
    prefill, steps = [], []
    for _ in range(repeats):
        cache = target.new_cache(n + decode_tokens + 1)
        t0 = time.perf_counter()
        out, _ = read_prompt(target, prompt, cache, ())
        prefill.append(time.perf_counter() - t0)
        token = int(out.logits[-1].argmax())
        for i in range(decode_tokens):
            t0 = time.perf_counter()
            out = target.forward(torch.tensor([token]), torch.tensor([n + i]), cache)
            cache.keep(range(1))
            steps.append((time.perf_counter() - t0) * 1000)
            token = int(out.logits[-1].argmax())
    return _summary(n, prefill, steps)


def llama_cpp_long_context(gguf, n: int, repeats: int = 2, decode_tokens: int = DECODE_TOKENS,
                           threads: int | None = None) -> dict:
    """llama.cpp on the same file and token ids: ``Llama.eval`` of the prompt (its own batching, ``n_batch`` 512 as
    the library's default) into an empty cache, then one-token evals (of fixed tokens: this wrapper keeps no logits
    unless asked to keep every position's, which would cost time)."""
    from llama_cpp import Llama

    threads = threads or torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=n + decode_tokens + 16, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False, logits_all=False)
    prompt = prompt_ids(llm.n_vocab(), n)
    feed = prompt_ids(llm.n_vocab(), decode_tokens, seed=1)  # the tokens decoded (the cost is the same for any)
    prefill, steps = [], []
    try:
        llm.eval(prompt[:WARM_UP_TOKENS])  # first-use costs (buffers, graphs) aside
        for _ in range(repeats):
            llm.reset()  # the next eval drops every cache entry from position 0 on
            t0 = time.perf_counter()
            llm.eval(prompt)
            prefill.append(time.perf_counter() - t0)
            for token in feed:
                t0 = time.perf_counter()
                llm.eval([token])
                steps.append((time.perf_counter() - t0) * 1000)
    finally:
        llm.close()
    return _summary(n, prefill, steps)


def _summary(n: int, prefill: list[float], steps: list[float]) -> dict:
    seconds = statistics.median(prefill)
    step_ms = statistics.median(steps)
    return {"prompt_tokens": n, "prefill_s": round(seconds, 5), "prefill_tokens_per_s": round(n / seconds, 1),
            "decode_ms": round(step_ms, 2), "decode_tokens_per_s": round(1000 / step_ms, 1)}
