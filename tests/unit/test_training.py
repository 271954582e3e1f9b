"""The training recipe at toy scale on CPU (float32): scripts/train_pair.py --toy end to end.

- the pipeline writes a target that transformers loads and a draft that the reference engine
  loads (load_pair runs a short DDTree generation that equals plain greedy decoding);
- two runs with one seed give byte-identical weights and tokenizer;
- the draft's batched training forward gives the reference DFlashDraftRunner's block logits on
  the trained checkpoint, and its context rule is "taps strictly before the anchor";
- the target and draft losses go down; the H200 recipe fits the 24 MiB budget.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sglang_ddtree.training.config import SIZE_LIMIT_BYTES, h200_recipe, toy_recipe
from sglang_ddtree.training.corpus import CorpusLimits, build_corpus, list_sources
from sglang_ddtree.training.data import sample_anchors
from sglang_ddtree.training.draft import target_taps
from sglang_ddtree.training.draft_model import block_labels, block_visibility, load_draft
from sglang_ddtree.training.pipeline import RunArgs, run

SEED = 0
# float32 on CPU: the batched forward and the runner differ only in reduction order.
LOGIT_ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("toy_a")
    return out, run(RunArgs(out=out, device="cpu", toy=True, seed=SEED))


@pytest.fixture(scope="module")
def pair(toy):
    from sglang_ddtree.reference.engine import load_pair

    out, _ = toy
    return load_pair(out / "target", out / "draft", "float32", "cpu")


def _sample_ids(tokenizer, length: int) -> torch.Tensor:
    text = Path(json.__file__).read_text()  # stdlib source: in-distribution text
    ids = tokenizer(text)["input_ids"][:length]
    assert len(ids) == length
    return torch.tensor(ids)


# ----------------------------------------------------------------------------- pipeline


def test_toy_pipeline_outputs_load(toy, pair):
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from sglang_ddtree.reference.engine import generate, generate_plain

    out, report = toy
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(out / "target"), dtype=torch.float32, local_files_only=True
    )
    assert model.config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    tok = AutoTokenizer.from_pretrained(str(out / "target"), local_files_only=True)
    assert tok.eos_token == "<|im_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    assert (out / "target" / "preprocessor_config.json").is_file()

    target, drafter, tokenizer = pair
    assert drafter.block_size == 16
    assert drafter.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    assert drafter.target_layer_ids == report["draft"]["target_layer_ids"]
    prompt = tokenizer("import os\n")["input_ids"]
    plain = generate_plain(target, prompt, 24).tokens
    assert generate(target, drafter, prompt, 24, budget=8, topk=4).tokens == plain

    held = json.loads((out / "heldout_packages.json").read_text())
    assert [p["package"] for p in held][:3] == ["asyncio", "email", "http"]
    assert report["sizes"]["total"] <= SIZE_LIMIT_BYTES
    # Better than a uniform guess over the vocabulary: the target learned something.
    assert report["target"]["heldout"]["loss"] < math.log(report["tokens"]["vocab_size"]) - 0.5
    acc = report["draft"]["acceptance"]
    assert sum(acc["chain_accept_len_hist"]) == acc["blocks"] > 0
    assert 1.0 <= acc["chain_accept_len"] <= 16.0


def test_toy_run_is_deterministic(toy, tmp_path):
    out_a, _ = toy
    out_b = tmp_path / "toy_b"
    run(RunArgs(out=out_b, device="cpu", toy=True, seed=SEED))
    for rel in ("target/model.safetensors", "draft/model.safetensors", "target/tokenizer.json"):
        assert (out_a / rel).read_bytes() == (out_b / rel).read_bytes(), rel
    for rel in ("target/config.json", "draft/config.json"):
        assert json.loads((out_a / rel).read_text()) == json.loads((out_b / rel).read_text())


def test_losses_go_down(toy):
    _, report = toy
    for stage in ("target", "draft"):
        losses = [loss for _, loss in report[stage]["train"]["losses"]]
        assert len(losses) >= 4, stage
        assert losses[-1] < losses[0] - 0.2, (stage, losses)


# ----------------------------------------------------------------------------- draft forward


def _check_forward_vs_runner(target, drafter, draft, ids: torch.Tensor) -> None:
    """Block logits of several anchors in one batched training forward == the runner's, one
    block at a time after append_context(taps[:a]) (fp32, atol LOGIT_ATOL, same argmax)."""
    _, taps_ref = target.prefill(ids)  # [T, K*H], the engine's own taps
    model = target.model
    taps = target_taps(model, ids[None], drafter.target_layer_ids)  # [1, T, K*H]
    torch.testing.assert_close(taps[0], taps_ref, atol=1e-5, rtol=0)
    last = ids.numel() - drafter.block_size  # the last anchor with a full block of labels
    anchors = torch.tensor([[1, 9, 30, last]])  # [1, nb]
    with torch.no_grad():
        ours = draft.block_logits(
            model.get_input_embeddings(), model.get_output_embeddings(), taps, ids[None], anchors
        )[0]  # [nb, B-1, V]
    for j, a in enumerate(anchors[0].tolist()):
        drafter.reset()
        drafter.append_context(taps_ref[:a])
        theirs = drafter.draft_logits(int(ids[a]), a)  # [B-1, V]
        torch.testing.assert_close(ours[j], theirs, atol=LOGIT_ATOL, rtol=0)
        assert torch.equal(ours[j].argmax(-1), theirs.argmax(-1))


def test_training_forward_matches_reference_runner(toy, pair):
    """The trained toy checkpoint (1 layer, 2 q / 1 kv heads, taps [1, 2])."""
    out, _ = toy
    target, drafter, tokenizer = pair
    _check_forward_vs_runner(target, drafter, load_draft(out / "draft"), _sample_ids(tokenizer, 64))


def test_training_forward_matches_runner_deeper_draft(toy, tmp_path):
    """A seeded 3-layer draft with 4 q / 2 kv heads and 3 taps (the H200 draft's structure),
    saved by save_draft in bf16 and loaded by both sides."""
    from dataclasses import replace

    from sglang_ddtree.reference.engine import load_pair
    from sglang_ddtree.training.draft_model import build_draft, draft_config, save_draft

    out, report = toy
    text = json.loads((out / "target" / "config.json").read_text())["text_config"]
    shape = replace(toy_recipe().draft, layers=3, heads=4, kv_heads=2, head_dim=16, taps=(0, 1, 2))
    cfg = draft_config(text, shape, report["tokens"]["special_ids"]["<|MASK|>"])
    save_draft(build_draft(cfg, seed=5, init_std=0.2), cfg, tmp_path / "draft")
    target, drafter, tokenizer = load_pair(out / "target", tmp_path / "draft", "float32", "cpu")
    assert drafter.target_layer_ids == [0, 1, 2] and len(drafter.layers) == 3
    draft = load_draft(tmp_path / "draft")
    _check_forward_vs_runner(target, drafter, draft, _sample_ids(tokenizer, 48))


def test_block_context_is_strictly_before_anchor(toy, pair):
    """Changing taps at positions >= a leaves block a unchanged; changing a - 1 changes it."""
    out, _ = toy
    target, drafter, tokenizer = pair
    ids = _sample_ids(tokenizer, 64)[None]
    draft, model = load_draft(out / "draft"), target.model
    taps = target_taps(model, ids, drafter.target_layer_ids)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    a = 30
    anchors = torch.tensor([[a]])
    with torch.no_grad():
        base = draft.block_logits(embed, head, taps, ids, anchors)
        later = taps.clone()
        later[:, a:] += 1.0
        same = draft.block_logits(embed, head, later, ids, anchors)
        earlier = taps.clone()
        earlier[:, a - 1] += 1.0
        changed = draft.block_logits(embed, head, earlier, ids, anchors)
    assert torch.equal(base, same)
    assert (base - changed).abs().max() > 1e-5  # exact equality above; any real change counts


def test_block_visibility_and_labels():
    anchors = torch.tensor([[2, 5]])  # one sequence, two blocks of B = 3, T = 8
    vis = block_visibility(anchors, ctx_len=8, block_size=3)[0, 0].int()  # [6, 8 + 6]
    expected_ctx = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 0, 0, 0]] * 3)
    expected_blk = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).int()
    assert torch.equal(vis, torch.cat([expected_ctx, expected_blk], 1))
    ids = torch.arange(100, 108)[None]
    assert block_labels(ids, anchors, 3).tolist() == [[[103, 104], [106, 107]]]
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(4, 40, 16, 8, gen)
    assert a.shape == (4, 8) and int(a.min()) >= 1 and int(a.max()) <= 40 - 16
    assert all(len(set(row)) == 8 for row in a.tolist())


# ----------------------------------------------------------------------------- corpus, configs


def test_corpus_holds_out_whole_packages():
    limits = CorpusLimits(max_train_bytes=200_000, max_heldout_bytes=20_000)
    a, b = build_corpus(limits, seed=3), build_corpus(limits, seed=3)
    assert [n for n, _ in a.train] == [n for n, _ in b.train]
    held = {(p["root_kind"], p["package"]) for p in a.heldout_packages}
    assert ("stdlib", "asyncio") in held
    for name, _ in a.train:
        kind, rel = name.split(":", 1)
        assert (kind, rel.split("/")[0].removesuffix(".py")) not in held, name
    texts = [t for _, t in a.train]
    assert len(set(texts)) == len(texts)
    assert not set(texts) & {t for _, t in a.heldout}
    c = build_corpus(limits, seed=4)
    assert [n for n, _ in c.train] != [n for n, _ in a.train]
    # The stdlib's tests of a held-out package are not trained on either.
    files = [
        f
        for f in list_sources()
        if f.root_kind == "stdlib"
        and (f.package == "asyncio" or f.rel.startswith(("test/test_asyncio", "test/test_json")))
    ]
    d = build_corpus(limits, seed=3, files=files)
    assert d.train and all(n.startswith("stdlib:test/test_json") for n, _ in d.train)
    assert any(f.rel.startswith("test/test_asyncio") for f in files)


def test_configs_parse_in_sglang(toy):
    """SGLang's own config readers: the target's layer pattern, the draft's DFlash fields."""
    sgl = pytest.importorskip("sglang.srt.speculative.dflash_utils")
    from sglang.srt.utils.hf_transformers.config import get_config

    out, report = toy
    target = get_config(str(out / "target"), trust_remote_code=False)
    assert target.architectures == ["Qwen3_5ForConditionalGeneration"]
    text = target.text_config
    assert text.layers_block_type == ["linear_attention"] * 3 + ["attention"]  # SGLang names
    assert (text.hidden_size, text.vocab_size) == (64, report["tokens"]["vocab_size"])
    draft = get_config(str(out / "draft"), trust_remote_code=False)
    assert draft.architectures == ["DFlashDraftModel"] and draft.head_dim == 32
    parsed = sgl.parse_dflash_draft_config(draft_hf_config=draft)
    assert parsed.resolve_block_size() == 16
    assert parsed.mask_token == "<|MASK|>"
    assert parsed.mask_token_id == report["tokens"]["special_ids"]["<|MASK|>"]
    assert parsed.resolve_target_layer_ids(target_num_layers=4) == [1, 2]


def test_h200_recipe_fits_size_budget():
    """Parameter counts of the H200 sizes (meta device) + 1 MiB for the tokenizer <= 24 MiB."""
    from sglang_ddtree.checkpoints.tiny import SPECIAL_TOKENS
    from sglang_ddtree.training.draft_model import build_draft, draft_config
    from sglang_ddtree.training.target import build_target, param_count, target_config

    r = h200_recipe()
    ids = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    tcfg = target_config(r.target, r.vocab_size, ids, r.init_std)
    with torch.device("meta"):
        target = build_target(tcfg, 0)
        draft = build_draft(draft_config(tcfg["text_config"], r.draft, 3), 0, r.init_std)
    tp, dp = param_count(target), param_count(draft)
    assert 2 * (tp + dp) + 2**20 <= SIZE_LIMIT_BYTES, (tp, dp)
    assert draft.config.block_size == 16 and len(draft.layers) == 3
    assert toy_recipe().target_train.steps is not None  # the toy run never depends on timing


# ----------------------------------------------------------------------------- loop


def test_lr_schedule_and_planned_steps():
    from dataclasses import replace

    from sglang_ddtree.training.config import StageHParams
    from sglang_ddtree.training.loops import lr_at, train_loop

    hp = StageHParams(seq_len=8, batch=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_at(s, hp, 110) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr_at(10, hp, 110) == 1.0 and lr_at(60, hp, 110) == pytest.approx(0.55)
    assert lr_at(110, hp, 110) == pytest.approx(0.1) == lr_at(500, hp, 110)

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def step(_: int):
        return torch.nn.functional.mse_loss(module(x), y), 16

    planned = replace(hp, lr=0.05, round_steps_to=7, log_every=1000)
    res = train_loop("t", module, step, planned, budget_s=0.5, device=torch.device("cpu"))
    assert res.step_source == "planned" and res.calibration_step_s is not None
    assert res.steps == res.planned_steps and res.steps % 7 == 0 and res.steps > 10
    assert not res.stopped_early and res.losses[-1][0] == res.steps
    with pytest.raises(ValueError, match="warmup_steps >= 10"):
        train_loop("t", module, step, replace(planned, warmup_steps=3), 1.0, torch.device("cpu"))


def test_cli_arguments():
    from tests.fixtures import load_script

    cli = load_script("train_pair")
    args = cli.parse_args(["--out", "x", "--toy", "--device", "cpu", "--total-minutes", "2"])
    assert args == RunArgs(out=Path("x"), device="cpu", toy=True, total_minutes=2.0)
    for bad in (["--minutes", "0"], ["--draft-steps", "0"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--out", "x", *bad])
