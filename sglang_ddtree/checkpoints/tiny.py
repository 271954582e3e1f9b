"""Seeded tiny checkpoints that both transformers 5.19.0 and SGLang 0.5.23 load.

Every writer is deterministic for a given seed (same bytes on the same machine and Python):
the tokenizer is trained on a sorted list of stdlib files, weights come from `torch.manual_seed`
(targets) or a seeded `torch.Generator` (DFlash drafts), and everything is stored in float32 so
CPU tests can compare speculative decoding against plain decoding without bf16 noise.

Initialisation: every nn.Linear / nn.Embedding weight is redrawn from N(0, init_std) with
init_std 0.2 by default (real checkpoints use 0.02). Measured on these 128-wide models: std 0.02
gives near-uniform next-token distributions (median max-prob 0.002) and greedy decoding that
falls into a 1-5 token loop; std 0.2 gives median max-prob ~0.12, 35+ distinct tokens in 40
greedy steps and median top-1/top-2 logit gaps ~0.5, far above fp32 noise, so greedy
comparisons between engines are meaningful. Other parameters (norms, GDN A_log / dt_bias,
conv1d) keep transformers' init.

The tokenizer's stdlib corpus depends on the Python version: checkpoints written on the GPU box
(Python 3.12) and here (3.11) may differ in vocabulary; write them on the machine that uses them.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|MASK|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_VOCAB_SIZE = 1024
DEFAULT_INIT_STD = 0.2
_CORPUS_FILES = 30  # first N sorted stdlib *.py files


# ----------------------------------------------------------------------------- tokenizer


def _stdlib_corpus() -> list[str]:
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return files[:_CORPUS_FILES]


def write_tokenizer(
    out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> dict[str, int]:
    """Train a byte-level BPE on stdlib sources, save it with a ChatML template.

    Returns the ids of SPECIAL_TOKENS (special tokens come first: ids 0..7).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = build_bpe_tokenizer(
        vocab_size, lambda tok, trainer: tok.train(_stdlib_corpus(), trainer)
    )
    fast.save_pretrained(str(out))
    return {s: fast.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}


def build_bpe_tokenizer(vocab_size: int, train: Callable[[Any, Any], None]):
    """A byte-level BPE with SPECIAL_TOKENS first (ids 0..7), eos <|im_end|>, pad <|endoftext|>
    and the ChatML template, as a PreTrainedTokenizerFast; `train(tokenizer, trainer)` feeds
    the text (files or an iterator). Shared by the tiny test checkpoints and the training run.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    train(tok, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def read_tokenizer_vocab_size(model_dir: str | os.PathLike) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size()


def read_special_token_id(model_dir: str | os.PathLike, token: str) -> int:
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).token_to_id(token)
    if tid is None:
        raise ValueError(f"token {token!r} is not in {model_dir}/tokenizer.json")
    return int(tid)


# ----------------------------------------------------------------------------- helpers


def _apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = _apply_overrides(dict(cfg[key]), value)
        else:
            cfg[key] = value
    return cfg


def _rescale_init(model: torch.nn.Module, std: float, seed: int) -> None:
    """Redraw every nn.Linear / nn.Embedding weight from N(0, std) in module order."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                w = torch.randn(module.weight.shape, generator=gen, dtype=torch.float32)
                module.weight.copy_(w * std)


def _save_hf_model(model: torch.nn.Module, out: Path) -> None:
    model.save_pretrained(str(out), safe_serialization=True)


# ----------------------------------------------------------------------------- Qwen3 target


def qwen3_config(vocab_size: int, ids: dict[str, int], init_std: float) -> dict[str, Any]:
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )


def write_tiny_qwen3(
    out_dir: str | os.PathLike,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    init_std: float = DEFAULT_INIT_STD,
    **overrides: Any,
) -> Path:
    """A 4-layer attention-only Qwen3ForCausalLM (hidden 128, GQA 4/2 x 64) + tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    ids = write_tokenizer(out, vocab_size)
    cfg = _apply_overrides(qwen3_config(read_tokenizer_vocab_size(out), ids, init_std), overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).float()
    _rescale_init(model, init_std, seed)
    _save_hf_model(model.eval(), out)
    return out


# ----------------------------------------------------------------------------- Qwen3.5 target


def qwen35_config(vocab_size: int, ids: dict[str, int], init_std: float) -> dict[str, Any]:
    """Qwen3.6-27B layout in miniature: 3 Gated DeltaNet layers + 1 gated attention layer."""
    text = dict(
        model_type="qwen3_5_text",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        attn_output_gate=True,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        # rotary dim = 0.25 * 128 = 32 -> 16 frequencies split over (t, h, w) sections.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        partial_rotary_factor=0.25,
        tie_word_embeddings=False,
        initializer_range=init_std,
        eos_token_id=ids["<|im_end|>"],
        mtp_num_hidden_layers=0,
        mtp_use_dedicated_embeddings=False,
        dtype="float32",
    )
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config=text,
        vision_config=_tiny_vision_config(text["hidden_size"], init_std),
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        dtype="float32",
    )


def _tiny_vision_config(out_hidden_size: int, init_std: float) -> dict[str, Any]:
    """The smallest vision tower Qwen3_5ForConditionalGeneration loads (never run here)."""
    return dict(
        model_type="qwen3_5",
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=out_hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
        in_channels=3,
        initializer_range=init_std,
    )


PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def write_tiny_qwen35(
    out_dir: str | os.PathLike,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    init_std: float = DEFAULT_INIT_STD,
    **overrides: Any,
) -> Path:
    """Qwen3_5ForConditionalGeneration (hybrid GDN + gated attention, tiny vision tower).

    Overrides merge into the top-level config; pass `text_config={...}` to change text fields.
    Weights are stored as `model.language_model.*`, `model.visual.*`, `lm_head.*` (Qwen3.6 names).
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out = Path(out_dir)
    ids = write_tokenizer(out, vocab_size)
    cfg = _apply_overrides(qwen35_config(read_tokenizer_vocab_size(out), ids, init_std), overrides)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg)).float()
    _rescale_init(model, init_std, seed)
    _save_hf_model(model.eval(), out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    return out


# ----------------------------------------------------------------------------- DFlash draft


def _target_text_config(target_dir: Path) -> dict[str, Any]:
    cfg = json.loads((target_dir / "config.json").read_text())
    return cfg.get("text_config", cfg)


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """Two taps, early and late (z-lab spreads taps over [1, L-3]; tiny targets are shallow)."""
    return sorted({min(1, num_target_layers - 1), max(num_target_layers - 2, 0)})


def dflash_config(
    target_text: dict[str, Any],
    mask_token_id: int,
    num_layers: int,
    block_size: int,
    layer_types: list[str],
    target_layer_ids: list[int],
    sliding_window: int | None,
) -> dict[str, Any]:
    cfg = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=target_text["vocab_size"],
        hidden_size=target_text["hidden_size"],
        intermediate_size=2 * target_text["hidden_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        hidden_act="silu",
        attention_bias=False,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        layer_types=layer_types,
        num_target_layers=target_text["num_hidden_layers"],
        block_size=block_size,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        tie_word_embeddings=False,
        dtype="float32",
    )
    if "sliding_attention" in layer_types:
        if sliding_window is None:
            raise ValueError("sliding_attention layers need sliding_window, got None")
        # transformers' Qwen3Config drops sliding_window unless use_sliding_window is true.
        cfg.update(sliding_window=sliding_window, use_sliding_window=True)
    return cfg


def dflash_weights(cfg: dict[str, Any], seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """z-lab DFlashDraftModel weight names (no `model.` prefix), seeded, float32.

    Norm weights are 1 + N(0, 0.1) rather than ones so that a misplaced norm changes outputs.
    """
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * init_std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(nq * hd, h)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, nq * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
    w["fc.weight"] = lin(h, n_taps * h)
    w["hidden_norm.weight"] = norm(h)
    w["norm.weight"] = norm(h)
    return {k: v.contiguous() for k, v in w.items()}


def write_tiny_dflash(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    seed: int = 0,
    num_layers: int = 1,
    block_size: int = 16,
    layer_types: list[str] | None = None,
    target_layer_ids: list[int] | None = None,
    sliding_window: int | None = None,
    init_std: float = DEFAULT_INIT_STD,
    **overrides: Any,
) -> Path:
    """A DFlash draft (z-lab format) for the target in `target_dir`: same vocab and hidden size,
    mask token = the target tokenizer's <|MASK|>, taps `target_layer_ids` of the target.

    Overrides merge into config.json after the weights' shapes are fixed (use them to write
    deliberately inconsistent configs in tests).
    """
    target = Path(target_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = _target_text_config(target)
    layer_types = list(layer_types or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_layers={num_layers}")
    taps = list(target_layer_ids or default_target_layer_ids(text["num_hidden_layers"]))
    mask_id = read_special_token_id(target, "<|MASK|>")
    cfg = dflash_config(text, mask_id, num_layers, block_size, layer_types, taps, sliding_window)
    weights = dflash_weights(cfg, seed, init_std)
    cfg = _apply_overrides(cfg, overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------- DFlash2 draft


def add_candidate_selector(
    draft_dir: str | os.PathLike,
    selector_rank: int = 8,
    selector_top_k: int = 4,
    seed: int = 0,
    init_std: float = DEFAULT_INIT_STD,
) -> Path:
    """Make the DFlash draft in `draft_dir` a DFlash2 draft, in place: SGLang 0.5.23's
    DFlash2DraftModel (the DFlash backbone plus a CandidateSelector, docs/dflash2.md) loads it.

    config.json: architectures ["DFlash2DraftModel"], dflash_config.selector_rank (r) and
    selector_top_k (K). Weights added (the draft's own untouched, so the DFlash2 draft drafts
    the DFlash draft's candidates), float32 from N(0, init_std), seeded:
    candidate_selector.predecessor_codebook [V, r], candidate_selector.successor_codebook
    [V, r], candidate_selector.hidden_projection.weight [r, H] (nn.Linear H -> r, no bias).
    """
    draft = Path(draft_dir)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"] = {
        **cfg.get("dflash_config", {}),
        "selector_rank": selector_rank,
        "selector_top_k": selector_top_k,
    }
    gen = torch.Generator().manual_seed(seed)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    shapes = {"predecessor_codebook": (V, selector_rank), "successor_codebook": (V, selector_rank)}
    shapes["hidden_projection.weight"] = (selector_rank, H)
    weights = load_file(str(draft / "model.safetensors"))
    for name, shape in shapes.items():
        weights[f"candidate_selector.{name}"] = torch.randn(shape, generator=gen) * init_std
    (draft / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return draft


def write_tiny_dflash2(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    seed: int = 0,
    selector_rank: int = 8,
    selector_top_k: int = 4,
    init_std: float = DEFAULT_INIT_STD,
    **dflash: Any,
) -> Path:
    """A DFlash2 draft for the target in `target_dir`: `write_tiny_dflash`'s draft (its
    keywords in `dflash`, the same seed: the same backbone) with a candidate selector of rank
    `selector_rank` over `selector_top_k` candidates (`add_candidate_selector`, seed + 1)."""
    out = write_tiny_dflash(out_dir, target_dir, seed=seed, init_std=init_std, **dflash)
    return add_candidate_selector(out, selector_rank, selector_top_k, seed + 1, init_std)


# ----------------------------------------------------------------------------- SGLang on CPU
