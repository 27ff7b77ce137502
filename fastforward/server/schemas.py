"""OpenAI request bodies -> one validated :class:`~fastforward.request.GenerationRequest`, and OpenAI-shaped errors.

Only the shape of the HTTP body is checked here (which fields, which JSON types, what this server supports); every
generation value (prompt text, sampling, seed, stop strings, the method and its option names) goes through
:class:`GenerationRequest`, the one place the CLI and the Python API use too, and its
:class:`~fastforward.errors.UsageError` becomes a 400 with the same message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UsageError
from ..proposers import available_methods
from ..request import GenerationRequest

MAX_STOP_STRINGS = 4  # as OpenAI's API


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})  # sent with the answer: Retry-After (429), WWW-Authenticate (401)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Limits:
    """What one request may ask of this server."""

    default_max_tokens: int = 256
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    #: wall seconds from arrival to the last token (queueing included); a request still decoding then ends with
    #: finish_reason "length", one still waiting gets a 503
    max_request_seconds: float = 600.0
    #: CPU seconds of the decode loop a request may use (its prefill, and its share of each shared forward by rows);
    #: then it ends with finish_reason "length"
    max_request_cpu_seconds: float = 300.0


@dataclass
class ParsedRequest:
    """One HTTP request, checked: what to generate (``generation``) and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    generation: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    trace: bool = False  # stream each token's text and how it came (the page uses it)
    options: dict = field(default_factory=dict)
    token_ids: bool = False  # return the generated token ids too
    ignored_fields: tuple[str, ...] = ()  # body fields this server does not act on (answered in a header, logged)

    @property
    def method(self) -> str:
        return self.generation.method


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type_name(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _expect(body: dict, name: str, check, what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not check(value):
        raise bad(f"'{name}' must be {what}, got {_type_name(value)} {value!r}"[:300], name)
    return value


# Fields of OpenAI's API this server does not implement: accepted only at their neutral value.
_NEUTRAL = {
    "n": (1, "only n = 1 is supported"),
    "best_of": (1, "only best_of = 1 is supported"),
    "echo": (False, "echo is not supported"),
    "logprobs": (None, "logprobs are not supported"),
    "top_logprobs": (None, "top_logprobs are not supported"),
    "suffix": (None, "suffix is not supported"),
    "presence_penalty": (0, "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (0, "frequency_penalty is not supported (only 0)"),
    "logit_bias": (None, "logit_bias is not supported"),
    "tools": (None, "tools are not supported"),
    "functions": (None, "functions are not supported"),
    "tool_choice": (None, "tool_choice is not supported"),
    "audio": (None, "audio is not supported"),
}


def _neutral(body: dict) -> None:
    for name, (neutral, message) in _NEUTRAL.items():
        value = body.get(name)
        if value is None or value == neutral or (neutral is None and value in (False, 0, {}, [], "none")):
            continue
        raise bad(f"{message}, got {name} = {value!r}"[:300], name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format: only {\"type\": \"text\"} is supported", "response_format")


def _model(body: dict, served: tuple[str, ...]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: a string naming the model (see GET /v1/models)", "model")
    if model not in served:
        raise APIError(404, f"the model '{model[:100]}' does not exist here; this server serves: {', '.join(served)}",
                       param="model", code="model_not_found")
    return model


def _max_tokens(body: dict, limits: Limits) -> int:
    names = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
    if not names:
        return limits.default_max_tokens
    name = names[0]
    value = body[name]
    if not _is_int(value) or value <= 0:
        raise bad(f"'{name}' must be a positive integer, got {value!r}"[:300], name)
    if value > limits.max_tokens:
        raise bad(f"'{name}' is {value}; this server allows at most {limits.max_tokens} tokens per request", name)
    return value


EXTENSION_FIELDS = ("method", "options", "trace", "token_ids")
#: the body fields a request may carry that this server acts on or checks (the rest are ignored, as OpenAI's servers
#: do, and listed in the answer's ``X-FastForward-Ignored-Fields`` header and the log)
KNOWN_FIELDS = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
                          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "response_format",
                          "fastforward", *_NEUTRAL})
IGNORED_FIELDS_HEADER = "X-FastForward-Ignored-Fields"
_MAX_IGNORED_LISTED = 16


def ignored_fields(body: dict) -> tuple[str, ...]:
    """The names of ``body``'s fields this server ignores, sorted, made safe for a header (printable ASCII, at most
    64 characters each, at most 16 of them; more are counted as ``+N more``)."""
    names = sorted(k for k in body if k not in KNOWN_FIELDS)
    safe = ["".join(c if 33 <= ord(c) < 127 and c != "," else "?" for c in k)[:64] or "?" for k in names]
    if len(safe) > _MAX_IGNORED_LISTED:
        safe = [*safe[:_MAX_IGNORED_LISTED], f"+{len(safe) - _MAX_IGNORED_LISTED} more"]
    return tuple(safe)
#: what the server shows in place of a path of its own (an error message, an answer's statistics)
SERVER_PATH = "<a server path>"
_PATH = re.compile(r"(?<![\w.:/~-])~?/[^\s'\"(),;:]*[^\s'\"(),;:.]")


def without_server_paths(text: str) -> str:
    """``text`` with each absolute path (``/...``, ``~/...``) in it replaced by :data:`SERVER_PATH`: what the server
    answers never shows where its files are."""
    return _PATH.sub(SERVER_PATH, text)


def refuse_files(method: str, options: dict) -> None:
    """A request may not name a file: every ``path`` option of ``method`` (a tree, a drafter, a draft model, a
    datastore) is refused unless its value is one of the in-memory kinds the option accepts that JSON can carry (a
    list: tr-jacobi's choices list). A string is refused whatever it says (an existing file, a missing one, a
    keyword such as ``builtin``), before it is looked at; the message never repeats it. The server's files are its
    launch options (``serve --method M -o KEY=VALUE``) or the methods' shipped defaults."""
    info = available_methods()[method]
    for name, value in options.items():
        option = info.option(name)
        if option is None or option.kind != "path":
            continue
        carried = tuple(t for t in option.accepts if t in (list, tuple))
        if carried and isinstance(value, carried):
            continue
        also = " (a request may give it only as a list)" if carried else ""
        raise bad(f"{method}: option '{name}' names a file; the server's files are chosen at launch (fastforward "
                  f"serve --method {method} -o {name}=...){also}", "fastforward.options", code="option_names_a_file")


def _extension(body: dict, default_method: str, default_options: dict | None = None,
               launch_options: dict | None = None) -> tuple[str, dict, bool, bool]:
    """(method, options, trace, token_ids) of the request's ``fastforward`` extension. Options naming files are
    refused (:func:`refuse_files`); the server's launch options of the method (``default_options`` for its default
    method: ``serve --method M -o KEY=VALUE``; ``launch_options``: method -> options) apply under the request's own."""
    launch = {m: dict(o) for m, o in (launch_options or {}).items()}
    launch[default_method] = {**launch.get(default_method, {}), **(default_options or {})}
    ext = body.get("fastforward")
    if ext is None:
        return default_method, launch[default_method], False, False
    if not isinstance(ext, dict):
        raise bad(f"'fastforward' must be an object {{\"method\": ..., \"options\": {{...}}}}, got "
                  f"{_type_name(ext)}", "fastforward")
    unknown = sorted(set(ext) - set(EXTENSION_FIELDS))
    if unknown:
        raise bad(f"unknown field(s) in 'fastforward': {', '.join(unknown)} (known: {', '.join(EXTENSION_FIELDS)})",
                  "fastforward")
    method = ext.get("method", default_method)
    if not isinstance(method, str) or not method:
        raise bad(f"'fastforward.method' must be a method name, got {method!r}"[:300], "fastforward.method")
    methods = available_methods()
    if method not in methods:
        raise APIError(404, f"unknown decoding method '{method}'; available: {', '.join(methods)}",
                       param="fastforward.method", code="method_not_found")
    options = ext.get("options") or {}
    if not isinstance(options, dict):
        raise bad(f"'fastforward.options' must be an object of option name -> value, got {_type_name(options)}",
                  "fastforward.options")
    refuse_files(method, options)
    options = {**launch.get(method, {}), **options}
    flags = []
    for name in ("trace", "token_ids"):
        flag = ext.get(name, False)
        if not isinstance(flag, bool):
            raise bad(f"'fastforward.{name}' must be true or false", f"fastforward.{name}")
        flags.append(flag)
    return method, options, *flags


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required: a non-empty array of {\"role\", \"content\"}", "messages")
    if not isinstance(messages, list):
        raise bad(f"'messages' must be an array, got {_type_name(messages)}", "messages")
    if not messages:
        raise bad("'messages' is empty: give at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with 'role' and 'content', got {_type_name(m)}", where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"{where}.role must be one of system, developer, user, assistant; got {role!r}"[:300],
                      f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}]: only text parts {{\"type\": \"text\", \"text\": ...}} are "
                              "supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string (or text parts), got {_type_name(content)}",
                      f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise bad("the messages hold no text", "messages")
    return out


def _prompt(body: dict):
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required: a string (or an array of token ids)", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad(f"'prompt' holds {len(prompt)} prompts; this server takes one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        if not all(_is_int(t) for t in prompt):
            raise bad("'prompt' must be a string or an array of integer token ids", "prompt")
        return prompt
    raise bad(f"'prompt' must be a string or an array of token ids, got {_type_name(prompt)}", "prompt")


def parse(kind: str, body, *, served: tuple[str, ...], default_method: str, limits: Limits,
          default_options: dict | None = None, launch_options: dict | None = None) -> ParsedRequest:
    """Check an OpenAI chat (``kind="chat"``) or completions body; raises :class:`APIError`. ``model`` must be one
    the server serves (``served``): a request never makes it load another."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}")
    model = _model(body, served)
    _neutral(body)
    stream = _expect(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    stream_options = _expect(body, "stream_options", lambda v: isinstance(v, dict), "an object", None)
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("'stream_options.include_usage' must be true or false", "stream_options.include_usage")
    max_tokens = _max_tokens(body, limits)
    temperature = _expect(body, "temperature", _is_number, "a number in [0, 2]", 1.0)
    if not 0 <= temperature <= 2:
        raise bad(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _expect(body, "top_p", _is_number, "a number in (0, 1]", 1.0)
    top_k = _expect(body, "top_k", _is_int, "an integer (0 or -1 = off)", 0)
    if top_k == -1:
        top_k = 0
    seed = _expect(body, "seed", _is_int, "an integer", None)
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    method, options, trace, token_ids = _extension(body, default_method, default_options, launch_options)
    if kind == "chat":
        prompt, chat = _messages(body), True
    else:
        prompt, chat = _prompt(body), False
    try:
        generation = GenerationRequest(prompt, method, max_new_tokens=max_tokens, temperature=float(temperature),
                                       top_k=top_k, top_p=float(top_p), seed=seed, stop=stop, chat=chat,
                                       method_options=options)
    except UsageError as exc:  # the one validation path: its message names the field
        raise bad(str(exc), _param_of(str(exc))) from None
    return ParsedRequest(kind, model, generation, stream, include_usage, trace, dict(options), token_ids,
                         ignored_fields(body))


def _param_of(message: str) -> str | None:
    for word, param in (("top_p", "top_p"), ("top_k", "top_k"), ("temperature", "temperature"), ("seed", "seed"),
                        ("stop", "stop"), ("option", "fastforward.options"), ("prompt", "prompt"),
                        ("chat message", "messages")):
        if word in message:
            return param
    return None
