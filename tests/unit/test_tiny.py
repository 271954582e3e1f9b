"""Tiny checkpoint writers: deterministic, loadable by transformers, and by SGLang's loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sglang_ddtree.checkpoints.tiny import (
    SPECIAL_TOKENS,
    write_tiny_dflash,
    write_tiny_dflash2,
    write_tiny_qwen3,
    write_tiny_qwen35,
    write_tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), seed=0)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen35(tmp_path_factory.mktemp("qwen35"), seed=0)


def _same_files(a: Path, b: Path, names: list[str]) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_deterministic_with_specials_and_chat_template(tmp_path):
    ids = write_tokenizer(tmp_path / "a", vocab_size=1024)
    assert write_tokenizer(tmp_path / "b", vocab_size=1024) == ids
    _same_files(tmp_path / "a", tmp_path / "b", ["tokenizer.json"])
    assert ids == {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == 1024 and tok.eos_token == "<|im_end|>"
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|MASK|>") == ids["<|MASK|>"]


# ----------------------------------------------------------------------------- Qwen3


def test_qwen3_writer_is_deterministic(tmp_path, qwen3_dir):
    again = write_tiny_qwen3(tmp_path / "again", seed=0)
    _same_files(qwen3_dir, again, ["config.json", "model.safetensors", "tokenizer.json"])
    other = load_file(str(write_tiny_qwen3(tmp_path / "other", seed=1) / "model.safetensors"))
    base = load_file(str(qwen3_dir / "model.safetensors"))
    assert base.keys() == other.keys()
    assert not torch.equal(
        base["model.layers.0.self_attn.q_proj.weight"],
        other["model.layers.0.self_attn.q_proj.weight"],
    )
    assert all(t.dtype == torch.float32 for t in base.values())


def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(
        ids[None], max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids[None])
    )
    return out[0, ids.numel() :].tolist()


def test_qwen3_loads_and_generates(qwen3_dir):
    model, info = AutoModelForCausalLM.from_pretrained(
        qwen3_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (4, 128, 64)
    assert cfg.vocab_size == len(AutoTokenizer.from_pretrained(qwen3_dir))
    ids = AutoTokenizer.from_pretrained(qwen3_dir)("def fib(n):", return_tensors="pt").input_ids[0]
    tokens = _greedy(model.eval(), ids, 16)
    assert len(tokens) == 16 and len(set(tokens)) > 3  # not a degenerate single-token loop
    # The argmax is clear of fp32 noise at every step (init std 0.2, not 0.02).
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor(tokens)])[None]).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4


# ----------------------------------------------------------------------------- Qwen3.5


def test_qwen35_writer_is_deterministic_small_and_named_like_qwen36(tmp_path, qwen35_dir):
    again = write_tiny_qwen35(tmp_path / "again", seed=0)
    _same_files(qwen35_dir, again, ["config.json", "model.safetensors", "preprocessor_config.json"])
    assert (qwen35_dir / "model.safetensors").stat().st_size < 8 * 2**20
    keys = load_file(str(qwen35_dir / "model.safetensors")).keys()
    prefixes = {k.split(".layers.")[0].split(".embed_tokens")[0].split(".norm")[0] for k in keys}
    assert {p for p in prefixes if not p.startswith("model.visual")} == {
        "lm_head.weight",
        "model.language_model",
    }
    assert any(k.startswith("model.visual.") for k in keys)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in keys
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in keys
    text = json.loads((qwen35_dir / "config.json").read_text())["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["attn_output_gate"] is True


def test_qwen35_loads_and_generates(qwen35_dir):
    from transformers import AutoModelForImageTextToText, Qwen3_5ForConditionalGeneration

    model, info = AutoModelForImageTextToText.from_pretrained(
        qwen35_dir, dtype=torch.float32, output_loading_info=True
    )
    assert isinstance(model, Qwen3_5ForConditionalGeneration)
    assert not any(info.values()), info
    ids = AutoTokenizer.from_pretrained(qwen35_dir)("import os\n", return_tensors="pt").input_ids[0]
    tokens = _greedy(model.eval(), ids, 12)
    assert len(tokens) == 12 and len(set(tokens)) > 3


# ----------------------------------------------------------------------------- DFlash


@pytest.mark.parametrize("target", ["qwen3", "qwen35"])
def test_dflash_config_is_what_sglang_parses(target, tmp_path, qwen3_dir, qwen35_dir):
    dflash_utils = pytest.importorskip("sglang.srt.speculative.dflash_utils")
    target_dir = qwen3_dir if target == "qwen3" else qwen35_dir
    draft = write_tiny_dflash(
        tmp_path / "d",
        target_dir,
        seed=0,
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        block_size=8,
    )
    cfg = AutoConfig.from_pretrained(draft)  # what SGLang reads: a Qwen3Config
    parsed = dflash_utils.parse_dflash_draft_config(draft_hf_config=cfg)
    mask_id = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids("<|MASK|>")
    text = AutoConfig.from_pretrained(target_dir).get_text_config()
    assert parsed.mask_token_id == mask_id
    assert parsed.block_size == 8 and parsed.num_hidden_layers == 2
    assert parsed.num_target_layers == text.num_hidden_layers == 4
    assert parsed.resolve_target_layer_ids(target_num_layers=4) == [1, 2]
    assert list(dflash_utils.get_dflash_layer_types(cfg)) == ["sliding_attention", "full_attention"]
    assert dflash_utils.get_dflash_attention_sliding_window_size(cfg) == 7  # window_left
    assert (cfg.hidden_size, cfg.vocab_size) == (text.hidden_size, text.vocab_size)
    weights = load_file(str(draft / "model.safetensors"))
    assert weights["fc.weight"].shape == (text.hidden_size, 2 * text.hidden_size)


def test_dflash_writer_is_deterministic(tmp_path, qwen3_dir):
    a = write_tiny_dflash(tmp_path / "a", qwen3_dir, seed=4, num_layers=2)
    b = write_tiny_dflash(tmp_path / "b", qwen3_dir, seed=4, num_layers=2)
    _same_files(a, b, ["config.json", "model.safetensors"])
    c = load_file(
        str(
            write_tiny_dflash(tmp_path / "c", qwen3_dir, seed=5, num_layers=2) / "model.safetensors"
        )
    )
    assert not torch.equal(c["fc.weight"], load_file(str(a / "model.safetensors"))["fc.weight"])


def test_dflash2_config_is_what_sglang_parses_and_ddtree_serves(tmp_path, qwen3_dir):
    """The DFlash2 draft: SGLang's DFlash2 architecture and selector keys, the selector's three
    tensors at SGLang's names and shapes, the DFlash draft of the same seed as its backbone;
    DDTREE's start-up reads it as a DFlash2 draft with K = selector_top_k."""
    dflash_utils = pytest.importorskip("sglang.srt.speculative.dflash_utils")
    from types import SimpleNamespace

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.config import DDTreeConfig

    draft = write_tiny_dflash2(tmp_path / "d2", qwen3_dir, seed=3, block_size=8, selector_rank=6)
    cfg = AutoConfig.from_pretrained(draft)
    parsed = dflash_utils.parse_dflash_draft_config(draft_hf_config=cfg)
    assert cfg.architectures == ["DFlash2DraftModel"]
    assert (parsed.selector_rank, parsed.selector_top_k, parsed.block_size) == (6, 4, 8)
    weights = load_file(str(draft / "model.safetensors"))
    V, H = cfg.vocab_size, cfg.hidden_size
    selector = {k: v.shape for k, v in weights.items() if k.startswith("candidate_selector.")}
    assert selector == {
        "candidate_selector.predecessor_codebook": (V, 6),
        "candidate_selector.successor_codebook": (V, 6),
        "candidate_selector.hidden_projection.weight": (6, H),
    }
    backbone = load_file(
        str(
            write_tiny_dflash(tmp_path / "d", qwen3_dir, seed=3, block_size=8) / "model.safetensors"
        )
    )
    assert all(torch.equal(weights[k], v) for k, v in backbone.items())
    assert set(weights) == set(backbone) | set(selector)
    args = SimpleNamespace(
        speculative_draft_model_path=str(draft),
        trust_remote_code=False,
        speculative_draft_model_revision=None,
        json_model_override_args=None,
    )
    read = compat.draft_checkpoint(args)
    assert (read.dflash2, read.block_size, read.selector_top_k) == (True, 8, 4)
    resolved = DDTreeConfig.resolve(
        block_size=None, draft_block_size=8, num_draft_tokens=None, topk=None, draft=read
    )
    assert (resolved.block_size, resolved.num_nodes, resolved.topk) == (8, 16, 4)


# ----------------------------------------------------------------------------- SGLang loaders


def _sglang_load_fills_every_param(model_cls, model_dir: Path) -> dict[str, torch.Tensor]:
    from sglang.srt.utils.hf_transformers.config import get_config

    from tests.fixtures import sglang_cpu_model_context

    ckpt = load_file(str(model_dir / "model.safetensors"))
    with sglang_cpu_model_context(model_dir), torch.no_grad():
        model = model_cls(get_config(str(model_dir), trust_remote_code=False))
        params = dict(model.named_parameters())
        for p in params.values():
            p.fill_(float("nan"))
        model.load_weights(list(ckpt.items()))
    unfilled = sorted(n for n, p in params.items() if torch.isnan(p).any())
    assert not unfilled, f"SGLang params left unloaded: {unfilled}"
    return params


@pytest.mark.slow
def test_sglang_qwen3_loader_takes_the_checkpoint(qwen3_dir):
    pytest.importorskip("sglang")
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    params = _sglang_load_fills_every_param(Qwen3ForCausalLM, qwen3_dir)
    ckpt = load_file(str(qwen3_dir / "model.safetensors"))
    assert torch.equal(params["lm_head.weight"], ckpt["lm_head.weight"])
    qkv = [ckpt[f"model.layers.2.self_attn.{s}_proj.weight"] for s in "qkv"]
    assert torch.equal(params["model.layers.2.self_attn.qkv_proj.weight"], torch.cat(qkv))


@pytest.mark.slow
def test_sglang_qwen35_loader_takes_the_checkpoint(qwen35_dir):
    """SGLang's Qwen3_5ForConditionalGeneration (the Qwen3.6-27B class) loads every tensor."""
    pytest.importorskip("sglang")
    from sglang.srt.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    params = _sglang_load_fills_every_param(Qwen3_5ForConditionalGeneration, qwen35_dir)
    ckpt = load_file(str(qwen35_dir / "model.safetensors"))
    prefix = "model.language_model.layers.0.linear_attn."
    qkvz = [ckpt[prefix + "in_proj_qkv.weight"], ckpt[prefix + "in_proj_z.weight"]]
    assert torch.equal(params["model.layers.0.linear_attn.in_proj_qkvz.weight"], torch.cat(qkvz))
    assert torch.equal(
        params["model.embed_tokens.weight"], ckpt["model.language_model.embed_tokens.weight"]
    )


@pytest.mark.slow
def test_sglang_dflash2_loader_takes_the_checkpoint(tmp_path, qwen3_dir):
    """SGLang's DFlash2DraftModel, built on CPU, takes every tensor of the DFlash2 draft: the
    backbone's and its CandidateSelector's."""
    pytest.importorskip("sglang")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.models.dflash import DFlash2DraftModel

    draft = write_tiny_dflash2(tmp_path / "d2", qwen3_dir, seed=0, num_layers=2)
    params = _sglang_load_fills_every_param(DFlash2DraftModel, draft)
    ckpt = load_file(str(draft / "model.safetensors"))
    for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
        key = f"candidate_selector.{name}"
        assert torch.equal(params[key], ckpt[key]), key
    assert params["candidate_selector.predecessor_codebook"].shape[1] == 8
