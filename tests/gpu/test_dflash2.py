"""DDTREE on a DFlash2 drafter, on the binary pairs (tests/gpu/servers.py): `ddtree_dflash2`
serves the binary draft with a candidate selector (checkpoints/binary_pair.write_binary_dflash2)
through the lattice head (round/draft_head.LatticeTreeHead), `dflash_dflash2` the same draft
through SGLang's own DFLASH, which walks its selector's chain: the control. Each DDTREE server
is held to the plain server with test_serve's checks: greedy under the near-tie referee (the
DFLASH control beside the plain one where it holds), the sampled distribution by chi-square at
T = 1; its rounds accept more than the chain on the same drafter; no host sync, no leak. First,
that both servers really served the DFlash2 drafter. One test needs no server: the lattice head
in a CUDA graph, replayed without a host sync, gives the reference tree.

Run on the device:  python -m pytest tests/gpu/test_dflash2.py -m gpu -q -rA   (with
DDTREE_GPU_ROOT set, it reuses the running set, as test_serve does)
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from tests.gpu import harness  # noqa: E402
from tests.gpu import test_serve as serve  # noqa: E402

# test_serve's fixtures, under their names here
servers, fp32_pair, plain_greedy, dflash_greedy, sampled = (
    serve.servers,
    serve.fp32_pair,
    serve.plain_greedy,
    serve.dflash_greedy,
    serve.sampled,
)

pytestmark = pytest.mark.gpu

DDTREE, DFLASH = "ddtree_dflash2", "dflash_dflash2"
DFLASH2_MODELS = [m for m in serve.MODELS if m != "pair"]  # the binary pairs


@pytest.mark.parametrize("model", DFLASH2_MODELS)
def test_the_dflash2_servers_served_the_selector(servers, model):
    """So that no check below can pass on a DFlash draft: both servers built SGLang's
    DFlash2DraftModel, DDTREE drafted through its lattice head at K = 4, and DFLASH folded its
    selector's chain into its draft graph."""
    for variant in (DDTREE, DFLASH):
        log = serve._up(servers, f"{model}-{variant}").log_text()
        assert "model=DFlash2DraftModel" in log, f"{model}-{variant}: not a DFlash2 draft"
    ddtree = serve._up(servers, f"{model}-{DDTREE}").log_text()
    assert "K=4, draft head LatticeTreeHead" in ddtree
    assert "DFLASH selector decode folded into the draft cuda graph" not in ddtree
    dflash = serve._up(servers, f"{model}-{DFLASH}").log_text()
    assert "DFLASH selector decode folded into the draft cuda graph" in dflash


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("model", DFLASH2_MODELS)
def test_dflash2_greedy_is_the_targets_greedy(
    servers, plain_greedy, dflash_greedy, fp32_pair, model, concurrency
):
    """test_serve's greedy check of the DDTREE server on the DFlash2 draft against the plain
    server: every token within the tolerance of the target's own greedy choice under teacher
    forcing, the plain server's decode-vs-prefill and the DFLASH control's chain verify the
    controls, the float32 referee beyond them."""
    serve.assert_targets_greedy(
        servers,
        plain_greedy,
        fp32_pair,
        model,
        DDTREE,
        concurrency,
        dflash=dflash_greedy(model, concurrency, DFLASH),
    )


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("model", DFLASH2_MODELS)
def test_dflash2_sampling_distribution_matches_plain(sampled, model, seeded):
    """test_serve's chi-square (T = 1, top-k 8; 3 positions at 1e-3, a rejection confirmed by a
    fresh draw at 1e-2) of the DDTREE server's tokens on the DFlash2 draft against the plain
    server's, with seeded requests and with torch's RNG: the lattice tree is accepted by the
    same target-only walk, which never reads the drafter's probabilities."""
    serve.assert_same_distribution(sampled, model, DDTREE, seeded)


@pytest.mark.parametrize("model", DFLASH2_MODELS)
def test_the_tree_accepts_more_than_the_selectors_chain(servers, model):
    """On the same DFlash2 drafter and prompts, DDTREE's lattice tree accepts at least a token
    more per round than DFLASH's chain: the binary draft ties its two tokens and the selector
    breaks the tie by a few tenths of a nat, so the chain is right about half the time at each
    position, while the tree holds both tokens 3 levels deep (test_binary_pair.py)."""
    lengths = {}
    for variant in (DDTREE, DFLASH):
        server = serve._up(servers, f"{model}-{variant}")
        accepted, rounds = 0.0, 0
        for prompt in harness.PROMPTS[:4]:
            serve._flush(server)
            out = harness.generate(
                server, prompt, max_new_tokens=64, temperature=0, ignore_eos=True
            )
            meta = out["meta_info"]
            accepted += meta["spec_accept_length"] * meta["spec_verify_ct"]
            rounds += meta["spec_verify_ct"]
        lengths[variant] = accepted / rounds
    print(f"{model}: tokens per round {lengths}")
    assert lengths[DDTREE] >= 3.0, lengths
    assert lengths[DDTREE] >= lengths[DFLASH] + 1.0, lengths


# Last of the server tests in this file: after the tests above have run on these servers.
@pytest.mark.parametrize("model", DFLASH2_MODELS)
def test_dflash2_pools_return_to_idle_and_no_host_sync(servers, model):
    serve.assert_idle_and_no_host_sync(serve._up(servers, f"{model}-{DDTREE}"))


class _TopKDraft(torch.nn.Module):
    """A DFlash2 draft model as the lattice head reads it: SGLang's CandidateSelector, an
    `lm_head` (weight [V, H], org_vocab_size, no quant_method: SGLang's candidate_topk projects
    through it), an identity unary transform (`draft_config`) and a compute_candidates (rows
    [n, H] -> the top-K ids and logits), which that transform leaves unused."""

    def __init__(self, weight, top_k: int, rank: int, generator):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.models.dflash import CandidateSelector

        V, H = weight.shape
        self.weight = weight
        self.lm_head = SimpleNamespace(weight=weight, org_vocab_size=V, quant_method=None)
        self.draft_config = SimpleNamespace(output_multiplier=1.0, final_logit_softcapping=None)
        selector = CandidateSelector(hidden_size=H, vocab_size=V, state_rank=rank, top_k=top_k)
        with torch.no_grad():
            for p in selector.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        self.candidate_selector = selector.to(weight.device)

    def compute_candidates(self, hidden):
        values, ids = torch.topk(hidden @ self.weight.T, self.candidate_selector.top_k, dim=-1)
        return ids, values.float()


def test_the_lattice_head_replays_in_a_cuda_graph_without_a_host_sync(monkeypatch):
    """LatticeTreeHead on SGLang's CandidateSelector (its torch.compile'd edge scores on CUDA)
    and candidate_topk with the full-vocabulary lse (lilicorr_topk_lse's Triton scan and select
    on CUDA, one rank; the coverage it gives is added to the chain): captured once in a CUDA
    graph at the largest batch's shapes, each replay on new block contents raises no host sync
    (torch's sync debug mode "error"; an eager call after the warm-up neither) and writes the
    heap's tree of that replay's lattice (tree.lattice's reference, on the CPU) into the static
    buffers."""
    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round.draft_head import LatticeTreeHead
    from sglang_ddtree.tree.lattice import build_lattice_tree_reference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models import dflash
    # candidate_topk reads the TP size from the runtime context, which only a server publishes
    monkeypatch.setattr(dflash, "get_parallel", lambda: SimpleNamespace(tp_size=1))
    g = torch.Generator().manual_seed(0)
    B, H, V, K, bs, dev = 8, 64, 4096, 8, 4, torch.device("cuda")
    draft = _TopKDraft(torch.randn(V, H, generator=g).to(dev), K, 16, g)
    cfg = DDTreeConfig(block_size=B, num_nodes=48, topk=K)
    head = LatticeTreeHead(draft_model=draft, cfg=cfg, max_bs=bs, device=dev)
    hidden = torch.randn(bs * B, H, generator=g).to(dev)
    input_ids = torch.randint(V, (bs * B,), generator=g).to(dev)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up off the capture
            for _ in range(2):
                head(hidden, input_ids)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.set_sync_debug_mode("error")  # the eager head (the worker's fallback) too
        try:
            head(hidden, input_ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            head(hidden, input_ids)
        for trial in range(3):
            hidden.copy_(torch.randn(bs * B, H, generator=g))
            input_ids.copy_(torch.randint(V, (bs * B,), generator=g))
            torch.cuda.set_sync_debug_mode("error")
            try:
                graph.replay()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            root = input_ids.view(bs, B)[:, 0]
            ids, cond = head.lattice(hidden.view(bs, B, H)[:, 1:], root)
            expected = build_lattice_tree_reference(root.cpu(), ids.cpu(), cond.cpu(), cfg.budget)
            tree = head.tree(bs)
            for name in tree._fields:
                got, want = getattr(tree, name).cpu(), getattr(expected, name)
                assert torch.equal(got, want), (trial, name)
