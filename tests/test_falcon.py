"""Falcon: the relaxed-causal block mask, the k-shift alignment of the loss, CSGD's glancing (exactly N rows, a
property test), the decode-time runner == the training forward (first pass and tree passes), lossless decoding
(greedy == AR under hypothesis, batch == solo, chi-square at T = 1), checkpoints, and ``fastforward train falcon``
through the CLI."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastforward as ff
from fastforward.drafters.eagle import target_embedding_rows
from fastforward.drafters.falcon import FalconDrafter, FalconRunner, block_mask, load_falcon, save_falcon
from fastforward.drafters.features import compute_features
from fastforward.drafters.vocab import DraftVocab
from fastforward.errors import UsageError
from fastforward.proposers import make_proposer
from fastforward.testing import tiny_hf_folder, tiny_target, write_tiny_make_data
from fastforward.train.falcon import FalconTraining, chain_mask, glance, glance_lambda

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target(layers=4, vocab_size=VOCAB, seed=3)


def _drafter(target, seed=0, draft_size=64, k=2, std=0.3):
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_size]
    drafter = FalconDrafter.for_target(target, DraftVocab.from_target_ids(ids, VOCAB), k, seed=seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std)
    return drafter.eval()


@pytest.fixture(scope="module", params=[2, 3])
def drafter_dir(request, target, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"falcon-k{request.param}")
    save_falcon(_drafter(target, k=request.param), folder, dtype="float32")
    return folder


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 20), k=st.integers(1, 5))
def test_block_mask_sees_the_past_and_its_own_block(T, k):
    m = block_mask(T, k)
    for i in range(T):
        for j in range(T):
            assert bool(m[i, j]) == (j // k <= i // k)
    if k == 1:
        assert torch.equal(m, torch.ones(T, T, dtype=torch.bool).tril())


def test_chain_mask_second_pass_sees_true_rows_before_its_block():
    m = chain_mask(6, 2)
    assert m[:6, 6:].sum() == 0  # true rows never see second-pass rows
    assert m[6 + 2].tolist() == [True, True, False, False, False, False, False, False, True, True, False, False]


@settings(max_examples=60, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=1, max_size=40), n=st.integers(0, 50), k=st.integers(1, 4),
       seed=st.integers(0, 10**6))
def test_glancing_replaces_exactly_n_candidate_rows_from_block_ends(mask, n, k, seed):
    cand = torch.tensor(mask)
    got = glance(cand, n, k, random.Random(seed))
    assert int(got.sum()) == min(n, int(cand.sum()))
    assert bool((got & ~cand).sum() == 0)  # only rows that hold a predicted input
    # within a block, the replaced rows are the block's last candidate rows (consecutive before the next block)
    for b in range(0, len(mask), k):
        rows = [r for r in range(b, min(b + k, len(mask))) if mask[r]]
        taken = [r for r in rows if got[r]]
        assert taken == rows[len(rows) - len(taken) :]
    # at most one block is partly taken
    partial = sum(1 for b in range(0, len(mask), k)
                  if 0 < sum(bool(got[r]) for r in range(b, min(b + k, len(mask))))
                  < sum(mask[r] for r in range(b, min(b + k, len(mask)))))
    assert partial <= 1


def test_glance_lambda_follows_the_papers_schedule():
    assert glance_lambda(0, 4) == pytest.approx(0.4)
    assert glance_lambda(3, 4) == pytest.approx(0.1)
    assert glance_lambda(9, 4) == pytest.approx(0.1)  # clamped to the last epoch


@pytest.mark.parametrize("k,csgd", [(2, "off"), (3, "off"), (2, "two-pass"), (3, "sequence")])
def test_loss_aligns_row_j_with_the_feature_k_ahead(target, k, csgd):
    """A drafter that outputs exactly f_{j+k} at row j (of either pass) predicts every in-vocabulary label (the
    k-shift); one shifted by k - 1 or k + 1 does not."""
    drafter = FalconDrafter.for_target(target, DraftVocab.full(VOCAB), k, seed=0)
    method = FalconTraining(k, VOCAB, csgd=csgd)
    method.vocab, method.embed = drafter.vocab, target_embedding_rows(target, torch.arange(VOCAB))
    ids = torch.tensor([[3] + ff.generate(target, [3], "ar", max_new_tokens=11).token_ids])  # the target's greedy
    T = ids.shape[1]
    final = compute_features(target, ids[0])["final"].unsqueeze(0)
    batch = {"ids": ids, "response": torch.ones(1, T, dtype=torch.bool), "final": final,
             "lengths": torch.tensor([T]), "seed": 0, "epoch": 0, "epochs": 1}

    def shifted(s):
        class Oracle(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = drafter

            def forward(self, emb, feat, mask, positions=None):
                out = torch.zeros_like(final)
                out[:, : T - s] = final[:, s:]
                return out.repeat(1, emb.shape[1] // T, 1)  # the two-pass form has 2T rows

            def logits(self, h):
                return drafter.logits(h)

        oracle = Oracle()
        oracle.lm_head = drafter.lm_head
        return oracle

    import fastforward.train.falcon as falcon_train

    falcon_train.NOISE, saved = 0.0, falcon_train.NOISE
    try:
        loss, metrics = method.loss(shifted(k), batch)
        depths = 2 * k if csgd == "two-pass" else k
        assert sorted(m for m in metrics if m.startswith("acc")) == [f"acc{i + 1}" for i in range(depths)]
        assert all(metrics[f"acc{i + 1}"] == 1.0 for i in range(depths))
        for s in (k - 1, k + 1):
            _, bad = method.loss(shifted(s), batch)
            assert min(bad[f"acc{i + 1}"] for i in range(k)) < 1.0
    finally:
        falcon_train.NOISE = saved


@pytest.mark.parametrize("k", [1, 2, 3])
def test_runner_first_pass_and_tree_passes_equal_the_training_forward(target, k):
    drafter = _drafter(target, seed=5, k=k)
    ids = torch.tensor([1, 5, 2, 8, 3, 9, 4, 7, 6, 2, 5, 1, 3])
    final = compute_features(target, ids)["final"]
    embed = target_embedding_rows(target, torch.arange(VOCAB))
    L = 2 * k  # committed rows: a whole number of blocks, so the training forward's blocks line up
    run = FalconRunner(drafter, target, capacity=2, weights="fp32")  # grows on the way
    run.commit(final[: L - 1], ids[1:L], torch.arange(L - 1))
    run.commit(final[L - 1 : L], ids[L : L + 1], torch.tensor([L - 1]))
    out1 = run.first_block()
    with torch.no_grad():
        full = drafter(F_embed(embed, ids[1 : L + 1]), final[:L].unsqueeze(0), block_mask(L, k))[0]
    assert torch.allclose(out1, full[L - k :], atol=1e-4)
    # a second pass over two branches at once: each equals the forward of its own sequence
    branches = torch.tensor([[11, 12, 13][:k], [21, 22, 23][:k]])
    feats = torch.stack([out1, out1.flip(0)])
    out2, rows = run.extend(branches, feats, L, torch.zeros(2, 0, dtype=torch.bool))
    assert rows.tolist() == [list(range(k)), list(range(k, 2 * k))]
    for b in range(2):
        emb = torch.cat([F_embed(embed, ids[1 : L + 1])[0], F_embed(embed, branches[b])[0]]).unsqueeze(0)
        feat = torch.cat([final[:L], feats[b]]).unsqueeze(0)
        with torch.no_grad():
            ref = drafter(emb, feat, block_mask(L + k, k))[0]
        assert torch.allclose(out2[b], ref[L:], atol=1e-4)
    # a third pass on branch 1 sees its own second-pass block, not branch 0's
    sees = torch.zeros(1, 2 * k, dtype=torch.bool)
    sees[0, rows[1]] = True
    third = torch.tensor([[31, 32, 33][:k]])
    out3, _ = run.extend(third, out2[1:2], L + k, sees)
    emb = torch.cat([F_embed(embed, ids[1 : L + 1])[0], F_embed(embed, branches[1])[0],
                     F_embed(embed, third[0])[0]]).unsqueeze(0)
    feat = torch.cat([final[:L], feats[1], out2[1]]).unsqueeze(0)
    with torch.no_grad():
        ref = drafter(emb, feat, block_mask(L + 2 * k, k))[0]
    assert torch.allclose(out3[0], ref[L + k :], atol=1e-4)


def test_native_layer_ops_give_the_torch_rows(target):
    """The runner through the native layer ops (packed weights: one native call per pass) equals the plain torch ops
    on the same weights -- commit, a first pass, two branches' later pass, and a third pass that sees one branch's
    scratch rows -- up to summation order."""
    k = 2
    drafter = _drafter(target, seed=6, k=k)
    native = FalconRunner(drafter, target, capacity=2, weights="auto").fresh(4)  # grows on the way
    if native.ops is None:
        pytest.skip("the native kernels did not build on this machine")
    plain = native.fresh(4)
    plain.ops = None
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(9, drafter.cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, VOCAB, (9,), generator=g)
    branches = torch.tensor([[11, 12], [21, 22]])
    for run in (native, plain):
        run.commit(feats[:6], ids[:6], torch.arange(6))
        run.commit(feats[6:], ids[6:], torch.arange(6, 9))
        out1 = run.first_block()
        out2, rows = run.extend(branches, torch.stack([out1, out1.flip(0)]), run.length, torch.zeros(2, 0).bool())
        sees = torch.zeros(1, 2 * k, dtype=torch.bool)
        sees[0, rows[1]] = True
        out3, _ = run.extend(torch.tensor([[31, 32]]), out2[1:2], run.length + k, sees)
        run.out = (out1, out2, out3, run.probs(out3))
    for a, b in zip(native.out, plain.out, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    n = native.length + native.scratch
    assert torch.allclose(native.kc[:, :n], plain.kc[:, :n], atol=1e-5)
    assert torch.allclose(native.vc[:, :n], plain.vc[:, :n], atol=1e-5)


def F_embed(embed, ids):
    return torch.nn.functional.embedding(ids, embed).unsqueeze(0)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), topk=st.integers(1, 4),
       passes=st.integers(1, 3), frontier=st.integers(1, 3), nodes=st.sampled_from([0, 0, 5]),
       backoff=st.sampled_from([0, 8]), window=st.sampled_from([0, 1, 4, 256]))
def test_falcon_greedy_equals_ar(target, drafter_dir, prompt, topk, passes, frontier, nodes, backoff, window):
    ar = ff.generate(target, prompt, "ar", max_new_tokens=24).token_ids
    out = ff.generate(target, prompt, "falcon", max_new_tokens=24,
                      method_options=dict(drafter=str(drafter_dir), topk=topk, passes=passes, frontier=frontier,
                                          nodes=nodes, backoff=backoff, prompt_window=window))
    assert out.token_ids == ar


def test_fixed_trees_really_draft_and_accept(target, drafter_dir):
    """With a fixed node count every step drafts; the greedy output is still AR's and some drafts are accepted by a
    drafter whose head agrees with the target's (its rows are the target's)."""
    prop = make_proposer("falcon", target, drafter=str(drafter_dir), topk=2, passes=2, nodes=8)
    res = ff.generate(target, [4, 8, 15, 16, 23, 42 % VOCAB], prop, max_new_tokens=30)
    assert res.token_ids == ff.generate(target, [4, 8, 15, 16, 23, 42 % VOCAB], "ar", max_new_tokens=30).token_ids
    assert prop.stats()["passes_per_look"] > 1.0  # later passes ran
    assert prop.stats()["mean_tree_nodes"] > 1.0


def test_batch_equals_solo(target, drafter_dir):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    opts = dict(drafter=str(drafter_dir), topk=2, nodes=6)
    solo = [ff.generate(target, p, "falcon", max_new_tokens=20, method_options=opts).token_ids for p in prompts]
    batch = ff.generate_batch(target, prompts, "falcon", max_new_tokens=20, method_options=opts,
                              max_batch_tokens=64)
    assert [r.token_ids for r in batch] == solo


def test_drafter_cache_holds_accepted_positions_only(target, drafter_dir):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    prop = make_proposer("falcon", target, drafter=str(drafter_dir), topk=3, nodes=7)
    res = ff.generate(target, prompt, prop, max_new_tokens=16)
    seq = torch.tensor(prompt + res.token_ids)
    run = prop.runner
    n = run.length
    assert len(prompt) <= n <= seq.numel() - 1
    again = prop.shared.fresh(64)
    again.commit(compute_features(target, seq)["final"][:-1], seq[1:], torch.arange(seq.numel() - 1))
    assert torch.allclose(run.kc[:, :n], again.kc[:, :n], atol=1e-4)
    assert torch.allclose(run.vc[:, :n], again.vc[:, :n], atol=1e-4)


def test_falcon_sampling_matches_the_target_distribution(tmp_path):
    """chi-square of 3-token continuations at T = 1 against the exact joint distribution of the target."""
    from fastforward.testing import chi2_critical, exact_joint, pooled_chi2
    from fastforward.verify import SamplingConfig

    target = tiny_target(vocab_size=8, init_std=0.15, seed=1, layers=4)
    drafter = FalconDrafter.for_target(target, DraftVocab.full(8), 2, seed=2)
    save_falcon(drafter, tmp_path, dtype="float32")
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    samples = 2500
    exact = exact_joint(target, prompt, SamplingConfig(1.0))
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(samples):
        prop = make_proposer("falcon", target, drafter=str(tmp_path), topk=2, passes=2, nodes=6)
        res = ff.generate(target, prompt, prop, max_new_tokens=3, temperature=1.0, seed=seed)
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        accepted += sum(res.stats.depth_accepts)
    assert accepted > 0.1 * samples  # drafted tokens are really accepted
    chi2, df = pooled_chi2(exact, counts)
    assert df >= 20
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} over {df} cells (critical {chi2_critical(df):.1f})"


def test_round_trip_and_layout(target, tmp_path):
    from safetensors.torch import load_file

    save_falcon(_drafter(target, k=3), tmp_path / "one", dtype="float32")
    drafter = load_falcon(tmp_path / "one", target)
    save_falcon(drafter, tmp_path / "again", dtype="float32")
    again = load_falcon(tmp_path / "again", target)
    for name, t in drafter.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
    tensors = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # the head is the target's, rebuilt from d2t
    assert {"lstm.w1", "lstm.w2", "layer.self_attn.q_proj.weight"} <= set(tensors)
    cfg = json.loads((tmp_path / "one" / "config.json").read_text())
    assert cfg["architectures"] == ["FalconDrafter"] and cfg["block_size"] == 3


def test_refusals_are_one_line_errors(target, tmp_path):
    save_falcon(_drafter(target), tmp_path / "d", dtype="float32")
    d = str(tmp_path / "d")
    other = tiny_target(layers=4, vocab_size=VOCAB, seed=4)
    with pytest.raises(UsageError, match="trained for"):
        ff.generate(other, [1, 2], "falcon", max_new_tokens=4, method_options=dict(drafter=d))
    with pytest.raises(UsageError, match="not found"):
        ff.generate(target, [1], "falcon", method_options=dict(drafter=str(tmp_path / "nope")))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"architectures": ["FastEagleDrafter"]}))
    with pytest.raises(UsageError, match="not a Falcon drafter"):
        ff.generate(target, [1], "falcon", method_options=dict(drafter=str(tmp_path / "x")))
    with pytest.raises(UsageError, match="no drafter ships"):
        ff.generate(target, [1], "falcon")
    for bad in (dict(topk=0), dict(passes=0), dict(frontier=99), dict(weights="int3")):
        with pytest.raises(UsageError, match=next(iter(bad))):
            ff.generate(target, [1], "falcon", method_options=dict(drafter=d, **bad))


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-falcon")
    model = tiny_hf_folder(root / "model", max_positions=128, layers=4)
    return model, write_tiny_make_data(root / "data", response_lengths=(10, 18))


def test_train_falcon_through_the_cli(train_setup, tmp_path, capsys):
    model, data = train_setup
    out = tmp_path / "out"
    common = ["train", "falcon", "--model", model, "--data", data, "--out", out, "--draft-vocab", 40,
              "--batch-size", 2, "--grad-accum", 1, "--save-every", 2, "--threads", 1, "--quiet"]
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 3)
    assert code == 0, err
    assert "step 3/3" in stdout
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    assert {"acc1", "acc2", "lambda", "glanced"} <= set(log[0])
    assert "held-out agreement" in stdout
    held = json.loads((out / "fastforward_train.json").read_text())["heldout"]
    assert len(held["top1"]) == 4 and held["chain"][0] == held["top1"][0] >= held["chain"][3]
    target = ff.load(str(model))
    got = ff.generate(target, [5, 6, 7, 8], "falcon", max_new_tokens=12, method_options={"drafter": str(out)})
    assert got.token_ids == ff.generate(target, [5, 6, 7, 8], "ar", max_new_tokens=12).token_ids
    code, stdout, err = run_cli(capsys, *common, "--max-steps", 4)  # resumes
    assert code == 0 and "step 4/4" in stdout, err
    line = assert_one_line_error(capsys, *common, "--max-steps", 4, "--csgd", "off")
    assert "different settings" in line
    code, stdout, err = run_cli(capsys, *common[:7], tmp_path / "tf", *common[8:], "--max-steps", 1, "--csgd", "off",
                                "--block-size", 3)
    assert code == 0, err
    assert json.loads((tmp_path / "tf" / "config.json").read_text())["block_size"] == 3
    assert "lambda" not in json.loads((tmp_path / "tf" / "train_log.jsonl").read_text().splitlines()[0])


def test_train_falcon_bad_input(train_setup, tmp_path, capsys):
    model, data = train_setup
    base = ["train", "falcon", "--model", model, "--data", data, "--out", tmp_path / "o"]
    assert "--block-size" in assert_one_line_error(capsys, *base, "--block-size", 0)
    assert "--draft-vocab" in assert_one_line_error(capsys, *base, "--draft-vocab", 0)
