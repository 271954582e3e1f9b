"""The trained pair shipped in sglang_ddtree/assets/demo: it loads offline in
transformers, the reference engine and SGLang's config readers, fits the size budget, and
DDTree / chain DFlash on it emit the target's own greedy tokens on a held-out prompt."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_ddtree import DEMO_PAIR_DIR as DEMO
from sglang_ddtree.reference.engine import generate, generate_chain, generate_plain, load_pair
from sglang_ddtree.training.corpus import HELD_OUT_STDLIB, heldout_prompts


def test_files_fit_the_budget_and_report_matches():
    sizes = sum(p.stat().st_size for p in (DEMO / "target").iterdir())
    sizes += sum(p.stat().st_size for p in (DEMO / "draft").iterdir())
    assert sizes <= 24 * 2**20, sizes
    report = json.loads((DEMO / "report.json").read_text())
    held = [p["package"] for p in report["corpus"]["heldout_packages"]]
    assert set(HELD_OUT_STDLIB) <= set(held)
    assert report["target"]["params"] == 9_728_920
    assert report["target"]["heldout"]["loss"] < 3.0  # the report's held-out loss, 2.77


def test_configs_parse_in_sglang():
    sgl = pytest.importorskip("sglang.srt.speculative.dflash_utils")
    from sglang.srt.utils.hf_transformers.config import get_config

    target = get_config(str(DEMO / "target"), trust_remote_code=False)
    assert target.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert target.text_config.layers_block_type == (["linear_attention"] * 3 + ["attention"]) * 2
    draft = get_config(str(DEMO / "draft"), trust_remote_code=False)
    parsed = sgl.parse_dflash_draft_config(draft_hf_config=draft)
    assert parsed.resolve_block_size() == 16 and parsed.mask_token == "<|MASK|>"
    assert parsed.resolve_target_layer_ids(target_num_layers=8) == [1, 3, 5]


@pytest.mark.usefixtures("one_thread")
def test_reference_engine_generates_the_targets_greedy_tokens():
    target, drafter, tok = load_pair(DEMO / "target", DEMO / "draft")
    ids = torch.tensor(tok(heldout_prompts(1)[0])["input_ids"])
    plain = list(generate_plain(target, ids, 48).tokens)
    tree = generate(target, drafter, ids, 48, budget=31, topk=8)
    chain = generate_chain(target, drafter, ids, 48)
    assert list(tree.tokens) == plain == list(chain.tokens)
    # A trained draft: more than one token per round (the numbers: docs/results.md).
    assert tree.rounds < len(plain) and chain.rounds < len(plain)
    text = tok.decode(plain)
    assert text.strip(), text
