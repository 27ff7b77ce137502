"""The Python API: :func:`generate`, :func:`stream` and :func:`generate_batch`.

Every call builds one :class:`~fastforward.request.GenerationRequest` per prompt (validated before any model
work), starts it as a :class:`~fastforward.engine.Generation` (the request, its run, its text, its result:
``request.start(target)``), and lets the engine drive it -- alone (:func:`stream`; :func:`generate` is
``stream(...).run()``) or together with others (:func:`generate_batch`).
"""

from __future__ import annotations

from .engine import Generation, GenerationResult, decode_batch
from .errors import InputTypeError, UsageError
from .model import TargetModel, load
from .model.prefix_cache import DEFAULT_PREFIX_CACHE_TOKENS, prefix_cache_for
from .request import DEFAULT_METHOD, GenerationRequest
from .validation import check_observers

MIN_BATCH_TOKENS = 16


def _target(model) -> TargetModel:
    if isinstance(model, str):
        return load(model)
    if not isinstance(model, TargetModel):
        raise InputTypeError("model must be a fastforward TargetModel (fastforward.load) or a model name, "
                             f"got {type(model).__name__}")
    return model


#: what :func:`stream` and :func:`generate_batch` set on the requests they build when an argument is left out
REQUEST_DEFAULTS = dict(method=DEFAULT_METHOD, max_new_tokens=256, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                        stop=None, chat=True, system=None, method_options=None)


def _left_out(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _request(prompt, method, options, where: str = "prompt") -> GenerationRequest:
    """The request of ``prompt``: built from the arguments, or the ready :class:`GenerationRequest` given -- which
    carries every setting of its own, so an argument given beside it (one not left at its default) is refused
    rather than ignored."""
    if isinstance(prompt, GenerationRequest):
        given = [name for name, value in {"method": method, **options}.items()
                 if not _left_out(value, REQUEST_DEFAULTS[name])]
        if given:
            raise UsageError(f"{', '.join(given)} given beside a GenerationRequest as the {where}: the request "
                             "carries its own settings and would ignore them; set them on the request")
        return prompt
    return GenerationRequest(prompt, method, **options)


def stream(
    model,
    prompt,
    method=DEFAULT_METHOD,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop=None,
    chat: bool = True,
    system: str | None = None,
    method_options: dict | None = None,
    on_prefill=None,
    observers=(),
) -> Generation:
    """A :class:`Generation` to iterate for text deltas (``.result`` after), or to ``.run()`` to the end.

    ``prompt`` is text, a list of chat messages, a list of token ids, or a ready :class:`GenerationRequest` (which
    carries its own settings: the arguments it holds are then refused, not ignored). ``chat=False`` feeds text
    without the chat template (messages are always templated); ``system`` is a system prompt for text in the chat
    template. ``observers``: callables ``(state, step)`` called after every verification
    step (statistics, calibration, trajectory recording). Everything is checked before the model is touched.
    """
    request = _request(prompt, method, dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
        chat=chat, system=system, method_options=method_options))
    if on_prefill is not None and not callable(on_prefill):
        raise InputTypeError("on_prefill must be a callable (done, total) or None")
    observers = check_observers(observers)
    return request.start(_target(model), on_prefill=on_prefill, observers=observers)


def generate(model, prompt, method=DEFAULT_METHOD, **kwargs) -> GenerationResult:
    """Generate a continuation of ``prompt`` with a decoding ``method``; the arguments are :func:`stream`'s.

    Every lossless method returns exactly what ``method="ar"`` returns at temperature 0, and samples from the
    same distribution at temperature > 0.
    """
    return stream(model, prompt, method, **kwargs).run()


def batch_token_budget(target: TargetModel) -> int:
    """Rows per shared forward for :func:`generate_batch`, from this machine's cost curve: the smallest measured
    q whose cost per token t(q)/q is within 10% of the cheapest (twice the largest measured q when the curve is
    still falling there), at least :data:`MIN_BATCH_TOKENS`, at most what the backend computes row-exactly."""
    from .costs import cost_model

    limit = target.batch_rows_limit()
    if limit <= 0:
        return 1
    curve = cost_model(target).curve()
    per_token = {q: curve.t(q) / q for q in curve.ms}
    best = min(per_token.values())
    q = min(q for q, c in per_token.items() if c <= 1.1 * best)
    if q == max(curve.ms):
        q *= 2
    return max(MIN_BATCH_TOKENS, min(q, limit))


def generate_batch(
    model,
    prompts,
    method=DEFAULT_METHOD,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed=None,
    stop=None,
    chat: bool = True,
    system: str | None = None,
    method_options: dict | None = None,
    max_batch_tokens: int | None = None,
    max_active: int | None = None,
    cut_drafts: bool = True,
    on_tokens=None,
    on_result=None,
    observers=None,
) -> list[GenerationResult]:
    """Decode several prompts together and return one result per prompt, in order.

    ``prompts`` is a list of prompts (each as :func:`generate` takes them) or of :class:`GenerationRequest`;
    ``method`` one name for all or a list with one per prompt; ``seed`` an int for all (each sequence then samples
    as it would alone with that seed) or a list. Each step every unfinished sequence drafts as it would alone; with
    ``cut_drafts`` (the default) the sequences' drafts are then cut to what they are worth in the shared
    forward, which on a CPU is much less than alone (:mod:`fastforward.draft_budget`; outputs unchanged); one target
    forward carries the drafts of as many sequences as fit in ``max_batch_tokens`` rows (default:
    :func:`batch_token_budget`). Prompts that start alike (a chat template's system prompt) read their shared
    prefix once (:mod:`fastforward.model.prefix_cache`; bitwise the same KV). With ``max_active``, at most that
    many sequences decode at once and the next prompt starts as soon as one finishes (continuous batching). Each
    result equals what :func:`generate` gives that prompt alone: token for token at temperature 0, the same
    samples with the same seed. ``on_tokens(index, token_ids)`` is called as tokens come, ``on_result(index,
    result)`` as soon as a sequence finishes (to save finished work while the others still decode).
    ``observers``: one tuple of step observers ``(state, step)`` for every prompt, or a list with one tuple per
    prompt.
    """
    requests = _batch_requests(prompts, method, seed, dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
        chat=chat, system=system, method_options=method_options))
    n = len(requests)
    _check_batch_settings(max_batch_tokens, max_active, cut_drafts, on_tokens, on_result)
    observers = _batch_observers(observers, n)
    target = _target(model)
    prompt_ids = [r.prompt_ids(target) for r in requests]  # every prompt checked before any method is built
    # prompts that start alike (a chat template's system prompt) read their shared prefix once
    prefix_cache = prefix_cache_for(target, DEFAULT_PREFIX_CACHE_TOKENS) if n > 1 else None
    generations = [r.start(target, prompt_ids=ids, observers=obs, prefix_cache=prefix_cache)
                   for r, ids, obs in zip(requests, prompt_ids, observers, strict=True)]
    budget = max_batch_tokens or batch_token_budget(target)
    for i, tokens in decode_batch([g.sequence for g in generations], budget, max_active, cut_drafts):
        generation = generations[i]
        generation.add(tokens)
        if on_tokens is not None and tokens:
            on_tokens(i, tokens)
        if generation.sequence.finished and generation.result is None:
            generation.finish()
            if on_result is not None:
                on_result(i, generation.result)
    return [g.result if g.result is not None else g.finish() for g in generations]


def _batch_requests(prompts, method, seed, options: dict) -> list[GenerationRequest]:
    """One request per prompt of :func:`generate_batch`: ``method`` and ``seed`` one for all or one per prompt,
    ``options`` (the settings, in :data:`REQUEST_DEFAULTS`'s order) the same for all but the seed."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise InputTypeError("prompts must be a list of prompts (or GenerationRequests)")
    if not prompts:
        raise UsageError("prompts is empty")
    n = len(prompts)

    def per_prompt(name, value):
        if isinstance(value, (list, tuple)) and not (name == "stop" and all(isinstance(s, str) for s in value)):
            if len(value) != n:
                raise UsageError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    methods = per_prompt("method", method)
    seeds = per_prompt("seed", seed)
    return [_request(p, methods[i], dict(options, seed=seeds[i]), f"prompts[{i}]") for i, p in enumerate(prompts)]


def _check_batch_settings(max_batch_tokens, max_active, cut_drafts, on_tokens, on_result) -> None:
    """:func:`generate_batch`'s own settings, each refused in one line when wrong."""
    if max_batch_tokens is not None and (not isinstance(max_batch_tokens, int) or isinstance(max_batch_tokens, bool)
                                         or max_batch_tokens <= 0):
        raise UsageError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
    if max_active is not None and (not isinstance(max_active, int) or isinstance(max_active, bool)
                                   or max_active <= 0):
        raise UsageError(f"max_active must be a positive integer, got {max_active!r}")
    if not isinstance(cut_drafts, bool):
        raise InputTypeError(f"cut_drafts must be True or False, got {cut_drafts!r}")
    if on_tokens is not None and not callable(on_tokens):
        raise InputTypeError("on_tokens must be a callable (index, token_ids) or None")
    if on_result is not None and not callable(on_result):
        raise InputTypeError("on_result must be a callable (index, result) or None")


def _batch_observers(observers, n: int) -> list[tuple]:
    """The step observers of each of ``n`` prompts: None (none), one tuple for all, or a list of one per prompt."""
    if observers is None:
        return [()] * n
    if isinstance(observers, tuple):
        return [check_observers(observers)] * n
    if not isinstance(observers, list):
        raise InputTypeError("observers must be a tuple of callables, or a list with one tuple per prompt, "
                             f"got {type(observers).__name__}")
    if len(observers) != n:
        raise UsageError(f"observers has {len(observers)} entries for {n} prompts (one tuple per prompt)")
    return [check_observers(obs, f"observers[{i}]") for i, obs in enumerate(observers)]
