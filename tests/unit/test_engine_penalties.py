"""Penalties in the reference engine: DDTree with frequency, presence and
repetition penalties and min_new_tokens emits exactly plain decoding's tokens under the same
penalties (float32, CPU, tiny seeded Qwen3 and Qwen3.5 targets, the OracleDrafter so that deep
paths and side branches are accepted), and the negative control, SGLang's way of applying one
set of counts to every node, is caught."""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.accept.penalties import Penalties, PenaltyState
from sglang_ddtree.reference import engine
from sglang_ddtree.reference.engine import generate, generate_plain
from sglang_ddtree.reference.oracle import OracleDrafter
from tests.fixtures import shared_penalties_for_every_node, tiny_pairs

ARCHS = ("qwen3", "qwen35")
PROMPTS = ("def add(a, b):\n    return", "import os\nimport sys\n\n", "x = [1, 2, 3]\ny = [")
NEW_TOKENS = 64
SETTINGS = {
    "frequency": Penalties(frequency=0.4),
    "presence+repetition": Penalties(presence=0.3, repetition=1.2),
    "all+min_tokens": Penalties(frequency=0.2, presence=0.2, repetition=1.1, min_tokens=48),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """arch -> (target runner, the prompts' token ids)."""
    loaded = tiny_pairs(tmp_path_factory, ARCHS, 8)
    return {
        arch: (t, [tok(p)["input_ids"] for p in PROMPTS]) for arch, (t, _, tok) in loaded.items()
    }


def _eos(target, ids: list[int], setting: Penalties) -> int:
    """An EOS for min_new_tokens to hold back: the 6th token that plain decoding with the same
    penalties but no floor emits, so that without the floor it would stop there."""
    free = Penalties(setting.frequency, setting.presence, setting.repetition)
    return generate_plain(target, ids, 6, penalties=free).tokens[5]


def _runs(target, ids, setting: Penalties, eos: int | None):
    oracle = OracleDrafter(target.model, 8, noise=0.2, seed=3, lookahead=NEW_TOKENS)
    kw = {"penalties": setting, "eos_token_id": eos}
    tree = generate(target, oracle, ids, NEW_TOKENS, budget=16, topk=3, **kw)
    return tree, generate_plain(target, ids, NEW_TOKENS, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_ddtree_with_penalties_is_plain_decoding_with_penalties(pairs, arch, name):
    target, prompts = pairs[arch]
    setting = SETTINGS[name]
    deep = 0
    for ids in prompts:
        eos = _eos(target, ids, setting) if setting.min_tokens else None
        tree, plain = _runs(target, ids, setting, eos)
        assert tree.tokens == plain.tokens, (arch, name, ids)
        if eos is not None:  # the floor held: past the EOS it would have stopped at
            assert eos not in plain.tokens[: setting.min_tokens] and len(plain.tokens) > 6
        deep += sum(n >= 3 for n in tree.accept_lengths)
    assert deep >= 3, f"only {deep} rounds accepted 2+ drafts: the tree was not exercised"


@pytest.mark.slow
def test_negative_control_shared_counts_for_every_node_are_caught(pairs, monkeypatch):
    """One count vector for every node (SGLang's linear penalizers on a tree) is not the
    request's distribution at a node whose path repeats a token: the comparison must see it."""

    differs = 0
    setting = Penalties(frequency=1.5, presence=0.5)
    for arch in ARCHS:
        target, prompts = pairs[arch]
        for ids in prompts:
            with monkeypatch.context() as m:
                m.setattr(PenaltyState, "tree", shared_penalties_for_every_node)
                tree, plain = _runs(target, ids, setting, None)
            differs += tree.tokens != plain.tokens
    assert differs >= 1, "the shared-count penalties went unnoticed"


def test_penalties_are_checked_and_off_by_default():
    with pytest.raises(ValueError, match="repetition > 0"):
        Penalties(repetition=0.0)
    with pytest.raises(ValueError, match="min_tokens >= 0"):
        Penalties(min_tokens=-1)
    state = PenaltyState(Penalties(frequency=1.0), torch.tensor([1, 2]), 8, [])
    state.observe([3, 3])
    got = state.step(torch.zeros(1, 8))
    assert got[0, 3] == -2.0 and (got[0, [0, 1, 2, 4]] == 0).all()
    # no penalty: the engine keeps no penalty state at all
    assert engine._penalty_state(Penalties(), torch.tensor([1]), 8, set()) is None
    assert engine._penalty_state(None, torch.tensor([1]), 8, set()) is None
