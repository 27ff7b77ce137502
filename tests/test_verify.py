"""Verification: greedy acceptance on hand-built logits, and lossless tree sampling checked with chi-squared tests.

The sampling tests draw with fixed seeds, so they are deterministic; the significance level only says how unlikely a
correct sampler is to fail them (and a biased one is caught: see ``test_chi2_detects_a_biased_sampler``).
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward import DraftTree, Proposal, Proposer, SamplingConfig, TreeShape, UsageError
from fastforward.testing import tiny_target
from fastforward.verify import (
    PositionKeyedUniforms,
    Verdict,
    argmax_rows,
    sample_at,
    target_probs,
    verify,
    verify_greedy,
    verify_sampling,
)

ALPHA = 1e-3  # a correct sampler fails one chi-squared test in a thousand seeds; these seeds are fixed
VOCAB = 8


# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def logits_with_argmax(argmaxes, vocab=10, seed=0):
    """Random logits whose row i has its (unique, clear) maximum at ``argmaxes[i]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(len(argmaxes), vocab, generator=g, dtype=torch.float64)
    x[torch.arange(len(argmaxes)), torch.as_tensor(argmaxes)] = 5.0
    return x


def chi2_pvalue(counts, probs) -> float:
    """Pearson's chi-squared goodness-of-fit p-value; cells expecting < 5 draws are pooled.

    Draws in cells of probability zero make the test fail outright (the sampler emitted an impossible token).
    """
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    assert counts.shape == probs.shape
    assert abs(float(probs.sum()) - 1) < 1e-9
    assert float(counts[probs == 0].sum()) == 0, "a token of probability zero was drawn"
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    small = (probs > 0) & ~big
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if small.any():
        obs.append(float(counts[small].sum()))
        exp.append(float(expected[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = len(obs) - 1
    assert df >= 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def reference_probs(logits, temperature, top_k=0, top_p=1.0):
    """Temperature, then top-k, then top-p (on the renormalised top-k), written independently of the library."""
    x = [float(v) / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[:top_k] if top_k else order
    z = torch.tensor([x[i] for i in keep], dtype=torch.float64).softmax(0).tolist()
    kept, mass = [], 0.0
    for i, p in zip(keep, z, strict=True):
        kept.append(i)
        mass += p
        if mass >= top_p:
            break
    out = torch.zeros(len(x), dtype=torch.float64)
    vals = torch.tensor([x[i] for i in kept], dtype=torch.float64).softmax(0)
    out[kept] = vals
    return out


def first_token(tree: DraftTree, verdict: Verdict) -> int:
    return int(tree.tokens[verdict.path[1]]) if len(verdict.path) > 1 else verdict.bonus


CONFIGS = [
    SamplingConfig(temperature=0.8),
    SamplingConfig(temperature=0.8, top_k=4),
    SamplingConfig(temperature=1.3, top_p=0.7),
]
CONFIG_IDS = ["T0.8", "T0.8-topk4", "T1.3-topp0.7"]


def fixed_logits(rows, seed=1, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g, dtype=torch.float64) * scale


# --------------------------------------------------------------------------------------------------------------
# Sampling configuration and the target distribution
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": 0.7, "top_p": 0.0},
        {"temperature": 0.7, "top_p": 1.5},
        {"temperature": 0.7, "top_p": -0.1},
        {"temperature": 0.7, "top_k": -1},
        {"temperature": 0.7, "top_k": 2.5},
        {"temperature": "hot"},
    ],
)
def test_sampling_config_rejects(kwargs):
    with pytest.raises(UsageError):
        SamplingConfig(**kwargs)


def test_sampling_config_greedy_flag():
    assert SamplingConfig().greedy
    assert SamplingConfig(temperature=0).greedy
    assert not SamplingConfig(temperature=0.5).greedy
    assert SamplingConfig(temperature=0.5, top_p=1.0).top_p == 1.0  # the upper bound is allowed


def test_target_probs_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=1.0))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.6))  # 0.5 < 0.6, 0.5 + 0.3 >= 0.6
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.5))  # the top token alone reaches 0.5
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=0.5))  # p^2 renormalised
    assert torch.allclose(p, torch.tensor([0.25, 0.09, 0.04], dtype=torch.float64) / 0.38)


@pytest.mark.parametrize("cfg", CONFIGS + [SamplingConfig(0.6, top_k=3, top_p=0.9)])
def test_target_probs_matches_reference(cfg):
    logits = fixed_logits(6, seed=3)
    for row in logits:
        want = reference_probs(row.tolist(), cfg.temperature, cfg.top_k, cfg.top_p)
        assert torch.allclose(target_probs(row, cfg), want, atol=1e-12)


# --------------------------------------------------------------------------------------------------------------
# Greedy verification, hand-built
# --------------------------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 6), V=st.integers(1, 70), levels=st.sampled_from([2, 5, 10**6]),
       specials=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 69),
                                   st.sampled_from([float("nan"), float("inf"), -float("inf")])), max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_argmax_rows_is_torch_argmax(rows, V, levels, specials, seed):
    """The greedy choice every method shares is torch's argmax, natively or not: the first largest value, ties
    (few levels), NaN (the first NaN wins), infinities, widths that are no multiple of the vector width."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, V), generator=g).float()
    for r, c, v in specials:
        if r < rows and c < V:
            x[r, c] = v
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(argmax_rows(x.double()), x.double().argmax(-1))  # other dtypes: torch's own


@settings(max_examples=120, deadline=None)
@given(data=st.data(), n=st.integers(2, 24), V=st.integers(1, 12), levels=st.sampled_from([2, 3, 10**6]),
       nan=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_native_greedy_verification_is_the_torch_one(data, n, V, levels, nan, seed):
    """Greedy verification of any tree natively (fp32 logits) gives the torch path's verdict (the same values in
    float64): the first accepted node of the greatest depth, its path and the bonus token -- ties in the logits, a
    NaN, chains and bushy trees, tokens mostly right (a vocabulary of a few ids)."""
    from fastforward.verify import _native

    if _native("greedy_verify") is None:
        pytest.skip("the native kernels are unavailable here")
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n,), generator=g)
    logits = torch.randint(0, levels, (n + 2, V), generator=g).float()
    if nan:
        logits[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, V - 1))] = float("nan")
    tree = DraftTree(tokens, TreeShape(torch.tensor(parents)))
    native, reference = verify_greedy(tree, logits), verify_greedy(tree, logits.double())
    assert (native.path, native.bonus) == (reference.path, reference.bonus)


def test_argmax_rows_of_a_vocabulary():
    x = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3))
    x[4, 40000] = x[4, 17] = 100.0  # a tie: the first
    assert torch.equal(argmax_rows(x), x.argmax(-1)) and int(argmax_rows(x)[4]) == 17


def test_greedy_partial_acceptance():
    tree = DraftTree.chain(7, [3, 4, 5])
    logits = logits_with_argmax([3, 4, 9, 1])  # 3 and 4 right, 5 wrong (the target wants 9)
    v = verify_greedy(tree, logits)
    assert v.path == [0, 1, 2] and v.accepted == 2 and v.bonus == 9


def test_greedy_full_acceptance():
    tree = DraftTree.chain(7, [3, 4, 5])
    logits = logits_with_argmax([3, 4, 5, 6])
    v = verify_greedy(tree, logits)
    assert v.path == [0, 1, 2, 3] and v.accepted == 3 and v.bonus == 6


def test_greedy_nothing_accepted():
    tree = DraftTree.chain(7, [3, 4, 5])
    logits = logits_with_argmax([8, 4, 5, 6])  # the later drafts would be right, but the first is not
    v = verify_greedy(tree, logits)
    assert v.path == [0] and v.accepted == 0 and v.bonus == 8


def test_greedy_root_only():
    v = verify_greedy(DraftTree.single(7), logits_with_argmax([2]))
    assert v.path == [0] and v.bonus == 2


def test_greedy_branch_picks_deepest_path():
    #          0 (root)
    #        /   \
    #   1 (tok 3)  2 (tok 3)
    #      |         |
    #   3 (tok 4)  4 (tok 6)
    #                |
    #              5 (tok 2)
    tree = DraftTree.from_parents([7, 3, 3, 4, 6, 2], [-1, 0, 0, 1, 2, 4])
    argmax = [3, 4, 6, 1, 2, 9]  # at node i, the target wants argmax[i] next
    v = verify_greedy(tree, logits_with_argmax(argmax))
    assert v.path == [0, 2, 4, 5] and v.bonus == 9
    # if node 4 is wrong, its correct child 5 is unreachable and the other branch (depth 2) wins
    argmax[2] = 0
    v = verify_greedy(tree, logits_with_argmax(argmax))
    assert v.path == [0, 1, 3] and v.bonus == 1


def test_greedy_sibling_choice():
    tree = DraftTree.from_parents([7, 1, 2, 3], [-1, 0, 0, 0])
    for want, node in [(1, 1), (2, 2), (3, 3)]:
        v = verify_greedy(tree, logits_with_argmax([want, 5, 6, 8]))
        assert v.path == [0, node] and v.bonus == [5, 6, 8][node - 1]
    v = verify_greedy(tree, logits_with_argmax([4, 5, 6, 8]))
    assert v.path == [0] and v.bonus == 4


def test_greedy_equal_depth_tie_takes_first_node():
    tree = DraftTree.from_parents([7, 3, 3], [-1, 0, 0])  # two identical candidates
    v = verify_greedy(tree, logits_with_argmax([3, 4, 5]))
    assert v.path == [0, 1] and v.bonus == 4


def test_verify_dispatches_on_temperature():
    tree = DraftTree.chain(7, [3, 4])
    logits = logits_with_argmax([3, 4, 5])
    assert verify(tree, logits, SamplingConfig()).path == [0, 1, 2]
    g = torch.Generator().manual_seed(0)
    v = verify(tree, logits * 100, SamplingConfig(temperature=1.0), g)  # ~one-hot: sampling picks the argmax
    assert v.path == [0, 1, 2] and v.bonus == 5


@st.composite
def greedy_cases(draw):
    n = draw(st.integers(1, 14))
    chain = draw(st.booleans())
    parents = [-1] + [i - 1 if chain else draw(st.integers(0, i - 1)) for i in range(1, n)]
    vocab = 4
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    argmax = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return parents, tokens, argmax


@settings(max_examples=80, deadline=None)
@given(greedy_cases())
def test_greedy_matches_brute_force(case):
    parents, tokens, argmax = case
    n = len(parents)
    ok = [True] * n
    depth = [0] * n
    for i in range(1, n):
        ok[i] = ok[parents[i]] and tokens[i] == argmax[parents[i]]
        depth[i] = depth[parents[i]] + 1
    best = max((i for i in range(n) if ok[i]), key=lambda i: (depth[i], -i))
    path = [best]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    v = verify_greedy(DraftTree.from_parents(tokens, parents), logits_with_argmax(argmax, vocab=4))
    assert v.path == path[::-1]
    assert v.bonus == argmax[best]


# --------------------------------------------------------------------------------------------------------------
# Lossless sampling: chi-squared tests on verify_sampling with fixed logits
# --------------------------------------------------------------------------------------------------------------


def test_chi2_helper():
    p = torch.full((VOCAB,), 1 / VOCAB, dtype=torch.float64)
    assert chi2_pvalue([1000] * VOCAB, p) == pytest.approx(1.0)
    assert chi2_pvalue([1200] + [1000] * (VOCAB - 2) + [800], p) < ALPHA
    with pytest.raises(AssertionError):
        chi2_pvalue([1, 1, 1], [0.5, 0.5, 0.0])  # a token of probability zero was drawn


N_DRAWS = 12000


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_first_token_point_mass_drafts(cfg):
    """Children without draft probabilities (distinct tokens): the first emitted token is distributed as p."""
    logits = fixed_logits(7)
    # root -> {2, 5, 7}; 2 -> {1, 2}; 5 -> {0}; 1 -> {3}
    tree = DraftTree.from_parents([4, 2, 5, 7, 1, 2, 0], [-1, 0, 0, 0, 1, 1, 2])
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB)
    depth_hits = 0
    for _ in range(N_DRAWS):
        v = verify_sampling(tree, logits, cfg, g)
        counts[first_token(tree, v)] += 1
        depth_hits += v.accepted > 0
    want = reference_probs(logits[0].tolist(), cfg.temperature, cfg.top_k, cfg.top_p)
    assert chi2_pvalue(counts, want) > ALPHA
    assert depth_hits > 0  # drafts were accepted sometimes: the tree walk was exercised


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_first_token_with_draft_probs(cfg):
    """Siblings sampled i.i.d. from q and verified by recursive rejection: the first token is distributed as p."""
    logits = fixed_logits(4)
    q = (fixed_logits(1, seed=7)[0] * 0.7).softmax(0)  # a different, full-support draft distribution
    shape = TreeShape([-1, 0, 0, 0])  # three i.i.d. siblings
    probs = q.expand(4, VOCAB)
    g = torch.Generator().manual_seed(99)
    draft_g = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB)
    accepted = 0
    for _ in range(N_DRAWS):
        kids = torch.multinomial(q, 3, replacement=True, generator=draft_g)
        tree = DraftTree(torch.cat([torch.tensor([4]), kids]), shape, probs)
        v = verify_sampling(tree, logits, cfg, g)
        counts[first_token(tree, v)] += 1
        accepted += v.accepted
    want = reference_probs(logits[0].tolist(), cfg.temperature, cfg.top_k, cfg.top_p)
    assert chi2_pvalue(counts, want) > ALPHA
    assert 0 < accepted < N_DRAWS  # both acceptance and rejection happened


def _two_token_joint(cfg, tree_for_trial, logits_for_tree, n_draws, seed):
    """Joint counts of the first two tokens a drafted step leads to (the second drawn as the next AR step would
    when only one token was emitted)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(n_draws):
        tree = tree_for_trial()
        logits = logits_for_tree(tree)
        v = verify_sampling(tree, logits, cfg, g)
        emitted = tree.tokens[v.path[1:]].tolist() + [v.bonus]
        if len(emitted) == 1:
            nxt = torch.multinomial(target_probs(NEXT[emitted[0]], cfg), 1, generator=g)
            emitted.append(int(nxt))
        counts[emitted[0], emitted[1]] += 1
    return counts


# The synthetic "model" for two-token tests: logits at the root, and logits after each first token.
ROOT_LOGITS = fixed_logits(1, seed=11)[0]
NEXT = fixed_logits(VOCAB, seed=12)


def _logits_by_token(tree):
    """Row 0: the root's logits; any other node: the logits after its token (a depth-2 tree only needs these)."""
    rows = [ROOT_LOGITS] + [NEXT[int(t)] for t in tree.tokens[1:]]
    return torch.stack(rows)


def _expected_joint(cfg):
    p1 = target_probs(ROOT_LOGITS, cfg)
    return p1.unsqueeze(1) * torch.stack([target_probs(NEXT[x], cfg) for x in range(VOCAB)])


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1]], ids=CONFIG_IDS[:2])
def test_two_tokens_point_mass_tree(cfg):
    # depth-2 tree: root -> {1, 6}; 1 -> {0, 3}; 6 -> {2}
    shape = TreeShape([-1, 0, 0, 1, 1, 2])
    tokens = torch.tensor([4, 1, 6, 0, 3, 2])
    counts = _two_token_joint(cfg, lambda: DraftTree(tokens, shape), _logits_by_token, N_DRAWS, seed=21)
    assert chi2_pvalue(counts, _expected_joint(cfg)) > ALPHA


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=[CONFIG_IDS[0], CONFIG_IDS[2]])
def test_two_tokens_draft_probs_tree(cfg):
    # two i.i.d. children of the root from q1; under each, two i.i.d. children from q2[parent token]
    q1 = (fixed_logits(1, seed=31)[0] * 0.5).softmax(0)
    q2 = (fixed_logits(VOCAB, seed=32) * 0.5).softmax(-1)
    shape = TreeShape([-1, 0, 0, 1, 1, 2, 2])
    draft_g = torch.Generator().manual_seed(33)

    def tree_for_trial():
        a = torch.multinomial(q1, 2, replacement=True, generator=draft_g)
        b = torch.multinomial(q2[a[0]], 2, replacement=True, generator=draft_g)
        c = torch.multinomial(q2[a[1]], 2, replacement=True, generator=draft_g)
        tokens = torch.cat([torch.tensor([4]), a, b, c])
        probs = torch.stack([q1, q1, q1, q2[a[0]], q2[a[0]], q2[a[1]], q2[a[1]]])
        return DraftTree(tokens, shape, probs)

    counts = _two_token_joint(cfg, tree_for_trial, _logits_by_token, N_DRAWS, seed=34)
    assert chi2_pvalue(counts, _expected_joint(cfg)) > ALPHA


def test_chi2_detects_a_biased_sampler():
    """The same harness rejects a classic mistake: after rejecting every sibling, sampling from p instead of the
    residual max(p - q, 0). This shows the tests above have the power to fail."""
    cfg = CONFIGS[0]
    p = target_probs(fixed_logits(1)[0], cfg)
    q = (fixed_logits(1, seed=7)[0] * 0.7).softmax(0)
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(VOCAB)
    for _ in range(N_DRAWS):
        x = int(torch.multinomial(q, 1, generator=g))
        if float(torch.rand((), generator=g, dtype=torch.float64)) < min(1.0, float(p[x] / q[x])):
            counts[x] += 1
        else:
            counts[int(torch.multinomial(p, 1, generator=g))] += 1  # wrong: should be the residual
    assert chi2_pvalue(counts, p) < ALPHA


def test_zero_draft_probability_is_an_error():
    q = torch.zeros(2, VOCAB, dtype=torch.float64)
    q[1, 3] = 1.0
    tree = DraftTree(torch.tensor([0, 5]), TreeShape([-1, 0]), q)  # token 5 has q = 0
    with pytest.raises(UsageError):
        verify_sampling(tree, fixed_logits(2), CONFIGS[0], torch.Generator().manual_seed(0))


def test_point_mass_token_outside_top_k_never_accepted():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0] + [-20.0] * (VOCAB - 4)] * 2, dtype=torch.float64)
    tree = DraftTree(torch.tensor([0, 3]), TreeShape([-1, 0]))
    g = torch.Generator().manual_seed(0)
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    for _ in range(300):
        v = verify_sampling(tree, logits, cfg, g)
        assert v.path == [0] and v.bonus in (0, 1, 2)


# --------------------------------------------------------------------------------------------------------------
# Through the engine: the second generated token (the first one a drafted step emits)
# --------------------------------------------------------------------------------------------------------------


class PointMassTreeProposer(Proposer):
    """Random trees of distinct sibling tokens, no draft probabilities."""

    name = "test-point-mass"

    def __init__(self, vocab, seed=0):
        self.vocab = vocab
        self.rng = random.Random(seed)

    def max_proposal_size(self):
        return 7

    def propose(self, state):
        kids = self.rng.sample(range(self.vocab), 3)
        grandkids = self.rng.sample(range(self.vocab), 2)
        tokens = [state.root] + kids + grandkids + [self.rng.randrange(self.vocab)]
        return Proposal(DraftTree.from_parents(tokens, [-1, 0, 0, 0, 1, 1, 4]))


class IIDDraftProposer(Proposer):
    """Two siblings sampled i.i.d. from a fixed q (with draft probabilities), each with one child from q."""

    name = "test-iid"
    drafts_with_probabilities = True

    def __init__(self, q, seed=0):
        self.q = q
        # a stream of its own: seeded like the run's generator, its draws would be the verifier's acceptance tests
        self.g = torch.Generator().manual_seed(seed * 7919 + 17)

    def max_proposal_size(self):
        return 5

    def propose(self, state):
        kids = torch.multinomial(self.q, 4, replacement=True, generator=self.g)
        tokens = torch.cat([torch.tensor([state.root]), kids])
        return Proposal(DraftTree(tokens, TreeShape([-1, 0, 0, 1, 2]), self.q.expand(5, -1)))


@pytest.fixture(scope="module")
def tiny8():
    return tiny_target(vocab_size=VOCAB, seed=3, init_std=0.15)


def _engine_expected_joint(target, prompt, cfg):
    """P(first, second generated token) computed from the target's own forwards."""
    cache = target.new_cache(16)
    out = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    p1 = target_probs(out.logits[-1], cfg)
    rows = []
    for x in range(VOCAB):
        ids = torch.tensor(prompt + [x])
        rows.append(target_probs(target.forward(ids, torch.arange(len(ids)), target.new_cache(16)).logits[-1], cfg))
    return p1.unsqueeze(1) * torch.stack(rows)


@pytest.mark.parametrize("kind", ["point-mass", "draft-probs"])
def test_engine_second_token_distribution(tiny8, kind):
    cfg = SamplingConfig(temperature=0.8)
    prompt = [1, 5, 2]
    expected = _engine_expected_joint(tiny8, prompt, cfg)
    q = torch.linspace(1, 2, VOCAB, dtype=torch.float64).softmax(0)
    counts = torch.zeros(VOCAB, VOCAB)
    n_runs = 3000
    drafted = 0
    for seed in range(n_runs):
        proposer = PointMassTreeProposer(VOCAB, seed) if kind == "point-mass" else IIDDraftProposer(q, seed)
        r = ff.generate(tiny8, prompt, proposer, max_new_tokens=2, temperature=cfg.temperature, seed=seed)
        assert len(r.token_ids) == 2
        counts[r.token_ids[0], r.token_ids[1]] += 1
        drafted += r.stats.target_forwards == 2
    assert drafted == n_runs  # the second token always came from a drafted (tree) step
    assert chi2_pvalue(counts, expected) > ALPHA


@settings(max_examples=25, deadline=None)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
       method=st.sampled_from(["pld", "jacobi", "lookahead", "tr-jacobi"]), seed=st.integers(0, 2**40),
       temperature=st.sampled_from([0.7, 1.0, 1.5]))
def test_keyed_draws_give_every_guessing_method_the_samples_of_ar(tiny8, prompt, method, seed, temperature):
    """The token at each position is drawn with that position's keyed uniform, so a seeded answer does not depend
    on what was drafted: every method whose drafts are guesses returns exactly ``ar``'s samples."""
    ar = ff.generate(tiny8, prompt, "ar", max_new_tokens=12, temperature=temperature, seed=seed)
    other = ff.generate(tiny8, prompt, method, max_new_tokens=12, temperature=temperature, seed=seed)
    assert other.token_ids == ar.token_ids


def test_keyed_uniforms_are_uniform_and_position_specific():
    keyed = PositionKeyedUniforms(123)
    u = torch.tensor([keyed.at(t) for t in range(20000)], dtype=torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert chi2_pvalue(counts.unsqueeze(0), torch.full((1, 10), 0.1, dtype=torch.float64)) > ALPHA
    assert keyed.at(5) == PositionKeyedUniforms(123).at(5) != PositionKeyedUniforms(124).at(5)
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert [sample_at(probs, x) for x in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]
