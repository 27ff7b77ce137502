"""Every decoding method's options have one schema (type, range or allowed set, default, description), and the CLI,
the API, the server and the benchmark check values against it before any work: an out-of-range value is one line
naming the option and its range. Every numeric option has a finite upper bound, with what it is derived from.

The reproductions of issue 42 (item 1) are here: ``pld`` ``max_ngram=1000000000`` was killed at 22.8 GB,
``tr-jacobi`` ``ngram`` had no upper bound, and ``jacobi`` ``n_tokens`` escaped the engine's 1,024 rows per forward
(4000 ran for minutes; 10**10 was an internal error, a raw RuntimeError or an HTTP 500)."""

from __future__ import annotations

import json
import math

import pytest
from cli_helpers import one_line_exit_2, run_cli

import fastforward as ff
from fastforward.proposers import available_methods, check_method_options, make_proposer
from fastforward.proposers._options import KINDS, Option
from fastforward.validation import MAX_PROPOSAL_ROWS

ALL = ["ar", "jacobi", "pld", "rest", "lookahead", "tr-jacobi", "eagle", "sps", "fasteagle", "falcon", "pasta"]
METHODS = available_methods()
NUMERIC = [(m, o) for m in ALL for o in METHODS[m].schema if o.numeric]
PROMPT = "Repeat: the cat sat on the mat. the cat sat on the mat."


def _one_line_usage_error(call) -> str:
    with pytest.raises(ff.UsageError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    return message


# --------------------------------------------------------------------------------------------------------------
# The schema itself
# --------------------------------------------------------------------------------------------------------------


def test_every_method_is_registered_with_a_schema():
    assert set(ALL) <= set(METHODS)
    assert all(METHODS[m].schema for m in ALL if m != "ar")


@pytest.mark.parametrize("method", ALL)
def test_the_schema_and_the_factory_never_drift(method):
    """The factory's keyword-only parameters (the defaults' source of truth) are the schema's options, in order,
    with the same defaults."""
    info = METHODS[method]
    assert [o.name for o in info.schema] == list(info.options())
    assert {o.name: o.default for o in info.schema} == info.options()
    for option in info.schema:
        assert option.kind in KINDS and option.help, option
        assert option.check(method, option.default) == option.default  # every default passes its own schema


@pytest.mark.parametrize("method,option", NUMERIC, ids=[f"{m}.{o.name}" for m, o in NUMERIC])
def test_every_number_has_a_finite_bound_and_just_above_it_is_refused(method, option):
    assert math.isfinite(option.high) and option.bound
    at = math.nextafter(option.high, -math.inf) if option.high_open else option.high
    assert option.check(method, at) == at  # the bound itself (or just under an open one) is allowed
    above = option.high if option.high_open else (option.high + 1 if option.kind == "int"
                                                   else math.nextafter(option.high, math.inf))
    message = _one_line_usage_error(lambda: check_method_options(method, {option.name: above}))
    assert message.startswith(f"{method}: option {option.name} must be ")
    assert f"[{option.low}, {option.high}" in message, message
    below = option.low - 1
    if below not in option.special:
        _one_line_usage_error(lambda: check_method_options(method, {option.name: below}))


def test_bounds_that_count_rows_stay_within_the_engine():
    """Options whose bound is the rows of a forward never allow more than the engine's cap on their own."""
    for method, option in NUMERIC:
        if option.bound.startswith("rows per forward"):
            assert option.high <= MAX_PROPOSAL_ROWS, (method, option.name)


WRONG = [True, 2.5, "3", None, [3], float("nan"), 10**5000]


@pytest.mark.parametrize("value", WRONG, ids=["bool", "float", "str", "None", "list", "nan", "5000 digits"])
def test_wrong_types_are_one_line(value):
    message = _one_line_usage_error(lambda: check_method_options("pld", {"max_ngram": value}))
    assert "max_ngram must be an integer in [1, 32]" in message


def test_floats_bools_choices_and_paths():
    for value in (1, 1.0, -0.1, float("inf"), float("nan"), "0.1", True):
        message = _one_line_usage_error(lambda v=value: check_method_options("eagle", {"min_prob": v}))
        assert "min_prob must be a number in [0, 1)" in message
    assert check_method_options("eagle", {"min_prob": 0}) and check_method_options("eagle", {"min_prob": 0.99})
    assert "blocks must be True or False" in _one_line_usage_error(lambda: check_method_options("jacobi",
                                                                                                {"blocks": 1}))
    assert "init must be one of prompt, noise, pad" in _one_line_usage_error(
        lambda: check_method_options("jacobi", {"init": ["prompt"]}))
    assert "drafter must be a path" in _one_line_usage_error(lambda: check_method_options("eagle", {"drafter": 3}))
    check_method_options("tr-jacobi", {"tree": [[0], [1]]})  # a tree given inline, not as a file
    check_method_options("sps", {"k": None})  # None: the draft length is chosen each step


def test_special_values_and_checks_across_options():
    check_method_options("lookahead", {"window": 0, "ngram": 0, "guesses": 0})  # 0: sized by the cost curve
    assert "ngram must be an integer in [2, 62] or 0, got 1" in _one_line_usage_error(
        lambda: check_method_options("lookahead", {"ngram": 1}))
    assert "nodes must be an integer in [2, 256] or 0, got 1" in _one_line_usage_error(
        lambda: check_method_options("rest", {"nodes": 1}))
    assert "min_ngram (4) cannot exceed max_ngram (3)" in _one_line_usage_error(
        lambda: check_method_options("pld", {"min_ngram": 4}))
    assert "min_ngram (5) cannot exceed ngram (2)" in _one_line_usage_error(
        lambda: check_method_options("tr-jacobi", {"ngram": 2, "min_ngram": 5}))
    assert "needs blocks=True" in _one_line_usage_error(
        lambda: check_method_options("jacobi", {"record_trajectory": True, "blocks": False}))
    assert "needs learn=True" in _one_line_usage_error(lambda: check_method_options("rest", {"datastore": "none"}))


def test_lookahead_rows_multiply_and_their_product_is_bounded():
    """Each size alone is within its bound, but together they would put more rows in a forward than the engine
    holds: refused before the model is loaded. A size left at 0 counts as the smallest the cost curve gives."""
    message = _one_line_usage_error(lambda: check_method_options("lookahead", {"window": 1023, "ngram": 62,
                                                                               "guesses": 1023}))
    assert "tokens in every forward; at most 1024" in message
    message = _one_line_usage_error(lambda: check_method_options("lookahead", {"window": 600, "guesses": 600}))
    assert "tokens in every forward" in message
    check_method_options("lookahead", {"window": 1023, "ngram": 2, "guesses": 1})  # exactly 1,024 rows


def test_a_value_shown_in_an_error_is_cut_short():
    message = _one_line_usage_error(lambda: check_method_options("jacobi", {"init": "x" * 100_000}))
    assert len(message) < 200


# --------------------------------------------------------------------------------------------------------------
# The reproductions of issue 42, through every entry point
# --------------------------------------------------------------------------------------------------------------

REPRODUCTIONS = [
    ("pld", "max_ngram=1000000000", "pld: option max_ngram must be an integer in [1, 32], got 1000000000"),
    ("tr-jacobi", "ngram=1000000000", "tr-jacobi: option ngram must be an integer in [1, 32], got 1000000000"),
    ("jacobi", "n_tokens=4000", "jacobi: option n_tokens must be an integer in [2, 1024], got 4000"),
    ("jacobi", "n_tokens=10000000000", "jacobi: option n_tokens must be an integer in [2, 1024], got 10000000000"),
    ("jacobi", "n_tokens=10**10", "jacobi: option n_tokens must be an integer in [2, 1024], got '10**10'"),
]


@pytest.mark.parametrize("method,option,words", REPRODUCTIONS, ids=[f"{m} {o}" for m, o, _ in REPRODUCTIONS])
def test_generate_refuses_before_loading_the_model(no_load, capsys, method, option, words):
    line = one_line_exit_2(capsys, "generate", PROMPT, "--method", method, "-o", option, "--max-new-tokens", "16")
    assert words in line, line


@pytest.mark.parametrize("method,option,words", REPRODUCTIONS[:3], ids=[f"{m} {o}" for m, o, _ in REPRODUCTIONS[:3]])
def test_bench_refuses_before_loading_the_model(no_load, capsys, tmp_path, method, option, words):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["hi"]}) + "\n")
    line = one_line_exit_2(capsys, "bench", "--questions", questions, "--methods", f"{method}:{option}",
                           "--out", tmp_path / "out", "--no-progress")
    assert words.split(": ", 1)[1] in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method,options", [
    ("pld", {"max_ngram": 10**9}),
    ("tr-jacobi", {"ngram": 10**9}),
    ("jacobi", {"n_tokens": 4000}),
    ("jacobi", {"n_tokens": 10**10}),
    ("lookahead", {"window": 1000, "ngram": 50, "guesses": 1000}),
])
def test_the_api_refuses_before_any_work(tiny, method, options):
    """A UsageError (not a RuntimeError, nor minutes of decoding, nor gigabytes), from the request alone and from
    ff.generate on a model."""
    name = next(iter(options))
    assert name in _one_line_usage_error(lambda: ff.GenerationRequest(PROMPT, method, method_options=options))
    assert name in _one_line_usage_error(lambda: make_proposer(method, tiny, **options))
    assert name in _one_line_usage_error(lambda: ff.generate(tiny, [1, 2, 3], method, max_new_tokens=4,
                                                             method_options=options))


def test_rows_against_the_models_context(tiny):
    """Within the engine's cap but beyond the model's context (512): refused once the model is known."""
    assert "at most 512" in _one_line_usage_error(lambda: make_proposer("jacobi", tiny, n_tokens=600))
    assert "at most 512" in _one_line_usage_error(lambda: make_proposer("pld", tiny, num_pred_tokens=600))
    assert make_proposer("jacobi", tiny, n_tokens=512).max_proposal_size() == 512


# --------------------------------------------------------------------------------------------------------------
# fastforward methods
# --------------------------------------------------------------------------------------------------------------


def test_methods_lists_every_option_with_its_range_and_bound(capsys):
    code, out, err = run_cli(capsys, "methods")
    assert code == 0 and not err
    assert "max_ngram=3: an integer in [1, 32]" in out
    assert "n_tokens=16: an integer in [2, 1024]" in out
    assert "window=0: an integer in [1, 1023] or 0" in out
    assert "init='prompt': one of prompt, noise, pad" in out
    for _, option in NUMERIC:
        assert f"bound {option.high}: " in out
    code, out, _ = run_cli(capsys, "methods", "--json")
    data = json.loads(out)
    assert data["pld"]["options"]["max_ngram"] == 3  # {name: default}, as before
    schema = data["pld"]["schema"]["max_ngram"]
    assert (schema["kind"], schema["low"], schema["high"], schema["default"]) == ("int", 1, 32, 3)
    assert schema["bound"].startswith("memory") and schema["help"]
    assert data["tr-jacobi"]["schema"]["tree"]["kind"] == "path"


def test_an_option_must_state_its_bound():
    with pytest.raises(ValueError, match="upper bound"):
        Option("n", "int", 1, 1, 10)
    with pytest.raises(ValueError, match="finite"):
        Option("n", "int", 1, 1, math.inf, bound="none")
    with pytest.raises(ValueError, match="kind"):
        Option("n", "number", 1)
