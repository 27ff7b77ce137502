"""API keys at the door of ``fastforward serve`` (``--api-key KEY``, ``--api-key-file FILE``), as llama-server and vLLM
spell them.

With keys, every path but the page (``/``) and ``/health`` -- every ``/v1/*`` route, ``/metrics``, unknown paths --
needs ``Authorization: Bearer KEY``; anything else (no header, a wrong key, another scheme, a malformed header) is an
OpenAI-shaped 401 (``code: invalid_api_key``, ``WWW-Authenticate: Bearer``) before the request is read. A presented
key is compared with every key of the server in constant time (:func:`hmac.compare_digest` over SHA-256 digests, so
neither which key matched nor how long a key is shows in the timing), and is never logged, echoed in an error or
counted in a metric: the server knows a client by the number of its key (``key 3``), never by the key itself.

:func:`load_keys` checks the keys the command line gives before the model loads: one line and exit code 2 for a
missing, unreadable, oversized or empty file, or a key that could not travel in a header (messages name the line,
never the key).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from ..errors import UsageError

#: the longest key taken (OpenAI's keys are ~170 characters)
MAX_KEY_CHARS = 512
#: the most keys a server takes, and the largest key file it reads
MAX_KEYS = 10_000
MAX_KEY_FILE_BYTES = 1 << 20
#: the paths anyone may read when the server has keys: the page (which asks for the key) and the liveness probe
OPEN_PATHS = ("/", "/health")


def _key_problem(key: str) -> str | None:
    if not key:
        return "is empty"
    if len(key) > MAX_KEY_CHARS:
        return f"is longer than {MAX_KEY_CHARS} characters"
    if not all(33 <= ord(c) < 127 for c in key):
        return "holds a space, a control character or a non-ASCII character (a key travels in an HTTP header)"
    return None


def load_keys(keys: list[str] | tuple[str, ...] = (), key_file: str | None = None) -> tuple[str, ...]:
    """The server's keys: ``keys`` (``--api-key``, repeatable) and the lines of ``key_file`` (``--api-key-file``:
    one key a line; blank lines and lines starting with ``#`` are skipped), in order, duplicates once. Raises a
    one-line :class:`UsageError` that never shows a key."""
    out: list[str] = []
    for i, key in enumerate(keys, 1):
        problem = _key_problem(key)
        if problem:
            raise UsageError(f"--api-key (the {_ordinal(i)} one) {problem}")
        out.append(key)
    if key_file is not None:
        out += _read_key_file(key_file)
    if len(set(out)) > MAX_KEYS:
        raise UsageError(f"{len(set(out))} API keys; a server takes at most {MAX_KEYS}")
    return tuple(dict.fromkeys(out))


def _read_key_file(path: str) -> list[str]:
    where = f"--api-key-file {path}"
    if not path.strip():
        raise UsageError("--api-key-file is empty; give a file with one key a line")
    if not os.path.exists(path):
        raise UsageError(f"{where}: no such file")
    if not os.path.isfile(path):
        raise UsageError(f"{where}: not a regular file")
    try:
        size = os.path.getsize(path)
        if size > MAX_KEY_FILE_BYTES:
            raise UsageError(f"{where}: {size} bytes; a key file is at most {MAX_KEY_FILE_BYTES} bytes")
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UsageError(f"{where}: line {line} holds a byte that is not ASCII (a key travels in an HTTP header)") \
            from None
    keys = []
    for number, line in enumerate(text.split("\n"), 1):
        key = line.strip(" \t\r")
        if not key or key.startswith("#"):
            continue
        problem = _key_problem(key)
        if problem:
            raise UsageError(f"{where}: the key on line {number} {problem}")
        keys.append(key)
    if not keys:
        raise UsageError(f"{where}: holds no key (one key a line; blank lines and # comments are skipped)")
    return keys


def _ordinal(i: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(i, f"{i}th")


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class APIKeys:
    """The server's keys, kept as SHA-256 digests: :meth:`client` says which key an ``Authorization`` header
    carries."""

    def __init__(self, keys: tuple[str, ...] | list[str]):
        for key in keys:
            problem = _key_problem(key)
            if problem:
                raise UsageError(f"an API key {problem}")
        self._digests = [_digest(key.encode("ascii")) for key in dict.fromkeys(keys)]

    def __len__(self) -> int:
        return len(self._digests)

    def client(self, headers: list[bytes]) -> tuple[int | None, str]:
        """(the number of the key, from 1; None when refused, then the reason) for the ``Authorization`` header
        values of a request. Every key is compared, whichever matches, each in constant time."""
        if not headers:
            return None, "no API key: send the header 'Authorization: Bearer KEY'"
        if len(headers) > 1:
            return None, "more than one Authorization header"
        scheme, _, token = headers[0].strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token or b" " in token:
            return None, "the Authorization header must be 'Bearer KEY'"
        presented = _digest(token)
        found = None
        for number, digest in enumerate(self._digests, 1):
            if hmac.compare_digest(presented, digest) and found is None:
                found = number
        if found is None:
            return None, "incorrect API key"
        return found, ""


def needs_key(path: str) -> bool:
    """Whether ``path`` is one a server with keys answers only with a key: all but :data:`OPEN_PATHS`."""
    return path not in OPEN_PATHS
