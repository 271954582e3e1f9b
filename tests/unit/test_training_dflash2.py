"""The DFlash2 drafter's training (training/selector.py, training/dflash2.py) and the offline
four-way table (training/lattice_eval.py), on CPU:

- the selector's scores are SGLang's own `CandidateSelector.build_lattice`, its greedy walk is
  SGLang's `sample_path` on greedy rows, and the saved checkpoint loads in SGLang's
  `DFlash2DraftModel` with the same lattice;
- the selector learns a predecessor rule the marginal cannot express, and starts as the marginal;
- a tree's greedy acceptance is the deepest prefix of the target's greedy continuation it holds,
  and the continuation is plain greedy decoding;
- the toy run end to end, deterministic.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.training.lattice_eval import (
    chain_accepted,
    four_way,
    greedy_continuation,
    greedy_walk,
    tree_accepted,
)
from sglang_ddtree.training.selector import (
    Selector,
    build_selector,
    lattice,
    load_selector,
    teacher_forced_loss,
)
from sglang_ddtree.tree.build import build_tree, topk_logprobs_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_selector(V: int, H: int, r: int, K: int, seed: int) -> Selector:
    g = torch.Generator().manual_seed(seed)
    sel = Selector(V, H, r, K)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return sel


def _sglang_selector(sel: Selector):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models.dflash import CandidateSelector
    V, r = sel.predecessor_codebook.shape
    theirs = CandidateSelector(
        hidden_size=sel.hidden_projection.in_features, vocab_size=V, state_rank=r, top_k=sel.top_k
    )
    theirs.load_state_dict(sel.state_dict())
    return theirs


def test_lattice_and_greedy_walk_are_sglangs():
    pytest.importorskip("sglang")
    V, H, r, K, n, L = 40, 12, 5, 4, 6, 7
    g = torch.Generator().manual_seed(1)
    sel = _random_selector(V, H, r, K, seed=2)
    hidden = torch.randn(n, L, H, generator=g)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n * L)]).view(n, L, K)
    unary = torch.randn(n, L, K, generator=g).sort(-1, descending=True).values
    anchor = torch.randint(0, V, (n,), generator=g)
    ours = lattice(sel, hidden, unary, cand, anchor)
    theirs_sel = _sglang_selector(sel)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        theirs = theirs_sel.build_lattice(
            candidate_ids=cand, unary_logits=unary, hidden_states=hidden, anchor_token_ids=anchor
        )
        tokens, _ = theirs_sel.sample_path(
            candidate_ids=cand,
            scores=theirs,
            uniforms=torch.rand(n, L, generator=g),
            temperatures=torch.ones(n),
            greedy_mask=torch.ones(n, dtype=torch.bool),
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy_walk(ours, cand), tokens)


def test_the_selector_learns_a_rule_the_marginal_cannot_express():
    """Every slot's 4 candidates have equal logits and the target puts its mass on
    (predecessor + 1) mod 4: the marginal is stuck at log 4, the untrained selector equals it,
    the trained one is near 0."""
    V, H, r, K, n, L = 16, 8, 4, 4, 64, 5
    g = torch.Generator().manual_seed(0)
    # the edge term is multiplicative in W h: a rule for every slot needs a shared direction,
    # as a final-normed hidden state has (RMSNorm's weight)
    hidden = 1.0 + 0.1 * torch.randn(n, L, H, generator=g)
    logits = torch.zeros(n, L, V)
    logits[..., :K] = 5.0
    pred = torch.randint(0, K, (n, L), generator=g)
    teacher = torch.full((n, L, V), -30.0).scatter(-1, ((pred + 1) % K)[..., None], 30.0)
    weights = torch.ones(L)
    sel = build_selector(V, H, r, K, seed=0, init_std=0.5)
    start, mass = teacher_forced_loss(sel, hidden, logits, pred, teacher, weights)
    assert float(mass) == pytest.approx(1.0)
    assert float(start.detach()) == pytest.approx(math.log(K), abs=1e-5)
    opt = torch.optim.Adam(sel.parameters(), lr=0.05)
    for _ in range(300):
        loss, _ = teacher_forced_loss(sel, hidden, logits, pred, teacher, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.1


def test_a_slot_counts_by_the_targets_mass_on_its_candidates():
    """Target mass outside the candidates adds nothing: a slot with none costs 0, and a slot
    with mass m on one candidate costs m times that candidate's -log q."""
    V, H, K = 10, 4, 3
    sel = _random_selector(V, H, 2, K, seed=3)
    logits = torch.arange(V, dtype=torch.float32).flip(0).expand(1, 2, V).clone()  # top: 0, 1, 2
    pred, hidden = torch.tensor([[4, 5]]), torch.randn(1, 2, H)
    teacher = torch.full((1, 2, V), -1e4)
    teacher[0, 0, [1, 7]] = 0.0  # half on candidate 1, half on a non-candidate
    teacher[0, 1, 9] = 0.0  # all outside
    loss, mass = teacher_forced_loss(sel, hidden, logits, pred, teacher, torch.ones(2))
    q = torch.log_softmax(
        sel.scores(hidden, logits[..., :K], torch.arange(K).expand(1, 2, K), pred[..., None])[
            0, 0, 0
        ],
        -1,
    )
    assert float(mass) == pytest.approx(0.25)
    torch.testing.assert_close(loss, -0.5 * q[1] / 2)


def _brute_accepted(tokens, parents, greedy) -> int:
    best = 0
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        path.reverse()
        if path == greedy[: len(path)]:
            best = max(best, len(path))
    return best


def test_tree_accepted_is_the_deepest_greedy_prefix_in_the_tree():
    g = torch.Generator().manual_seed(4)
    bs, L, V, K = 40, 6, 5, 3
    ids, lp = topk_logprobs_from_logits(torch.randn(bs, L, V, generator=g) * 2, K)
    tree = build_tree(torch.zeros(bs, dtype=torch.long), ids, lp, 20)
    greedy = torch.randint(0, V, (bs, L), generator=g)
    greedy[::2] = ids[::2, :, 0]  # half the rows follow the top candidates: deep accepts
    got = tree_accepted(tree, greedy)
    for b in range(bs):
        want = _brute_accepted(
            tree.tokens[b].tolist(), tree.parents[b].tolist(), greedy[b].tolist()
        )
        assert int(got[b]) == want
    assert int(got.max()) >= 3
    assert chain_accepted(
        torch.tensor([[1, 2, 3], [1, 0, 3]]), torch.tensor([[1, 2, 4]])
    ).tolist() == [2, 1]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from sglang_ddtree.training.dflash2 import DFlash2Args, run_dflash2
    from sglang_ddtree.training.pipeline import RunArgs, run

    pair = tmp_path_factory.mktemp("pair")
    run(RunArgs(out=pair, device="cpu", toy=True))
    out = tmp_path_factory.mktemp("dflash2")
    return pair, out, run_dflash2(DFlash2Args(pair=pair, out=out, device="cpu", toy=True))


@pytest.mark.slow
def test_greedy_continuation_is_plain_greedy_decoding(toy):
    from sglang_ddtree.reference.engine import generate_plain, load_pair
    from sglang_ddtree.training.target import load_target

    pair, _, _ = toy
    wrapped, _, tokenizer = load_pair(pair / "target", pair / "draft", "float32", "cpu")
    target = load_target(pair / "target", torch.device("cpu"))
    ids = torch.tensor([tokenizer(Path(json.__file__).read_text())["input_ids"][:48]] * 2)
    anchors = torch.tensor([20, 31])
    got = greedy_continuation(target, ids, anchors, 6)
    for j, a in enumerate(anchors.tolist()):
        want = generate_plain(wrapped, ids[0, : a + 1].tolist(), 6).tokens
        assert got[0, j].tolist() == want == got[1, j].tolist()


@pytest.mark.slow
def test_the_toy_dflash2_run_serves_in_sglang_and_is_deterministic(toy, tmp_path):
    pytest.importorskip("sglang")
    from safetensors.torch import load_file
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers.config import get_config

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.training.dflash2 import DFlash2Args, run_dflash2
    from tests.fixtures import sglang_cpu_model_context

    pair, out, report = toy
    d2 = out / "draft_dflash2"
    cfg = get_config(str(d2), False)
    assert cfg.architectures == ["DFlash2DraftModel"]
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    assert (parsed.selector_rank, parsed.selector_top_k) == (8, 8)
    acc = report["acceptance"]
    assert set(acc["tokens_per_round"]) == {
        "dflash_chain",
        "dflash2_chain",
        "ddtree_marginal",
        "ddtree_lattice",
        "ddtree_lattice_coverage",
    }
    assert acc["heldout_loss"]["selector"] < acc["heldout_loss"]["marginal"]
    assert 0 < acc["heldout_loss"]["target_mass_in_top_k"] < 1

    ours = load_selector(d2)
    head = load_file(str(pair / "target" / "model.safetensors"))["lm_head.weight"].float()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 15, head.shape[1], generator=g)
    anchor = torch.randint(0, head.shape[0], (3,), generator=g)
    with warnings.catch_warnings(), sglang_cpu_model_context(d2), torch.no_grad():
        warnings.simplefilter("ignore")
        from sglang.srt.models.dflash import DFlash2DraftModel

        model = DFlash2DraftModel(cfg)
        model.load_weights(list(load_file(str(d2 / "model.safetensors")).items()))
        lm_head = SimpleNamespace(weight=head, org_vocab_size=head.shape[0], quant_method=None)
        compat.attach_target_lm_head(model, lm_head)
        with torch.compiler.set_stance("force_eager"):
            ids, scores, coverage = compat.selector_lattice(model, hidden, anchor)
    unary, top = torch.topk(hidden @ head.T, 8, dim=-1)
    assert torch.equal(ids, top)
    mass = torch.logsumexp(unary, -1) - torch.logsumexp(hidden @ head.T, -1)  # log coverage
    torch.testing.assert_close(coverage, mass, rtol=0, atol=1e-5)
    want = lattice(ours, hidden, unary, top, anchor)
    torch.testing.assert_close(scores, want, rtol=1e-4, atol=1e-4)

    again = run_dflash2(DFlash2Args(pair=pair, out=tmp_path, device="cpu", toy=True))
    assert (tmp_path / "draft_dflash2" / "model.safetensors").read_bytes() == (
        d2 / "model.safetensors"
    ).read_bytes()
    assert again["acceptance"] == report["acceptance"]


@pytest.mark.slow
def test_an_untrained_selector_is_the_marginal(toy):
    """A zero predecessor codebook: every row is the marginal's, renormalised over K."""
    from sglang_ddtree.training.data import fixed_anchors
    from sglang_ddtree.training.draft_model import load_draft
    from sglang_ddtree.training.target import load_target

    pair, _, _ = toy
    cpu = torch.device("cpu")
    target, draft = load_target(pair / "target", cpu), load_draft(pair / "draft")
    taps = json.loads((pair / "draft" / "config.json").read_text())["dflash_config"][
        "target_layer_ids"
    ]
    V, H = target.get_output_embeddings().weight.shape
    sel = build_selector(V, H, 4, 8, seed=0, init_std=0.02)
    windows = torch.randint(8, V, (2, 64), generator=torch.Generator().manual_seed(0))
    table = four_way(draft, sel, target, taps, windows, fixed_anchors(64, 16, 3), 2, cpu, [16])
    tokens, loss = table["tokens_per_round"], table["heldout_loss"]
    assert tokens["dflash2_chain"] == tokens["dflash_chain"]
    # the conditionals renormalised over K, times the K's marginal mass: the marginal again
    assert tokens["ddtree_lattice_coverage"] == tokens["ddtree_marginal"]
    assert loss["selector"] == pytest.approx(loss["marginal"], abs=1e-6)


def test_train_dflash2_cli_refuses_bad_arguments(tmp_path):
    from tests.fixtures import load_script

    cli = load_script("train_dflash2")
    for part in ("target", "draft"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "config.json").write_text("{}")
    args = cli.parse_args(
        ["--pair", str(tmp_path), "--out", "x", "--device", "cpu", "--batch", "8"]
    )
    assert (args.batch, args.minutes, args.device) == (8, 3.0, "cpu")
    for bad in (["--minutes", "0"], ["--steps", "0"], ["--eval-windows", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--pair", str(tmp_path), "--out", "x", *bad])
    with pytest.raises(SystemExit):
        cli.parse_args(["--pair", str(tmp_path / "nowhere"), "--out", "x"])
    (tmp_path / "draft" / "config.json").unlink()  # a pair without its draft
    with pytest.raises(SystemExit):
        cli.parse_args(["--pair", str(tmp_path), "--out", "x"])
    from sglang_ddtree.training.dflash2 import DFlash2Args, run_dflash2

    with pytest.raises(FileNotFoundError, match="draft/config.json"):
        run_dflash2(DFlash2Args(pair=tmp_path, out=tmp_path / "out", device="cpu", toy=True))


@pytest.mark.slow
def test_the_toy_runs_rows_render_on_the_results_page(toy):
    from sglang_ddtree.training.dflash2 import ROWS
    from tests.fixtures import load_script

    _, out, report = toy
    rows = [json.loads(line) for line in (out / ROWS).read_text().splitlines()]
    acc = report["acceptance"]
    assert len(rows) == 2 + 3 * len(acc["nodes"])
    page = load_script("results_page")
    stamped = [{**r, "date": "d", "commit": "c", "sitting": 1} for r in rows]
    text = page.dflash2_offline_table(stamped)
    assert "DDTREE, lattice tree" in text and f"{report['train']['steps']} steps" in text
    chain = acc["tokens_per_round"]["dflash_chain"][0]
    lattice32 = acc["tokens_per_round"]["ddtree_lattice"][1]
    row = f"| 32 | {lattice32:.3f} | {lattice32 / chain:.3f} |"
    assert f"| DDTREE, lattice tree without coverage {row}" in text
    served32 = acc["tokens_per_round"]["ddtree_lattice_coverage"][1]
    row = f"| 32 | {served32:.3f} | {served32 / chain:.3f} |"
    assert f"| DDTREE, lattice tree with coverage (as served) {row}" in text
