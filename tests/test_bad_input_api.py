"""Bad input through the Python API: each case is one clear UsageError / TypeError, raised before any model work.

(The command-line side of the suite is tests/test_bad_input_cli.py.)
"""

from __future__ import annotations

import pytest

import fastforward as ff
from fastforward.engine import SequenceRun
from fastforward.errors import UsageError
from fastforward.request import DEFAULT_METHOD

OK = [1, 2, 3]

CASES = [
    # prompts
    ("prompt None", dict(prompt=None), TypeError, "prompt"),
    ("prompt int", dict(prompt=123), TypeError, "prompt"),
    ("prompt bytes", dict(prompt=b"hello"), TypeError, "bytes"),
    ("prompt dict", dict(prompt={"role": "user"}), TypeError, "prompt"),
    ("prompt empty string", dict(prompt=""), UsageError, "empty"),
    ("prompt blank", dict(prompt="  \n "), UsageError, "empty"),
    ("prompt empty list", dict(prompt=[]), UsageError, "empty"),
    ("prompt mixed list", dict(prompt=[1, "a"]), TypeError, "token ids"),
    ("prompt bool ids", dict(prompt=[True, False]), TypeError, "token ids"),
    ("token id too large", dict(prompt=[1, 10**9]), UsageError, "out of range"),
    ("token id negative", dict(prompt=[-1, 2]), UsageError, "out of range"),
    ("prompt lone surrogate", dict(prompt="caf\udce9"), UsageError, "UTF-8"),
    ("message without content", dict(prompt=[{"role": "user"}]), UsageError, "content"),
    ("message without role", dict(prompt=[{"content": "hi"}]), UsageError, "role"),
    ("message content int", dict(prompt=[{"role": "user", "content": 5}]), UsageError, "content"),
    ("message lone surrogate", dict(prompt=[{"role": "user", "content": "\udcff"}]), UsageError, "UTF-8"),
    ("prompt over the context", dict(prompt=list(range(1, 90)) * 8), UsageError, "context"),
    ("2-D tensor prompt", dict(prompt="tensor2d"), UsageError, "one sequence"),
    ("float tensor prompt", dict(prompt="tensorfloat"), TypeError, "integer"),
    # lengths
    ("max_new_tokens 0", dict(max_new_tokens=0), UsageError, "max_new_tokens"),
    ("max_new_tokens negative", dict(max_new_tokens=-5), UsageError, "max_new_tokens"),
    ("max_new_tokens float", dict(max_new_tokens=2.5), UsageError, "max_new_tokens"),
    ("max_new_tokens bool", dict(max_new_tokens=True), UsageError, "max_new_tokens"),
    ("max_new_tokens str", dict(max_new_tokens="5"), UsageError, "max_new_tokens"),
    # sampling
    ("temperature negative", dict(temperature=-1.0), UsageError, "temperature"),
    ("temperature nan", dict(temperature=float("nan")), UsageError, "temperature"),
    ("temperature inf", dict(temperature=float("inf")), UsageError, "temperature"),
    ("temperature str", dict(temperature="hot"), TypeError, "temperature"),
    ("temperature None", dict(temperature=None), TypeError, "temperature"),
    ("top_k negative", dict(top_k=-1), UsageError, "top_k"),
    ("top_k float", dict(top_k=1.5), UsageError, "top_k"),
    ("top_p zero", dict(top_p=0.0), UsageError, "top_p"),
    ("top_p above one", dict(top_p=1.5), UsageError, "top_p"),
    ("top_p nan", dict(top_p=float("nan")), UsageError, "top_p"),
    ("temperature denormal", dict(temperature=1e-310), UsageError, "0 (greedy) or at least"),
    ("temperature smallest float", dict(temperature=5e-324), UsageError, "0 (greedy) or at least"),
    ("temperature below 1e-4", dict(temperature=5e-5), UsageError, "0 (greedy) or at least"),
    ("seed negative", dict(seed=-1), UsageError, "seed"),
    ("seed huge", dict(seed=2**64), UsageError, "seed"),
    ("seed float", dict(seed=1.5), UsageError, "seed"),
    ("seed str", dict(seed="7"), UsageError, "seed"),
    # stop strings
    ("stop int", dict(stop=123), TypeError, "stop"),
    ("stop empty", dict(stop=""), UsageError, "stop"),
    ("stop list with empty", dict(stop=["ok", ""]), UsageError, "stop"),
    ("stop list with int", dict(stop=["ok", 3]), TypeError, "stop"),
    ("stop lone surrogate", dict(stop="\udcff"), UsageError, "UTF-8"),
    # methods
    ("unknown method", dict(method="nope"), UsageError, "unknown method"),
    ("method int", dict(method=123), TypeError, "method"),
    ("unknown option", dict(method="pld", method_options={"nope": 1}), UsageError, "no option"),
    ("options not a dict", dict(method="pld", method_options="k=3"), TypeError, "method_options"),
    ("option value wrong", dict(method="pld", method_options={"max_ngram": 0}), UsageError, "max_ngram"),
    ("option type wrong", dict(method="jacobi", method_options={"n_tokens": "many"}), UsageError, "n_tokens"),
    ("lookahead window huge", dict(method="lookahead", method_options=dict(window=100000, ngram=2, guesses=1)),
     UsageError, "window"),
    ("lookahead forward too large", dict(method="lookahead", method_options=dict(window=1000, ngram=50, guesses=1000)),
     UsageError, "tokens in every forward"),
    ("lookahead forward over the context",
     dict(method="lookahead", method_options=dict(window=300, ngram=3, guesses=1)), UsageError, "at most 512"),
    ("lookahead ngram huge", dict(method="lookahead", method_options=dict(ngram=10**9)), UsageError, "ngram"),
    ("lookahead guesses huge", dict(method="lookahead", method_options=dict(guesses=10**6)), UsageError, "guesses"),
    ("tr-jacobi retrieval_len huge", dict(method="tr-jacobi", method_options=dict(retrieval_len=100000)), UsageError,
     "retrieval_len"),
    ("tr-jacobi tree of strings", dict(method="tr-jacobi", method_options=dict(tree=[["a"]])), UsageError,
     "bad tree choice"),
    ("tr-jacobi tree of ints", dict(method="tr-jacobi", method_options=dict(tree=[1, 2])), UsageError,
     "bad tree choice"),
    ("tr-jacobi tree of None", dict(method="tr-jacobi", method_options=dict(tree=[[None]])), UsageError,
     "bad tree choice"),
    ("tr-jacobi tree of floats", dict(method="tr-jacobi", method_options=dict(tree=[[0.5]])), UsageError,
     "bad tree choice"),
    ("tr-jacobi tree of digit strings", dict(method="tr-jacobi", method_options=dict(tree=[["0"]])), UsageError,
     "bad tree choice"),
    ("tr-jacobi tree of bools", dict(method="tr-jacobi", method_options=dict(tree=[[True]])), UsageError,
     "bad tree choice"),
    # the rest
    ("chat not bool", dict(chat="yes"), TypeError, "chat"),
    ("system not str", dict(system=5), TypeError, "system"),
    ("system lone surrogate", dict(system="\udcff"), UsageError, "UTF-8"),
    # settings the prompt's kind would ignore: refused, not ignored
    ("chat False with messages", dict(prompt=[{"role": "user", "content": "hi"}], chat=False), UsageError,
     "chat=False (--no-chat) cannot apply to a list of chat messages"),
    ("system with token ids", dict(system="Be brief."), UsageError, "system cannot be combined with a prompt of token"),
    ("system with messages", dict(prompt=[{"role": "user", "content": "hi"}], system="Be brief."), UsageError,
     "system cannot be combined with a list of chat messages"),
    ("system with chat False", dict(prompt="hi", system="Be brief.", chat=False), UsageError,
     "system cannot be combined with chat=False"),
    ("system without a chat template", dict(prompt="hi", system="Be brief."), UsageError,
     "system needs a chat template"),
    ("on_prefill not callable", dict(on_prefill=5), TypeError, "on_prefill"),
    ("observers an int", dict(observers=5), TypeError, "observers"),
    ("observers a list of ints", dict(observers=[5]), TypeError, "observers[0]"),
    ("observers a string", dict(observers="print"), TypeError, "observers"),
]


def call_case(entry: str, model, kwargs: dict):
    """``ff.<entry>(model, prompt, method, **rest)`` for one case of :data:`CASES` (its prompt placeholders made
    into tensors); also run by tests/test_bad_input_bounds.py in a child process."""
    import torch

    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", OK)
    if prompt == "tensor2d":
        prompt = torch.tensor([[1, 2], [3, 4]])
    elif prompt == "tensorfloat":
        prompt = torch.tensor([1.0, 2.0])
    method = kwargs.pop("method", "ar")
    return getattr(ff, entry)(model, prompt, method, **kwargs)


@pytest.mark.parametrize(("name", "kwargs", "error", "words"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("entry", ["generate", "stream"])
def test_bad_api_input(tiny, monkeypatch, entry, name, kwargs, error, words):
    started = []
    monkeypatch.setattr(SequenceRun, "prefill", lambda self: started.append(1) or [])
    with pytest.raises(error) as info:
        call_case(entry, tiny, kwargs)
    message = str(info.value)
    assert words.lower() in message.lower() and "\n" not in message and len(message) < 300
    assert isinstance(info.value, UsageError)  # every bad input is also a UsageError: one line on the CLI
    assert not started  # nothing ran


@pytest.mark.parametrize(
    ("model", "error", "words"),
    [
        (123, TypeError, "model"),
        (None, TypeError, "model"),
        ("", UsageError, "empty"),
        ("/no/such/model", ff.ModelNotFoundError, "unknown model"),
    ],
)
def test_bad_model_argument(model, error, words):
    with pytest.raises(error, match=words):
        ff.generate(model, "hi") if model is not None else ff.generate(None, "hi")
    if isinstance(model, str):
        with pytest.raises(error, match=words):
            ff.load(model)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(threads=0), "threads"),
        (dict(threads="2"), "threads"),
        (dict(weights="fp8"), "weights"),
        (dict(backend="gpu"), "backend"),
    ],
)
def test_bad_load_options(kwargs, words):
    with pytest.raises(UsageError, match=words):
        ff.load("default", **kwargs)


def test_load_rejects_a_non_path():
    with pytest.raises(TypeError, match="model"):
        ff.load(123)


def test_settings_beside_a_generation_request_are_refused(tiny, monkeypatch):
    """A GenerationRequest carries every setting of its own: an argument given beside it was silently ignored."""
    started = []
    monkeypatch.setattr(SequenceRun, "prefill", lambda self: started.append(1) or [])
    request = ff.GenerationRequest(OK, max_new_tokens=4)
    cases = [
        (lambda: ff.generate(tiny, request, max_new_tokens=5), "max_new_tokens given beside a GenerationRequest"),
        (lambda: ff.stream(tiny, request, "pld"), "method given beside"),
        (lambda: ff.generate(tiny, request, temperature=0.5, seed=3), "temperature, seed given beside"),
        (lambda: ff.generate(tiny, request, temperature=0), "temperature given beside"),
        (lambda: ff.generate(tiny, request, chat=False, system="x", stop="\n", method_options={}),
         "stop, chat, system, method_options given beside"),
        (lambda: ff.generate_batch(tiny, [[4, 5], request], top_k=3), "top_k given beside a GenerationRequest as the "
                                                                        "prompts[1]"),
        (lambda: ff.generate_batch(tiny, [request, [4, 5]], method=["pld", "ar"]), "as the prompts[0]"),
    ]
    for call, words in cases:
        with pytest.raises(UsageError) as info:
            call()
        message = str(info.value)
        assert words in message and "\n" not in message, message
    assert not started
    monkeypatch.undo()
    # arguments that are not the request's settings still apply; so do per-prompt ones for the other prompts
    seen = []
    result = ff.generate(tiny, request, observers=[lambda state, step: seen.append(step)], on_prefill=lambda d, t: 0)
    assert len(result.token_ids) == 4 and seen
    results = ff.generate_batch(tiny, [request, [4, 5]], method=[DEFAULT_METHOD, "pld"], seed=[None, 7],
                                max_batch_tokens=16)
    assert len(results[0].token_ids) == 4


def test_request_defaults_are_the_signature_defaults():
    """The defaults a left-out argument is recognised by are the ones stream and generate_batch declare."""
    import inspect

    from fastforward.api import REQUEST_DEFAULTS

    for function in (ff.stream, ff.generate_batch):
        params = inspect.signature(function).parameters
        assert {name: params[name].default for name in REQUEST_DEFAULTS} == REQUEST_DEFAULTS, function.__name__


def test_huge_max_new_tokens_is_bounded_by_the_context(tiny):
    """10**20 new tokens is a valid request: generation stops at the context, nothing is allocated for 10**20."""
    result = ff.generate(tiny, [1, 2, 3], max_new_tokens=10**20)
    assert result.finish_reason in ("context", "eos") and len(result.token_ids) < tiny.max_context


@pytest.mark.parametrize(("observers", "error", "words"), [
    ([5, 5], TypeError, "observers[0]"),
    (5, TypeError, "observers"),
    ((5,), TypeError, "observers[0]"),
    ([(print,), (5,)], TypeError, "observers[1][0]"),
    ([()], UsageError, "1 entries for 2 prompts"),
])
def test_bad_batch_observers(tiny, monkeypatch, observers, error, words):
    started = []
    monkeypatch.setattr(SequenceRun, "prefill", lambda self: started.append(1) or [])
    with pytest.raises(error) as info:
        ff.generate_batch(tiny, [OK, [4, 5]], observers=observers, max_new_tokens=4)
    message = str(info.value)
    assert words in message and "\n" not in message
    assert isinstance(info.value, UsageError) and not started


def test_observers_still_run(tiny):
    seen = []
    ff.generate(tiny, OK, observers=[lambda state, step: seen.append(step)], max_new_tokens=4)
    assert seen
    ff.generate_batch(tiny, [OK, [4, 5]], observers=(lambda state, step: seen.append(step),), max_new_tokens=4)
    assert len(seen) > 4


@pytest.mark.parametrize(("files", "words"), [
    ({"config.json": '{"model_type": "llama"}'}, "has no tokenizer"),
    ({"config.json": "{not json"}, "config.json is not valid JSON"),
    ({"config.json": "[1, 2]"}, "config.json is not a JSON object"),
    ({"config.json": '{"model_type": "llama"}', "tokenizer.json": "{}"}, "has no weights"),
    ({"config.json": '{"model_type": "llama", "fastforward": {"kind": "eagle3"}}'}, "drafter (kind eagle3)"),
    ({}, "has no config.json"),
    ({"model.safetensors": "x", "tokenizer.json": "{}"}, "has no config.json"),
    ({"model.Q4_0.gguf": "x"}, "holds model.Q4_0.gguf: give the .gguf file itself"),
], ids=["config only", "config not JSON", "config not an object", "no weights", "an EAGLE drafter", "empty",
        "no config", "a GGUF inside"])
def test_load_refuses_a_folder_that_is_not_a_model(tmp_path, files, words):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(ff.ModelNotFoundError) as info:
        ff.load(str(folder))
    message = str(info.value)
    assert words in message and str(folder) in message and "\n" not in message


def test_temperature_1e_4_still_samples(tiny):
    assert len(ff.generate(tiny, OK, temperature=1e-4, seed=0, max_new_tokens=4).token_ids) == 4
