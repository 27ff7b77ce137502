"""PASTA's quality judge: ROUGE-L, the pairwise form, the win/loss ratio, win rates, log-prob scoring under the
original model, the proxy judge, and the OpenAI-compatible judge against a fake local server."""

from __future__ import annotations

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastforward.errors import UsageError
from fastforward.testing import tiny_llama_hf, tiny_tokenizer_hf
from fastforward.train.pasta.judge import (
    JUDGE_INSTRUCTION,
    OpenAIJudge,
    ProxyJudge,
    distinct_n,
    judge_win_rate,
    judgment,
    lcs_length,
    mean_logprob,
    mean_logprobs,
    preference_prob,
    quality,
    rouge_l,
    win_loss_ratio,
    win_rate,
    words,
)

# --- ROUGE-L -----------------------------------------------------------------------------------------------------


def _lcs_dp(a, b) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def test_rouge_l_known_values():
    assert words("The CAT, sat! on_the mat") == ["the", "cat", "sat", "on", "the", "mat"]
    assert rouge_l("the cat sat on the mat", "The cat sat on the mat.") == 1.0
    assert rouge_l("the cat sat", "dogs run fast") == 0.0
    # LCS("the cat sat on the mat", "the cat lay on a mat") = the cat on mat = 4; F1 = 2*4 / (6 + 6)
    assert rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(2 / 3)
    # P = 2/3, R = 2/4: F1 = 2PR/(P+R) = 4/7
    assert rouge_l("a b c", "a x b y") == pytest.approx(4 / 7)
    assert rouge_l("", "") == 1.0 and rouge_l("...", "") == 1.0  # no words on either side: identical
    assert rouge_l("", "a b") == 0.0 and rouge_l("a b", "!") == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcde"), max_size=30), st.lists(st.sampled_from("abcde"), max_size=30))
def test_lcs_and_rouge_properties(a, b):
    assert lcs_length(a, b) == _lcs_dp(a, b) == lcs_length(b, a)
    ta, tb = " ".join(a), " ".join(b)
    r = rouge_l(ta, tb)
    assert 0.0 <= r <= 1.0
    assert r == rouge_l(tb, ta)


def test_rouge_l_on_400_words_matches_the_plain_dp():
    gen = torch.Generator().manual_seed(0)
    a = " ".join(f"w{i}" for i in torch.randint(0, 60, (400,), generator=gen).tolist())
    b = " ".join(f"w{i}" for i in torch.randint(0, 60, (400,), generator=gen).tolist())
    r = rouge_l(a, b)
    assert r == pytest.approx(2 * _lcs_dp(words(a), words(b)) / 800)


def test_distinct_n():
    assert distinct_n("a b a b a b", 2) == pytest.approx(2 / 5)
    assert distinct_n("a b c", 2) == 1.0 and distinct_n("a", 2) == 1.0


# --- pairwise form, ratio, win rate -------------------------------------------------------------------------------

@given(st.floats(-50, 50), st.floats(-50, 50), st.floats(0.01, 10))
def test_preference_prob_is_symmetric(s_a, s_b, tau):
    p = preference_prob(s_a, s_b, tau)
    assert 0.0 <= p <= 1.0
    assert p + preference_prob(s_b, s_a, tau) == pytest.approx(1.0, abs=1e-12)


def test_preference_prob_values():
    assert preference_prob(1.0, 1.0) == 0.5
    assert preference_prob(1.25, 1.0, tau=0.25) == pytest.approx(1 / (1 + math.exp(-1)))
    assert preference_prob(-1000.0, 0.0, tau=0.25) == 0.0  # no overflow
    with pytest.raises(UsageError):
        preference_prob(1.0, 0.0, tau=0.0)


def test_judgment_and_ratio():
    assert judgment(0.8) == ("win", 0.8)
    assert judgment(0.3) == ("loss", pytest.approx(0.7))
    assert judgment(0.5) == ("tie", 0.5)
    assert win_loss_ratio([("win", 0.8), ("loss", 0.6)], eps=0.1) == pytest.approx(0.9 / 0.7)
    assert win_loss_ratio([("win", 0.9), ("win", 0.7)], eps=0.1) == pytest.approx(1.7 / 0.1)
    assert win_loss_ratio([("tie", 0.5), ("loss", 0.9)], eps=0.1) == pytest.approx(0.1 / 1.0)
    assert win_loss_ratio([], eps=0.1) == 1.0
    with pytest.raises(UsageError):
        win_loss_ratio([("draw", 0.5)])
    with pytest.raises(UsageError):
        win_loss_ratio([("win", 1.5)])


def test_win_rate_counts_ties():
    w = win_rate([0.9, 0.5, 0.2, 0.7, 0.5])
    assert (w.wins, w.ties, w.losses) == (2, 2, 1) and w.rate == pytest.approx(3 / 5)
    w = win_rate([0.9, 0.5, 0.2, 0.7, 0.5], margin=0.25)  # 0.7 falls in the tie band [0.25, 0.75]
    assert (w.wins, w.ties, w.losses) == (1, 3, 1) and w.rate == pytest.approx(2.5 / 5)
    with pytest.raises(UsageError):
        win_rate([])


class _FixedJudge:
    def __init__(self, probs):
        self.probs, self.calls = list(probs), []

    def compare(self, prompt, a_text, b_text, baseline_text=None, reference_text=None):
        self.calls.append((prompt, a_text, b_text, baseline_text, reference_text))
        return self.probs.pop(0)


def test_quality_and_judge_win_rate_with_any_judge():
    judge = _FixedJudge([0.8, 0.3])
    assert quality(judge, "q", "y", "base", "ref", eps=0.1) == pytest.approx(0.9 / 0.8)
    # a comparison answer is not an anchor of its own comparison
    assert judge.calls == [("q", "y", "base", None, "ref"), ("q", "y", "ref", "base", None)]
    assert quality(_FixedJudge([0.2]), "q", "y", "base", None, eps=0.1) == pytest.approx(0.1 / 0.9)
    w = judge_win_rate(_FixedJudge([0.9, 0.5, 0.1]), ["p1", "p2", "p3"], ["a1", "a2", "a3"], ["b1", "b2", "b3"])
    assert (w.wins, w.ties, w.losses, w.rate) == (1, 1, 1, 0.5)
    with pytest.raises(UsageError):
        judge_win_rate(_FixedJudge([]), ["p"], ["a", "b"], ["c"])


# --- log-probs under the original model, the proxy judge ----------------------------------------------------------

@pytest.fixture(scope="module")
def lm():
    return tiny_llama_hf(vocab_size=320, seed=3), tiny_tokenizer_hf()


def test_mean_logprob_matches_hand_computation(lm):
    model, tok = lm
    prompt, answer = tok.encode("Q: hi?", add_special_tokens=False), tok.encode(" A: yes", add_special_tokens=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    hand = sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(answer)) / len(answer)
    assert mean_logprob(model, prompt, answer) == pytest.approx(hand, rel=1e-5)
    assert mean_logprob(model, prompt, answer) < 0
    with pytest.raises(UsageError, match="non-empty answer"):
        mean_logprob(model, prompt, [])
    with pytest.raises(UsageError):
        mean_logprobs(model, [(prompt, answer), (prompt, [])])


def test_batched_equals_single(lm):
    model, tok = lm
    texts = [("Hello", " world, how are you"), ("A longer prompt here", " ok"), ("x", " y z w v u t s r")]
    pairs = [(tok.encode(p, add_special_tokens=False), tok.encode(a, add_special_tokens=False)) for p, a in texts]
    single = [mean_logprob(model, p, a) for p, a in pairs]
    for bs in (1, 2, 3):
        assert mean_logprobs(model, pairs, batch_size=bs) == pytest.approx(single, rel=1e-6)


def test_proxy_judge_score_and_compare(lm):
    model, tok = lm
    judge = ProxyJudge(model, tok)
    prompt = tok.encode("Name a colour.", add_special_tokens=False)
    a, b, base, ref = "Red is a colour.", "Bananas are yellow, I think.", "Blue is a colour.", "Red."
    lp = mean_logprob(model, prompt, tok.encode(a, add_special_tokens=False))
    assert judge.score(prompt, a) == pytest.approx(lp)
    assert judge.score(prompt, a, base, ref) == pytest.approx(lp + rouge_l(a, base) + rouge_l(a, ref))
    assert judge.score("Name a colour.", a) == pytest.approx(lp)  # a text prompt is encoded
    p = judge.compare(prompt, a, b, base, ref)
    assert p == pytest.approx(1 - judge.compare(prompt, b, a, base, ref))
    s_a, s_b = judge.score(prompt, a, base, ref), judge.score(prompt, b, base, ref)
    assert p == pytest.approx(1 / (1 + math.exp(-(s_a - s_b) / judge.tau)))
    assert judge.compare(prompt, a, a, base, ref) == 0.5
    rep = ProxyJudge(model, tok, w_repetition=0.5)
    text = "red red red red red"
    assert rep.score(prompt, text) == pytest.approx(judge.score(prompt, text) - 0.5 * (1 - distinct_n(text)))
    with pytest.raises(UsageError):
        ProxyJudge(model, tok, tau=-1.0)


# --- the OpenAI-compatible judge ----------------------------------------------------------------------------------

class _FakeChat(BaseHTTPRequestHandler):
    replies: list = []  # (status, body) per request, in order
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, dict(self.headers), body))
        status, payload = type(self).replies.pop(0)
        data = payload.encode() if isinstance(payload, str) else json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": payload["content"]}}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _FakeChat.replies, _FakeChat.seen = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeChat
    server.shutdown()
    server.server_close()
    thread.join()


def test_openai_judge_asks_both_orders(fake_server):
    url, chat = fake_server
    chat.replies = [(200, {"content": "A 0.8"}), (200, {"content": "A 0.6"})]
    judge = OpenAIJudge(url, "judge-model", api_key="k123", timeout=5)
    p = judge.compare("Which colour?", "red", "banana")
    assert p == pytest.approx(0.5 * (0.8 + (1 - 0.6)))
    assert len(chat.seen) == 2
    (path1, headers1, body1), (_, _, body2) = chat.seen
    assert path1 == "/v1/chat/completions" and headers1["Authorization"] == "Bearer k123"
    assert body1["model"] == "judge-model" and body1["messages"][0]["content"] == JUDGE_INSTRUCTION
    user1, user2 = body1["messages"][1]["content"], body2["messages"][1]["content"]
    assert "Answer A:\nred\n\nAnswer B:\nbanana" in user1 and "Answer A:\nbanana\n\nAnswer B:\nred" in user2
    # order 1: B (= b) wins at 0.65, so P(a) = 0.35; order 2: B (= a) wins at 1, so P(a) = 1
    chat.replies = [(200, {"content": " B 0.65\n"}), (200, {"content": "**B**: 1"})]
    assert OpenAIJudge(url + "/v1/", "m").compare("q", "a", "b") == pytest.approx(0.5 * (0.35 + 1.0))
    assert chat.seen[2][0] == "/v1/chat/completions" and "Authorization" not in chat.seen[2][1]


@pytest.mark.parametrize("reply", [(200, {"content": "Answer A is better"}), (200, {"content": "A 1.7"}),
                                   (200, "not json"), (200, '{"choices": []}'), (500, '{"error": "boom"}')])
def test_openai_judge_bad_replies_raise(fake_server, reply):
    url, chat = fake_server
    chat.replies = [reply, (200, {"content": "A 0.9"})]
    with pytest.raises(UsageError, match=f"{url}/v1/chat/completions") as err:
        OpenAIJudge(url, "m", timeout=5).compare("q", "a", "b")
    assert "\n" not in str(err.value)


def test_openai_judge_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UsageError, match=f"cannot reach the judge at http://127.0.0.1:{port}"):
        OpenAIJudge(f"http://127.0.0.1:{port}", "m", timeout=5).compare("q", "a", "b")
