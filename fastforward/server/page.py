"""The page at ``/``: plain HTML and JavaScript (``page.html``, package data), served by the same process, no build
step.

A prompt, two method pickers (each with its options as JSON), and both answers streaming side by side from
``/v1/chat/completions`` (with ``"fastforward": {"trace": true}``, so every chunk says which tokens it holds and how
each came): a token produced by the target's own forward is plain, a token drafted and accepted at depth d is
coloured by d. Live tau (tokens per target forward) and tokens/s above each answer; the final statistics below.
"""

from importlib.resources import files

#: the page's HTML, read once from the package
PAGE = files(__package__).joinpath("page.html").read_text(encoding="utf-8")
