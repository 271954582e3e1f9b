"""The decode round on the CPU (round/worker.py making a round/round.py `Round`): it carries the width, the
draft block's positions and write slots, and the tree from step to step, with SGLang's verify,
the draft forward and the draft-KV write replaced by recorders (the GPU suite runs them for
real)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

B, N, K, H = 4, 8, 2, 6


class _SeqLens:
    """batch.seq_lens as the round reads it on the host: its length and record_stream."""

    def __init__(self, values):
        self.values = torch.tensor(values)

    def __len__(self):
        return len(self.values)

    def record_stream(self, stream):
        del stream


def _round_worker(monkeypatch, calls):
    worker_mod = pytest.importorskip("sglang_ddtree.round.worker")
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.config import DDTreeConfig, Options
    from sglang_ddtree.round import round as round_mod
    from sglang_ddtree.round.runtime import Runtime
    from sglang_ddtree.tree.build import topk_logprobs_from_logits
    from sglang_ddtree.tree.build_reference import build_tree_reference

    w = worker_mod.DDTreeWorker.__new__(worker_mod.DDTreeWorker)
    w.cfg = DDTreeConfig(block_size=B, num_nodes=N, topk=K)
    w.runtime = Runtime.create(Options(), w.cfg)
    w.device, w._tp_rank = "cpu", 0
    w._widths = w._readings = w._rank_widths = w._penalties = None
    w._graphs_on, w._eager_warned = True, set()
    w._target_worker = SimpleNamespace(model_runner=None)
    w.model_runner = SimpleNamespace(
        req_to_token_pool="req_to_token_pool", token_to_kv_pool_allocator="allocator"
    )
    bs = 2
    logprobs, ids = topk_logprobs_from_logits(
        torch.randn(bs, B - 1, 32, generator=torch.Generator().manual_seed(0)), K
    )
    tree = build_tree_reference(torch.tensor([5, 6]), logprobs, ids, N)

    class Head:
        reading_widths = (N // 2, N)

        def tree(self, n, width):
            calls.append(("tree", n, width))
            return tree

    w.tree_head = Head()
    w._round_dump = SimpleNamespace(round=lambda *a: calls.append(("dump", *a)))

    def draft(rnd):
        calls.append(("draft", rnd.bs, rnd.width, rnd.draft_input))
        rnd.positions = torch.arange(bs * B).view(bs, B) + 100
        rnd.draft_slots = torch.arange(bs * B).view(bs, B) + 1000

    monkeypatch.setattr(round_mod.Round, "draft", draft)

    def verify_input(
        cfg,
        tokens,
        depth,
        first_child,
        next_sibling,
        visibility,
        seq_lens,
        seq_lens_sum,
        write_mask,
    ):
        calls.append(("verify_input", tokens, seq_lens_sum, write_mask))
        return "verify input"

    hidden = torch.randn(bs * N, H)
    result = SimpleNamespace(
        can_run_cuda_graph=True,
        next_token_ids=torch.arange(bs * N),
        new_seq_lens="new lens",
        accept_lens=torch.tensor([2, 3]),
        logits_output=SimpleNamespace(hidden_states=hidden),
        next_draft_input=SimpleNamespace(bonus_tokens=torch.tensor([7, 8])),
    )

    def verify(batch, **kwargs):
        calls.append(("verify", batch.spec_info, kwargs["num_draft_tokens"], kwargs["topk"]))
        return result

    monkeypatch.setattr(round_mod, "make_verify_input", verify_input)
    monkeypatch.setattr(round_mod, "run_eagle_verify", verify)
    monkeypatch.setattr(worker_mod, "make_draft_input_v2", lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(compat, "append_draft_kv", lambda worker, **kw: calls.append(("kv", kw)))
    draft_input = DFlashDraftInputV2.__new__(DFlashDraftInputV2)
    draft_input.nxt_kv_lens_sum = 77
    batch = SimpleNamespace(
        spec_info=draft_input,
        seq_lens=_SeqLens([10, 11]),
        reqs=[],
        forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False),
        is_extend_in_batch=False,
    )
    return w, batch, draft_input, tree, hidden, result


def test_a_decode_round_hands_its_state_from_step_to_step(monkeypatch):
    calls = []
    w, batch, draft_input, tree, hidden, result = _round_worker(monkeypatch, calls)
    published = []
    out = w.forward_batch_generation(batch, on_publish=published.append)
    names = [c[0] for c in calls]
    assert names == ["draft", "tree", "verify_input", "verify", "dump", "kv"], names
    assert calls[0][1:] == (2, N, draft_input)  # a fixed width: N
    assert calls[1][1:] == (2, N)
    assert calls[2][1] is tree.tokens and calls[2][2:] == (77, False)  # the host plan packs it
    assert calls[3][1:] == ("verify input", N, K)  # the verify read the tree's input
    assert batch.spec_info is draft_input  # the draft state again, for the next round
    assert published == ["new lens"]
    dump = calls[4]
    assert dump[1] is tree.tokens and dump[4].shape == (2, B)  # the emitted tokens, [bs, B]
    assert torch.equal(dump[4], torch.arange(2 * N).view(2, N)[:, :B])
    kv = calls[5][1]
    assert torch.equal(kv["cache_loc"], torch.arange(2 * B) + 1000)
    assert torch.equal(kv["positions"], torch.arange(2 * B) + 100)
    assert torch.equal(kv["target_hidden"], hidden.view(2, N, H)[:, :B].reshape(2 * B, H))
    assert kv["commit_lens"] is result.accept_lens
    assert out is result and out.logits_output.hidden_states is None
    assert torch.equal(out.next_draft_input.bonus_tokens, torch.tensor([7, 8]))
    assert out.next_draft_input.new_seq_lens == "new lens"


def test_a_verify_without_graphs_is_noted_at_the_rounds_width(monkeypatch):
    calls = []
    w, batch, *_, result = _round_worker(monkeypatch, calls)
    result.can_run_cuda_graph = False
    noted = []
    w._note_eager_verify = lambda bs, width: noted.append((bs, width))
    w.forward_batch_generation(batch)
    assert noted == [(2, N)]


@pytest.mark.parametrize("measured", [True, False])
def test_a_measured_round_hands_the_readings_what_each_width_accepted(monkeypatch, measured):
    """With automatic widths the round's end gives the readings the tokens accepted at each read
    width (Round.accepted_at_widths, after the draft context is written); a round whose
    reading was dropped (its slot still out) computes nothing for them."""
    calls = []
    w, batch, *_ = _round_worker(monkeypatch, calls)
    finished = []
    w._readings = SimpleNamespace(
        current="slot" if measured else None, finish=lambda accepted: finished.append(accepted)
    )
    w._choose_width = lambda bs: N
    from sglang_ddtree.round.round import Round

    monkeypatch.setattr(
        Round,
        "accepted_at_widths",
        lambda rnd, result, widths: calls.append(("accepted", rnd.width)) or "read",
    )
    w.forward_batch_generation(batch)
    names = [c[0] for c in calls]
    if measured:
        assert names[-2:] == ["kv", "accepted"] and finished == ["read"]
    else:
        assert "accepted" not in names and finished == []
