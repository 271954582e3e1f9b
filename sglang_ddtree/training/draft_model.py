"""A trainable DFlash draft whose forward is the reference drafter's, batched over many blocks.

Parameters carry the z-lab / SGLang checkpoint names (`layers.N.self_attn.q_proj.weight`, `fc`,
`hidden_norm`, `norm`), so `state_dict()` is the checkpoint. The math reuses the reference
drafter's functions (`rms_norm`, `rope_cos_sin`, `apply_rope`, `sglang_ddtree.reference.dflash`)
in the same order; only the batching differs:

  one sequence ids [T] with taps [T, K*H] and anchors a_1..a_nb carries nb blocks at once.
  Block j is [ids[a_j], MASK x (B-1)] at positions a_j..a_j+B-1. Keys are the T context tokens
  (hidden_norm(fc(taps)) -> that layer's k_proj / v_proj, k_norm, RoPE at 0..T-1) followed by
  all nb*B block tokens. Block j's queries see context keys at positions < a_j and the keys of
  block j only (non-causal inside the block) - exactly the reference runner after
  append_context(taps[:a_j]) and draft_logits(ids[a_j], a_j).

tests/unit/test_training.py checks this against DFlashDraftRunner on a trained checkpoint.
Only non-causal full-attention draft layers are supported here (what the recipe trains).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from sglang_ddtree.checkpoints.tiny import dflash_config
from sglang_ddtree.reference.dflash import (
    DFlashConfig,
    apply_rope,
    default_target_layer_ids,
    load_dflash_state_dict,
    parse_dflash_config,
    rms_norm,
    rope_cos_sin,
)
from sglang_ddtree.training.config import DraftShape
from sglang_ddtree.training.tokenizer import MASK_TOKEN


class RMSNormWeight(nn.Module):
    """Holds a Qwen3 RMSNorm weight (checkpoint name `<...>.weight`); math is rms_norm."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm, self.k_norm = RMSNormWeight(d), RMSNormWeight(d)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn, self.mlp = DraftAttention(cfg), DraftMLP(cfg)
        self.input_layernorm = RMSNormWeight(cfg.hidden_size)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size)


class DFlashDraft(nn.Module):
    """DFlash draft layers + fc + hidden_norm + norm (no embedding, no LM head: the target's)."""

    def __init__(self, cfg: DFlashConfig, num_taps: int, mask_token_id: int):
        super().__init__()
        if cfg.attention_bias:
            raise ValueError("the training draft has no attention biases")
        bad = [t for t in cfg.layer_types if t != "full_attention"]
        if bad or cfg.full_attention_causal:
            raise ValueError(
                f"the training draft supports non-causal full_attention layers only, got "
                f"layer_types={cfg.layer_types}, is_causal={cfg.full_attention_causal}"
            )
        self.config, self.mask_token_id = cfg, mask_token_id
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.fc = nn.Linear(num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNormWeight(cfg.hidden_size)
        self.norm = RMSNormWeight(cfg.hidden_size)

    # -- forward ------------------------------------------------------------------------------

    def block_ids(self, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """ids [b, T], anchors [b, nb] -> block token ids [b, nb, B]: [ids[a], MASK x (B-1)]."""
        b, nb = anchors.shape
        blocks = torch.full(
            (b, nb, self.config.block_size), self.mask_token_id, dtype=torch.long, device=ids.device
        )
        blocks[:, :, 0] = ids.gather(1, anchors)
        return blocks

    def block_hidden(
        self, embed: nn.Embedding, taps: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """taps [b, T, K*H], ids [b, T], anchors [b, nb] -> final-normed hidden [b, nb, B, H]."""
        cfg = self.config
        b, t = ids.shape
        nb, bs, hid = anchors.shape[1], cfg.block_size, cfg.hidden_size
        ctx = rms_norm(F.linear(taps, self.fc.weight), self.hidden_norm.weight, cfg.rms_norm_eps)
        h = embed(self.block_ids(ids, anchors)).reshape(b, nb * bs, hid)  # [b, Q, H]
        q_pos = (anchors[:, :, None] + torch.arange(bs, device=ids.device)).reshape(-1)  # [b*Q]
        ctx_pos = torch.arange(t, device=ids.device).repeat(b)  # [b*T]
        rope_q = rope_cos_sin(q_pos, cfg.head_dim, cfg.rope_theta)  # 2 x [b*Q, D]
        rope_c = rope_cos_sin(ctx_pos, cfg.head_dim, cfg.rope_theta)  # 2 x [b*T, D]
        mask = block_visibility(anchors, t, bs)  # [b, 1, Q, T+Q]
        for layer in self.layers:
            x = rms_norm(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
            h = h + self._attention(layer.self_attn, x, ctx, rope_q, rope_c, mask)
            x = rms_norm(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return rms_norm(h, self.norm.weight, cfg.rms_norm_eps).reshape(b, nb, bs, hid)

    def block_logits(
        self,
        embed: nn.Embedding,
        lm_head: nn.Linear,
        taps: torch.Tensor,
        ids: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """-> logits [b, nb, B-1, V] of block rows 1..B-1 through the target's lm_head."""
        return lm_head(self.block_hidden(embed, taps, ids, anchors)[:, :, 1:])

    def _kv(
        self, attn: DraftAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> k (k_norm + RoPE), v: [N, Hkv, D] (the reference runner's _kv)."""
        n, d, eps = x.shape[0], self.config.head_dim, self.config.rms_norm_eps
        k = attn.k_proj(x).view(n, -1, d)
        v = attn.v_proj(x).view(n, -1, d)
        return apply_rope(rms_norm(k, attn.k_norm.weight, eps), *rope), v

    def _attention(
        self,
        attn: DraftAttention,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_c: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block queries x [b, Q, H] over context [b, T, H] + block keys -> o_proj out [b, Q, H]."""
        cfg = self.config
        (b, nq, hid), t, d = x.shape, ctx.shape[1], cfg.head_dim
        q = attn.q_proj(x).view(b * nq, -1, d)  # [b*Q, Hq, D]
        q = apply_rope(rms_norm(q, attn.q_norm.weight, cfg.rms_norm_eps), *rope_q)
        k_blk, v_blk = self._kv(attn, x.reshape(b * nq, hid), rope_q)  # [b*Q, Hkv, D]
        k_ctx, v_ctx = self._kv(attn, ctx.reshape(b * t, hid), rope_c)  # [b*T, Hkv, D]
        k = torch.cat([k_ctx.view(b, t, -1, d), k_blk.view(b, nq, -1, d)], 1)  # [b, T+Q, Hkv, D]
        v = torch.cat([v_ctx.view(b, t, -1, d), v_blk.view(b, nq, -1, d)], 1)
        groups = cfg.num_heads // cfg.num_kv_heads
        k = k.transpose(1, 2).repeat_interleave(groups, 1)  # [b, Hq, T+Q, D]
        v = v.transpose(1, 2).repeat_interleave(groups, 1)
        q = q.view(b, nq, -1, d).transpose(1, 2)  # [b, Hq, Q, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)
        return attn.o_proj(out.transpose(1, 2).reshape(b, nq, -1))  # [b, Q, H]


def block_visibility(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """anchors [b, nb] -> bool [b, 1, Q, T+Q], Q = nb*B: may block query q see key k?

    Context key at position p: p < the query block's anchor. Block key: same block.
    """
    b, nb = anchors.shape
    device = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    ctx = torch.arange(ctx_len, device=device)[None, None, :] < q_anchor[:, :, None]  # [b, Q, T]
    q_block = torch.arange(nb, device=device).repeat_interleave(block_size)  # [Q]
    same = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [b, Q, Q]
    return torch.cat([ctx, same], dim=2)[:, None]


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The tokens block rows 1..B-1 predict: ids[a+1..a+B-1] -> [b, nb, B-1]."""
    offsets = torch.arange(1, block_size, device=ids.device)  # [B-1]
    b, nb = anchors.shape
    idx = (anchors[:, :, None] + offsets).reshape(b, -1)  # [b, nb*(B-1)]
    return ids.gather(1, idx).view(b, nb, block_size - 1)


# ----------------------------------------------------------------------------- config, I/O


def draft_config(
    target_text: dict[str, Any], shape: DraftShape, mask_token_id: int
) -> dict[str, Any]:
    """z-lab DFlash config.json dict (tiny.py's writer, resized; bf16; mask token named)."""
    taps = list(
        shape.taps or default_target_layer_ids(target_text["num_hidden_layers"], shape.layers)
    )
    cfg = dflash_config(
        target_text,
        mask_token_id,
        shape.layers,
        shape.block_size,
        ["full_attention"] * shape.layers,
        taps,
        None,
    )
    cfg.update(
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        max_position_embeddings=target_text["max_position_embeddings"],
        dtype="bfloat16",
    )
    cfg["dflash_config"] = dict(cfg["dflash_config"], mask_token=MASK_TOKEN)
    return cfg


def build_draft(cfg_dict: dict[str, Any], seed: int, init_std: float) -> DFlashDraft:
    """Linear weights N(0, init_std), norm weights 1 (float32, CPU, seeded)."""
    cfg = parse_dflash_config(cfg_dict)
    taps = cfg_dict["dflash_config"]["target_layer_ids"]
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg, len(taps), int(cfg_dict["dflash_config"]["mask_token_id"]))
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, init_std)
    return draft


def save_draft(draft: DFlashDraft, cfg_dict: dict[str, Any], out: Path) -> None:
    """config.json + model.safetensors (bf16, checkpoint names without a `model.` prefix)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")


def load_draft(path: Path, dtype: torch.dtype = torch.float32) -> DFlashDraft:
    """A saved draft as a DFlashDraft (weights upcast to `dtype`, strict names)."""
    cfg_dict = json.loads((Path(path) / "config.json").read_text())
    cfg = parse_dflash_config(cfg_dict)
    state = load_dflash_state_dict(path)
    num_taps = state["fc.weight"].shape[1] // cfg.hidden_size
    draft = DFlashDraft(cfg, num_taps, int(cfg.mask_token_id))
    draft.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return draft.to(dtype)
