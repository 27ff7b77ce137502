"""``fastforward chat``: a conversation with a model in the terminal, as ``llama-cli -cnv`` or ``ollama run`` hold one.

Each turn is the model's chat template over the whole conversation (system prompt, every user message and answer as
shown), decoded by the chosen method -- so a turn's tokens are exactly what ``ar`` gives that conversation -- and
streamed. Only the turn's new tokens are read: after each answer the conversation's KV entries (prompt and answer;
and the taps a drafter reads) go into a prefix cache (:mod:`fastforward.model.prefix_cache`), and the next turn's
prompt, which starts with the same tokens, copies them in (bitwise what reading them gives) and reads the rest: the
template's end of the answer and the new message. Where the backend cannot reuse entries exactly (the HF forward,
dense fp32 weights), every turn reads the whole conversation. ``/stats`` shows what each turn read.

Ctrl-C stops the current answer at the next step and keeps what was shown of it in the conversation; a second
Ctrl-C stops at once. EOF (Ctrl-D) or ``/exit`` leaves. The input prompt is ``> `` (a line ending in ``\\``
continues on the next, after ``... ``). Slash commands: see :data:`HELP`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastforward as ff

from ..api import REQUEST_DEFAULTS
from ..engine import SequenceRun
from ..errors import FastForwardError, UsageError
from ..interrupts import Terminated, deferred_stops, raise_if_stopped
from ..model import resolve_model
from ..model.prefix_cache import prefix_cache_for
from ..paths import check_output_file, owned_json
from ..proposers import available_methods, make_proposer
from ..version import __version__
from .generate import _prefill_progress
from .options import (
    add_method_option_argument,
    add_model_arguments,
    max_new_tokens,
    model_load_kwargs,
    parse_options,
    seed,
)

#: the library's default method (what ``ff.generate`` and ``ff.stream`` use when none is named)
DEFAULT_METHOD = REQUEST_DEFAULTS["method"]
#: the most new tokens of one answer, unless --max-new-tokens says otherwise (the context bounds it too)
DEFAULT_MAX_NEW_TOKENS = 1024
PROMPT = "> "
CONTINUATION = "... "
#: the first key of a transcript written by /save (how /save recognises a file it may overwrite)
TRANSCRIPT_KEY = "fastforward_chat"

HELP = """\
/method [NAME [KEY=VALUE ...]]  show the method, or decode the next answers with NAME (and its options)
/stats                          what the last answer read and cost, and the conversation's size
/reset                          forget the conversation (the system prompt given at start stays)
/system [TEXT]                  show the system prompt, or set it (the next answer reads the conversation anew)
/save FILE                      write the conversation as a JSON transcript (never over a file chat did not write)
/help                           this list
/exit                           leave (Ctrl-D too)
Ctrl-C stops an answer and keeps what was shown of it. End a line with \\ to continue on the next; start it with
// to send a message that begins with /."""


def add_arguments(p, name: str) -> None:
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"decoding method of the answers, see 'fastforward methods' (default: {DEFAULT_METHOD})")
    add_method_option_argument(p)
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=max_new_tokens, default=DEFAULT_MAX_NEW_TOKENS,
                   help="the most tokens of one answer; the model's context bounds it too (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--seed", type=seed, default=None, help="seed for sampling (each answer draws by position: the "
                   "same conversation gives the same answers)")
    p.add_argument("--stop", action="append", help="stop string of every answer (repeatable)")
    p.add_argument("--system", default=None, help="system prompt of the conversation")
    p.add_argument("--stats", action="store_true", help="print each answer's statistics on stderr")


# ------------------------------------------------------------------------------------------------------------------
# The conversation: what the terminal loop drives, and what tests drive directly
# ------------------------------------------------------------------------------------------------------------------


class Turn:
    """One answer in flight: iterate it for the text as it comes; then :meth:`Conversation.finish` it.

    Its run's KV cache is held (the run lets go of it when it ends) together with the taps of every accepted token,
    so that :meth:`Conversation.finish` can keep the whole conversation's entries for the next turn."""

    def __init__(self, conversation: Conversation, user: str, request, prompt_ids: list[int], progress=None):
        self.conversation, self.user, self.request = conversation, user, request
        self.prompt_ids = prompt_ids
        self.method, self.method_options = request.method, dict(request.method_options)
        self.shown: list[str] = []
        self._progress = progress
        self._cache = None
        self._taps: dict[int, list[torch.Tensor]] = {}
        self._stop = False
        self.stopped_at_a_step = False  # the answer was stopped between two steps (its KV entries are whole)
        target = conversation.target
        self.generation = request.start(target, prompt_ids=prompt_ids, prefix_cache=conversation.prefix_cache,
                                        on_prefill=self._on_prefill, observers=(self._observe,))

    @property
    def done(self) -> bool:
        return self.generation.result is not None

    @property
    def text(self) -> str:
        """The answer as shown so far."""
        return "".join(self.shown)

    def stop(self) -> None:
        """Stop the answer at the next step (what Ctrl-C does)."""
        self._stop = True

    def __iter__(self):
        for delta in self.generation:
            self.shown.append(delta)
            yield delta

    # -- called by the engine --------------------------------------------------------------------------------------
    def _on_prefill(self, done: int, total: int) -> None:
        self._cache = self.generation.sequence.cache  # the run drops it when it ends; the next turn reuses it
        if self._progress is not None:
            self._progress(done, total)
        self._stop_here()

    def _observe(self, state, step) -> None:
        if step.hidden:  # the accepted path's taps: the drafter's features of these positions, for the next turn
            path = torch.as_tensor(step.verdict.path, dtype=torch.long)
            for layer, h in step.hidden.items():
                self._taps.setdefault(layer, []).append(h[path])
        self._stop_here()

    def _stop_here(self) -> None:
        """A safe point: the cache holds exactly what was accepted. Stop here if asked (Ctrl-C, :meth:`stop`)."""
        try:
            if self._stop:
                raise KeyboardInterrupt
            raise_if_stopped()
        except KeyboardInterrupt:
            self.stopped_at_a_step = True
            raise

    # -- for Conversation.finish -----------------------------------------------------------------------------------
    def known_entries(self, done: bool):
        """(token ids, KV cache, taps by layer, tap layers) of every position of this turn whose KV entries (and
        taps) are exact -- the prompt and the accepted answer tokens but the last -- or None when there are none to
        keep (no prefix cache, a run of another kind, an answer stopped in the middle of a step or its prefill)."""
        run, n = self.generation.sequence, len(self.prompt_ids)
        if self.conversation.prefix_cache is None or self._cache is None or not isinstance(run, SequenceRun):
            return None
        if not (done or self.stopped_at_a_step) or run.state.length <= n:
            return None
        k = min(self._cache.length, run.state.length)
        if k <= n:
            return None
        ids = run.ids[:k].clone()
        layers = tuple(run.hidden_layers)
        taps: dict[int, torch.Tensor] = {}
        if layers:
            # the prompt's taps: the entry the engine kept for the prompt at the end of its prefill
            entry, m = self.conversation.prefix_cache.lookup(run.ids[: n + 1], layers, self._cache.k.dtype)
            if entry is None or m < n:
                return None
            for layer, h in entry.hidden.items():
                if layer in self._taps:
                    taps[layer] = torch.cat([h[:n], *self._taps[layer]])[:k]
            if any(t.shape[0] < k for t in taps.values()):
                return None
        return ids, self._cache, taps, layers


class Conversation:
    """A conversation with ``target``: its messages, each answer's method and settings, and the prefix cache that
    carries the KV entries of one turn into the next (None where the backend cannot reuse them exactly)."""

    def __init__(self, target, *, method: str = DEFAULT_METHOD, method_options: dict | None = None,
                 system: str | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop=None):
        if not getattr(target.tokenizer, "chat_template", None):
            raise UsageError(f"the model {target.name} has no chat template, which a conversation needs; use "
                             "'fastforward generate --no-chat' to continue plain text")
        self.target = target
        self.settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=seed, stop=stop)
        self.method, self.method_options = method, dict(method_options or {})
        self.initial_system = system
        self.system = system
        self.messages: list[dict] = []  # user and assistant messages, in order (the system prompt apart)
        self.turns: list[dict] = []  # one record per answer kept
        self.last: dict | None = None  # the last answer's record (kept or not)
        self.prefix_cache = prefix_cache_for(target, target.max_context)
        self._request([{"role": "user", "content": "probe"}])  # the settings, checked once

    # -- settings ----------------------------------------------------------------------------------------------------
    def _request(self, messages: list[dict], method=None, options=None):
        return ff.GenerationRequest(messages, self.method if method is None else method,
                                    method_options=self.method_options if options is None else options,
                                    **self.settings)

    def conversation(self, user: str | None = None) -> list[dict]:
        """The messages a turn's template is applied to: the system prompt, the conversation, ``user``'s message."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages + ([{"role": "user", "content": user}] if user is not None else [])

    def set_method(self, method: str, options: dict) -> None:
        """Decode the next answers with ``method`` and its ``options`` (checked: names here, values by building it
        once for the target)."""
        self._request([{"role": "user", "content": "probe"}], method, options)
        prepare_method(method, options, self.target)
        self.method, self.method_options = method, dict(options)

    def set_system(self, text: str) -> int:
        """Set the system prompt (checked against the chat template); returns the tokens the next prompt holds
        before the new message."""
        request = ff.GenerationRequest([{"role": "system", "content": text}, *self.messages,
                                        {"role": "user", "content": "probe"}], self.method,
                                       method_options=self.method_options, **self.settings)
        ids = request.prompt_ids(self.target)
        self.system = text
        return len(ids)

    def reset(self) -> None:
        """Forget the conversation; the system prompt given at the start stays (the prefix cache keeps its
        entries: a new conversation reads its system prompt from them)."""
        self.messages, self.turns, self.last = [], [], None
        self.system = self.initial_system

    # -- turns -------------------------------------------------------------------------------------------------------
    def start(self, user: str, progress=None) -> Turn:
        """The answer to ``user``'s message, ready to be iterated; a bad message or a conversation that no longer
        fits the context is a :class:`UsageError` (the conversation unchanged)."""
        request = self._request(self.conversation(user))
        try:
            ids = request.prompt_ids(self.target)
        except UsageError as exc:
            if "context" in str(exc):
                raise UsageError(f"{exc}: the conversation no longer fits; /reset starts a new one") from None
            raise
        return Turn(self, user, request, ids, progress)

    def finish(self, turn: Turn) -> dict:
        """Close ``turn`` (run to its end, or stopped): keep the user's message and the answer as shown in the
        conversation (a stopped answer that showed nothing is not kept), the turn's KV entries in the prefix cache,
        and its record; returns the record."""
        gen, done = turn.generation, turn.done
        result = gen.result if done else gen.partial_result("interrupted")
        stats = result.stats
        record = {
            "user": turn.user, "assistant": turn.text, "method": turn.method, "method_options": turn.method_options,
            "interrupted": not done, "finish_reason": stats.finish_reason,
            "prompt_tokens": stats.prompt_tokens, "cached_prompt_tokens": stats.cached_prompt_tokens,
            "read_prompt_tokens": stats.prompt_tokens - stats.cached_prompt_tokens,
            "new_tokens": len(result.token_ids), "token_ids": list(result.token_ids), "stats": stats,
        }
        record["kept"] = bool(done or turn.text)
        if record["kept"]:
            self.messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.text}]
            self.turns.append(record)
        known = turn.known_entries(done)
        if known is not None:
            ids, cache, taps, layers = known
            self.prefix_cache.store(ids, cache, taps, layers)
        record["kv_kept_tokens"] = 0 if known is None else int(known[0].numel())
        self.last = record
        return record

    # -- /save ---------------------------------------------------------------------------------------------------------
    def transcript(self) -> dict:
        return {
            TRANSCRIPT_KEY: __version__,
            "model": self.target.name,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {k: v for k, v in self.settings.items()},
            "method": self.method, "method_options": self.method_options,
            "messages": self.conversation(),
            "turns": [{k: (v.to_dict() if k == "stats" else v) for k, v in t.items()} for t in self.turns],
        }


def prepare_method(method: str, options: dict, target) -> None:
    """Build ``method`` once for ``target`` (its option values are checked so) and let it prepare (a method that
    sizes its drafts reads this machine's cost curve, measuring it the first time): at the start or at /method,
    not inside the next answer."""
    built = make_proposer(method, target, **options)
    prepare = getattr(built, "prepare", None)
    if prepare is not None:
        prepare(target)


def owned_transcript(path: Path) -> bool:
    """Whether ``path`` holds a transcript /save wrote (the only files it overwrites)."""
    return owned_json(path, lambda d: isinstance(d, dict) and TRANSCRIPT_KEY in d, TRANSCRIPT_KEY)


def save_transcript(conversation: Conversation, path: str) -> Path:
    file = check_output_file(path, "/save", owned=owned_transcript)
    text = json.dumps(conversation.transcript(), indent=1, ensure_ascii=False, default=str) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return file


# ------------------------------------------------------------------------------------------------------------------
# The terminal
# ------------------------------------------------------------------------------------------------------------------


def _settings(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop)


def run(args, name: str) -> int:
    options = parse_options(args.option)
    settings = _settings(args)
    # every check that does not need the model, before it loads
    ff.GenerationRequest([{"role": "system", "content": args.system or "-"}, {"role": "user", "content": "probe"}],
                         args.method, method_options=options, **settings)
    resolve_model(args.model)  # an unknown model: one line now
    t0 = time.perf_counter()
    target = ff.load(args.model, **model_load_kwargs(args))
    load_seconds = time.perf_counter() - t0
    conversation = Conversation(target, method=args.method, method_options=options, system=args.system, **settings)
    if args.system:
        conversation.set_system(args.system)
    prepare_method(args.method, options, target)  # its option values checked, its cost curve read or measured
    _say(f"fastforward chat: {target.name} (loaded in {load_seconds:.1f} s), method "
         f"{_method_text(conversation.method, conversation.method_options)}; /help lists the commands, Ctrl-C stops "
         "an answer, Ctrl-D leaves")
    if conversation.prefix_cache is None:
        _say("(this backend cannot reuse KV entries exactly: every answer reads the whole conversation)")
    Terminal(conversation, show_stats=args.stats).loop()
    return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _method_text(method: str, options: dict) -> str:
    return method + "".join(f" {k}={v}" for k, v in options.items())


class Terminal:
    """The read-answer loop over a :class:`Conversation`: input lines, slash commands, streamed answers."""

    def __init__(self, conversation: Conversation, show_stats: bool = False, stdin=None, stdout=None):
        self.conversation = conversation
        self.show_stats = show_stats
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.commands = {"/help": self.help, "/exit": None, "/quit": None, "/bye": None, "/method": self.method,
                         "/stats": self.stats, "/reset": self.reset, "/system": self.system, "/save": self.save}
        if _is_terminal(self.stdin):
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass

    def write(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def read(self) -> str | None:
        """One message (lines ending in a backslash continue it), or None at EOF."""
        lines, prompt = [], PROMPT
        while True:
            try:
                line = self._input(prompt)
            except EOFError:
                if lines:
                    return "\n".join(lines)
                return None
            if line.endswith("\\"):
                lines.append(line[:-1])
                prompt = CONTINUATION
                continue
            lines.append(line)
            return "\n".join(lines)

    def _input(self, prompt: str) -> str:
        if self.stdin is sys.stdin and self.stdout is sys.stdout:
            return input(prompt)
        self.write(prompt)
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def loop(self) -> None:
        while True:
            try:
                text = self.read()
            except Terminated:
                raise
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
                self.write("\n")
                _say("(Ctrl-D or /exit leaves)")
                continue
            except UnicodeDecodeError as exc:
                _say(f"error: the input is not valid UTF-8 text (byte {exc.start}); the message was not sent")
                continue
            if text is None:
                self.write("\n")
                return
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if self.command(text) is False:
                    return
                continue
            self.answer(text[1:] if text.startswith("//") else text)

    # -- an answer -------------------------------------------------------------------------------------------------
    def answer(self, user: str) -> None:
        try:
            turn = self.conversation.start(user, progress=_prefill_progress())
        except FastForwardError as exc:
            _say(f"error: {_one_line(exc)}")
            return
        record = None
        try:
            with deferred_stops():  # Ctrl-C stops the answer at its next step (a second one at once)
                try:
                    for delta in turn:
                        self.write(delta)
                except Terminated:
                    raise
                except KeyboardInterrupt:
                    pass
                except FastForwardError as exc:  # a method's refusal met while decoding (an option value, ...)
                    self.write("\n")
                    _say(f"error: {_one_line(exc)}")
                    return
                record = self.conversation.finish(turn)
        except Terminated:
            raise
        except KeyboardInterrupt:  # after the answer had ended: nothing to stop
            pass
        if record is None:
            return
        self.write("\n")
        if record["interrupted"]:
            _say("(stopped; the answer so far stays in the conversation)" if record["kept"] else
                 "(stopped before the answer began; the message was not kept)")
        if self.show_stats:
            _say(record["stats"].summary() + f"; prompt {record['prompt_tokens']} tokens, read "
                                             f"{record['read_prompt_tokens']}")

    # -- slash commands ----------------------------------------------------------------------------------------------
    def command(self, line: str):
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name not in self.commands:
            _say(f"error: unknown command {name}; /help lists them")
            return None
        handler = self.commands[name]
        if handler is None:
            return False
        try:
            handler(rest)
        except FastForwardError as exc:
            _say(f"error: {_one_line(exc)}")
        return None

    def help(self, rest: str) -> None:
        self.write(HELP + "\n")

    def method(self, rest: str) -> None:
        conversation = self.conversation
        if not rest:
            self.write(f"method {_method_text(conversation.method, conversation.method_options)}; available: "
                       f"{', '.join(available_methods())}\n")
            return
        name, *pairs = rest.split()
        conversation.set_method(name, parse_options(pairs))
        self.write(f"method {_method_text(conversation.method, conversation.method_options)}\n")

    def stats(self, rest: str) -> None:
        conversation = self.conversation
        last = conversation.last
        if last is None:
            self.write("no answer yet\n")
            return
        stats = last["stats"]
        context = last["prompt_tokens"] + last["new_tokens"]
        ended = "shown, then stopped" if last["interrupted"] else f"finish: {stats.finish_reason}"
        lines = [
            f"last answer: {last['new_tokens']} tokens, {ended}, method "
            f"{_method_text(last['method'], last['method_options'])}",
            f"  prompt {last['prompt_tokens']} tokens: {last['read_prompt_tokens']} read now, "
            f"{last['cached_prompt_tokens']} from earlier turns' KV entries",
            "  " + stats.summary(),
            f"conversation: {_count(len(conversation.turns), 'answer')}, {context} of "
            f"{conversation.target.max_context} "
            f"context tokens; {last['kv_kept_tokens']} tokens' KV entries kept for the next turn"
            + ("" if conversation.prefix_cache is not None else " (none: this backend re-reads the conversation)"),
        ]
        self.write("\n".join(lines) + "\n")

    def reset(self, rest: str) -> None:
        self.conversation.reset()
        self.write("(a new conversation)\n")

    def system(self, rest: str) -> None:
        conversation = self.conversation
        if not rest:
            self.write(f"system prompt: {conversation.system!r}\n" if conversation.system else "no system prompt\n")
            return
        tokens = conversation.set_system(rest)
        self.write(f"(system prompt set: the next answer reads the conversation anew, {tokens} tokens)\n")

    def save(self, rest: str) -> None:
        if not rest:
            raise UsageError("/save needs a file name: /save FILE")
        file = save_transcript(self.conversation, rest)
        self.write(f"(saved {_count(len(self.conversation.turns), 'answer')} to {file})\n")


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _one_line(exc) -> str:
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
