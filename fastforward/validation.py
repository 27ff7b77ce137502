"""Checks of request values, one place for all of them: types, ranges, text encoding. Each failure is one
:class:`~fastforward.errors.UsageError` (a ``ValueError``) or ``TypeError`` whose message names the value."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from .errors import InputTypeError, UsageError
from .verify import SamplingConfig

MAX_SEED = 2**63 - 1
#: the smallest positive temperature: below it ``logits / temperature`` overflows (NaN probabilities), and sampling
#: is greedy to within float precision anyway; 0 itself means greedy
MIN_TEMPERATURE = 1e-4
#: the most tokens one step's proposal (draft tree plus any lookahead branch) may put in a target forward, whatever
#: the model's context: a method option that asks for more is refused rather than run for minutes or out of memory
MAX_PROPOSAL_ROWS = 1024


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_text(name: str, value: str) -> str:
    """``value`` must be encodable as UTF-8 (no lone surrogates, which invalid UTF-8 input decodes to)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{name} is not valid UTF-8 text (character {exc.start})") from None
    return value


def check_prompt(prompt):
    """A prompt is a non-empty string, a non-empty list of chat messages ``{"role": str, "content": str}``, or a
    non-empty list of token ids (ints; a 1-D tensor is accepted too)."""
    if prompt is None:
        raise InputTypeError("prompt must be a string, a list of chat messages or a list of token ids, got None")
    if hasattr(prompt, "tolist") and hasattr(prompt, "dim"):  # a tensor of token ids
        if prompt.dim() > 1 and prompt.shape[0] != 1:
            raise UsageError(f"a tensor prompt must hold one sequence of token ids, got shape {tuple(prompt.shape)}")
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex:
            raise InputTypeError(f"a tensor prompt must hold integer token ids, got {prompt.dtype}")
        prompt = prompt.flatten().tolist()
    if isinstance(prompt, str):
        check_text("the prompt", prompt)
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        return prompt
    if isinstance(prompt, (bytes, bytearray)):
        raise InputTypeError("prompt must be text (str), not bytes: decode it first")
    if not isinstance(prompt, (list, tuple)):
        raise InputTypeError(f"prompt must be a string, a list of chat messages or a list of token ids, "
                        f"got {type(prompt).__name__}")
    if not prompt:
        raise UsageError("the prompt is empty")
    if all(_is_int(t) for t in prompt):
        return list(prompt)
    if all(isinstance(m, dict) for m in prompt):
        for i, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not m["role"]:
                raise UsageError(f"chat message {i} needs a non-empty string 'role'")
            if not isinstance(m.get("content"), str):
                raise UsageError(f"chat message {i} needs a string 'content'")
            check_text(f"chat message {i}", m["content"])
        return [dict(m) for m in prompt]
    raise InputTypeError("prompt lists must hold only token ids (int) or only chat messages (dict with role/content)")


def check_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise InputTypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stops:
        if not isinstance(s, str):
            raise InputTypeError(f"stop strings must be strings, got {type(s).__name__}")
        if not s:
            raise UsageError("stop strings must be non-empty strings")
        check_text("a stop string", s)
    return tuple(stops)


def check_sampling(temperature, top_k, top_p) -> SamplingConfig:
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise InputTypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"temperature must be a finite number >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise UsageError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")
    if not _is_int(top_k) or top_k < 0:
        raise UsageError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not math.isfinite(top_p) or \
            not 0 < top_p <= 1:
        raise UsageError(f"top_p must be in (0, 1], got {top_p!r}")
    return SamplingConfig(float(temperature), top_k, float(top_p))


def check_max_new_tokens(value) -> int:
    if not _is_int(value) or value <= 0:
        raise UsageError(f"max_new_tokens must be a positive integer, got {value!r}")
    return value


def check_seed(seed) -> int | None:
    if seed is None:
        return None
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise UsageError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    return seed


def check_observers(observers, name: str = "observers") -> tuple:
    """Step observers: an iterable of callables ``(state, step)``, returned as a tuple; else one
    :class:`InputTypeError` naming ``name`` (``observers``, or ``observers[i]`` for one prompt of a batch)."""
    if isinstance(observers, (str, bytes)) or not isinstance(observers, Iterable):
        raise InputTypeError(f"{name} must be a list or tuple of callables (state, step), "
                             f"got {type(observers).__name__}")
    observers = tuple(observers)
    for i, observer in enumerate(observers):
        if not callable(observer):
            raise InputTypeError(f"{name}[{i}] must be a callable (state, step), got {type(observer).__name__}")
    return observers


def check_proposal_rows(method: str, rows: int, settings: str, max_context: int | None = None) -> int:
    """``rows``, the most tokens ``method`` with ``settings`` (its options, in words) puts in one target forward,
    if it is at most :data:`MAX_PROPOSAL_ROWS` and the model's context ``max_context``; else a one-line
    :class:`UsageError` saying the limit."""
    limit = MAX_PROPOSAL_ROWS if max_context is None else min(MAX_PROPOSAL_ROWS, max_context)
    if rows > limit:
        why = ("the engine's cap" if max_context is None
               else f"the smaller of {MAX_PROPOSAL_ROWS} and the model's context")
        raise UsageError(f"{method}: {settings} put {rows} tokens in every forward; at most {limit} are allowed "
                         f"({why})")
    return rows


def token_ids_problem(ids, vocab_size: int | None = None, *, allow_empty: bool = False) -> str | None:
    """What is wrong with ``ids`` as a record's token ids (None: nothing): a list of integer ids >= 0 (not bools),
    non-empty unless ``allow_empty``, each below ``vocab_size`` when it is given. The one check of the token-id
    fields of make-data records, of PASTA's record files and of a REST datastore."""
    if not isinstance(ids, list) or not (ids or allow_empty):
        return "must be a list of token ids" if allow_empty else "must be a non-empty list of token ids"
    bad_type = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)), None)
    if bad_type is not None:
        return f"must hold integer token ids, not {json.dumps(bad_type)}"
    outside = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if outside is None:
        return None
    if vocab_size is None:
        return f"has a negative token id {outside}"
    return f"has token id {outside} outside the target's vocabulary of {vocab_size}"
