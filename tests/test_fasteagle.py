"""FastEagle: the cascaded drafter (training forward == decode-time runner, cascade vs parallel), the backbone tree,
lossless decoding (greedy == AR under hypothesis, batch == solo, chi-square at T = 1), the drafter's KV cache holding
accepted positions only, checkpoints, and ``fastforward train fasteagle`` through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import native_or_skip, with_python_twin

import fastforward as ff
from fastforward.drafters.eagle import target_embedding_rows
from fastforward.drafters.fasteagle import FastEagleDrafter, FastEagleRunner, load_fasteagle, save_fasteagle
from fastforward.drafters.features import compute_features
from fastforward.drafters.vocab import DraftVocab
from fastforward.errors import UsageError
from fastforward.proposers import make_proposer
from fastforward.proposers.fasteagle import backbone_tree, expected_tokens
from fastforward.testing import backoff_outcomes, tiny_hf_folder, tiny_target, write_tiny_make_data
from fastforward.tree import TreeShape

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


def _drafter(target, seed=0, draft_size=64, layers=3, cascade=True, std=0.3):
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_size]
    drafter = FastEagleDrafter.for_target(target, DraftVocab.from_target_ids(ids, VOCAB), layers, cascade, seed=seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std)
    return drafter


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fasteagle")
    save_fasteagle(_drafter(target), folder, dtype="float32")
    return folder


@pytest.mark.parametrize("cascade", [True, False])
def test_training_forward_equals_the_decode_time_runner(target, cascade):
    drafter = _drafter(target, seed=5, cascade=cascade)
    ids = torch.tensor([1, 5, 2, 8, 3, 9, 4])
    feats = compute_features(target, ids)
    embed = target_embedding_rows(target, torch.arange(VOCAB))
    with torch.no_grad():
        hs = drafter(feats["taps"].reshape(1, 7, -1).float(), ids.unsqueeze(0), embed)
    run = FastEagleRunner(drafter, target, capacity=4, weights="fp32")  # grows on the way
    run.commit(feats["taps"][:3], ids[1:4], torch.arange(3))
    last = run.commit(feats["taps"][3:6], ids[4:7], torch.arange(3, 6))  # in two calls, as decoding does
    assert run.length == 6
    want = torch.stack([h[0, 5] for h in hs])
    assert torch.allclose(last, want, atol=1e-4)
    assert torch.allclose(run.probs(last), drafter.logits(want).softmax(-1), atol=1e-4)


def test_cascade_and_parallel_differ_only_from_layer_three(target):
    a = _drafter(target, seed=7, cascade=True)
    b = _drafter(target, seed=7, cascade=False)
    b.load_state_dict(a.state_dict())
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    taps = compute_features(target, ids[0])["taps"].reshape(1, 5, -1).float()
    embed = target_embedding_rows(target, torch.arange(VOCAB))
    with torch.no_grad():
        ha, hb = a(taps, ids, embed), b(taps, ids, embed)
    assert torch.equal(ha[0], hb[0]) and torch.equal(ha[1], hb[1]) and not torch.allclose(ha[2], hb[2])


def test_backoff_skips_looks_when_nothing_is_drafted(target, tmp_path, pin_costs):
    """A drafter that never pays (its outputs are 0: uniform distributions, on a cost curve where a token more costs
    as much as one) looks at fewer steps with back-off than without, and both decode AR's tokens."""
    from fastforward.costs import CostCurve

    pin_costs(target, CostCurve({1: 1.0, 64: 64.0}))
    flat = FastEagleDrafter.for_target(target, DraftVocab.full(VOCAB), 2, seed=0)
    with torch.no_grad():
        flat.fc_in.weight.zero_()
    save_fasteagle(flat, tmp_path, dtype="float32")
    outs = backoff_outcomes(target, "fasteagle", tmp_path, "looks_per_step")
    assert outs[0][0] == outs[8][0] == outs["ar"]
    assert outs[0][1] == 1.0 and outs[8][1] < 0.5


def test_backbone_tree_shape():
    tokens = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = backbone_tree(tokens, 5, levels=3, k=2)
    assert tree.tokens.tolist() == [5, 10, 11, 20, 21, 30, 31]
    assert tree.shape.parents.tolist() == [-1, 0, 0, 1, 1, 3, 3]  # N * k nodes + root, side nodes are leaves
    assert tree.shape.depths.tolist() == [0, 1, 1, 2, 2, 3, 3] == TreeShape(tree.shape.parents).depths.tolist()
    chain = backbone_tree(tokens, 5, levels=3, k=1)
    assert chain.shape.parents.tolist() == [-1, 0, 1, 2] and chain.shape.depths.tolist() == [0, 1, 2, 3]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(shape=st.tuples(st.integers(1, 8), st.integers(1, 5)).flatmap(lambda rk: st.lists(
           st.lists(st.sampled_from([0.0, 1e-6, 0.05, 0.1, 0.2, 0.25, 0.5, 0.9, 1.0]), min_size=rk[1],
                    max_size=rk[1]), min_size=rk[0], max_size=rk[0])),
       curve_step=st.floats(0.0, 3.0), limit=st.integers(1, 41))
def test_the_native_backbone_draft_chooses_the_python_tree(shape, curve_step, limit):
    """``backbone_draft`` (one native call) picks the (levels, k) that ``_best_shape`` picks from the same top-k
    probabilities and cost curve -- the same float64 sums, so the same choice on ties -- and builds
    ``backbone_tree``'s tree of it (target ids through d2t)."""
    from fastforward.proposers.fasteagle import FastEagleProposer

    native = native_or_skip("backbone_draft")
    probs = torch.tensor([sorted(row, reverse=True) for row in shape], dtype=torch.float32)
    room, topk = probs.shape
    ids = torch.arange(room * topk).view(room, topk) % 7
    d2t = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    curve = 5.0 + curve_step * np.arange(max(limit, room * topk + 1))

    class Sizing:  # what _best_shape reads of a proposer
        greedy_map = None

        def __init__(self):
            self.topk = topk

        def _curve_ms(self, numpy=False):
            return curve

        _chances = FastEagleProposer._chances

    levels, k = FastEagleProposer._best_shape(Sizing(), probs.double(), room, limit)
    tokens, parents, depths, got_levels, got_k = native.backbone_draft(probs, ids, d2t, curve[:limit], limit, 5)
    assert (got_levels, got_k) == (levels, k)
    if levels:
        tree = backbone_tree(ids + d2t[ids], 5, levels, k)
        assert tokens.tolist() == tree.tokens.tolist()
        assert parents.tolist() == tree.shape.parents.tolist() and depths.tolist() == tree.shape.depths.tolist()
    else:
        assert tokens.tolist() == [5] and parents.tolist() == [-1] and depths.tolist() == [0]


def test_expected_tokens_of_the_backbone_tree():
    q = torch.tensor([[0.5, 0.3], [0.4, 0.2]], dtype=torch.float64)
    e = expected_tokens(q)
    assert e[0, 0] == pytest.approx(1.5) and e[0, 1] == pytest.approx(1.8)
    assert e[1, 0] == pytest.approx(1.5 + 0.5 * 0.4)  # depth 2 needs the depth-1 backbone node accepted
    assert e[1, 1] == pytest.approx(1.8 + 0.5 * 0.6)
    assert np.allclose(expected_tokens(q.numpy()), e.numpy())  # numpy arrays as torch tensors


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), topk=st.integers(1, 4),
       depth=st.integers(1, 4), fixed=st.booleans(), backoff=st.sampled_from([0, 1, 8]), on_loss=st.booleans(),
       window=st.sampled_from([0, 1, 4, 256]))
def test_fasteagle_greedy_equals_ar(target, drafter_dir, prompt, topk, depth, fixed, backoff, on_loss, window):
    ar = ff.generate(target, prompt, "ar", max_new_tokens=24).token_ids
    out = ff.generate(target, prompt, "fasteagle", max_new_tokens=24,
                      method_options=dict(drafter=str(drafter_dir), topk=topk, depth=depth, fixed=fixed,
                                          backoff=backoff, backoff_on_loss=on_loss, prompt_window=window))
    assert out.token_ids == ar


def test_batch_equals_solo(target, drafter_dir):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    opts = dict(drafter=str(drafter_dir), topk=2, fixed=True)
    solo = [ff.generate(target, p, "fasteagle", max_new_tokens=20, method_options=opts).token_ids for p in prompts]
    batch = ff.generate_batch(target, prompts, "fasteagle", max_new_tokens=20, method_options=opts,
                              max_batch_tokens=64)
    assert [r.token_ids for r in batch] == solo


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=10), topk=st.integers(1, 3),
       fixed=st.booleans(), window=st.sampled_from([0, 1, 3]))
def test_drafter_kv_holds_accepted_positions_only(target, drafter_dir, prompt, topk, fixed, window):
    """After decoding, the drafter's caches hold rows first .. n-1 of the output only -- first = 0, or with a prompt
    window the prompt's last ``window`` rows onwards (rows of the last steps may still wait: the step that ends the
    generation, or steps the back-off skipped) -- and they equal the caches of one commit of the final sequence from
    row first: no rejected draft, and no prompt row before the window, ever entered them."""
    prop = make_proposer("fasteagle", target, drafter=str(drafter_dir), topk=topk, fixed=fixed, prompt_window=window)
    res = ff.generate(target, prompt, prop, max_new_tokens=16)
    seq = torch.tensor(prompt + res.token_ids)
    run = prop.runner
    first = max(0, len(prompt) - window) if window else 0
    assert len(prompt) - first <= run.length <= seq.numel() - 1 - first
    again = prop.shared.fresh(64)
    again.commit(compute_features(target, seq)["taps"][first:-1], seq[first + 1:], torch.arange(first, seq.numel() - 1))
    n = run.length
    assert torch.allclose(run.k[:, :, :n], again.k[:, :, :n], atol=1e-4)
    assert torch.allclose(run.v[:, :, :n], again.v[:, :, :n], atol=1e-4)


def test_fasteagle_sampling_matches_the_target_distribution(tmp_path):
    """chi-square of 3-token continuations at T = 1 against the exact joint distribution of the target."""
    from fastforward.testing import chi2_critical, exact_joint, pooled_chi2
    from fastforward.verify import SamplingConfig

    target = tiny_target(vocab_size=8, init_std=0.15, seed=1, layers=4)
    drafter = FastEagleDrafter.for_target(target, DraftVocab.full(8), 3, seed=2)
    save_fasteagle(drafter, tmp_path, dtype="float32")
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    samples = 2500
    exact = exact_joint(target, prompt, SamplingConfig(1.0))
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(samples):
        prop = make_proposer("fasteagle", target, drafter=str(tmp_path), topk=2, depth=3, fixed=True)
        res = ff.generate(target, prompt, prop, max_new_tokens=3, temperature=1.0, seed=seed)
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        accepted += sum(res.stats.depth_accepts)
    assert accepted > 0.1 * samples  # drafted tokens are really accepted
    chi2, df = pooled_chi2(exact, counts)
    assert df >= 20
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


def test_round_trip_and_layout(target, drafter_dir, tmp_path):
    from safetensors.torch import load_file

    drafter = load_fasteagle(drafter_dir, target)
    save_fasteagle(drafter, tmp_path / "again", dtype="float32")
    again = load_fasteagle(tmp_path / "again", target)
    for name, t in drafter.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # the head is the target's, rebuilt from d2t
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["FastEagleDrafter"] and cfg["num_layers"] == 3 and cfg["cascade"] is True


def test_refusals_are_one_line_errors(target, drafter_dir, tmp_path):
    other = tiny_target(layers=4, vocab_size=VOCAB, seed=4)
    with pytest.raises(UsageError, match="trained for"):
        ff.generate(other, [1, 2], "fasteagle", max_new_tokens=4, method_options=dict(drafter=str(drafter_dir)))
    with pytest.raises(UsageError, match="not found"):
        ff.generate(target, [1], "fasteagle", method_options=dict(drafter=str(tmp_path / "nope")))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(UsageError, match="not a FastEagle drafter"):
        ff.generate(target, [1], "fasteagle", method_options=dict(drafter=str(tmp_path)))
    with pytest.raises(UsageError, match="no drafter ships"):
        ff.generate(target, [1], "fasteagle")
    with pytest.raises(UsageError, match="topk"):
        ff.generate(target, [1], "fasteagle", method_options=dict(drafter=str(drafter_dir), topk=0))
    with pytest.raises(UsageError, match="fixed"):
        ff.generate(target, [1], "fasteagle", method_options=dict(drafter=str(drafter_dir), fixed="yes"))


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-fasteagle")
    model = tiny_hf_folder(root / "model", max_positions=128, layers=4)
    return model, write_tiny_make_data(root / "data", response_lengths=(6, 14))


def test_train_fasteagle_through_the_cli(train_setup, tmp_path, capsys):
    model, data = train_setup
    out = tmp_path / "out"
    common = ["train", "fasteagle", "--model", model, "--data", data, "--out", out, "--draft-vocab", 40,
              "--layers", 3, "--batch-size", 2, "--grad-accum", 1, "--save-every", 2, "--threads", 1, "--quiet"]
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 3)
    assert code == 0, err
    assert "step 3/3" in stdout
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    assert {"acc1", "acc2", "acc3"} <= set(log[0])
    assert "held-out agreement" in stdout  # scored on the held-out split at the end
    held = json.loads((out / "fastforward_train.json").read_text())["heldout"]
    assert len(held["top1"]) == 3 and held["chain"][0] == held["top1"][0] >= held["chain"][2]
    target = ff.load(str(model))
    got = ff.generate(target, [5, 6, 7, 8], "fasteagle", max_new_tokens=12, method_options={"drafter": str(out)})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=12).token_ids
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 4)  # resumes
    assert code == 0 and "step 4/4" in stdout, err
    line = assert_one_line_error(capsys, *common, "--max-steps", 4, "--parallel")
    assert "different settings" in line
    # the ablations train through the same command
    for extra in (["--parallel"], ["--feature-weight", 0]):
        code, stdout, err = run_cli(capsys, *common[:7], tmp_path / extra[0], *common[8:], "--max-steps", 1, *extra)
        assert code == 0, err
    assert json.loads((tmp_path / "--parallel" / "config.json").read_text())["cascade"] is False


def test_train_fasteagle_bad_input(train_setup, tmp_path, capsys):
    model, data = train_setup
    base = ["train", "fasteagle", "--model", model, "--data", data, "--out", tmp_path / "o"]
    assert "--layers" in assert_one_line_error(capsys, *base, "--layers", 0)
    assert "feature-weight" in assert_one_line_error(capsys, *base, "--ce-weight", 0, "--feature-weight", 0)


@pytest.mark.parametrize("cascade", [True, False])
def test_native_layer_ops_give_the_torch_rows(target, cascade):
    """Commits through the native layer ops equal the plain torch ops on the same weights (up to summation order)."""
    import copy

    drafter = _drafter(target, seed=9, cascade=cascade)
    native = FastEagleRunner(drafter, target, capacity=4, weights="auto")
    if native.ops is None:
        pytest.skip("the native kernels did not build on this machine")
    plain = copy.copy(native)
    plain.ops = None
    feats = compute_features(target, torch.tensor([1, 5, 2, 8, 3, 9, 4]))
    ids = torch.tensor([5, 2, 8, 3, 9, 4])
    outs = []
    for run in (native, plain):
        run = run.fresh(4)  # grows on the way
        a = run.commit(feats["taps"][:3], ids[:3], torch.arange(3))
        b = run.commit(feats["taps"][3:6], ids[3:6], torch.arange(3, 6))
        outs.append((a, b, run.probs(b)))
    for x, y in zip(*outs, strict=True):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=3), k=st.integers(1, 6),
       layers=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_the_native_cascade_gives_the_runners_values(target, sizes, k, layers, seed):
    """``commit_top`` in one native call per chunk (the fusion, the input projection, the cascaded layers, the
    head's top-k) gives bitwise what the runner's ``commit`` + ``top`` give, and the same keys and values: commits
    of 1-300 rows one after another (chunks of 256 past that)."""
    drafter = _drafter(target, seed=11, layers=layers).float()
    native, plain = with_python_twin(FastEagleRunner(drafter, target, capacity=4, weights="auto"))
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    taps = torch.randn(n, 3 * drafter.cfg.target_hidden_size, generator=g)
    toks = torch.randint(0, VOCAB, (n,), generator=g)
    outs = []
    for run in (native, plain):
        got, a = [], 0
        for size in sizes:
            got.extend(run.commit_top(taps[a : a + size], toks[a : a + size], torch.arange(a, a + size), k))
            a += size
        outs.append((*got, run.k[:, :, :n], run.v[:, :, :n]))
    assert native.length == plain.length == n
    for x, y in zip(*outs, strict=True):
        assert x.shape == y.shape and torch.equal(x, y)
    assert outs[0][0].shape == (layers, drafter.cfg.hidden_size) and outs[0][1].shape == (layers, k)


def test_a_sampled_chain_matches_the_target_distribution_and_repeats_with_its_seed(tmp_path, pin_costs):
    """topk=1 at T = 1: depth i sampled from cascade layer i's distribution (a draft vocabulary of 6 of the 8
    tokens), verified by rejection with those probabilities. chi-square of 3-token continuations against the exact
    joint distribution; the same seed gives the same tokens. The chain's length follows the cost curve: pinned to
    one where a draft token costs a tenth of a step (the machine's own, measured under load, may price every draft
    out)."""
    from fastforward.costs import CostCurve
    from fastforward.testing import chi2_critical, exact_joint, pooled_chi2
    from fastforward.verify import SamplingConfig

    target = tiny_target(vocab_size=8, init_std=0.4, seed=1, layers=4)  # its head rows, the drafter's: sharp
    pin_costs(target, CostCurve({1: 10.0, 64: 73.0}))
    drafter = FastEagleDrafter.for_target(target, DraftVocab.from_target_ids([0, 1, 2, 4, 5, 7], 8), 3, True, seed=2)
    with torch.no_grad():  # a drafter with opinions, often wrong
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    save_fasteagle(drafter, tmp_path, dtype="float32")
    cfg = SamplingConfig(1.0)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    samples = 2000
    exact = exact_joint(target, prompt, cfg)
    counts: dict[tuple, int] = {}
    accepted = drafted = 0
    opts = dict(drafter=str(tmp_path), topk=1, depth=3)
    for seed in range(samples):
        prop = make_proposer("fasteagle", target, **opts)
        res = ff.generate(target, prompt, prop, max_new_tokens=3, temperature=1.0, seed=seed)
        assert prop.drafts_with_probabilities
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        accepted += sum(res.stats.depth_accepts)
        drafted += sum(res.stats.depth_attempts)
    assert drafted > samples and accepted > 0.1 * samples
    chi2, df = pooled_chi2(exact, counts)
    assert df >= 20
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"
    again = [ff.generate(target, prompt, "fasteagle", max_new_tokens=12, temperature=1.0, seed=7,
                         method_options=opts).token_ids for _ in range(2)]
    assert again[0] == again[1]
