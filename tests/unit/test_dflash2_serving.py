"""DDTREE serving a DFlash2 drafter, on the CPU: the lattice draft head (round/draft_head.py's
LatticeTreeHead) on SGLang's own CandidateSelector (random weights, eager) and a stand-in draft
model with DFlash2DraftModel's candidates (SGLang's candidate_topk, its lse included, on the
CPU); the coverage it adds to the chain; the worker's DFlash2 wiring (round/worker.py). The start-up
checks are in test_plugin.py, the tiny DFlash2 checkpoint in test_tiny.py; the GPU suite serves
it (tests/gpu/test_dflash2.py)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_ddtree.adapter import compat  # noqa: E402
from sglang_ddtree.config import DDTreeConfig  # noqa: E402
from sglang_ddtree.round.draft_head import DraftTreeHead, LatticeTreeHead  # noqa: E402
from sglang_ddtree.tree.lattice import (  # noqa: E402
    build_lattice_tree_reference,
    lattice_chain_logprobs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, R = 6, 16, 5  # block, hidden, selector rank


def _sglang_dflash():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models import dflash
    return dflash


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """SGLang's candidate_topk reads the TP size from the runtime context, which only a server
    (or tests.fixtures.sglang_cpu_model_context) publishes: one rank here."""
    monkeypatch.setattr(_sglang_dflash(), "get_parallel", lambda: SimpleNamespace(tp_size=1))


class StubDraft(torch.nn.Module):
    """What the lattice head reads of SGLang's DFlash2DraftModel: `candidate_selector` (SGLang's
    own), `lm_head` (the target's: weight [V, H], org_vocab_size, no quant_method),
    `draft_config` (the unary transform: output_multiplier, final_logit_softcapping) and
    DFlash2DraftModel's own compute_candidates and transform over them."""

    def __init__(self, weight, top_k: int, generator, multiplier=1.0, softcap=None):
        super().__init__()
        V, hidden_size = weight.shape
        self.lm_head = SimpleNamespace(weight=weight, org_vocab_size=V, quant_method=None)
        self.draft_config = SimpleNamespace(
            output_multiplier=multiplier, final_logit_softcapping=softcap
        )
        self.candidate_selector = _sglang_dflash().CandidateSelector(
            hidden_size=hidden_size, vocab_size=V, state_rank=R, top_k=top_k
        )
        with torch.no_grad():
            for p in self.candidate_selector.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))

    def compute_candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _sglang_dflash().DFlash2DraftModel.compute_candidates(self, hidden)

    def _transform_unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return _sglang_dflash().DFlash2DraftModel._transform_unary_logits(self, logits)


def _lattice_from_logits(draft, slots, root, transform=lambda x: x):
    """The drafter's lattice computed here, apart from compat and SGLang's top-K, from the
    full-vocabulary logits [bs, L, V] of slots [bs, L, H]: the top-K ids [bs, L, K], the
    selector's scores [bs, L, K, K] on the transformed unary logits, and the log coverage
    [bs, L] (logsumexp of the K logits - logsumexp of all V)."""
    bs, L, Hs = slots.shape
    weight = draft.lm_head.weight
    logits = (slots.reshape(-1, Hs).to(weight.dtype) @ weight.T).float().view(bs, L, -1)
    unary, ids = torch.topk(logits, draft.candidate_selector.top_k, dim=-1)
    scores = draft.candidate_selector.build_lattice(
        candidate_ids=ids, unary_logits=transform(unary), hidden_states=slots, anchor_token_ids=root
    )
    return ids, scores, torch.logsumexp(unary, -1) - torch.logsumexp(logits, -1)


def _block(
    bs: int, V: int, g: torch.Generator, B: int = B, H: int = H
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft block's outputs as the draft graph's tail gets them: hidden states [bs * B, H]
    and input ids [bs * B] (the root, then mask tokens)."""
    hidden = torch.randn(bs * B, H, generator=g)
    ids = torch.full((bs, B), V - 1, dtype=torch.int64)
    ids[:, 0] = torch.randint(V - 1, (bs,), generator=g)
    return hidden, ids.flatten()


def _fields_equal(a, b) -> None:
    for name in a._fields:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _same_tree(ours, theirs, atol: float = 1e-5) -> None:
    """Every integer and structural field equal; the float32 node scores within atol."""
    for name in ours._fields:
        if name != "scores":
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    torch.testing.assert_close(ours.scores, theirs.scores, rtol=0, atol=atol)


def test_the_dflash2_architectures_are_sglangs():
    """compat's list is every DFlash2 class the installed release registers."""
    dflash = _sglang_dflash()
    names = {c.__name__ for c in dflash.EntryClass if issubclass(c, dflash.DFlash2DraftModel)}
    assert set(compat.DFLASH2_ARCHITECTURES) == names


@pytest.mark.parametrize("budget", [7, 30])
def test_the_lattice_head_builds_the_reference_tree_of_the_drafters_lattice(budget):
    """Into its static buffers: the heap's tree (tree.lattice's specification) on the lattice
    SGLang's selector scores for the block's slots 1..B-1, anchored at the block's root, with
    the chain's log conditionals and each slot's coverage (both computed here from the whole
    logits matrix); every integer field exact, the scores within float32 rounding. Rows past
    the batch stay as they were."""
    g = torch.Generator().manual_seed(3)
    V, K, bs = 40, 4, 3
    draft = StubDraft(torch.randn(V, H, generator=g), K, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=budget + 1, topk=K)
    head = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=5, device=torch.device("cpu"))
    hidden, input_ids = _block(bs, V, g)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        head(hidden, input_ids)
        root = input_ids.view(bs, B)[:, 0]
        ids, scores, coverage = _lattice_from_logits(draft, hidden.view(bs, B, H)[:, 1:], root)
    cond = lattice_chain_logprobs(scores, coverage)
    _same_tree(head.tree(bs), build_lattice_tree_reference(root, ids, cond, budget))
    assert not head.tokens[bs:].any() and not head.visibility[bs:].any()
    # the lattice is not the marginal one: some node's children follow its own row
    assert not torch.equal(scores[:, 1:, 0], scores[:, 1:, 1])


@pytest.mark.parametrize("V, K", [(6, 6), (40, 4)])
def test_a_selector_that_ignores_the_predecessor_gives_the_dflash_heads_tree(V, K):
    """With the selector's predecessor codebook zero, every row of a slot is its unary logits:
    their softmax over the K plus the slot's log coverage (the K's share of the full softmax)
    is the LM head's full log-softmax on the K, for K the whole vocabulary or not. The lattice
    head's tree is then the DFlash head's (DraftTreeHead, the torch builder) on the same LM
    head: the same nodes, links and mask, the scores within float32 rounding (the two sum the
    same terms in different orders). Without the coverage, K < V would not match."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(V, H, generator=g)
    draft = StubDraft(weight, K, g)
    with torch.no_grad():
        draft.candidate_selector.predecessor_codebook.zero_()
    cfg = DDTreeConfig(block_size=B, num_nodes=32, topk=K)
    cpu = torch.device("cpu")
    lattice = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=4, device=cpu)
    marginal = DraftTreeHead(lm_head_weight=weight, vocab_size=V, cfg=cfg, max_bs=4)
    hidden, input_ids = _block(4, V, g)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        lattice(hidden, input_ids)
        marginal(hidden, input_ids)
    _same_tree(lattice.tree(4), marginal.tree(4))


def _slots(bs: int, V: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's slots 1..B-1 [bs, B-1, H] and its roots [bs]."""
    return torch.randn(bs, B - 1, H, generator=g), torch.randint(V, (bs,), generator=g)


def test_the_lattice_heads_conditionals_add_the_drafters_coverage():
    """A drafter whose unary transform is the identity (output_multiplier 1, no softcap): the
    head's log conditionals are lattice_chain_logprobs(scores, log coverage), the coverage
    (logsumexp of the K unary logits - the full-vocabulary lse) computed here from the whole
    logits matrix [bs, L, V]; float32 rounding apart. They are not the chain over the K alone."""
    g = torch.Generator().manual_seed(13)
    V, K, bs = 40, 4, 3
    draft = StubDraft(torch.randn(V, H, generator=g), K, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=16, topk=K)
    head = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=bs, device=torch.device("cpu"))
    slots, root = _slots(bs, V, g)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ids, cond = head.lattice(slots, root)
        want_ids, scores, coverage = _lattice_from_logits(draft, slots, root)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(cond, lattice_chain_logprobs(scores, coverage), rtol=0, atol=1e-5)
    assert not torch.allclose(cond, lattice_chain_logprobs(scores), rtol=0, atol=1e-3)


@pytest.mark.parametrize("multiplier, softcap", [(2.0, None), (1.0, 5.0), (0.5, 3.0)])
def test_a_drafter_that_scales_or_softcaps_its_logits_has_no_coverage(multiplier, softcap):
    """Its candidates are compute_candidates' (SGLang's transform of the unary logits), its
    coverage None, and the head's log conditionals the chain over the K alone, on the
    transformed logits."""

    def transform(x):
        x = x * multiplier
        return x if softcap is None else softcap * torch.tanh(x / softcap)

    g = torch.Generator().manual_seed(17)
    V, K, bs = 40, 4, 3
    draft = StubDraft(torch.randn(V, H, generator=g), K, g, multiplier, softcap)
    cfg = DDTreeConfig(block_size=B, num_nodes=16, topk=K)
    head = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=bs, device=torch.device("cpu"))
    slots, root = _slots(bs, V, g)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ids, scores, coverage = compat.selector_lattice(draft, slots, root)
        head_ids, cond = head.lattice(slots, root)
        want_ids, want_scores, _ = _lattice_from_logits(draft, slots, root, transform)
    assert coverage is None
    assert torch.equal(ids, want_ids) and torch.equal(head_ids, want_ids)
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=1e-5)
    assert torch.equal(cond, lattice_chain_logprobs(scores))


def test_the_coverage_costs_the_slots_whose_top_k_holds_little_mass():
    """Slots with flat logits (zero hidden states: the K of V hold K / V of the mass) beside
    slots that point at one token (its LM-head row, scaled: the K hold nearly all of it): the
    coverage is <= 0 everywhere, log(K / V) on the flat slots, about 0 on the peaked ones, and
    the head's log conditionals are the chain over the K lowered by exactly the coverage."""
    g = torch.Generator().manual_seed(19)
    V, K, bs = 40, 4, 2
    weight = torch.randn(V, H, generator=g)
    draft = StubDraft(weight, K, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=16, topk=K)
    head = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=bs, device=torch.device("cpu"))
    slots, root = torch.zeros(bs, B - 1, H), torch.randint(V, (bs,), generator=g)
    peaked = torch.randint(V, (bs, len(range(1, B - 1, 2))), generator=g)
    slots[:, 1::2] = 8 * weight[peaked]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ids, scores, coverage = compat.selector_lattice(draft, slots, root)
        _, cond = head.lattice(slots, root)
    assert coverage.shape == (bs, B - 1) and coverage.dtype == torch.float32
    assert (coverage <= 0).all()
    flat = torch.full_like(coverage[:, ::2], torch.log(torch.tensor(K / V)).item())
    torch.testing.assert_close(coverage[:, ::2], flat, rtol=0, atol=1e-6)
    assert (coverage[:, 1::2] > -1e-3).all()
    assert torch.equal(ids[:, 1::2, 0], peaked)
    lowered = cond - lattice_chain_logprobs(scores)
    torch.testing.assert_close(
        lowered, coverage[:, :, None, None].expand_as(cond), rtol=0, atol=1e-5
    )


def test_the_lattice_head_refuses_a_k_other_than_its_selectors():
    g = torch.Generator().manual_seed(0)
    draft = StubDraft(torch.randn(20, H, generator=g), 4, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=8, topk=8)
    with pytest.raises(ValueError, match="scores 4 candidates per position.*K=8"):
        LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=2, device=torch.device("cpu"))


# ------------------------------------------------------------------------------ the worker


def _exec_config(bs=(1, 2, 4), backend=None):
    """get_exec()'s graph config as the worker reads it: the decode graphs' batch sizes and
    backend (default: captured)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    decode = SimpleNamespace(bs=list(bs), backend=backend or Backend.FULL)
    return SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=decode)))


def _dflash2_worker(monkeypatch, V=40, K=4):
    """A DDTreeWorker as DFlashWorkerV2's start-up leaves it on a DFlash2 draft (its selector
    sampler not built, no chain sample), around a stand-in draft model and target LM head."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_ddtree.round import worker as worker_mod

    def never(self):
        raise AssertionError("DFLASH's selector sampler was built")

    monkeypatch.setattr(DFlashWorkerV2, "_maybe_build_draft_sampler", never)
    monkeypatch.setattr(worker_mod, "get_exec", _exec_config)
    monkeypatch.setattr(compat, "max_running_requests", lambda: 3)
    g = torch.Generator().manual_seed(7)
    lm_head = torch.nn.Linear(H, V, bias=False)  # the target's (its weight [V, H])
    lm_head.org_vocab_size = V  # as SGLang's ParallelLMHead has it
    draft = StubDraft(lm_head.weight.detach(), K, g)
    draft.lm_head = None  # DFlash2DraftModel's until the worker points it at the target's
    w = worker_mod.DDTreeWorker.__new__(worker_mod.DDTreeWorker)
    w.cfg = DDTreeConfig(block_size=B, num_nodes=16, topk=K)
    w.draft_model, w._tp_size = draft, 1
    w._target_worker = SimpleNamespace(
        model_runner=SimpleNamespace(model=SimpleNamespace(lm_head=lm_head))
    )
    w.draft_model_runner = SimpleNamespace(capture_tail_hooks=[])
    w._draft_sampler = w._selector_sample = None  # as DFlashWorkerV2.__init__ leaves them
    return w, worker_mod


def test_the_worker_serves_a_dflash2_draft_through_the_lattice_head(monkeypatch):
    """At start-up the DFlash2 draft gets the lattice head, at the largest batch, and its
    lm_head is the target's before the draft graphs are captured; the capture folds DDTREE's
    tail alone into them (DFLASH's selector sampler is never built), and that tail builds the
    lattice tree; DFLASH's chain sample stays None."""
    w, worker_mod = _dflash2_worker(monkeypatch)
    head = w._build_tree_head()
    assert isinstance(head, LatticeTreeHead) and head.max_bs == 4
    assert w.draft_model.lm_head is w.target_worker.model_runner.model.lm_head
    w.tree_head = head
    captured = []
    monkeypatch.setattr(w, "_free_gb", lambda: 10.0)
    monkeypatch.setattr(w, "_ask_for_readings", lambda: None)
    monkeypatch.setattr(w, "_init_widths", lambda capture: None)
    monkeypatch.setattr(compat, "init_draft_cuda_graphs", lambda wk, cap: captured.append(cap))
    monkeypatch.setattr(compat, "target_verify_state", lambda runner: (None, None))
    w.init_cuda_graphs()
    assert captured == [True] and len(w.draft_model_runner.capture_tail_hooks) == 1
    assert w._draft_sampler is None and w._selector_sample is None
    hidden, input_ids = _block(2, 40, torch.Generator().manual_seed(1))
    tail = w.draft_model_runner.capture_tail_hooks[0]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        tail(
            None,
            SimpleNamespace(hidden_states=hidden),
            SimpleNamespace(input_ids=input_ids, positions=None),
            None,
        )
        root = input_ids.view(2, B)[:, 0]
        ids, cond = head.lattice(hidden.view(2, B, H)[:, 1:], root)
    expected = build_lattice_tree_reference(root, ids, cond, w.cfg.budget)
    _fields_equal(head.tree(2), expected)
    assert w._selector_sample is None


def test_a_dflash_draft_keeps_the_dflash_head(monkeypatch):
    w, _ = _dflash2_worker(monkeypatch)
    w.draft_model.candidate_selector = None  # SGLang's DFlashDraftModel
    head = w._build_tree_head()
    assert type(head) is DraftTreeHead and w.draft_model.lm_head is None


def test_a_quantized_target_lm_head_is_refused_for_a_dflash2_draft(monkeypatch):
    w, _ = _dflash2_worker(monkeypatch)
    lm_head = w.target_worker.model_runner.model.lm_head
    lm_head.weight = torch.nn.Parameter(lm_head.weight.detach().to(torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="keeps lm_head unquantized"):
        w._build_tree_head()


def test_a_dflash2_decode_round_verifies_the_lattice_tree(monkeypatch):
    """test_worker_round's decode round with the lattice head in the draft graph's tail: the
    verify input is the lattice tree, and DFLASH's chain sample stays None (its chain accept
    never runs)."""
    from sglang_ddtree.round import round as round_mod
    from sglang_ddtree.round import worker as worker_mod
    from tests.unit import test_worker_round as rounds

    calls = []
    w, batch, *_ = rounds._round_worker(monkeypatch, calls)
    g = torch.Generator().manual_seed(11)
    draft = StubDraft(torch.randn(32, rounds.H, generator=g), rounds.K, g)
    w.tree_head = LatticeTreeHead(
        draft_model=draft, cfg=w.cfg, max_bs=2, device=torch.device("cpu")
    )
    w._selector_sample = None  # as DFlashWorkerV2.__init__ leaves it
    hidden, input_ids = _block(2, 32, g, B=rounds.B, H=rounds.H)

    def draft_replay(rnd):  # the draft graph: the block's forward, then DDTREE's tail
        out = SimpleNamespace(hidden_states=hidden)
        batch = SimpleNamespace(input_ids=input_ids, positions=None)
        worker_mod.draft_tail(w.tree_head)(None, out, batch, None)
        rnd.positions = torch.arange(2 * rounds.B).view(2, rounds.B) + 100
        rnd.draft_slots = torch.arange(2 * rounds.B).view(2, rounds.B) + 1000

    monkeypatch.setattr(round_mod.Round, "draft", draft_replay)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        w.forward_batch_generation(batch)
        root = input_ids.view(2, rounds.B)[:, 0]
        ids, cond = w.tree_head.lattice(hidden.view(2, rounds.B, rounds.H)[:, 1:], root)
    expected = build_lattice_tree_reference(root, ids, cond, w.cfg.budget)
    verify_input = next(c for c in calls if c[0] == "verify_input")
    assert torch.equal(verify_input[1], expected.tokens)
    assert w._selector_sample is None


@pytest.mark.slow
def test_sglangs_dflash2_model_gives_the_lattice_head_dflashs_own_lattice(tmp_path):
    """The tiny DFlash2 checkpoint in SGLang's DFlash2DraftModel (CPU), its lm_head pointed at
    the target's as the worker does: compat.selector_lattice gives exactly the lattice DFLASH's
    worker draws its chain from (dflash_worker_v2._selector_lattice), with the coverage computed
    here from the whole logits matrix, and the lattice head's tree over it is the heap's."""
    from safetensors.torch import load_file
    from sglang.srt.speculative.dflash_worker_v2 import _selector_lattice
    from sglang.srt.utils.hf_transformers.config import get_config

    from sglang_ddtree.checkpoints.tiny import write_tiny_dflash2, write_tiny_qwen3
    from tests.fixtures import sglang_cpu_model_context

    target = write_tiny_qwen3(tmp_path / "target", seed=0)
    draft_dir = write_tiny_dflash2(tmp_path / "draft", target, seed=0, block_size=B)
    head_weight = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    V, Hd = head_weight.shape
    lm_head = SimpleNamespace(weight=head_weight, org_vocab_size=V, quant_method=None)
    cfg = DDTreeConfig(block_size=B, num_nodes=24, topk=4)
    g = torch.Generator().manual_seed(2)
    with (
        sglang_cpu_model_context(draft_dir),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        model = _sglang_dflash().DFlash2DraftModel(get_config(str(draft_dir), False))
        model.load_weights(list(load_file(str(draft_dir / "model.safetensors")).items()))
        compat.attach_target_lm_head(model, lm_head)
        head = LatticeTreeHead(draft_model=model, cfg=cfg, max_bs=3, device=torch.device("cpu"))
        hidden, input_ids = _block(3, V, g, H=Hd)
        head(hidden, input_ids)
        slots, root = hidden.view(3, B, Hd)[:, 1:], input_ids.view(3, B)[:, 0]
        ids, scores, coverage = compat.selector_lattice(model, slots, root)
        theirs = _selector_lattice(model, slots, root)
        *_, want = _lattice_from_logits(model, slots, root)
    for a, b in zip((ids, scores), theirs, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(coverage, want, rtol=0, atol=1e-5)
    cond = lattice_chain_logprobs(scores, coverage)
    _fields_equal(head.tree(3), build_lattice_tree_reference(root, ids, cond, 23))


def test_the_gpu_suites_dflash2_servers_pass_ddtrees_start_up(tmp_path):
    """tests/gpu/servers.py's DFlash2 servers, on the CPU: the binary pair's DFlash2 draft is
    written beside its draft with the selector's K = the suite's TOPK, the DDTREE server's flags
    pass DDTREE's start-up (B = 16, N = 31, K = 4), the control is SGLang's DFLASH on the same
    draft."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_ddtree.adapter import spec
    from tests.gpu import servers as suite
    from tests.unit.test_plugin import _server_args

    target, draft = suite.write_pair(tmp_path, "qwen3")
    dflash2 = suite.dflash2_draft(draft)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = {}
    for variant in suite.DFLASH2_VARIANTS:
        args = [*suite.COMMON, *suite.VARIANTS[variant]("qwen3", draft)]
        parsed[variant] = parser.parse_args(["--model-path", str(target), *args])
        assert parsed[variant].speculative_draft_model_path == str(dflash2)
    assert parsed["dflash_dflash2"].speculative_algorithm == "DFLASH"
    ns = parsed["ddtree_dflash2"]
    sa = _server_args(dflash2, **{k: v for k, v in vars(ns).items() if v is not None})
    spec.validate_server_args(sa)
    cfg = spec.apply_server_args(sa)
    assert (cfg.block_size, cfg.num_nodes, cfg.topk) == (16, suite.NUM_NODES, suite.TOPK)
    assert compat.draft_checkpoint(sa).selector_top_k == suite.TOPK
