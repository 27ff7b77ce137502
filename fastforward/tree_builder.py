"""Trees as data the package builds: measure, construct greedily, size for this machine.

Medusa built its ``mc_sim_7b_63`` tree by measuring how often each head's rank-r guess was right and growing the
tree greedily; TR-Jacobi fills trees the same way (a candidate table ``cand[depth, rank]``), so the same recipe
applies, with one change for CPUs: the node budget is chosen from the measured cost of a forward, because here a
69-token verification costs several single-token steps.

1. :func:`collect_calibration` runs TR-Jacobi (greedy) with a wide calibration tree on calibration prompts and
   records every step's candidate table and retrieval chain; the final output (= the AR output, decoding being
   lossless) says which entries were right.
2. :func:`acceptance_rates`: ``rate[d, r]`` = how often the rank-r candidate at depth d+1 was the correct token,
   counted over the steps whose table held the correct token at every shallower depth (its parent path correct).
3. :func:`greedy_tree`: repeatedly add the node (path of ranks) with the largest product of rates along its path,
   which is the node's probability of being accepted, so each addition maximises the expected accepted length.
   The order of addition is kept: every prefix of it is the greedy tree for a smaller budget.
4. :func:`replay_tau` replays the recorded steps to get the tokens per forward τ(n) each prefix would have given
   (tree and retrieval chain together; :func:`expected_tau` is the rates-only model), :func:`choose_budget` picks
   the n maximising τ(n)·t(1)/t(q(n)) from the cost curve t(q) of :func:`measure_forward_costs`, interpolated by
   :class:`~fastforward.costs.CostCurve`.

Calibration prompts come from question files (:func:`select_calibration`). ``fastforward build-tree``
(``fastforward/cli/tree.py``) runs all of it and writes the tree as JSON.
"""

from __future__ import annotations

import heapq
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .costs import DEFAULT_QS, CostCurve, best_draft, measure_forward_costs
from .engine import Generation
from .errors import UsageError
from .paths import owned_json
from .proposers.tr_jacobi import TRJacobiProposer, build_template
from .tree import TREE_FORMAT, is_built_tree, write_tree_file

__all__ = [
    "Calibration",
    "acceptance_rates",
    "build_tree",
    "calibration_choices",
    "choose_budget",
    "collect_calibration",
    "expected_tau",
    "greedy_tree",
    "interpolate_cost",
    "measure_forward_costs",
    "replay_tau",
    "save_tree",
    "select_calibration",
    "size_tree",
]


def _pick(items: list, n: int, offset: int) -> list:
    """n evenly spaced items starting at ``offset`` (wrapping), without repeats."""
    if n >= len(items):
        return list(items)
    picked = []
    for i in range(n):
        item = items[(offset + (i * len(items)) // n) % len(items)]
        if all(item is not p for p in picked):
            picked.append(item)
    return picked


def select_calibration(questions: list, per_category: int | None, limit: int | None, offset: int) -> list:
    """The calibration questions (records with a ``category``, as :mod:`fastforward.bench.questions` loads them):
    from each category (``per_category``) or, with ``limit``, from the whole list (default 12), evenly spaced items
    starting at index ``offset``.

    With offset 11 on Spec-Bench's 80-question categories, ``per_category=2`` takes indices 11 and 51 (4 takes 11,
    31, 51, 71): never among the first 8 of a category nor at the multiples of 10 or 20 the benchmark's evenly
    spaced selection picks (its ``--per-category 4`` and ``8``), so calibration and benchmark prompts are disjoint.
    """
    if per_category is not None:
        groups: dict[str, list] = {}
        for q in questions:
            groups.setdefault(q.category, []).append(q)
        chosen = {id(q) for items in groups.values() for q in _pick(items, per_category, offset)}
        return [q for q in questions if id(q) in chosen]
    return _pick(questions, limit if limit is not None else 12, offset)


def calibration_choices(width: int = 10, depth: int = 5) -> list[list[int]]:
    """The calibration tree: every depth-1 rank with a rank-0 chain below it down to ``depth`` (a comb).

    What is measured is the candidate table, whose every row holds ``width`` candidates whatever the tree; the
    tree only decides which logits refill the table, and a comb gives every accepted node a full-depth
    continuation, as a tree built for any budget would at its most used nodes.
    """
    return [[r] + [0] * j for r in range(width) for j in range(depth)]


@dataclass
class Calibration:
    """What the calibration runs recorded, one row per decoding step (S steps, D depths, K ranks)."""

    hits: torch.Tensor  # [S, D, K] bool: cand[d, r] equalled the true token at depth d+1 (and it is known)
    valid: torch.Tensor  # [S, D] bool: the true token at depth d+1 is known (inside the generated text)
    retrieval_accept: torch.Tensor  # [S] long: leading retrieval-chain tokens that were correct
    retrieval_lengths: torch.Tensor | None = None  # [S] long: retrieval tokens proposed (the chain is cut to them)
    prompts: int = 0
    new_tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return self.hits.shape[0]


def _record_steps(record, sequence: torch.Tensor, depth: int, width: int, retrieval_len: int):
    """hits/valid/retrieval_accept of one generation from the proposer's record of (root position, table, chain)."""
    n = sequence.numel()
    positions = torch.tensor([pos for pos, _, _ in record]).unsqueeze(1) + 1  # [S, 1]
    rows = positions + torch.arange(depth)  # [S, D] absolute positions the table rows guess
    valid = rows < n
    truth = sequence[rows.clamp(max=n - 1)]
    tables = torch.stack([t for _, t, _ in record]) if depth else torch.zeros(len(record), 0, width, dtype=torch.long)
    hits = (tables == truth.unsqueeze(-1)) & valid.unsqueeze(-1)
    retrieval = torch.zeros(len(record), dtype=torch.long)
    lengths = torch.tensor([chain.numel() for _, _, chain in record], dtype=torch.long)
    if retrieval_len:
        chain_pos = positions + torch.arange(retrieval_len)
        chain_truth = torch.where(chain_pos < n, sequence[chain_pos.clamp(max=n - 1)], -1)
        chains = torch.full((len(record), retrieval_len), -2, dtype=torch.long)
        for i, (_, _, chain) in enumerate(record):
            chains[i, : chain.numel()] = chain
        retrieval = (chains == chain_truth).long().cumprod(1).sum(1)
    return hits, valid, retrieval, lengths


def collect_calibration(
    target,
    prompts: Sequence,
    *,
    max_new_tokens: int = 128,
    width: int = 10,
    depth: int = 5,
    retrieval_len: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Run greedy TR-Jacobi with :func:`calibration_choices` over ``prompts`` (token-id lists, or strings that
    are encoded with the chat template) and record every step's table and retrieval chain against the output."""
    if not prompts:
        raise UsageError("no calibration prompts")
    template = build_template(calibration_choices(width, depth), retrieval_len)
    parts, stats = [], dict(prompts=0, new_tokens=0, forwards=0)
    t_start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        ids = target.encode(prompt) if isinstance(prompt, str) else list(prompt)
        record = []  # per step: (root position, candidate table, retrieval chain), from the proposal's info

        def observe(state, step, record=record):
            info = step.proposal.info
            record.append((info["root_position"], info["candidates"], info["retrieval"]))

        t0 = time.perf_counter()
        result = Generation(target, ids, TRJacobiProposer(template), max_new_tokens=max_new_tokens, seed=seed + i,
                            observers=[observe]).run()
        sequence = torch.tensor(ids + result.token_ids, dtype=torch.long)
        if record:
            parts.append(_record_steps(record, sequence, template.depth, template.width, retrieval_len))
        stats["prompts"] += 1
        stats["new_tokens"] += len(result.token_ids)
        stats["forwards"] += result.stats.target_forwards
        if progress:
            progress(f"calibration {i + 1}/{len(prompts)}: {len(ids)} prompt tokens, {len(result.token_ids)} new, "
                     f"tau {result.stats.tau:.2f}, {time.perf_counter() - t0:.1f}s")
    if not parts:
        raise UsageError("the calibration runs made no drafting step (every answer ended at once)")
    hits, valid, retrieval, lengths = (torch.cat(x) for x in zip(*parts, strict=True))
    return Calibration(hits, valid, retrieval, lengths, seconds=time.perf_counter() - t_start, **stats)


def acceptance_rates(cal: Calibration) -> torch.Tensor:
    """``[D, K]``: P(rank r right at depth d+1 | the correct token was in every shallower row), from the steps."""
    row_hit = cal.hits.any(-1)  # [S, D]
    prefix_ok = torch.ones_like(row_hit)
    prefix_ok[:, 1:] = row_hit[:, :-1].long().cumprod(1).bool()
    counted = prefix_ok & cal.valid
    accepted = (cal.hits & counted.unsqueeze(-1)).sum(0).double()
    return accepted / counted.sum(0).clamp(min=1).double().unsqueeze(-1)


def greedy_tree(rates, max_nodes: int, max_depth: int | None = None) -> tuple[list[tuple[int, ...]], list[float]]:
    """Grow a tree node by node, each time adding the candidate node (a child of the tree) whose path has the
    largest product of rates (its acceptance probability; ties: the shallower, then lower ranks). Returns the
    nodes in the order added and their probabilities; stops early when no candidate has a probability above 0."""
    rates = torch.as_tensor(rates, dtype=torch.float64)
    if rates.ndim != 2:
        raise UsageError("rates must be a [depth, rank] table")
    if not isinstance(max_nodes, int) or max_nodes < 0:
        raise UsageError(f"max_nodes must be an integer >= 0, got {max_nodes!r}")
    depth_limit = rates.shape[0] if max_depth is None else min(max_depth, rates.shape[0])
    table = rates.tolist()
    frontier: list[tuple[float, int, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...], value: float) -> None:
        d = len(path)
        if d < depth_limit:
            for r, rate in enumerate(table[d]):
                heapq.heappush(frontier, (-value * rate, d + 1, path + (r,)))

    push_children((), 1.0)
    nodes, values = [], []
    while frontier and len(nodes) < max_nodes:
        neg, _, path = heapq.heappop(frontier)
        if -neg <= 0:
            break
        nodes.append(path)
        values.append(-neg)
        push_children(path, -neg)
    return nodes, values


def expected_tau(rates, choices) -> float:
    """1 + the sum over nodes of the product of rates along their paths (the bonus token counts)."""
    rates = torch.as_tensor(rates, dtype=torch.float64)
    total = 1.0
    for path in {tuple(c) for c in choices}:
        p = 1.0
        for d, r in enumerate(path):
            p *= float(rates[d, r]) if d < rates.shape[0] and r < rates.shape[1] else 0.0
        total += p
    return total


def replay_tau(cal: Calibration, nodes: Sequence[Sequence[int]]) -> list[float]:
    """τ(n) for n = 0..len(nodes): the mean tokens per forward (1 + accepted) that the tree made of the first n
    nodes and the retrieval chain would have given on the recorded steps (table dynamics as recorded)."""
    steps = cal.steps
    accepted = torch.zeros(steps, dtype=torch.long)
    ok: dict[tuple[int, ...], torch.Tensor] = {(): torch.ones(steps, dtype=torch.bool)}
    taus = [float((1 + torch.maximum(accepted, cal.retrieval_accept)).double().mean())]
    depth, width = cal.hits.shape[1], cal.hits.shape[2]
    for node in nodes:
        path = tuple(node)
        parent = ok.get(path[:-1])
        if parent is None:
            raise UsageError(f"node {list(path)} comes before its parent")
        d, r = len(path), path[-1]
        hit = cal.hits[:, d - 1, r] if d <= depth and r < width else torch.zeros(steps, dtype=torch.bool)
        ok[path] = parent & hit
        accepted = torch.where(ok[path], torch.clamp(accepted, min=d), accepted)
        taus.append(float((1 + torch.maximum(accepted, cal.retrieval_accept)).double().mean()))
    return taus


def interpolate_cost(costs: dict, q: float) -> float:
    """t(q) from measured points (q -> ms), as :class:`~fastforward.costs.CostCurve` interpolates them: piecewise
    linear and monotone, linear extrapolation from the last two beyond the largest, the smallest point's cost below
    it."""
    return CostCurve(dict(costs)).t(q)


def choose_budget(taus: Sequence[float], costs: dict, extra_tokens=6, min_nodes: int = 1) -> tuple[int, list]:
    """The node budget n maximising τ(n)/t(n + extra), and the predicted speedup τ(n)·t(1)/t(n + extra) for
    every n. ``taus[n]`` is τ with n tree nodes; ``extra_tokens`` counts the other tokens of a forward (root and
    retrieval chain): an int, or a ``{extra: weight}`` distribution over steps (the chain is cut to the lookup's
    match, so its length varies), in which case t is the weighted mean. Ties go to the smaller tree."""
    if len(taus) <= min_nodes:
        raise UsageError(f"need τ for at least {min_nodes + 1} tree sizes")
    dist = {int(extra_tokens): 1.0} if isinstance(extra_tokens, int) else dict(extra_tokens)
    total = sum(dist.values())
    if total <= 0:
        raise UsageError("extra_tokens weights must sum to a positive number")
    curve = CostCurve(dict(costs))
    t1 = curve.t(1)

    def cost(n: int) -> float:
        return sum(w * curve.t(n + e) for e, w in dist.items()) / total

    speedups = [tau * t1 / cost(n) for n, tau in enumerate(taus)]
    # priced as every draft is (costs.best_draft), in units of a plain step's tokens per millisecond
    sizes = range(min_nodes, len(taus))
    best = min_nodes + best_draft([taus[n] * t1 for n in sizes], [cost(n) for n in sizes])
    return best, speedups


def sweep_spread(sweeps: Sequence[dict]) -> float:
    """Median over q of (slowest - fastest) / fastest across cost sweeps: how much other processes disturbed the
    measurement (a quiet machine gives a few percent)."""
    spreads = sorted((max(s[q] for s in sweeps) - min(s[q] for s in sweeps)) / min(s[q] for s in sweeps)
                     for q in sweeps[0])
    return spreads[len(spreads) // 2]


def _min_costs(*sweeps: dict) -> dict:
    return {q: min(s[q] for s in sweeps) for q in sweeps[0]}


def cost_qs(max_nodes: int, retrieval_len: int) -> list[int]:
    """The q values the cost curve is measured at: the profile's points, every q up to 16 (where small budgets land
    and the engine switches matmul paths, so linear interpolation would mislead), 24, 48 and the largest tree."""
    return sorted(set(DEFAULT_QS) | set(range(1, 17)) | {24, 48, max_nodes + 1 + retrieval_len})


def _extra_tokens(data: dict) -> dict[int, float]:
    """{tokens besides the tree nodes: weight} over the calibration steps (root + the retrieval chain's length)."""
    counts = data.get("retrieval_length_counts")
    if counts:
        return {1 + int(m): float(c) for m, c in counts.items() if c}
    mean = float(data.get("mean_retrieval_tokens", data.get("retrieval_len", 0)))  # older files: the mean only
    low = int(mean)
    return {1 + low: 1.0 - (mean - low), 2 + low: mean - low} if mean > low else {1 + low: 1.0}


def size_tree(data: dict, costs: dict, budget: int | str = "auto", sweeps: Sequence[dict] = (), kv: int = 300,
              target=None) -> dict:
    """Choose the node budget of a measured tree (``data`` holds ``greedy_order`` and ``tau_by_nodes`` from
    :func:`build_tree`) for the cost curve ``costs`` (q -> ms), and fill in the tree and its predictions.

    Only this part depends on the machine's speed, so a tree re-sized after the engine or machine changed
    (``fastforward build-tree --from TREE``) keeps its calibration and needs only a fresh cost curve."""
    order = [list(p) for p in data["greedy_order"]]
    taus = data["tau_by_nodes"]
    if len(taus) != len(order) + 1:
        raise UsageError("a tree's tau_by_nodes must have one entry more than its greedy_order")
    if budget != "auto" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise UsageError(f"budget must be 'auto' or a positive integer, got {budget!r}")
    best, speedups = choose_budget(taus, costs, _extra_tokens(data))
    n = best if budget == "auto" else min(budget, len(order))
    out = dict(data)
    out.update(
        choices=order[:n],
        nodes=n,
        tokens_per_forward=n + 1 + int(data["retrieval_len"]),
        budget=budget,
        predicted_tau=round(taus[n], 4),
        predicted_tau_rates_only=round(data["tau_rates_only_by_nodes"][n], 4),
        predicted_speedup=round(speedups[n], 4),
        speedup_by_nodes=[round(x, 4) for x in speedups],
        cost_curve_ms={str(q): round(float(costs[q]), 2) for q in sorted(costs, key=int)},
        cost_sweeps_ms=[{str(q): round(float(s[q]), 2) for q in sorted(s, key=int)} for s in sweeps],
        cost_sweep_spread=round(sweep_spread(sweeps), 3) if len(sweeps) > 1 else None,
        cost_kv=kv,
        threads=torch.get_num_threads(),
        sized=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    if target is not None:
        backend = getattr(target, "backend", None)
        out["machine"] = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                          "backend": getattr(target, "backend_name", ""),
                          "matmul": getattr(backend, "matmul_kernel", "")}
    order_keys = ["format", "method", "model", "choices", "nodes", "tokens_per_forward", "budget", "predicted_tau",
                  "predicted_tau_rates_only", "predicted_speedup", "retrieval_len", "mean_retrieval_tokens"]
    return {k: out[k] for k in order_keys if k in out} | {k: v for k, v in out.items() if k not in order_keys}


def measure_costs(target, qs, kv: int = 300, repeats: int = 7, sweeps: int = 2,
                  progress: Callable[[str], None] | None = None) -> tuple[dict, list[dict]]:
    """The cost curve as the faster median per q over ``sweeps`` sweeps, so that a burst of load from other
    processes during one sweep does not decide the budget; returns (curve, sweeps)."""
    done = []
    for i in range(sweeps):
        if progress:
            progress(f"measuring forward costs, sweep {i + 1}/{sweeps}: q = {list(qs)} (KV {kv}, {repeats} repeats)")
        done.append(measure_forward_costs(target, qs, kv, repeats))
    return _min_costs(*done), done


def build_tree(
    target,
    prompts: Sequence,
    *,
    max_nodes: int = 64,
    budget: int | str = "auto",
    width: int = 10,
    depth: int = 5,
    retrieval_len: int = 5,
    max_new_tokens: int = 128,
    seed: int = 0,
    kv: int = 300,
    repeats: int = 7,
    costs: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Measure, build and size a TR-Jacobi tree for ``target`` on this machine; returns the JSON-ready tree.

    ``costs`` (q -> ms) skips the cost measurement (tests); otherwise the cost curve is measured once before and
    once after calibration (at :func:`cost_qs`), keeping the faster median per q.
    """
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise UsageError(f"max_nodes must be a positive integer, got {max_nodes!r}")
    if budget != "auto" and (not isinstance(budget, int) or not 1 <= budget <= max_nodes):
        raise UsageError(f"budget must be 'auto' or an integer in 1..{max_nodes}, got {budget!r}")
    qs = cost_qs(max_nodes, retrieval_len)
    sweeps = []
    if costs is None:
        sweeps += measure_costs(target, qs, kv, repeats, 1, progress)[1]
    cal = collect_calibration(target, prompts, max_new_tokens=max_new_tokens, width=width, depth=depth,
                              retrieval_len=retrieval_len, seed=seed, progress=progress)
    if costs is None:
        sweeps += measure_costs(target, qs, kv, repeats, 1, progress)[1]
        costs = _min_costs(*sweeps)
    rates = acceptance_rates(cal)
    order, probs = greedy_tree(rates, max_nodes)
    if not order:
        raise UsageError("no calibration step ever had a correct candidate; nothing to build a tree from")
    taus = replay_tau(cal, order)
    tau_model = [1.0]
    for p in probs:
        tau_model.append(tau_model[-1] + p)
    lengths = cal.retrieval_lengths if cal.retrieval_lengths is not None else torch.full((cal.steps,), retrieval_len)
    data = {
        "format": TREE_FORMAT,
        "method": "tr-jacobi",
        "model": getattr(target, "name", "model"),
        "retrieval_len": retrieval_len,
        "mean_retrieval_tokens": round(float(lengths.double().mean()), 3),
        "retrieval_length_counts": {str(m): int((lengths == m).sum()) for m in range(retrieval_len + 1)},
        "tau_by_nodes": [round(x, 4) for x in taus],
        "tau_rates_only_by_nodes": [round(x, 4) for x in tau_model],
        "greedy_order": [list(p) for p in order],
        "acceptance_rates": [[round(float(x), 4) for x in row] for row in rates],
        "calibration": {
            "tree": f"comb: ranks 0..{width - 1} at depth 1, each with a rank-0 chain to depth {depth}",
            "prompts": cal.prompts, "new_tokens_per_prompt": max_new_tokens, "new_tokens": cal.new_tokens,
            "forwards": cal.forwards, "steps": cal.steps, "seconds": round(cal.seconds, 1), "seed": seed,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return size_tree(data, costs, budget, sweeps, kv, target)


def is_tree_file(path) -> bool:
    """Whether ``path`` holds a tree ``fastforward build-tree`` wrote (so writing there again replaces only that); a
    long file by its start, ``{"format": ...`` (:func:`~fastforward.paths.owned_json` reads a bounded prefix)."""
    return owned_json(path, lambda data: is_built_tree(data) and data.get("format", TREE_FORMAT) == TREE_FORMAT,
                      "format")


def save_tree(data: dict, path) -> Path:
    """Write a built tree file (see :func:`fastforward.tree.write_tree_file`)."""
    return write_tree_file(data, path)
