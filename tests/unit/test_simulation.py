"""The simulated world, benchmark tooling (scripts/simworld: world.py) and its patches in a server
(server.py, installed by its sitecustomize.py): calibration, one world for the chain and the
tree, and DDTREE's draft head and DFLASH's chain accept against the reference engine run on the
same world."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.accept import accept_walk
from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.reference.engine import generate, generate_chain

REPO = Path(__file__).resolve().parents[2]


def _simworld():
    """scripts/simworld as the benchmark scripts import it (scripts/ first on the path)."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return (
        importlib.import_module("simworld"),
        importlib.import_module("simworld.world"),
        importlib.import_module("simworld.server"),
    )


simworld, sim, simserver = _simworld()

B, N, K, V = 16, 32, 8, 1024
CFG = DDTreeConfig(block_size=B, num_nodes=N, topk=K)
PROMPT = [3, 4, 5]
# Monte Carlo over 100k rounds: the standard error of an acceptance near 0.6 is 0.0015
SAMPLES, TOLERANCE = 100_000, 0.006


def _keys(bs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    position = torch.randint(0, 1 << 20, (bs,), generator=g)
    root = torch.randint(sim.FIRST_ID, V, (bs,), generator=g)
    return position, root


@pytest.mark.parametrize("name", sorted(sim.REGIMES))
def test_the_chains_acceptance_per_position_matches_the_calibration(name):
    world = sim.REGIMES[name]
    drafts, picks = world.chain(*_keys(SAMPLES), B, V)
    accepted = (picks[:, :-1] == drafts).long().cumprod(dim=1).float().mean(dim=0)
    want = sim.chain_acceptance(world, B - 1)
    for d in range(B - 1):
        assert abs(float(accepted[d]) - want[d]) < TOLERANCE, (name, d + 1)


def test_the_regimes_are_the_published_curves():
    """The fine-tune's cumulative chain acceptance as published, and the chain tau of the
    narrative and code regimes at block 16."""
    curve = sim.chain_acceptance(sim.REGIMES["fine_tune"], 5)
    assert curve == pytest.approx([0.600, 0.385, 0.215, 0.108, 0.062], abs=5e-4)
    assert sim.chain_tau(sim.REGIMES["narrative"], B - 1) == pytest.approx(3.7, abs=0.01)
    assert sim.chain_tau(sim.REGIMES["code"], B - 1) == pytest.approx(8.0, abs=0.01)
    assert sim.MID_REGIME in sim.REGIMES


def test_the_drafts_are_ranked_distinct_tokens_of_the_vocabulary():
    world = sim.REGIMES["fine_tune"]
    ids, logprobs = world.draft(*_keys(4096), B - 1, sim.RANKS, V)
    assert ids.min() >= sim.FIRST_ID and ids.max() < V
    ranked = ids.sort(dim=-1).values
    assert (ranked[..., 1:] != ranked[..., :-1]).all()
    assert (logprobs[..., 1:] <= logprobs[..., :-1]).all()  # rank 1 is the top-1
    assert (logprobs.exp().sum(-1) <= 1.0 + 1e-6).all()


def test_one_world_for_the_chain_and_the_tree():
    """The tree's top-1 path carries the chain's drafts and the same target tokens."""
    world, bs = sim.REGIMES["narrative"], 64
    position, root = _keys(bs)
    drafts, chain_picks = world.chain(position, root, B, V)
    head = _head(world, bs)
    head(torch.zeros(bs * B, 8), _block(root), _positions(position))
    tree = head.tree(bs)
    for b in range(bs):
        node = 0
        for d in range(B - 1):
            assert int(head.simulated_picks[b, node]) == int(chain_picks[b, d])
            children = (tree.parents[b] == node).nonzero().flatten()
            spine = [c for c in children.tolist() if int(tree.tokens[b, c]) == int(drafts[b, d])]
            if not spine:
                break
            node = spine[0]


def test_the_trees_acceptance_matches_its_expectation():
    """Mean accepted drafts over many rounds against the exact expectation of the same trees:
    the sum over nodes of the product of the match probabilities along the path."""
    world, bs = sim.REGIMES["fine_tune"], 20_000
    position, root = _keys(bs, seed=1)
    head = _head(world, bs)
    head(torch.zeros(bs * B, 8), _block(root), _positions(position))
    tree = head.tree(bs)
    accepted = accept_walk(tree, head.simulated_picks[:bs], B - 1).num_accepted.float()
    keys = world.keys(position, root)
    probs = world.probabilities(keys, B)
    ids = world.token_ids(keys, B, V)
    spine = torch.ones(bs, N, dtype=torch.bool)
    reach = torch.ones(bs, N)
    rows = torch.arange(bs)
    for n in range(1, N):
        parent, depth = tree.parents[:, n], tree.depth[:, n]
        ranked = ids[rows, depth - 1, : sim.RANKS] == tree.tokens[:, n, None]
        rank = ranked.float().argmax(dim=-1)
        p = probs[rows, depth - 1, rank] * torch.where(spine[rows, parent], 1.0, world.off_spine)
        reach[:, n] = reach[rows, parent] * p
        spine[:, n] = spine[rows, parent] & (rank == 0)
    expected = reach[:, 1:].sum(dim=1)
    assert float(accepted.mean()) == pytest.approx(float(expected.mean()), abs=0.03)


@pytest.mark.parametrize("name", sorted(sim.REGIMES))
def test_ddtrees_rounds_are_the_reference_engines_on_the_same_world(name):
    """DDTREE's draft head (the world's top-K, its target tokens computed in the same call) and
    the accept walk, round by round, against the reference engine over SimulatedDrafter and
    SimulatedTarget: the same tokens and the same accepted lengths."""
    world = sim.REGIMES[name]
    reference = generate(
        sim.SimulatedTarget(world, V),
        sim.SimulatedDrafter(world, B, V),
        PROMPT,
        120,
        budget=N - 1,
        topk=K,
    )
    head = _head(world, 1)
    tokens, lengths = [sim.FIRST_ID], []
    position, root = len(PROMPT), sim.FIRST_ID
    while len(tokens) < 120:
        head(torch.zeros(B, 8), _block(torch.tensor([root])), _positions(torch.tensor([position])))
        accept = accept_walk(head.tree(1), head.simulated_picks[:1], B - 1)
        a = int(accept.num_accepted[0])
        emitted = accept.emitted[0, : a + 1].tolist()
        tokens += emitted
        lengths.append(a + 1)
        position, root = position + a + 1, emitted[-1]
    assert tokens[:120] == reference.tokens
    assert lengths[: len(reference.accept_lengths)] == reference.accept_lengths


@pytest.mark.parametrize("name", sorted(sim.REGIMES))
def test_dflashs_chain_accept_reads_the_world_as_the_reference_chain(name):
    """The DFLASH hook replaces the block's drafts with the world's top-1 path and the target's
    tokens with the world's; the chain's rounds then match the reference engine's K = 1 tree."""
    world = sim.REGIMES[name]
    reference = generate_chain(
        sim.SimulatedTarget(world, V), sim.SimulatedDrafter(world, B, V), PROMPT, 120
    )
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=V))
        )
    )
    seen = {}

    def accept_block(
        worker_, *, candidates, next_token_logits, target_predict, prefix_lens, **kwargs
    ):
        seen.update(candidates=candidates.clone(), target=target_predict.clone(), kwargs=kwargs)
        return "accepted"

    hook = simserver.ChainAccept(world)
    tokens, lengths = [sim.FIRST_ID], []
    position, root = len(PROMPT), sim.FIRST_ID
    while len(tokens) < 120:
        candidates = torch.full((1, B), 7)  # the dummy drafter's
        candidates[0, 0] = root
        logits = torch.randn(B, V)
        got = hook(
            accept_block,
            worker,
            candidates=candidates,
            next_token_logits=logits,
            prefix_lens=torch.tensor([position]),
            sampling_info=None,
            bs=1,
        )
        assert got == "accepted" and seen["kwargs"] == {"sampling_info": None, "bs": 1}
        drafts, target = seen["candidates"][0, 1:], seen["target"].view(-1)
        assert seen["target"].shape == (B,)  # the argmax's shape, [bs * B]
        a = int((target[:-1] == drafts).long().cumprod(0).sum())
        emitted = [*drafts[:a].tolist(), int(target[a])]
        tokens += emitted
        lengths.append(a + 1)
        position, root = position + a + 1, emitted[-1]
    assert tokens[:120] == reference.tokens
    assert lengths[: len(reference.accept_lengths)] == reference.accept_lengths


def test_a_simulated_world_needs_dummy_weights():
    simulated = simserver
    simulated.check_dummy_weights("dummy")
    for load_format in ("auto", "safetensors", None):
        with pytest.raises(RuntimeError, match="--load-format dummy"):
            simulated.check_dummy_weights(load_format)
    calls = []
    with pytest.raises(RuntimeError, match="unset DDTREE_SIMULATE"):
        simulated.worker_init(
            sim.REGIMES["code"],
            lambda *a, **k: calls.append(a),
            object(),
            SimpleNamespace(load_format="auto"),
            0,
        )
    assert calls == []  # refused before the worker is built


def test_the_variable_names_a_regime_and_its_overrides():
    assert sim.parse(None) is None and sim.parse("") is None
    world = sim.parse("code:off_spine=0.5,seed=3")
    assert world.top1 == sim.REGIMES["code"].top1 and (world.off_spine, world.seed) == (0.5, 3)
    for bad, message in (
        ("fast", "DDTREE_SIMULATE: unknown regime"),
        ("code:depth=3", "unknown parameter"),
        ("code:ratio=x", "not a number"),
        ("code:spread=2", "spread"),
    ):
        with pytest.raises(ValueError, match=message):
            sim.parse(bad)


def test_the_package_has_no_world_and_refuses_its_old_switch(monkeypatch):
    """The world is benchmark tooling: the package neither ships nor reads it, and a server
    started with the switch it once read is refused, naming the tooling."""
    from sglang_ddtree import config
    from sglang_ddtree.round.draft_head import DraftTreeHead

    assert not (REPO / "sglang_ddtree" / "simulation.py").exists()
    assert "world" not in inspect.signature(DraftTreeHead).parameters
    assert "simulate" not in {f.name for f in config.dataclasses.fields(config.Options)}
    monkeypatch.setenv("SGLANG_DDTREE_SIMULATE", "narrative")
    with pytest.raises(ValueError, match=r"benchmark tooling \(scripts/simworld, DDTREE_"):
        config.Options.from_env()


def test_the_tree_verify_reads_the_worlds_tokens_for_the_call_only(monkeypatch):
    """tree_greedy_targets hands SGLang's greedy tree verify the world's tokens (the global of
    eagle_sample's module, read at call time) and puts SGLang's function back."""
    from sglang_ddtree.adapter import compat

    module = pytest.importorskip(compat.TREE_SAMPLER_MODULE)
    seen = []
    monkeypatch.setattr(module, simserver.TREE_GREEDY, lambda **kw: seen.append(kw) or "walked")
    original = getattr(module, simserver.TREE_GREEDY)
    picks = torch.arange(12).view(3, 4)[:2, :3]  # a slice, as the worker passes it
    argmax = torch.zeros(2, 3, dtype=torch.int64)
    with simserver.tree_greedy_targets(picks):
        got = getattr(module, simserver.TREE_GREEDY)(candidates="c", target_predict=argmax)
    assert got == "walked" and seen[0]["candidates"] == "c"
    assert torch.equal(seen[0]["target_predict"], picks)
    # SGLang's kernel checks its inputs are contiguous: a width below N slices every row
    assert not picks.is_contiguous() and seen[0]["target_predict"].is_contiguous()
    assert getattr(module, simserver.TREE_GREEDY) is original


def test_sglangs_eagle_sample_reads_the_greedy_verify_the_world_replaces():
    from sglang_ddtree.adapter import compat

    module = pytest.importorskip(compat.TREE_SAMPLER_MODULE)
    assert simserver.TREE_GREEDY in module.eagle_sample.__code__.co_names
    assert simserver.TREE_GREEDY not in module.eagle_sample.__code__.co_varnames
    assert "target_predict=target_predict" in inspect.getsource(module.eagle_sample)


def test_dflashs_accept_takes_the_keywords_the_chain_hook_reads():
    """The hook reads DFLASH's accept by keyword: were one renamed, the chain would silently
    read the dummy weights."""
    dflash = pytest.importorskip(simserver.DFLASH_WORKER)
    params = inspect.signature(dflash.DFlashWorkerV2._accept_block).parameters
    for name in ("candidates", "next_token_logits", "target_predict", "prefix_lens"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    source = inspect.getsource(dflash.DFlashWorkerV2.forward_batch_generation)
    assert "prefix_lens = batch.seq_lens" in source  # the block's root sits at prefix_lens
    assert "self._accept_block(" in source
    init = inspect.signature(dflash.DFlashWorkerV2.__init__).parameters
    assert list(init)[:2] == ["self", "server_args"]  # worker_init reads server_args


def test_the_patches_put_dflash_and_ddtree_in_the_world(monkeypatch):
    """patch_dflash: DFlashWorkerV2's start-up is refused without dummy weights and its accept
    reads the world; patch_ddtree: DDTREE's worker makes SimulatedHeads and its round's verify
    hands SGLang the head's picks. Each module is patched once."""
    world = sim.REGIMES["narrative"]
    made, accepted = [], []

    class DFlashWorkerV2:
        def __init__(self, server_args, gpu_id):
            made.append(gpu_id)

        def _accept_block(self, *, candidates, next_token_logits, target_predict, prefix_lens):
            accepted.append(target_predict)

    dflash = types.ModuleType("dflash")
    dflash.DFlashWorkerV2 = DFlashWorkerV2
    simserver.apply(simserver.patch_dflash, world, dflash)
    with pytest.raises(RuntimeError, match="--load-format dummy"):
        DFlashWorkerV2(SimpleNamespace(load_format="auto"), 0)
    worker = DFlashWorkerV2(SimpleNamespace(load_format="dummy"), 1)
    assert made == [1]
    worker.target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=V))
    )
    position, root = _keys(2)
    candidates = torch.zeros(2, B, dtype=torch.int64)
    candidates[:, 0] = root
    worker._accept_block(
        candidates=candidates, next_token_logits=torch.randn(2 * B, V), prefix_lens=position
    )
    drafts, picks = world.chain(position, root, B, V)
    assert torch.equal(candidates[:, 1:], drafts)
    assert torch.equal(accepted[0].view(2, B), picks)
    with pytest.raises(RuntimeError, match="patched already"):
        simserver.apply(simserver.patch_dflash, world, dflash)

    class Round:
        def verify(self, grammar_barrier):
            return grammar_barrier, picked

    stages = types.ModuleType("round")
    stages.Round = Round
    monkeypatch.setitem(sys.modules, simserver.DDTREE_ROUND, stages)
    ddtree = types.ModuleType("worker")
    simserver.apply(simserver.patch_ddtree, world, ddtree)
    head = ddtree.DraftTreeHead(lm_head_weight=torch.randn(V, 8), vocab_size=V, cfg=CFG, max_bs=3)
    assert isinstance(head, simserver.SimulatedHead) and head.world == world
    head.simulated_picks.copy_(torch.arange(3 * N).view(3, N))
    picked = []
    monkeypatch.setattr(simserver, "tree_greedy_targets", lambda t: _recording(picked, t))
    rnd = Round()
    rnd.worker, rnd.bs, rnd.width = SimpleNamespace(tree_head=head), 2, 16
    assert rnd.verify("barrier")[0] == "barrier"
    assert torch.equal(picked[0], head.simulated_picks[:2, :16])


def _recording(seen: list, targets):
    import contextlib

    seen.append(targets)
    return contextlib.nullcontext()


def test_install_patches_a_module_once_it_is_imported(tmp_path, monkeypatch):
    """AfterImport finds a pending module with the other finders and patches it after it ran;
    modules it does not wait for import untouched."""
    (tmp_path / "simworld_probe.py").write_text("VALUE = 1\n")
    (tmp_path / "simworld_other.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = simserver.AfterImport({"simworld_probe": lambda m: setattr(m, "VALUE", 2)})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in ("simworld_probe", "simworld_other"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert importlib.import_module("simworld_other").VALUE == 1
    assert importlib.import_module("simworld_probe").VALUE == 2
    assert finder not in sys.meta_path  # nothing left to wait for


def test_a_server_gets_the_world_from_its_environment(tmp_path):
    """server_env puts scripts/simworld first on PYTHONPATH with DDTREE_SIMULATE: a process
    started so installs the world's patches (waiting for SGLang's and DDTREE's workers), one
    with a bad value does not start, and a folder with its own sitecustomize is refused."""
    env = simworld.server_env({"X": "1"}, "narrative", environ={"PYTHONPATH": str(REPO)})
    assert env["X"] == "1" and env[simworld.VARIABLE] == "narrative"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(simworld.FOLDER), str(REPO)]
    probe = (
        "import sys; from simworld import server; "
        "f = [x for x in sys.meta_path if isinstance(x, server.AfterImport)]; "
        "print(*sorted(f[0].pending))"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [simserver.DFLASH_WORKER, simserver.DDTREE_WORKER]
    bad = {**os.environ, **env, simworld.VARIABLE: "fast"}
    run = subprocess.run([sys.executable, "-c", "0"], env=bad, capture_output=True, text=True)
    assert run.returncode != 0 and "DDTREE_SIMULATE: unknown regime 'fast'" in run.stderr
    sampler = REPO / "scripts" / "host_sampler"
    with pytest.raises(ValueError, match="already has one"):
        simworld.server_env({"PYTHONPATH": str(sampler)}, "narrative")


def _head(world, bs: int):
    weight = torch.randn(V, 8)
    return simserver.SimulatedHead(world, lm_head_weight=weight, vocab_size=V, cfg=CFG, max_bs=bs)


def _block(root: torch.Tensor) -> torch.Tensor:
    ids = torch.zeros(root.numel(), B, dtype=torch.int64)
    ids[:, 0] = root
    return ids.flatten()


def _positions(position: torch.Tensor) -> torch.Tensor:
    return (position[:, None] + torch.arange(B)).flatten()


@pytest.mark.gpu
def test_the_heads_world_replays_in_a_cuda_graph():
    """The world's draws run inside the draft graph (no host copy in the capture): a replay on
    new roots and positions gives the eager call's trees and target tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev, bs = torch.device("cuda"), 4
    world = sim.REGIMES["narrative"]
    head = simserver.SimulatedHead(
        world, lm_head_weight=torch.randn(V, 8, device=dev), vocab_size=V, cfg=CFG, max_bs=bs
    )
    hidden = torch.zeros(bs * B, 8, device=dev)
    position, root = _keys(bs)
    ids, positions = _block(root).to(dev), _positions(position).to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        head(hidden, ids, positions)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head(hidden, ids, positions)
    position, root = _keys(bs, seed=5)
    ids.copy_(_block(root).to(dev))
    positions.copy_(_positions(position).to(dev))
    graph.replay()
    replayed = head.tokens.clone(), head.simulated_picks.clone()
    head(hidden, ids, positions)
    assert torch.equal(replayed[0], head.tokens)
    assert torch.equal(replayed[1], head.simulated_picks)


def test_the_docs_state_each_regimes_parameters():
    """docs/simulation.md's regime table carries each regime's means and calibrated chain."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "simulation.md").read_text()
    for name, world in sim.REGIMES.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"{world.top1[0]:.3f}" in row and f"{sim.chain_tau(world, B - 1):.2f}" in row
    for value in (
        f"spread {sim.REGIMES['code'].spread}",
        f"ratio {sim.REGIMES['code'].ratio}",
        f"off-spine {sim.REGIMES['code'].off_spine}",
    ):
        assert value in text


# -- the fitted regime (ddtree_paper) and the draws it adds: tail, shared, miss_ratio ----------

# sha256 (first 16 hex) of the trees, their target tokens and the chain of 512 seeded rounds in
# each regime, taken before tail, shared and miss_ratio existed: their defaults draw the same
GOLDEN = {
    "fine_tune": "5c4b93437be004b5",
    "narrative": "8a808056a13e105a",
    "code": "3a0b13ec554acc76",
}


def _digest(world, bs: int = 512) -> str:
    import hashlib

    g = torch.Generator().manual_seed(7)
    position = torch.randint(0, 1 << 20, (bs,), generator=g)
    root = torch.randint(sim.FIRST_ID, V, (bs,), generator=g)
    head = simserver.SimulatedHead(
        world, lm_head_weight=torch.zeros(V, 1), vocab_size=V, cfg=CFG, max_bs=bs
    )
    ids = torch.zeros(bs, B, dtype=torch.int64)
    ids[:, 0] = root
    head(torch.zeros(bs * B, 1), ids.flatten(), (position[:, None] + torch.arange(B)).flatten())
    drafts, picks = world.chain(position, root, B, V)
    h = hashlib.sha256()
    for t in (head.tokens, head.simulated_picks, drafts, picks):
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_pessimistic_regimes_draw_as_before(name):
    world = sim.REGIMES[name]
    assert (world.tail, world.shared, world.miss_ratio) == (0.0, 0.0, None)
    assert _digest(world) == GOLDEN[name]


def _fit():
    sys.path.insert(0, str(REPO / "scripts" / "simworld"))
    return importlib.import_module("simworld.fit")


def test_the_fitted_regime_is_the_fits_and_its_chain_the_papers_histogram():
    import json

    fit = _fit()
    rows = [json.loads(x) for x in (REPO / "docs/data/world_fit.jsonl").read_text().splitlines()]
    params = next(r for r in rows if r["kind"] == "fit")["parameters"]
    world = sim.REGIMES["ddtree_paper"]
    assert world == fit.paper_world(**params)
    assert sim.PAPER_CHAIN_HISTOGRAM == tuple(fit.paper_targets()["hist"]["dflash"])
    want = sim.chain_survival(sim.PAPER_CHAIN_HISTOGRAM)
    assert sim.chain_acceptance(world, B - 1) == pytest.approx(want, abs=2e-4)


def test_the_new_parameters_parse_and_are_checked():
    world = sim.parse("ddtree_paper:tail=1.5,shared=0.5,miss_ratio=0.2")
    assert (world.tail, world.shared, world.miss_ratio) == (1.5, 0.5, 0.2)
    assert world.top1 == sim.REGIMES["ddtree_paper"].top1
    for bad in ("ddtree_paper:shared=2", "ddtree_paper:miss_ratio=-1", "ddtree_paper:tail=50"):
        with pytest.raises(ValueError):
            sim.parse(bad)


@pytest.mark.parametrize(
    "params", [{"shared": 0.6}, {"tail": 2.0}, {"tail": 2.0, "shared": 0.7, "miss_ratio": 0.2}]
)
def test_the_chains_acceptance_matches_its_exact_mean_under_the_new_draws(params):
    world = sim.World("x", (0.85, 0.8, 0.9), **params)
    drafts, picks = world.chain(*_keys(SAMPLES), B, V)
    accepted = (picks[:, :-1] == drafts).long().cumprod(dim=1).float().mean(dim=0)
    want = sim.chain_acceptance(world, B - 1)
    assert max(abs(float(accepted[d]) - want[d]) for d in range(B - 1)) < TOLERANCE


def test_the_new_draws_are_hash_deterministic_and_sync_free():
    world = sim.REGIMES["ddtree_paper"]
    keys = world.keys(*_keys(256))
    first = world.target_probabilities(keys, B, world.means_on(B, "cpu"))
    again = world.target_probabilities(keys.clone(), B, world.means_on(B, "cpu"))
    assert torch.equal(first, again)
    # the target's tail past rank 1 is its own, the top-1 the drafter's
    stated = world.probabilities(keys, B)
    assert torch.equal(first[..., 0], stated[..., 0]) and not torch.equal(first, stated)
    if torch.cuda.is_available():
        means = world.means_on(B, "cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            world.target_probabilities(keys.cuda(), B, means)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_the_fit_reproduces_its_committed_rows():
    """The fit's evaluation at the committed world: a cheap subset (the first 500 rounds of
    budgets 16 and 32) equals what the committed run's rounds give, and the tree of a budget is
    the first nodes of a larger one's (what the fit's truncation reads)."""
    fit = _fit()
    world = sim.REGIMES["ddtree_paper"]
    small = fit.evaluate(world, budgets=(16, 32), rounds=500)
    large = fit.evaluate(world, budgets=(16, 32, 64), rounds=500)
    for key in ("chain", 16, 32):
        assert torch.equal(small[key], large[key]), key
    again = fit.evaluate(world, budgets=(16, 32), rounds=500)
    assert all(torch.equal(small[k], again[k]) for k in small)


def test_the_committed_fit_rows_are_what_the_fit_gives():
    """The committed run's chain and budget-16 tokens per round, recomputed (its rounds, its
    seed: the tree of budget 16 is the first 17 nodes of any larger one)."""
    import json

    fit = _fit()
    rows = [json.loads(x) for x in (REPO / "docs/data/world_fit.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["sitting"] == max(x["sitting"] for x in rows)]
    chain = next(r for r in rows if r.get("verify") == "chain" and r["kind"] == "tokens_per_round")
    tree = next(r for r in rows if r.get("budget") == 16 and r["kind"] == "tokens_per_round")
    got = fit.evaluate(sim.REGIMES["ddtree_paper"], budgets=(16,), rounds=chain["rounds"])
    assert float(got["chain"].double().mean()) == pytest.approx(chain["tau"], abs=1e-9)
    assert float(got[16].double().mean()) == pytest.approx(tree["tau"], abs=1e-9)
