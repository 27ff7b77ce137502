"""The page at ``/`` in a real headless browser (Chromium through Playwright): it loads, streams two methods side by
side, and colours every token by how it came.

The tiny random model rarely accepts a draft, so the colours are checked with an *oracle* method registered for
this test only: it drafts the next four tokens of the known greedy answer, all accepted at depths 1-4, and the
target adds the fifth. Skipped, with the reason, when no Chromium can be launched (``pip install playwright`` and
``playwright install chromium``, or a system Chromium such as Debian's ``chromium`` package).
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

import fastforward as ff  # noqa: E402
from fastforward.costs import CostCurve, CostModel, set_cost_model  # noqa: E402
from fastforward.engine import Proposal, Proposer  # noqa: E402
from fastforward.proposers import METHODS, register  # noqa: E402
from fastforward.server import BackgroundServer, create_app  # noqa: E402
from fastforward.testing import tiny_hf_folder  # noqa: E402
from fastforward.tree import DraftTree  # noqa: E402

PROMPT = "Tell me about caches."
MAX_TOKENS = 20


class Oracle(Proposer):
    name = "oracle"

    def __init__(self, answer: list[int]):
        self.answer = answer

    def max_proposal_size(self) -> int:
        return 5

    def propose(self, state):
        done = state.ids[state.prompt_length : state.length].tolist()
        if done != self.answer[: len(done)] or len(done) >= len(self.answer):
            return None
        return Proposal(DraftTree.chain(state.root, self.answer[len(done) : len(done) + 4]))


def launch(p):
    """Playwright's own Chromium, else a system one; skip with both reasons if neither starts."""
    reasons = []
    try:
        return p.chromium.launch()
    except Exception as exc:  # not downloaded: 'playwright install chromium' needs the browser's download site
        reasons.append(f"playwright's Chromium: {str(exc).splitlines()[0]}")
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            try:
                return p.chromium.launch(executable_path=path)
            except Exception as exc:
                reasons.append(f"{path}: {str(exc).splitlines()[0]}")
    reasons.append("no system Chromium on PATH")
    pytest.skip("no headless Chromium can be launched (" + "; ".join(reasons) + ")")


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    target = ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("page") / "tiny")))
    answer = ff.generate(target, [{"role": "user", "content": PROMPT}], "ar", max_new_tokens=MAX_TOKENS)
    # a machine where rows are free: the oracle's whole drafts stay when the two panes share forwards (on a real
    # CPU curve the shared step would cut them to what they are worth there, which depends on the machine)
    set_cost_model(target, CostModel(CostCurve.flat(), learn=False))
    register("oracle", "test only: drafts the known greedy answer")(lambda target: Oracle(answer.token_ids))
    try:
        app = create_app(target, model_name="tiny", max_batch_tokens=64)
        with BackgroundServer(app) as url:
            yield url, answer
    finally:
        METHODS.pop("oracle", None)


def test_page_streams_two_methods_and_colours_tokens(page_server):
    url, answer = page_server
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            methods = page.eval_on_selector_all("#m0 option", "os => os.map(o => o.value)")
            assert {"ar", "pld", "oracle"} <= set(methods)
            page.fill("#prompt", PROMPT)
            page.fill("#max", str(MAX_TOKENS))
            page.fill("#temp", "0")
            page.select_option("#m0", "ar")
            page.select_option("#m1", "oracle")
            page.click("#go")
            page.wait_for_selector("#p0[data-done='1']", timeout=60_000)
            page.wait_for_selector("#p1[data-done='1']", timeout=60_000)
            assert page.inner_text("#p0 .final").startswith(f"{MAX_TOKENS} tokens"), page.inner_text("#p0 .final")
            texts = [page.eval_on_selector(f"#{pane} .out", "e => e.textContent") for pane in ("p0", "p1")]
            assert texts[0] == texts[1] == answer.text  # lossless: the same answer, side by side
            depths = {pane: page.eval_on_selector_all(f"#{pane} .out span", "ss => ss.map(s => +s.dataset.depth)")
                      for pane in ("p0", "p1")}
            assert set(depths["p0"]) == {0}  # ar: every token from the target's forward
            assert {0, 1, 2, 3, 4} <= set(depths["p1"])  # the oracle's drafts, accepted at depths 1-4
            colours = page.eval_on_selector_all(
                "#p1 .out span", "ss => ss.map(s => [s.dataset.depth, getComputedStyle(s).backgroundColor])")
            by_depth = {}
            for depth, colour in colours:
                by_depth.setdefault(depth, set()).add(colour)
            assert all(len(c) == 1 for c in by_depth.values())  # one colour per depth
            assert len({next(iter(c)) for c in by_depth.values()}) == len(by_depth)  # a different one each
            assert "tau" in page.inner_text("#p1 .live") and "tok/s" in page.inner_text("#p1 .live")
            tau = float(page.get_attribute("#p1 .final", "data-tau"))
            assert tau > 2  # four drafts accepted per forward
        finally:
            browser.close()


KEY = "sk-page-test-key-0123"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    target = ff.load(str(tiny_hf_folder(tmp_path_factory.mktemp("page-keyed") / "tiny")))
    answer = ff.generate(target, [{"role": "user", "content": PROMPT}], "ar", max_new_tokens=MAX_TOKENS)
    app = create_app(target, model_name="tiny", max_batch_tokens=64, api_keys=(KEY,))
    with BackgroundServer(app) as url:
        yield url, answer


def test_page_asks_for_the_key_once_and_keeps_it_for_the_tab(keyed_server):
    url, answer = keyed_server
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        try:
            context = browser.new_context()
            page = context.new_page()
            page.goto(url + "/")
            page.wait_for_selector("body[data-needs-key='1']", timeout=30_000)
            assert page.is_visible("#keybar") and page.inner_text("#keymsg") == ""
            page.fill("#key", "sk-wrong")
            page.click("#keygo")
            page.wait_for_function("document.getElementById('keymsg').textContent.includes('refused')",
                                   timeout=30_000)
            assert page.is_visible("#keybar")
            page.fill("#key", KEY)
            page.click("#keygo")
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert not page.is_visible("#keybar")
            assert page.evaluate("sessionStorage.getItem('fastforward-api-key')") == KEY
            page.fill("#prompt", PROMPT)
            page.fill("#max", str(MAX_TOKENS))
            page.fill("#temp", "0")
            page.select_option("#m0", "ar")
            page.select_option("#m1", "pld")
            page.click("#go")
            page.wait_for_selector("#p0[data-done='1']", timeout=60_000)
            page.wait_for_selector("#p1[data-done='1']", timeout=60_000)
            for pane in ("p0", "p1"):
                assert page.eval_on_selector(f"#{pane} .out", "e => e.textContent") == answer.text
            page.reload()  # the same tab keeps the key: no question
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert not page.is_visible("#keybar")
            other = context.new_page()  # another tab asks again (sessionStorage is the tab's)
            other.goto(url + "/")
            other.wait_for_selector("body[data-needs-key='1']", timeout=30_000)
        finally:
            browser.close()
