"""The docs hold together: every relative link in README.md and docs/*.md reaches a file, every #anchor a heading of
that file (GitHub's slugs), docs/*.md stays a reference a reader can finish (at most 3,000 lines; docs/results/ not
counted), no page names a machine path, and every number in README.md's "Where it stands" table is found in the run
(a folder of docs/results/) its cell links to. Text only: no model loads."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_DOC_LINES = 3000

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]*(?:\([^()\s]*\))?[^()\s]*)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text):
    """The lines outside fenced code blocks, with inline code spans blanked (a link inside code is not a link)."""
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield _INLINE_CODE.sub(" ", line)


def slug(heading):
    """GitHub's anchor for a heading's text: the rendered text (code, emphasis and link markup dropped), lower-cased,
    every character but letters, digits, marks, underscores, hyphens and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    kept = []
    for ch in text:
        category = unicodedata.category(ch)
        if ch in "-_ " or category[0] in "LMN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path):
    """Every anchor a page offers: its headings' slugs, repeated slugs numbered -1, -2, ... as GitHub does."""
    seen = {}
    result = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path):
    """(line number, target) of every relative link of a page (web links and mail addresses left out)."""
    found = []
    for number, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), 1):
        for match in _LINK.finditer(line):
            target = match.group(1)
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue
            found.append((number, target))
    return found


def test_slug_follows_github():
    assert slug("`rest` — retrieval from a datastore (REST)") == "rest--retrieval-from-a-datastore-rest"
    assert slug("2. `--method eagle` and `fastforward train eagle`") == "2---method-eagle-and-fastforward-train-eagle"
    assert slug("Load test: `fastforward serve-bench`") == "load-test-fastforward-serve-bench"
    assert slug("The default for GGUF files: llama.cpp's integer arithmetic (`--arithmetic q8`)") == (
        "the-default-for-gguf-files-llamacpps-integer-arithmetic---arithmetic-q8")
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_links_are_found_outside_code_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see [a](a.md#x) and `[b](b.md)`\n```\n[c](c.md)\n```\n![d](d.png) [e](https://e.org)\n")
    assert [target for _, target in links(page)] == ["a.md#x", "d.png"]


def broken_links(page):
    """One line per relative link of the page that reaches no file, or no heading of the file it names."""
    broken = []
    for number, target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n## A `code` part (here)\n## Twice\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-part-here) [ok](other.md#twice-1) [ok](#local)\n# Local\n"
                    "[bad](other.md#nope) [bad](missing.md) [bad](#elsewhere)\n")
    assert broken_links(page) == ["line 3: other.md#nope (no heading #nope in other.md)",
                                  "line 3: missing.md (no such file)",
                                  "line 3: #elsewhere (no heading #elsewhere in page.md)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_docs_fit_a_reader():
    counts = {p.name: p.read_text(encoding="utf-8").count("\n") for p in (ROOT / "docs").glob("*.md")}  # wc -l
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
    assert total <= MAX_DOC_LINES, f"docs/*.md holds {total} lines (at most {MAX_DOC_LINES}); largest: {largest}"


def test_docs_name_no_machine_paths():
    pattern = re.compile(r"(?<![\w.])(/tmp/|/root\b|~/ffwork|/work/|/home/)")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in PAGES
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, "machine paths in the docs (use placeholders such as DATA_DIR, OUT_DIR):\n" + "\n".join(found)


# -- the README's table: every number in it is found in the run it links to ------------------------------------------

STANDS_HEADING = "Where it stands"
RUN_FILES = ("report.md", "summary.json", "batch.md", "COMMAND.md")  # the files a kept run may hold
_NUMBER = re.compile(r"(?<![\w.])(\d{4}-\d{2}-\d{2}|\d+(?:[.,]\d+)*)(?!\w)")
_LINK_TEXT = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^()\s]*(?:\([^()\s]*\))?[^()\s]*\)")


def section_table(path, heading):
    """(line number, cells) of each body row of the first table under the heading ``heading`` (before the next
    heading); [] when there is none."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines)
                  if (m := _HEADING.match(line)) and m.group(2).strip() == heading), None)
    if start is None:
        return []
    rows = []
    for number, line in enumerate(lines[start + 1:], start + 2):
        if _HEADING.match(line):
            break
        if line.startswith("|"):
            rows.append((number, [cell.strip() for cell in line.strip().strip("|").split("|")]))
        elif rows:
            break
    return rows[2:]  # the header and its |---| line name no numbers of a run


def _number_in(number, texts):
    pattern = re.compile(r"(?<![\w.])" + re.escape(number) + r"(?!\w|\.\d)")
    return any(pattern.search(text) for text in texts)


def table_numbers_not_in_runs(page, heading=STANDS_HEADING):
    """One line per number of the page's table under ``heading`` that is not found verbatim in the files of the
    run folder (a folder of docs/results/) its cell links to -- a cell without a link: any run its row links to --
    and per link of the table that reaches no run folder."""
    rows = section_table(page, heading)
    if not rows:
        return [f"no table under '## {heading}'"]
    results = (page.parent / "docs" / "results").resolve()
    problems = []
    for number, cells in rows:
        runs_per_cell = []
        for cell in cells:
            runs = [] if links_in(cell) else None  # None: the cell links nowhere, its row's runs stand for it
            for target in links_in(cell):
                run = (page.parent / target.partition("#")[0]).resolve().parent
                if run.parent != results or not run.is_dir():
                    problems.append(f"line {number}: {target} is not a file of a run folder under docs/results/")
                else:
                    runs.append(run)
            runs_per_cell.append(runs)
        row_runs = list(dict.fromkeys(run for runs in runs_per_cell if runs for run in runs))
        for cell, runs in zip(cells, runs_per_cell, strict=True):
            runs = row_runs if runs is None else runs
            texts = [(run / name).read_text(encoding="utf-8") for run in runs for name in RUN_FILES
                     if (run / name).is_file()]
            for value in _NUMBER.findall(_LINK_TEXT.sub(r"\1", cell)):
                if not runs:
                    problems.append(f"line {number}: {value} links to no run")
                elif not _number_in(value, texts):
                    problems.append(f"line {number}: {value} not found in {', '.join(r.name for r in runs)}")
    return problems


def links_in(text):
    """The target of every link in one line of text (as links() finds them)."""
    return [m.group(1) for m in _LINK.finditer(text)]


def test_a_table_number_missing_from_its_run_is_reported(tmp_path):
    run = tmp_path / "docs" / "results" / "run-a"
    run.mkdir(parents=True)
    (run / "COMMAND.md").write_text("- Machine: AMD EPYC (Zen 4) with AVX-512, 2 cores.\n- When: 2026-11-27.\n")
    (run / "report.md").write_text("| `ar` | 12.07× | 2.07× | 3.5× |\n")
    (tmp_path / "docs" / "results" / "run-b").mkdir()
    (tmp_path / "docs" / "results" / "run-b" / "summary.json").write_text('{"vs_llama_cpp": 9.99}')
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n## Where it stands\n\nText 1.00×.\n\n"
        "| CPU (2 cores), date | ar | best | note |\n|---|---|---|---|\n"
        "| [EPYC (Zen 4) AVX-512](docs/results/run-a/COMMAND.md), 2026-11-27 | [2.07×](docs/results/run-a/report.md)"
        " | [9.99×](docs/results/run-a/report.md) | 3.50× |\n"
        "| [AVX2](docs/results/run-b/summary.json) | [0.7×](docs/results/run-a/report.md#x) | [9.99×]"
        "(docs/results/run-b/summary.json) | [1.5×](docs/other.md) |\n"
        "| AVX2 only | 4.00× | – | – |\n"
        "\n| after | 8.88× |\n|---|---|\n| x | 8.88× |\n")
    assert table_numbers_not_in_runs(page) == [
        "line 8: 9.99 not found in run-a",  # another run's number
        "line 8: 3.50 not found in run-a",  # an unlinked cell is checked against its row's runs; 3.5 is not 3.50
        "line 9: docs/other.md is not a file of a run folder under docs/results/",
        "line 9: 0.7 not found in run-a",  # not a part of 2.07
        "line 9: 1.5 links to no run",
        "line 10: 4.00 links to no run",
    ]
    assert table_numbers_not_in_runs(page, "Nowhere") == ["no table under '## Nowhere'"]


def test_readme_table_numbers_are_in_their_runs():
    problems = table_numbers_not_in_runs(ROOT / "README.md")
    assert not problems, "README.md's table:\n" + "\n".join(problems)
