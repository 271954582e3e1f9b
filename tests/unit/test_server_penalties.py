"""round/penalties.py: the server's per-node penalties (SGLANG_DDTREE_PENALTIES=1): the
device count table (prefill, retraction, chunks, each round's emitted tokens) and the
eagle_sample hook, against tree.penalties' reference and a plain per-node loop."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.accept.penalties import block_stops_, min_p_filter_, penalize
from sglang_ddtree.round import penalties
from sglang_ddtree.round.penalties import PenaltyTable
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import random_build_inputs

V = 29


def _req(output=(), f=0.0, p=0.0, r=1.0, min_new=0, stops=None, eos=2, model_eos=None):
    """A request's fields the penalties read; model_eos: the model's own EOS ids
    (Req.eos_token_ids, which SGLang's min_new_tokens penalizer blocks too)."""
    params = SimpleNamespace(
        frequency_penalty=f,
        presence_penalty=p,
        repetition_penalty=r,
        min_new_tokens=min_new,
        stop_token_ids=stops,
    )
    tok = SimpleNamespace(eos_token_id=eos, additional_stop_token_ids=None)
    return SimpleNamespace(
        output_ids=list(output), sampling_params=params, tokenizer=tok, eos_token_ids=model_eos
    )


def test_the_table_counts_each_requests_output_tokens():
    table = PenaltyTable(rows=6, vocab=V, device="cpu")
    table.counts.fill_(7.0)  # a previous occupant's counts: restart clears the rows it takes
    reqs = [_req(), _req(output=[4, 4, 9]), _req()]  # new, resumed after a retraction, new
    slots = torch.tensor([3, 0, 5])
    table.restart(reqs, slots, torch.tensor([11, 12, 13]))
    want = torch.zeros(6, V)
    want[[1, 2, 4]] = 7.0  # rows no request took
    want[3, 11] = 1
    want[0, 4], want[0, 9], want[0, 12] = 2, 1, 1
    want[5, 13] = 1
    assert torch.equal(table.counts, want)
    # a round: the first accept_lens[b] emitted tokens of each row count, the rest do not
    emitted = torch.tensor([[5, 5, 6, 0], [12, 1, 1, 1], [3, 8, 0, 0]])
    table.observe(slots, emitted, torch.tensor([3, 1, 2]))
    want[3, 5], want[3, 6] = 2, 1
    want[0, 12] += 1
    want[5, 3], want[5, 8] = 1, 1
    assert torch.equal(table.counts, want)


def test_a_neutral_requests_row_changes_no_logit():
    """The worker counts a round's tokens only when its batch asks for a penalty, so a neutral
    request's row may be stale: whatever it holds, its nodes' logits stay raw, and a penalised
    request's beside it are the same as with that row empty."""
    tree = _tree(2, 6, seed=3)
    raw = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(4))
    reqs = [_req(f=0.5, p=0.3, r=1.2, min_new=3), _req()]
    slots = torch.tensor([1, 0])
    outs = []
    for stale in (0.0, 5.0):
        table = PenaltyTable(rows=2, vocab=V, device="cpu")
        table.counts[1, 4] = 2.0  # the penalised request's output so far
        table.counts[0].fill_(stale)  # the neutral one's row, never observed
        outs.append(
            table.penalize_(raw.clone(), reqs, slots, tree.tokens, tree.visibility, tree.depth)
        )
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1][1], raw[1])
    assert not torch.equal(outs[1][0], raw[0])


def _tree(bs, N, seed):
    gen = torch.Generator().manual_seed(seed)
    root, ids, lps = random_build_inputs(gen, bs, 5, 3, V, mode="continuous")
    return build_tree_reference(root, ids, lps, N - 1)


def _per_node(raw, tree, counts, req):
    """A plain loop: node i's context = the output so far + the tokens of nodes 1..i on its path."""
    out = torch.empty_like(raw)
    N = raw.shape[0]
    for i in range(N):
        c = counts.clone()
        for j in range(1, N):
            if tree["visibility"][i, j]:
                c[tree["tokens"][j]] += 1
        sp = req.sampling_params
        x = penalize(
            raw[i], c, c > 0, sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty
        )
        if c.sum() < sp.min_new_tokens:  # no stop token yet (its EOS and stop_token_ids)
            for s in {
                req.tokenizer.eos_token_id,
                *(sp.stop_token_ids or ()),
                *(req.eos_token_ids or ()),
            }:
                x[s] = float("-inf")
        out[i] = x
    return out


def test_the_hook_penalises_every_node_by_its_own_path_and_hides_sglangs_vectors():
    bs, N = 3, 9
    tree = _tree(bs, N, seed=4)
    table = PenaltyTable(rows=5, vocab=V, device="cpu")
    slots = torch.tensor([4, 1, 2])
    reqs = [
        _req(output=[3, 3, 7], f=0.5, p=0.3, r=1.4),
        _req(output=[1], min_new=5, stops=[6], model_eos={5, 11}),
        _req(),
    ]
    table.restart(reqs, slots, torch.tensor([8, 9, 10]))
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(bs * N, V, generator=gen) * 2
    logits_output = SimpleNamespace(next_token_logits=raw.clone())
    info = SimpleNamespace(acc_additive_penalties="sglang's", acc_scaling_penalties="sglang's")
    batch = SimpleNamespace(reqs=reqs, req_pool_indices=slots, sampling_info=info)
    verify = SimpleNamespace(
        tree_tokens=tree.tokens, tree_visibility=tree.visibility, tree_depth=tree.depth
    )
    seen = []

    def original(verify_input, batch_, output, grammar_mask=None):
        seen.append(
            (
                output.next_token_logits.clone(),
                info.acc_additive_penalties,
                info.acc_scaling_penalties,
                grammar_mask,
            )
        )
        return "sampled"

    runtime = SimpleNamespace(penalties=table)  # the worker's table, as the hook is bound to it
    assert (
        penalties.eagle_sample(runtime, original, verify, batch, logits_output, "mask") == "sampled"
    )
    got, add, scale, mask = seen[0]
    assert add is None and scale is None and mask == "mask"  # SGLang's shared vectors hidden
    assert info.acc_additive_penalties == "sglang's" == info.acc_scaling_penalties  # restored
    for b in range(bs):
        one = {"tokens": tree.tokens[b], "visibility": tree.visibility[b]}
        want = _per_node(raw.view(bs, N, V)[b], one, table.counts[slots[b]], reqs[b])
        torch.testing.assert_close(got.view(bs, N, V)[b], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.view(bs, N, V)[2], raw.view(bs, N, V)[2])  # no penalties: untouched


def test_the_hook_passes_everything_else_through():
    calls = []

    def original(*args):
        calls.append(args)
        return "sglang"

    plain = SimpleNamespace(reqs=[_req()], sampling_info=None)
    asked = SimpleNamespace(reqs=[_req(f=0.5)], sampling_info=None)
    ddtree = SimpleNamespace(tree_visibility=torch.ones(1, 2, 2, dtype=torch.bool))
    eagle = SimpleNamespace()  # another algorithm's verify input: no tree
    off = SimpleNamespace(penalties=None)  # no table: off
    assert penalties.eagle_sample(off, original, ddtree, asked, None) == "sglang"
    on = SimpleNamespace(penalties=PenaltyTable(rows=2, vocab=V, device="cpu"))
    assert penalties.eagle_sample(on, original, eagle, asked, None) == "sglang"
    assert penalties.eagle_sample(on, original, ddtree, plain, None) == "sglang"
    assert len(calls) == 3


def test_the_hook_target_has_the_signature_the_hook_assumes():
    module = pytest.importorskip("sglang.srt.speculative.eagle_utils")
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks

    params = list(inspect.signature(module.eagle_sample).parameters)
    assert params[:4] == ["verify_input", "batch", "logits_output", "grammar_mask"]
    assert compat.EAGLE_SAMPLE == f"{module.__name__}.eagle_sample"
    assert hooks.HOOKS[compat.EAGLE_SAMPLE] is penalties.eagle_sample
    import dataclasses

    from sglang_ddtree.round.verify_input import DDTreeVerifyInput

    fields = {f.name for f in dataclasses.fields(DDTreeVerifyInput)}
    assert {"tree_tokens", "tree_visibility", "tree_depth"} <= fields


def test_min_p_keeps_what_sglangs_plain_sampler_keeps_in_the_same_proportions():
    """min_p_filter_ against SGLang's plain sampler's rule (sglang.srt.layers.sampler: a token
    below min_p x its row's largest probability is zeroed, the rest sampled in proportion): the
    kept set and the renormalised probabilities; min_p 0 leaves a request's rows alone; worked a
    request or two at a time, the same bits."""
    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(3, 4, 50, generator=gen) ** 4
    probs /= probs.sum(-1, keepdim=True)
    min_ps = torch.tensor([0.3, 0.0, 0.05])
    got = min_p_filter_(probs.clone(), min_ps)
    assert torch.equal(got[1], probs[1])
    for b in (0, 2):
        rows = probs[b]
        keep = rows >= rows.amax(-1, keepdim=True) * min_ps[b]
        torch.testing.assert_close(
            got[b], torch.where(keep, rows, 0) / (rows * keep).sum(-1, keepdim=True)
        )
    per_request = 4 * 50  # one bool [N, V]
    for budget in (1, per_request, 2 * per_request + 1):
        assert torch.equal(min_p_filter_(probs.clone(), min_ps, temp_bytes=budget), got)


def test_min_p_rides_on_sglangs_tree_sampling_for_the_call_only(monkeypatch):
    """With min_p asked, the hook hands SGLang's target-only tree sampling (the global of
    eagle_sample's module that eagle_sample calls) the filtered probs, passes SGLang's further
    arguments on, and puts SGLang's function back."""
    from sglang_ddtree.adapter import compat

    module = pytest.importorskip(compat.TREE_SAMPLER_MODULE)
    seen = []
    monkeypatch.setattr(module, compat.TREE_SAMPLER, lambda **kw: seen.append(kw))
    original_kernel = getattr(module, compat.TREE_SAMPLER)
    probs = torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])

    def eagle_sample(verify_input, batch_, output, grammar_mask=None, uno=None, *, mark=None):
        getattr(module, compat.TREE_SAMPLER)(predicts=None, target_probs=probs)
        return ("sampled", uno, mark)  # SGLang's shape of it: the module global at call time

    info = SimpleNamespace(
        need_min_p_sampling=True,
        min_ps=torch.tensor([0.5]),
        acc_additive_penalties=None,
        acc_scaling_penalties=None,
    )
    batch = SimpleNamespace(reqs=[_req()], req_pool_indices=torch.tensor([0]), sampling_info=info)
    verify = SimpleNamespace(tree_visibility=torch.ones(1, 1, 1, dtype=torch.bool))
    runtime = SimpleNamespace(penalties=PenaltyTable(rows=1, vocab=4, device="cpu"))
    got = penalties.eagle_sample(runtime, eagle_sample, verify, batch, None, None, 7, mark="w")
    assert got == ("sampled", 7, "w")
    torch.testing.assert_close(seen[0]["target_probs"], torch.tensor([[[0.625, 0.375, 0, 0]]]))
    assert getattr(module, compat.TREE_SAMPLER) is original_kernel


def test_sglangs_eagle_sample_calls_the_sampler_the_min_p_hook_replaces():
    """The real eagle_sample looks its target-only tree sampler up as a global of its module at
    call time (what compat.tree_sampling_probs replaces for the call): were it imported under
    another name, or from another module, min_p would silently stop applying inside the tree."""
    from sglang_ddtree.adapter import compat

    module = pytest.importorskip(compat.TREE_SAMPLER_MODULE)
    assert compat.TREE_SAMPLER in module.eagle_sample.__code__.co_names
    assert compat.TREE_SAMPLER not in module.eagle_sample.__code__.co_varnames
    assert hasattr(module, compat.TREE_SAMPLER)  # the kernel on CUDA (None on this CPU)
    source = inspect.getsource(module.eagle_sample)
    assert f"sampling_fn = {compat.TREE_SAMPLER}" in source
    assert "target_probs=target_probs" in source  # the keyword the hook's wrapper takes


def test_the_worker_makes_its_table_once_the_request_pool_exists(monkeypatch):
    """Every penalties server once died at start-up, its worker reading the
    request pool in __init__, which SGLang's scheduler runs before it allocates any pool
    (the pool is None then; the worker's model_runner is the target's). The table is made in
    alloc_memory_pool, after DFlashWorkerV2's allocation, from the target's pool rows and
    vocabulary, once DDTREE's memory at the maximum has been checked."""
    pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_ddtree import config
    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round.worker import DDTreeWorker

    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "1")
    runner = SimpleNamespace(req_to_token_pool=None, model_config=SimpleNamespace(vocab_size=V))
    worker = _bare_worker(DDTreeWorker, runner, options=config.Options.from_env())
    with pytest.raises(AttributeError):  # what __init__ met: no pool yet
        DDTreeWorker._penalty_table(worker)

    def allocate(self, **kwargs):  # the scheduler's pools, as SGLang's allocation leaves them
        runner.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros((7, 64)))
        return "allocated"

    monkeypatch.setattr(DFlashWorkerV2, "alloc_memory_pool", allocate)
    worker.cfg = DDTreeConfig(block_size=4, num_nodes=8, topk=2)
    worker.tree_head = SimpleNamespace(max_bs=4)
    assert worker.alloc_memory_pool(memory_pool_config=None) == "allocated"
    assert worker.runtime.penalties is worker._penalties  # the eagle_sample hook's
    assert tuple(worker._penalties.counts.shape) == (7, V)


def _bare_worker(cls, runner, device="cpu", options=None):
    """A DDTreeWorker with the attributes the start-up methods read, no __init__."""
    from sglang_ddtree.config import Options

    worker = object.__new__(cls)
    worker.runtime = SimpleNamespace(options=options or Options(), penalties=None)
    worker.model_runner, worker.device, worker.gpu_id = runner, device, 0
    worker._tp_rank = 0  # the sizes go to the log on rank 0
    worker._target_worker = SimpleNamespace(model_runner=runner)  # behind target_worker
    return worker


def test_memory_that_does_not_fit_at_the_maximum_stops_the_start_up_with_the_numbers(monkeypatch):
    """On a GPU, DDTREE's memory at the server's maximum (round_memory.at_maximum: the tables,
    a round's temporaries and mask) is checked against what SGLang's pools left: one that does
    not fit is refused with its parts, the free memory and the ways out."""
    pytest.importorskip("sglang.srt.speculative.dflash_worker_v2")
    from sglang_ddtree import config
    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round import worker as worker_mod

    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(0, 0)),
        model_config=SimpleNamespace(vocab_size=248320),
    )
    runner.req_to_token_pool.req_to_token = SimpleNamespace(shape=(1000, 4096 + 68))
    worker = _bare_worker(
        worker_mod.DDTreeWorker, runner, device="cuda:0", options=config.Options(penalties=True)
    )
    worker.cfg, worker.tree_head = DDTreeConfig(16, 32, 8), SimpleNamespace(max_bs=16)
    monkeypatch.setattr(worker_mod, "get_available_gpu_memory", lambda device, gpu: 0.5)
    with pytest.raises(
        RuntimeError,
        match=r"needs 1\.40 GiB: penalty tables 1\.16, per-round "
        r"penalty temporaries 0\.24, verify mask 0\.00, and 0\.50 GiB are free"
        r".*--max-running-requests.*SGLANG_DDTREE_PENALTIES=0",
    ):
        worker._check_round_memory()
    monkeypatch.setattr(worker_mod, "get_available_gpu_memory", lambda device, gpu: 40.0)
    worker._check_round_memory()  # fits
    worker.device = "cpu"
    monkeypatch.setattr(worker_mod, "get_available_gpu_memory", lambda device, gpu: 0.0)
    worker._check_round_memory()  # no GPU: nothing to check


def test_each_requests_stop_tokens_are_written_once_at_its_prefill(monkeypatch):
    """The stop-token rows come from a request's lists at its prefill (restart), a previous
    occupant's row cleared, and no round rebuilds them: penalize_ reads the table only."""
    table = PenaltyTable(rows=4, vocab=V, device="cpu")
    table.stops[2, [1, 5, 9]] = True  # a previous occupant's stops
    reqs = [_req(min_new=3, stops=[4, 40], eos=7), _req(stops=[11])]  # 40: past the vocabulary
    reqs[0].eos_token_ids = {12, None}  # the model's EOS ids (SGLang 0.5.23's penalizer's too)
    slots = torch.tensor([2, 0])
    table.restart(reqs, slots, torch.tensor([1, 1]))
    assert table.stops[2].nonzero().flatten().tolist() == [4, 7, 12]
    assert not table.stops[0].any()  # no min_new_tokens: its row is never read, not written
    built = []
    monkeypatch.setattr(penalties, "stop_tokens", lambda *a: built.append(a) or [])
    tree = _tree(2, 5, seed=6)
    raw = torch.randn(2, 5, V, generator=torch.Generator().manual_seed(6))
    for _ in range(3):  # rounds
        out = table.penalize_(raw.clone(), reqs, slots, tree.tokens, tree.visibility, tree.depth)
        early = tree.depth[0] + 1 < 3  # one output token so far, the floor 3
        assert early.any() and not early.all()
        assert torch.isinf(out[0][early][:, [4, 7, 12]]).all()
        assert not torch.isinf(out[0][~early][:, [4, 7, 12]]).any()
        assert not torch.isinf(out[0][:, 5]).any()
        assert torch.equal(out[1], raw[1])
    assert built == []


def test_the_stop_block_works_a_few_requests_at_a_time_to_the_same_bits():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 3, V, generator=gen)
    early = torch.rand(5, 3, generator=gen) < 0.5
    stops = torch.rand(5, V, generator=gen) < 0.2
    want = logits.masked_fill(early[:, :, None] & stops[:, None, :], float("-inf"))
    for budget in (1, 3 * V, 2 * 3 * V + 1, 10**9):
        assert torch.equal(block_stops_(logits.clone(), early, stops, temp_bytes=budget), want)
