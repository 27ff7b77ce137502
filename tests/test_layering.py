"""The package's layering is one-way, and this test keeps it so.

Every module of ``fastforward/`` belongs to exactly one layer (:data:`LAYERS`, top to bottom; a module may import
its own layer and the layers below it, never one above):

    commands     fastforward.cli
    research     fastforward.train (drafter, draft-model and PASTA training, PASTA's research pipeline),
                 fastforward.evaluate
    benchmarks   fastforward.bench
    face         fastforward (the package face: fastforward/__init__.py)
    service      api, request, server, testing, tree_builder, machine_facts
    methods      proposers, pasta (PASTA's language, layout, interpreter and metrics)
    engine       engine, costs, draft_budget, tree, verify, validation
    drafters     drafters (the drafter modules and their folder formats; their training is fastforward.train)
    model        model, kernels, linear, gguf_file, arithmetic, tokenizer
    base         errors, paths, version, interrupts, jsonl, stats, stopping, machine, adapters

Every ``.py`` under ``fastforward/`` is parsed with ``ast``; every import (at the top of a module and inside
functions alike: an import hidden in a function is still an arrow) becomes an edge of the module graph, relative
imports resolved. The checks:

* every module is in a layer (a new package or top-level module is classified here when it is added);
* no module imports a layer above its own, and the layers' graph has no cycle;
* nothing outside ``fastforward/cli/`` imports the command line;
* only the face itself and the command layer import the face (``from .. import x`` resolving to
  ``fastforward/__init__`` below the face is a violation; the version lives in ``fastforward/version.py``);
* there is no import cycle among fastforward modules (a package ``__init__`` importing its submodules is an ordinary
  edge: it is a cycle only when a submodule imports the ``__init__`` back);
* the core (engine, model, tree, verify, linear, gguf_file, kernels, tokenizer, paths, errors, costs, proposers,
  and every other module of the layers from ``methods`` down) never imports the layers above it.

The checker works on a plain ``{module: {imported module: line}}`` dict, so the last tests run it on synthetic
graphs that break each rule and expect it to say so.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

PACKAGE = "fastforward"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

Graph = dict[str, dict[str, int]]  # module -> {imported fastforward module: line of the (first) import}

CLI = "fastforward.cli"
FACE = "fastforward"

# The layers, top to bottom: (name, the modules and packages in it). ``fastforward`` itself names the face only (the
# package ``__init__``), not everything below it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("commands", ("fastforward.cli",)),
    ("research", ("fastforward.train", "fastforward.evaluate")),
    ("benchmarks", ("fastforward.bench",)),
    ("face", (FACE,)),
    ("service", ("fastforward.api", "fastforward.request", "fastforward.server", "fastforward.testing",
                 "fastforward.tree_builder", "fastforward.machine_facts")),
    ("methods", ("fastforward.proposers", "fastforward.pasta")),
    ("engine", ("fastforward.engine", "fastforward.costs", "fastforward.draft_budget", "fastforward.tree",
                "fastforward.verify", "fastforward.validation")),
    ("drafters", ("fastforward.drafters",)),
    ("model", ("fastforward.model", "fastforward.kernels", "fastforward.linear", "fastforward.gguf_file",
               "fastforward.arithmetic", "fastforward.tokenizer")),
    ("base", ("fastforward.errors", "fastforward.paths", "fastforward.version", "fastforward.interrupts",
              "fastforward.jsonl", "fastforward.stats", "fastforward.stopping", "fastforward.machine",
              "fastforward.adapters")),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}  # 0 is the top


def _layers(first: str, last: str) -> tuple[str, ...]:
    """The modules and packages of the layers from ``first`` down to ``last``."""
    return tuple(m for name, members in LAYERS[RANK[first] : RANK[last] + 1] for m in members)


# Modules (and packages) that may import the package face: the face itself and the layers above it.
COMMAND_LAYER = _layers("commands", "benchmarks")
# The core: the decoding methods and everything below them.
CORE = _layers("methods", "base")
ABOVE_CORE = tuple(m for m in _layers("commands", "service") if m != FACE)


def within(module: str, prefixes) -> bool:
    """``module`` is one of ``prefixes`` or inside one of them (``fastforward.bench`` holds
    ``fastforward.bench.runner``, not ``fastforward.benchmark`` nor ``fastforward.kernels.bench``)."""
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# ----------------------------------------------------------------------------------------------------------------
# Building the graph
# ----------------------------------------------------------------------------------------------------------------


def discover(root: Path, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package ``__init__``) for every ``.py`` under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_pkg)
    return modules


def _resolve(name: str, modules) -> str | None:
    """The fastforward module an imported dotted name lands in: itself, else its longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, is_pkg: bool, modules) -> dict[str, int]:
    """{fastforward module: first line} that ``module`` imports anywhere in its source (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if is_pkg else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if within(alias.name, PACKAGE):
                    add(_resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            if not within(base_name, PACKAGE):
                continue
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                # ``from pkg import submodule`` imports the submodule; ``from pkg import name`` the module holding it
                add(sub if sub in modules else _resolve(base_name, modules), node.lineno)
    return found


def build_graph(root: Path = ROOT, package: str = PACKAGE) -> Graph:
    modules = discover(root, package)
    return {name: imports_of(name, path, is_pkg, modules) for name, (path, is_pkg) in modules.items()}


# ----------------------------------------------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------------------------------------------


def _edge(graph: Graph, a: str, b: str) -> str:
    return f"{a} -> {b} (line {graph[a][b]})"


def cli_violations(graph: Graph) -> list[str]:
    """Imports of the command line from outside it."""
    return [f"{_edge(graph, a, b)}: only fastforward/cli/ may import the command line"
            for a, targets in sorted(graph.items()) if not within(a, CLI)
            for b in sorted(targets) if within(b, CLI)]


def face_violations(graph: Graph) -> list[str]:
    """Imports of the package face (``fastforward/__init__``) from below it."""
    return [f"{_edge(graph, a, b)}: below the package face, import the module that defines the name (the version "
            "is fastforward.version)"
            for a, targets in sorted(graph.items()) if a != FACE and not within(a, COMMAND_LAYER)
            for b in sorted(targets) if b == FACE]


def layer_violations(graph: Graph) -> list[str]:
    """Imports of the upper layers from the core."""
    return [f"{_edge(graph, a, b)}: the core never imports {', '.join(ABOVE_CORE)}"
            for a, targets in sorted(graph.items()) if within(a, CORE)
            for b in sorted(targets) if within(b, ABOVE_CORE)]


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one concrete cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # iterative Tarjan: no recursion limit on deep graphs
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, comp) for comp in components]


def _cycle_in(graph: Graph, component: list[str]) -> list[str]:
    """One cycle through the component's first module, as a path [a, b, ..., a] (breadth-first: a shortest one)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return [*component, component[0]]


def cycle_violations(graph: Graph) -> list[str]:
    return ["import cycle: " + " -> ".join(f"{b} (line {graph[a][b]})" if i else a
                                            for i, (a, b) in enumerate(zip([c[0], *c], c, strict=False)))
            for c in cycles(graph)]


def layer_of(module: str) -> str | None:
    """The layer of ``module``: the one naming it or its closest enclosing package (None: in no layer)."""
    best, best_len = None, -1
    for name, members in LAYERS:
        for member in members:
            hit = module == member if member == FACE else within(module, member)
            if hit and len(member) > best_len:
                best, best_len = name, len(member)
    return best


def unclassified(graph: Graph) -> list[str]:
    """Modules in no layer."""
    return [f"{m}: in no layer; add it (or its package) to LAYERS in tests/test_layering.py"
            for m in sorted(graph) if layer_of(m) is None]


def upward_imports(graph: Graph) -> list[str]:
    """Imports of a layer above the importer's own."""
    found = []
    for a, targets in sorted(graph.items()):
        mine = layer_of(a)
        for b in sorted(targets):
            theirs = layer_of(b)
            if mine is not None and theirs is not None and RANK[theirs] < RANK[mine]:
                found.append(f"{_edge(graph, a, b)}: the {mine} layer imports the {theirs} layer, which is above it")
    return found


def layer_graph(graph: Graph) -> tuple[Graph, dict[tuple[str, str], str]]:
    """(the layers' graph -- layer -> {imported layer: 0}, imports within a layer left out --, one module edge
    behind each layer edge, for the messages)."""
    layers: Graph = {name: {} for name, _ in LAYERS}
    witness: dict[tuple[str, str], str] = {}
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and la != lb:
                layers[la].setdefault(lb, 0)
                witness.setdefault((la, lb), _edge(graph, a, b))
    return layers, witness


def layer_cycle_violations(graph: Graph) -> list[str]:
    """Cycles among the layers, each hop with one import that makes it."""
    layers, witness = layer_graph(graph)
    return ["layer cycle: " + " -> ".join([c[0], *(f"{b} ({witness[a, b]})" for a, b in pairwise(c))])
            for c in cycles(layers)]


def layering_violations(graph: Graph) -> list[str]:
    """Every layer rule: each module in a layer, no upward import, no cycle among the layers."""
    return unclassified(graph) + upward_imports(graph) + layer_cycle_violations(graph)


def all_violations(graph: Graph) -> list[str]:
    return cli_violations(graph) + face_violations(graph) + layer_violations(graph) + cycle_violations(graph)


def _report(violations: list[str]) -> str:
    return "\n".join(["the package's layering is broken:", *violations])


# ----------------------------------------------------------------------------------------------------------------
# The package
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


def test_graph_sees_the_package(graph):
    """A sanity check of the builder on the real package: known modules and edges are there."""
    assert {"fastforward", "fastforward.engine", "fastforward.cli", "fastforward.cli.options",
            "fastforward.bench.runner", "fastforward.proposers.jacobi"} <= set(graph)
    assert "fastforward.model" in graph["fastforward.engine"]  # from .model import ...
    assert "fastforward.engine" in graph["fastforward.proposers.jacobi"]  # from ..engine import ...
    assert "fastforward.proposers" in graph["fastforward.proposers.jacobi"]  # from . import register
    assert "fastforward.version" in graph["fastforward.cli"]


def test_nothing_outside_the_cli_imports_it(graph):
    assert not cli_violations(graph), _report(cli_violations(graph))


def test_only_the_command_layer_imports_the_package_face(graph):
    assert not face_violations(graph), _report(face_violations(graph))


def test_core_never_imports_the_layers_above(graph):
    assert not layer_violations(graph), _report(layer_violations(graph))


def test_no_import_cycles(graph):
    assert not cycle_violations(graph), _report(cycle_violations(graph))


def test_every_module_is_in_a_layer(graph):
    assert not unclassified(graph), _report(unclassified(graph))


def test_no_module_imports_a_layer_above_its_own(graph):
    assert not upward_imports(graph), _report(upward_imports(graph))


def test_the_layers_have_no_cycle(graph):
    assert not layer_cycle_violations(graph), _report(layer_cycle_violations(graph))


def test_every_layer_member_is_a_module_of_the_package(graph):
    """No stale entry in :data:`LAYERS` (a moved package leaves none behind), and none listed twice."""
    members = [m for _, ms in LAYERS for m in ms]
    assert len(members) == len(set(members))
    assert [m for m in members if m not in graph] == []


def test_decoding_sits_below_training_benchmarks_and_commands(graph):
    """The decoder -- engine, proposers, drafters (the modules and their folder formats) and PASTA's language,
    layout, interpreter and metrics -- is classified below the face, so the rules above keep it from importing
    fastforward.train, fastforward.bench or fastforward.cli."""
    decoding = [m for m in graph if within(m, ("fastforward.engine", "fastforward.proposers", "fastforward.drafters",
                                               "fastforward.pasta"))]
    assert {"fastforward.drafters.draft_model", "fastforward.pasta.interpreter", "fastforward.pasta.language",
            "fastforward.pasta.layout"} <= set(decoding)
    assert all(RANK[layer_of(m)] > RANK["face"] for m in decoding), {m: layer_of(m) for m in decoding}
    assert {layer_of(m) for m in ("fastforward.train.draft_model", "fastforward.train.pasta.annotate",
                                  "fastforward.train.pasta.evaluation")} == {"research"}


# ----------------------------------------------------------------------------------------------------------------
# The checker can fail
# ----------------------------------------------------------------------------------------------------------------


def test_checker_reports_synthetic_violations():
    bad: Graph = {
        "fastforward": {"fastforward.engine": 1},
        "fastforward.engine": {"fastforward.model": 3, "fastforward.cli.options": 9},  # engine -> the CLI
        "fastforward.model": {},
        "fastforward.cli": {"fastforward": 2},  # the command layer may import the face
        "fastforward.cli.options": {"fastforward.model": 4},
        "fastforward.costs": {"fastforward": 5, "fastforward.tree_builder": 6},  # the face, and upwards
        "fastforward.tree_builder": {"fastforward.costs": 7},
        "fastforward.bench.methods": {"fastforward.bench.peers": 8},  # a circle of two
        "fastforward.bench.peers": {"fastforward.bench.methods": 10},
        "fastforward.bench": {"fastforward.bench.methods": 11},  # an __init__ re-exporting: not a cycle by itself
    }
    assert cli_violations(bad) == [
        "fastforward.engine -> fastforward.cli.options (line 9): only fastforward/cli/ may import the command line"]
    face = face_violations(bad)
    assert len(face) == 1 and face[0].startswith("fastforward.costs -> fastforward (line 5)")
    layers = layer_violations(bad)
    assert [v.split(":")[0] for v in layers] == ["fastforward.costs -> fastforward.tree_builder (line 6)",
                                                 "fastforward.engine -> fastforward.cli.options (line 9)"]
    found = cycles(bad)
    assert sorted(map(sorted, found)) == [
        ["fastforward.bench.methods", "fastforward.bench.methods", "fastforward.bench.peers"],
        ["fastforward.costs", "fastforward.costs", "fastforward.tree_builder"],
    ]
    messages = cycle_violations(bad)
    assert ("import cycle: fastforward.bench.methods -> fastforward.bench.peers (line 8) -> "
            "fastforward.bench.methods (line 10)") in messages
    assert len(all_violations(bad)) == 6
    # the same graph without the bad edges is clean
    broken = {("fastforward.engine", "fastforward.cli.options"), ("fastforward.costs", "fastforward"),
              ("fastforward.costs", "fastforward.tree_builder"),
              ("fastforward.bench.peers", "fastforward.bench.methods")}
    good = {a: {b: n for b, n in t.items() if (a, b) not in broken} for a, t in bad.items()}
    assert all_violations(good) == []


def test_checker_finds_a_cycle_through_a_package_init():
    """A submodule importing its package's ``__init__`` while the ``__init__`` imports it is a real cycle."""
    graph: Graph = {"fastforward.bench": {"fastforward.bench.report": 1},
                    "fastforward.bench.report": {"fastforward.bench": 2}}
    assert cycle_violations(graph) == [
        "import cycle: fastforward.bench -> fastforward.bench.report (line 1) -> fastforward.bench (line 2)"]


def test_builder_resolves_relative_and_function_level_imports(tmp_path):
    """The graph builder on a synthetic package: relative imports at every level, imports inside functions,
    ``from pkg import submodule`` vs ``from pkg import name``, and imports of other packages ignored."""
    pkg = tmp_path / "fastforward"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "cli").mkdir()
    (pkg / "__init__.py").write_text("from .engine import run\n__version__ = '0'\n")
    (pkg / "engine.py").write_text("import os\n\n\ndef run():\n    from .cli import main\n    return main\n")
    (pkg / "cli" / "__init__.py").write_text("def main():\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text(
        "import torch\nfrom .. import __version__\nfrom ..engine import run\nimport fastforward.sub.other as o\n")
    (pkg / "sub" / "other.py").write_text("from fastforward import sub\n")
    graph = build_graph(pkg)
    assert graph["fastforward"] == {"fastforward.engine": 1}
    assert graph["fastforward.engine"] == {"fastforward.cli": 5}  # found inside the function
    assert graph["fastforward.sub"] == {"fastforward.sub.leaf": 1}  # from . import leaf: the submodule
    assert graph["fastforward.sub.leaf"] == {"fastforward": 2, "fastforward.engine": 3, "fastforward.sub.other": 4}
    assert graph["fastforward.sub.other"] == {"fastforward.sub": 1}
    assert cli_violations(graph) == [
        "fastforward.engine -> fastforward.cli (line 5): only fastforward/cli/ may import the command line"]
    assert [v.split(":")[0] for v in face_violations(graph)] == ["fastforward.sub.leaf -> fastforward (line 2)"]
    assert cycle_violations(graph) == ["import cycle: fastforward.sub -> fastforward.sub.leaf (line 1) -> "
                                       "fastforward.sub.other (line 4) -> fastforward.sub (line 1)"]


def test_checker_reports_unclassified_modules_upward_imports_and_layer_cycles():
    bad: Graph = {
        "fastforward": {"fastforward.engine": 1},
        "fastforward.engine": {"fastforward.model": 3, "fastforward.train.trainer": 4},  # decoding -> training
        "fastforward.model": {"fastforward.errors": 5},
        "fastforward.errors": {},
        "fastforward.drafters.draft_model": {"fastforward.model": 6, "fastforward.train.launcher": 7},
        "fastforward.pasta.interpreter": {"fastforward.engine": 8, "fastforward.bench.questions": 9},
        "fastforward.train.trainer": {"fastforward": 10, "fastforward.bench.questions": 11},  # downwards: fine
        "fastforward.train.launcher": {"fastforward.errors": 12},
        "fastforward.bench.questions": {"fastforward.errors": 13},
        "fastforward.newthing": {"fastforward.engine": 14},  # in no layer
    }
    assert unclassified(bad) == [
        "fastforward.newthing: in no layer; add it (or its package) to LAYERS in tests/test_layering.py"]
    assert [v.split(":")[0] for v in upward_imports(bad)] == [
        "fastforward.drafters.draft_model -> fastforward.train.launcher (line 7)",
        "fastforward.engine -> fastforward.train.trainer (line 4)",
        "fastforward.pasta.interpreter -> fastforward.bench.questions (line 9)",
    ]
    assert upward_imports(bad)[1].endswith("the engine layer imports the research layer, which is above it")
    cyc = layer_cycle_violations(bad)
    assert len(cyc) == 1 and cyc[0].startswith("layer cycle: ")
    assert "fastforward.engine -> fastforward.train.trainer (line 4)" in cyc[0]
    assert len(layering_violations(bad)) == 5
    # without the upward edges and the stray module, clean
    upward = {("fastforward.engine", "fastforward.train.trainer"),
              ("fastforward.drafters.draft_model", "fastforward.train.launcher"),
              ("fastforward.pasta.interpreter", "fastforward.bench.questions")}
    good = {a: {b: n for b, n in t.items() if (a, b) not in upward}
            for a, t in bad.items() if a != "fastforward.newthing"}
    assert layering_violations(good) == []


def test_layer_of_reads_the_closest_package_and_the_face_exactly():
    assert layer_of("fastforward") == "face"
    assert layer_of("fastforward.train.pasta.annotate") == "research"
    assert layer_of("fastforward.pasta.annotate") == "methods"  # were it put back, it would be decoding code
    assert layer_of("fastforward.cli.__main__") == "commands"
    assert layer_of("fastforward.treeish") is None  # not fastforward.tree
    assert layer_of("fastforward.somewhere_new") is None
