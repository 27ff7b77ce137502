"""One generation request, validated once: the CLI, the Python API, the benchmark, evaluation and the server all
build a :class:`GenerationRequest` and hand it to the engine.

:meth:`GenerationRequest.start` turns it into a :class:`~fastforward.engine.Generation` -- the request, the run its
method builds, the text streamer and, once done, the result -- which ``stream``, ``generate_batch`` and the server's
scheduler all drive.

``GenerationRequest(...)`` checks everything that can be checked without the model (types, ranges, text encoding,
the method name and its options' names); :meth:`GenerationRequest.prompt_ids` checks the rest against the target
(token ids in range, the prompt fits the context). Every problem is one :class:`~fastforward.errors.UsageError`
(a ``ValueError``) or ``TypeError`` with a message that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import Generation
from .errors import InputTypeError, UsageError
from .proposers import available_methods, check_method_options, is_method, make_proposer
from .validation import (
    check_max_new_tokens,
    check_prompt,
    check_sampling,
    check_seed,
    check_stop,
    check_text,
)
from .verify import SamplingConfig


def check_method(method, method_options) -> dict:
    """The method's name (or a ready method instance) and its options' names; values are checked by the method."""
    options = {} if method_options is None else method_options
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise InputTypeError("method_options must be a dict of option name -> value")
    if isinstance(method, str):
        methods = available_methods()
        if method not in methods:
            raise UsageError(f"unknown method '{method}'; available: {', '.join(methods)}")
        check_method_options(method, options)
    elif not is_method(method):
        raise InputTypeError(f"method must be a method name or a Proposer, got {type(method).__name__}")
    elif options:
        raise UsageError("options cannot be given with a ready proposer instance")
    return dict(options)


#: the method of a request that names none: ``auto`` (each step the best of the context, the datastore, the trained
#: drafter or no draft, priced by this machine's cost curve; lossless like every method)
DEFAULT_METHOD = "auto"


@dataclass
class GenerationRequest:
    """What to generate and how; validated on construction (see the module docstring)."""

    prompt: object
    method: object = DEFAULT_METHOD
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: object = None
    chat: bool = True
    system: str | None = None
    method_options: dict | None = None
    sampling: SamplingConfig = field(init=False, repr=False)
    stops: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        self.prompt = check_prompt(self.prompt)
        self.max_new_tokens = check_max_new_tokens(self.max_new_tokens)
        self.sampling = check_sampling(self.temperature, self.top_k, self.top_p)
        self.seed = check_seed(self.seed)
        self.stops = check_stop(self.stop)
        if not isinstance(self.chat, bool):
            raise InputTypeError(f"chat must be True or False, got {self.chat!r}")
        if self.system is not None:
            if not isinstance(self.system, str):
                raise InputTypeError(f"system must be a string, got {type(self.system).__name__}")
            check_text("the system prompt", self.system)
        self._check_prompt_settings()
        self.method_options = check_method(self.method, self.method_options)

    def _check_prompt_settings(self) -> None:
        """``chat`` and ``system`` are refused where the prompt's kind would ignore them: chat messages are always
        chat-templated, token ids are fed as given, and a system prompt exists only inside the chat template."""
        messages = isinstance(self.prompt, list) and isinstance(self.prompt[0], dict)
        token_ids = isinstance(self.prompt, list) and not messages
        if messages and not self.chat:
            raise UsageError("chat=False (--no-chat) cannot apply to a list of chat messages: they are always "
                             "chat-templated; give the text itself, or leave chat on")
        if not self.system:  # None, or "" (no system prompt either way)
            return
        if token_ids:
            raise UsageError("system cannot be combined with a prompt of token ids: the ids are fed as given; put "
                             "the system prompt into them, or give the prompt as text")
        if messages:
            raise UsageError("system cannot be combined with a list of chat messages: give it as their first "
                             "message, {'role': 'system', 'content': ...}")
        if not self.chat:
            raise UsageError("system cannot be combined with chat=False (--no-chat): a system prompt is part of the "
                             "chat template, which chat=False leaves out")

    def prompt_ids(self, target) -> list[int]:
        """The prompt as token ids for ``target``, checked against its vocabulary and context."""
        if self.system and isinstance(self.prompt, str) and not getattr(target.tokenizer, "chat_template", None):
            raise UsageError(f"system needs a chat template, and the model {target.name} has none (its prompts are "
                             "fed as plain text): leave system out, or put it into the prompt")
        ids = target.encode(self.prompt, chat=self.chat, system=self.system)
        if not ids:
            raise UsageError("the prompt is empty")
        vocab = target.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UsageError(f"token id {bad} is out of range for a vocabulary of {vocab}")
        if len(ids) >= target.max_context:
            raise UsageError(f"the prompt has {len(ids)} tokens; the model's context is {target.max_context}")
        return ids

    def start(self, target, *, prompt_ids: list[int] | None = None, on_prefill=None, observers=(),
              prefix_cache=None) -> Generation:
        """This request in flight on ``target``: its method built and its run made (nothing is decoded yet).
        ``prompt_ids``: :meth:`prompt_ids` already taken; ``observers`` and ``on_prefill`` are the run's step
        observers and prefill progress; ``prefix_cache`` one shared with other runs of ``target``."""
        ids = self.prompt_ids(target) if prompt_ids is None else prompt_ids
        method = make_proposer(self.method, target, **self.method_options)
        return Generation(target, ids, method, self.stops or None, max_new_tokens=self.max_new_tokens,
                          sampling=self.sampling, seed=self.seed, on_prefill=on_prefill, observers=observers,
                          prefix_cache=prefix_cache, request=self)
