"""``fastforward chat``: every turn's tokens are ``ar``'s on the same conversation, each turn reads only its new tokens
(counted: the prompt tokens a turn prefilled), Ctrl-C keeps what was shown, slash commands and bad input go on in one
line -- in this process, and through a pseudo-terminal (pexpect) with a child that loads a tiny chat model by path."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import sys

import pytest
import torch
from cli_helpers import one_line_exit_2
from tiny_chat_model import write_tiny_chat_gguf

import fastforward as ff
from fastforward import kernels
from fastforward.api import REQUEST_DEFAULTS
from fastforward.cli import build_parser
from fastforward.cli.chat import DEFAULT_METHOD, TRANSCRIPT_KEY, Conversation, Terminal
from fastforward.testing import tiny_hf_folder, tiny_target

MESSAGES = ["hello there", "what is up", "tell me more"]



def ctrl_c_as_in_a_terminal():
    """In the chat's child, before it starts: SIGINT at its default, as a shell's terminal gives it (a test run
    started in the background inherits SIGINT ignored, which a child would keep); and the terminal's NOFLSH on: on
    Ctrl-C the line discipline otherwise discards output written but not yet read by the other end (here pexpect),
    so what the test reads could lack the last characters the chat showed."""
    import signal
    import termios

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        attrs = termios.tcgetattr(1)
        attrs[3] |= termios.NOFLSH  # lflag
        termios.tcsetattr(1, termios.TCSANOW, attrs)
    except termios.error:  # not a terminal: nothing is flushed
        pass

def _load(path):
    from fastforward.costs import CostCurve, CostModel, set_cost_model

    target = ff.load(str(path))
    if kernels.load_native() is None or target.batch_rows_limit() < 256:
        pytest.skip("the native kernels are not available: no exact reuse of KV entries to test")
    # methods that size drafts by the cost curve draft here whatever this machine's (none is measured: a test's
    # outputs never depend on timings, and these are ar's whatever is drafted)
    set_cost_model(target, CostModel(CostCurve({1: 10.0, 64: 73.0}), learn=False))
    return target


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_tiny_chat_gguf(tmp_path_factory.mktemp("chat") / "chat.gguf")


@pytest.fixture(scope="module")
def chat(chat_file):
    """The tiny chat model: answers of printable ASCII that end with EOS."""
    return _load(chat_file)


@pytest.fixture(scope="module")
def endless_file(tmp_path_factory):
    return write_tiny_chat_gguf(tmp_path_factory.mktemp("endless") / "endless.gguf", eos=False, max_positions=4096)


@pytest.fixture(scope="module")
def endless(endless_file):
    """The same without EOS: every answer runs to its budget (time to stop one in the middle)."""
    return _load(endless_file)


@pytest.fixture(scope="module")
def eagle_drafter(chat, tmp_path_factory):
    """A random EAGLE-3 drafter for the tiny chat model: it drafts from the target's taps, which a turn reuses."""
    from fastforward.drafters.checkpoint import save_eagle3
    from fastforward.drafters.eagle import Eagle3Drafter
    from fastforward.drafters.vocab import DraftVocab

    vocab = DraftVocab.from_target_ids(torch.arange(200), 260)
    drafter = Eagle3Drafter.for_target(chat, vocab, seed=0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("eagle")
    save_eagle3(drafter, folder, dtype="float32")
    return str(folder)


def talk(conversation: Conversation, messages, stop_after: dict | None = None) -> list[dict]:
    """Each message's answer in turn (``stop_after``: message index -> stop that answer after so many deltas);
    the records."""
    records = []
    for i, message in enumerate(messages):
        turn = conversation.start(message)
        try:
            for n, _ in enumerate(turn, 1):
                if stop_after and n == stop_after.get(i):
                    turn.stop()  # as Ctrl-C: the answer stops at its next step
        except KeyboardInterrupt:
            assert turn.stopped_at_a_step
        records.append(conversation.finish(turn))
    return records


def ar_tokens(target, conversation: Conversation, upto: int, **settings) -> list[int]:
    """What ``ar`` gives the conversation up to (and with) user message ``upto`` (0-based, counting kept turns)."""
    system = [{"role": "system", "content": conversation.system}] if conversation.system else []
    messages = system + conversation.messages[: 2 * upto + 1]
    return ff.generate(target, messages, "ar", **settings).token_ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_reads_only_new_tokens(target, conversation: Conversation, records, exact: bool = True):
    """Each turn after the first reads only what the turns before left unread: its prompt less the longest prefix it
    shares with the turn before's prompt and answer, whose entries were kept (all of them but an answer's last
    token when it was decoded but never fed -- the bonus token of the last step, not one accepted from a draft --;
    all of a stopped answer's shown tokens). ``exact``: the answers' text encodes back to their tokens (the tiny
    chat model's greedy ASCII), so that prefix is the whole turn before."""
    system = [{"role": "system", "content": conversation.system}] if conversation.system else []
    for i, (before, turn) in enumerate(zip(records, records[1:], strict=False)):
        whole = before["prompt_tokens"] + before["new_tokens"]
        if before["interrupted"]:
            assert before["kv_kept_tokens"] >= whole, before
        else:
            assert before["kv_kept_tokens"] in (whole - 1, whole), before
        kept = min(before["kv_kept_tokens"], whole)
        prompt_before = target.encode(system + conversation.messages[: 2 * i + 1])
        prompt = target.encode(system + conversation.messages[: 2 * i + 3])
        assert (len(prompt_before), len(prompt)) == (before["prompt_tokens"], turn["prompt_tokens"])
        shared = common_prefix(prompt, (prompt_before + before["token_ids"])[:kept])
        assert turn["cached_prompt_tokens"] == shared, (i, before, turn)
        assert turn["read_prompt_tokens"] == turn["prompt_tokens"] - shared
        if exact:
            assert shared == kept and turn["read_prompt_tokens"] < turn["prompt_tokens"] / 2


# ----------------------------------------------------------------------------------------------------------------
# In this process
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,options,sampling", [
    ("ar", {}, {}),
    ("pld", {}, {}),
    ("lookahead", {}, {}),
    ("jacobi", {"n_tokens": 4}, {}),
    ("eagle", "drafter", {}),
    ("ar", {}, {"temperature": 1.0, "seed": 3}),
    ("pld", {}, {"temperature": 0.8, "top_k": 20, "seed": 5}),
])
def test_turns_equal_ar_and_read_only_their_new_tokens(chat, eagle_drafter, method, options, sampling):
    options = {"drafter": eagle_drafter} if options == "drafter" else options
    settings = dict(max_new_tokens=40, **sampling)
    conversation = Conversation(chat, method=method, method_options=options, **settings)
    records = talk(conversation, MESSAGES)
    assert len(conversation.messages) == 2 * len(MESSAGES)
    for i, record in enumerate(records):
        assert record["token_ids"] == ar_tokens(chat, conversation, i, **settings), (method, i)
        assert record["assistant"] == conversation.messages[2 * i + 1]["content"] == chat.decode(record["token_ids"])
    assert records[0]["cached_prompt_tokens"] == 0
    assert_reads_only_new_tokens(chat, conversation, records, exact=not sampling)


def test_a_system_prompt_and_a_reset(chat):
    conversation = Conversation(chat, system="be brief", max_new_tokens=24)
    records = talk(conversation, MESSAGES[:2])
    assert records[1]["token_ids"] == ar_tokens(chat, conversation, 1, max_new_tokens=24)
    assert_reads_only_new_tokens(chat, conversation, records)
    first = records[0]
    conversation.reset()
    assert conversation.messages == [] and conversation.system == "be brief"
    again = talk(conversation, MESSAGES[:1])[0]
    assert again["token_ids"] == first["token_ids"]  # the same conversation again: the same answer
    assert again["cached_prompt_tokens"] == first["prompt_tokens"] - 1  # read: only the prompt's last token
    conversation.set_system("be long")
    changed = talk(conversation, MESSAGES[1:2])[0]
    assert changed["token_ids"] == ar_tokens(chat, conversation, 1, max_new_tokens=24)


def test_a_stopped_answer_stays_as_shown(endless):
    conversation = Conversation(endless, max_new_tokens=300)
    records = talk(conversation, MESSAGES, stop_after={1: 7})
    stopped = records[1]
    assert stopped["interrupted"] and stopped["kept"] and stopped["finish_reason"] == "interrupted"
    assert 7 <= stopped["new_tokens"] < 300
    assert conversation.messages[3]["content"] == stopped["assistant"] == endless.decode(stopped["token_ids"])
    full = ar_tokens(endless, conversation, 1, max_new_tokens=300)
    assert full[: stopped["new_tokens"]] == stopped["token_ids"]  # what was shown: ar's answer, cut
    assert records[2]["token_ids"] == ar_tokens(endless, conversation, 2, max_new_tokens=300)
    assert_reads_only_new_tokens(endless, conversation, records)


def test_a_stop_before_anything_was_shown_keeps_nothing(endless):
    conversation = Conversation(endless, max_new_tokens=50)
    turn = conversation.start("hello")
    turn.stop()  # asked before the prefill's end: stops there
    stopped = False
    try:  # (not pytest.raises: pytest takes a KeyboardInterrupt for the user's)
        next(iter(turn))
    except KeyboardInterrupt:
        stopped = True
    assert stopped and turn.shown == []
    record = conversation.finish(turn)
    assert record["interrupted"] and not record["kept"] and conversation.messages == []
    assert record["kv_kept_tokens"] == 0


def test_without_exact_reuse_every_turn_reads_the_conversation(tmp_path):
    """Dense fp32 weights are not row-exact over a whole prefill chunk: no prefix cache, every turn reads the whole
    conversation -- and still equals ar."""
    target = ff.load(str(tiny_hf_folder(tmp_path / "hf")))
    conversation = Conversation(target, max_new_tokens=16)
    assert conversation.prefix_cache is None
    records = talk(conversation, MESSAGES)
    for i, record in enumerate(records):
        assert record["cached_prompt_tokens"] == 0 and record["read_prompt_tokens"] == record["prompt_tokens"]
        assert record["token_ids"] == ar_tokens(target, conversation, i, max_new_tokens=16)


def test_the_default_method_is_the_librarys():
    assert DEFAULT_METHOD == REQUEST_DEFAULTS["method"] == inspect.signature(ff.generate).parameters["method"].default
    args = build_parser("chat").parse_args(["chat"])
    assert args.method == DEFAULT_METHOD


# ----------------------------------------------------------------------------------------------------------------
# The terminal loop, in this process
# ----------------------------------------------------------------------------------------------------------------


def terminal(conversation, lines: list[str]):
    out = io.StringIO()
    Terminal(conversation, stdin=io.StringIO("".join(line + "\n" for line in lines)), stdout=out).loop()
    return out.getvalue()


def test_slash_commands_and_bad_input_go_on(chat, capsys, tmp_path):
    conversation = Conversation(chat, max_new_tokens=24)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("mine\n")
    out = terminal(conversation, [
        "hello there", "/stats", "/bogus", "/method nope", "/method pld max_ngram=0", "/method pld no_such=1",
        "/method pld num_pred_tokens=4", "what is up", "/stats", f"/save {foreign}", f"/save {tmp_path}",
        f"/save {tmp_path / 'no' / 'x.json'}", "/save", f"/save {tmp_path / 'chat.json'}", "//slash first",
        f"/save {tmp_path / 'chat.json'}", "/system", "/system be brief", "/system", "/help", "/exit", "never read",
    ])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert [e.split(";")[0].split(":")[1].strip() for e in errors[:2]] == ["unknown command /bogus",
                                                                           "unknown method 'nope'"]
    assert len(errors) == 8, err  # each bad command: one line, and the chat went on
    assert all("Traceback" not in line for line in err.splitlines())
    assert "max_ngram" in errors[2] and "no_such" in errors[3]
    assert "was not written by fastforward" in errors[4] and foreign.read_text() == "mine\n"
    assert "is a folder" in errors[5] and "does not exist" in errors[6] and "/save needs a file name" in errors[7]
    assert out.count("> ") >= 20 and "method pld num_pred_tokens=4" in out
    assert out.count(" read now, ") == 2  # /stats, twice
    assert "never read" not in out and conversation.method == "pld"
    assert [m["content"] for m in conversation.messages[::2]] == ["hello there", "what is up", "/slash first"]
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert next(iter(saved)) == TRANSCRIPT_KEY  # how /save knows a file it may overwrite
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 3
    assert [t["method"] for t in saved["turns"]] == [DEFAULT_METHOD, "pld", "pld"]
    assert saved["turns"][1]["read_prompt_tokens"] < saved["turns"][1]["prompt_tokens"]
    assert "system prompt: 'be brief'" in out and conversation.system == "be brief"
    assert "/method" in out and "/save FILE" in out  # /help


def test_eof_leaves_and_an_overlong_conversation_is_one_line(chat, capsys):
    conversation = Conversation(chat, max_new_tokens=8)
    assert terminal(conversation, []).endswith("> \n")  # EOF at the prompt: a newline, and out
    long_message = "x" * (chat.max_context + 10)
    terminal(conversation, [long_message, "hello"])
    err = capsys.readouterr().err
    assert "no longer fits" in err and "/reset" in err and len(conversation.messages) == 2


@pytest.mark.parametrize("argv,match", [
    (["--temperature", "-1"], "temperature"),
    (["--method", "nope"], "unknown method"),
    (["-o", "bogus=1"], "bogus"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--seed", "x"], "--seed"),
    (["--top-p", "2"], "top_p"),
    (["--system", "\udcff"], "UTF-8"),
    (["--model", "/no/such.gguf"], "unknown model"),
])
def test_bad_options_are_one_line_before_the_model_loads(capsys, no_load, argv, match):
    one_line_exit_2(capsys, "chat", *argv, match=match)


def test_a_model_without_a_chat_template_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(ff, "load", lambda *a, **k: tiny_target())
    line = one_line_exit_2(capsys, "chat", match="no chat template")
    assert "generate --no-chat" in line


# ----------------------------------------------------------------------------------------------------------------
# Through a pseudo-terminal: a child `fastforward chat` loading the model by path
# ----------------------------------------------------------------------------------------------------------------

PROMPT = "\r\n> "
STATS = re.compile(r"last answer: (\d+) tokens, .*?prompt (\d+) tokens: (\d+) read now, (\d+) from earlier", re.S)


def test_chat_in_a_terminal(endless, endless_file, tmp_path):
    """Three turns and a fourth, /stats, /save, Ctrl-C in the middle of the third answer: the second turn reads only
    its new tokens, the stopped answer stays in the conversation as shown, every answer is ar's on the conversation
    before it (the fourth's conversation holds the stopped answer)."""
    pexpect = pytest.importorskip("pexpect")
    transcript = tmp_path / "chat.json"
    child = pexpect.spawn(sys.executable, ["-m", "fastforward.cli", "chat", "--model", str(endless_file),
                                           "--max-new-tokens", "400"],
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), encoding="utf-8", timeout=180,
                          dimensions=(40, 200), preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        child.expect_exact("> ")  # loaded; the prompt ends with "> "

        def say(line: str) -> str:
            child.sendline(line)
            child.expect_exact(PROMPT)
            return child.before

        say(MESSAGES[0])
        first = STATS.search(say("/stats")).groups()
        say(MESSAGES[1])
        second = STATS.search(say("/stats")).groups()
        child.sendline("tell me a story")
        child.expect_exact("tell me a story\r\n")
        child.expect(r"[ -~]{12}")  # the answer is streaming
        head = child.after
        child.sendintr()
        child.expect_exact("(stopped; the answer so far stays in the conversation)")
        shown = head + child.before
        child.expect_exact(PROMPT)
        say("and then?")
        say(f"/save {transcript}")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    # the second turn read its new tokens only: its prompt less the first turn's prompt and answer but its last
    new1, prompt1, read1, cached1 = map(int, first)
    new2, prompt2, read2, cached2 = map(int, second)
    assert (new1, read1, cached1) == (400, prompt1, 0)
    assert cached2 == prompt1 + new1 - 1 and read2 == prompt2 - cached2 < 40
    saved = json.loads(transcript.read_text())
    turns = saved["turns"]
    assert [t["interrupted"] for t in turns] == [False, False, True, False]
    stopped = turns[2]["assistant"]
    assert 12 <= len(stopped) < 400
    assert shown.replace("^C", "").strip() == stopped  # kept as the terminal showed it
    assert saved["messages"][5]["content"] == stopped
    for i, turn in enumerate(turns):
        messages = saved["messages"][: 2 * i + 1]
        ar = ff.generate(endless, messages, "ar", max_new_tokens=400).token_ids
        assert (ar[: len(turn["token_ids"])] if turn["interrupted"] else ar) == turn["token_ids"], i
    assert turns[3]["cached_prompt_tokens"] == turns[2]["prompt_tokens"] + turns[2]["new_tokens"]


@pytest.mark.parametrize("when", ["at the prompt", "in an answer"])
def test_sigterm_ends_the_chat(endless_file, when):
    """SIGTERM (kill, a scheduler's notice) leaves, where Ctrl-C only stops an answer."""
    import signal

    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "fastforward.cli", "chat", "--model", str(endless_file),
                                           "--max-new-tokens", "2000"], env=dict(os.environ), encoding="utf-8",
                          timeout=180, preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        child.expect_exact("> ")
        if when == "in an answer":
            child.sendline("hello there")
            child.expect(r"[ -~]{12}")
        child.kill(signal.SIGTERM)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 143 and "fastforward: terminated" in child.before
