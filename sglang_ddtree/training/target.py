"""The target: Qwen3_5ForConditionalGeneration trained with next-token cross-entropy.

The transformers class is used as is (with flash-linear-attention absent it runs Gated DeltaNet
through its torch chunked fallback). The config is testing/tiny.py's Qwen3.5 layout, resized by
a TargetShape; weights are float32 during training (bf16 autocast on CUDA) and saved in bf16.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_ddtree.checkpoints.tiny import PREPROCESSOR_CONFIG, qwen35_config
from sglang_ddtree.training.config import StageHParams, TargetShape
from sglang_ddtree.training.data import sample_windows
from sglang_ddtree.training.loops import StageResult, autocast, train_loop

GDN, ATTENTION = "linear_attention", "full_attention"


def target_config(
    shape: TargetShape, vocab_size: int, ids: dict[str, int], init_std: float
) -> dict[str, Any]:
    """Qwen3_5ForConditionalGeneration config.json dict: tiny.py's layout at `shape`'s sizes."""
    if shape.layers % 4:
        raise ValueError(
            f"target layers must be a multiple of 4 (3 GDN + 1 attention), got {shape.layers}"
        )
    rotary_half = int(shape.attn_head_dim * 0.25) // 2
    if sum(shape.mrope_section) != rotary_half:
        raise ValueError(
            f"mrope_section {shape.mrope_section} must sum to head_dim*0.25/2 = {rotary_half}"
        )
    cfg = qwen35_config(vocab_size, ids, init_std)
    text = cfg["text_config"]
    text.update(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        layer_types=([GDN] * 3 + [ATTENTION]) * (shape.layers // 4),
        num_attention_heads=shape.attn_heads,
        num_key_value_heads=shape.attn_kv_heads,
        head_dim=shape.attn_head_dim,
        linear_key_head_dim=shape.gdn_head_dim,
        linear_value_head_dim=shape.gdn_head_dim,
        linear_num_key_heads=shape.gdn_key_heads,
        linear_num_value_heads=shape.gdn_value_heads,
        max_position_embeddings=shape.max_positions,
        dtype="bfloat16",
    )
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=list(shape.mrope_section))
    cfg["vision_config"]["out_hidden_size"] = shape.hidden
    cfg["dtype"] = "bfloat16"
    return cfg


def build_target(cfg: dict[str, Any], seed: int) -> nn.Module:
    """A freshly initialised float32 model on the CPU (same weights on every device)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(**cfg)
    config._attn_implementation = "sdpa"
    config.get_text_config()._attn_implementation = "sdpa"
    return Qwen3_5ForConditionalGeneration(config).float()


def language_model(model: nn.Module) -> nn.Module:
    return model.model.language_model


def lm_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows [b, T+1] (inputs [:, :-1], labels [:, 1:])."""
    hidden = language_model(model)(input_ids=windows[:, :-1], use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)  # [b, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def train_target(
    model: nn.Module,
    stream: torch.Tensor,
    hp: StageHParams,
    budget_s: float,
    device: torch.device,
    seed: int,
) -> StageResult:
    """Train on random windows of `stream` (a seeded generator fixes the data order)."""
    gen = torch.Generator().manual_seed(seed)
    model.to(device)

    def step(_: int) -> tuple[torch.Tensor, int]:
        windows = sample_windows(stream, hp.batch, hp.seq_len + 1, gen).to(device)
        with autocast(device):
            return lm_loss(model, windows), hp.batch * hp.seq_len

    return train_loop("target", model, step, hp, budget_s, device)


@torch.no_grad()
def heldout_loss(
    model: nn.Module, windows: torch.Tensor, batch: int, device: torch.device
) -> dict[str, float]:
    """Mean next-token loss (nats) over held-out windows [n, T+1], and its perplexity."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch].to(device)
        with autocast(device):
            loss = lm_loss(model, w)
        n = w.shape[0] * (w.shape[1] - 1)
        total, count = total + loss.item() * n, count + n
    mean = total / max(count, 1)
    return {"loss": mean, "perplexity": float(torch.tensor(mean).exp()), "tokens": count}


def save_target(model: nn.Module, out: Path) -> None:
    """bf16 safetensors + config (+ preprocessor config); the tokenizer is saved beside it."""
    out.mkdir(parents=True, exist_ok=True)
    bf16 = copy.deepcopy(model).to("cpu", torch.bfloat16)
    bf16.config.dtype = torch.bfloat16
    bf16.save_pretrained(str(out), safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))


def load_target(path: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The saved target (bf16 weights, upcast to `dtype`), eval mode, frozen."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(path), dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    model.requires_grad_(False)
    return model.to(device).eval()


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
