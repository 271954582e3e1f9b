"""DFlash block-diffusion drafter in plain torch (batch 1), semantics of SGLang.

One checkpoint must give the same distributions here and in SGLang
(`sglang/srt/models/dflash.py`, `speculative/dflash_worker_v2.py`), so this module follows SGLang:

- Context: taps of committed target tokens [n, K*H] -> `hidden_norm(fc(taps))` -> in *every* layer
  that layer's k_proj / v_proj (no input_layernorm), k_norm, RoPE at positions 0..n-1. Only K/V
  are kept; block entries are never cached.
- Block: `[bonus, MASK x (B-1)]` embedded with the *target's* embed_tokens at positions
  p..p+B-1 (p = number of committed tokens); Qwen3 pre-norm layers; final `norm`; logits of block
  rows 1..B-1 from the *target's* lm_head.
- Masks per layer type: `full_attention` is non-causal over context + block (SGLang
  ENCODER_ONLY) unless the config sets `is_causal`; `sliding_attention` is causal with a window of
  `sliding_window` keys including the query itself (SGLang window_left = sliding_window - 1).

Where z-lab's reference (z-lab/dflash `dflash/model.py`) differs, we follow SGLang:
- z-lab applies a config `is_causal` to *all* layers (a non-causal sliding layer then gets a
  symmetric window); SGLang keeps sliding layers causal and applies `is_causal` to full layers only.
- z-lab scales noise embeddings by `input_embedding_scale` and logits by `output_multiplier` /
  `final_logit_softcapping` (DFlash2 drafters); SGLang's DFlashDraftModel ignores these keys.
- z-lab requires `target_layer_ids`; SGLang derives them from the layer counts when absent.
- transformers' Qwen3Config (which SGLang uses to read the draft config) drops `sliding_window`
  unless `use_sliding_window` is true; sliding layers without a window are an error in SGLang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

DEFAULT_MASK_TOKEN = "<|MASK|>"
DEFAULT_BLOCK_SIZE = 16  # SGLang: draft_config.resolve_block_size(default=16)


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class DFlashConfig:
    """The fields of a z-lab DFlash config.json that change the computation."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    block_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None  # HF convention: keys visible to a query, itself included
    full_attention_causal: bool
    mask_token: str
    mask_token_id: int | None
    target_layer_ids: tuple[int, ...] | None
    num_target_layers: int | None
    vocab_size: int | None


def _get(cfg: dict[str, Any], dcfg: dict[str, Any], key: str) -> Any:
    """dflash_config[key] wins over the top-level key (SGLang parse_dflash_draft_config)."""
    return dcfg.get(key, cfg.get(key))


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"DFlash draft rope_type={rope_type!r} is not supported by the reference drafter "
            "(only 'default')"
        )
    if not cfg.get("rope_is_neox_style", cfg.get("is_neox_style", True)):
        raise ValueError("DFlash draft with is_neox_style=false is not supported")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _layer_types(cfg: dict[str, Any], num_layers: int, window: int | None) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:  # transformers' Qwen3Config default
        start = int(cfg.get("max_window_layers", 28))
        types = [
            "sliding_attention" if window is not None and i >= start else "full_attention"
            for i in range(num_layers)
        ]
    if isinstance(types, str) or len(types) != num_layers:
        raise ValueError(
            f"DFlash config.layer_types must list one type per draft layer "
            f"(num_hidden_layers={num_layers}), got {types!r}"
        )
    for i, t in enumerate(types):
        if t not in ("full_attention", "sliding_attention"):
            raise ValueError(f"Unsupported DFlash draft layer type layer_types[{i}]={t!r}")
    if "sliding_attention" in types and window is None:
        raise ValueError(
            "DFlash sliding_attention layers need config.sliding_window with "
            "use_sliding_window=true (transformers' Qwen3Config drops the window otherwise); "
            f"got sliding_window={cfg.get('sliding_window')!r}, "
            f"use_sliding_window={cfg.get('use_sliding_window')!r}"
        )
    return tuple(types)


def _optional_int_list(value: Any, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) == 0:
        raise ValueError(f"DFlash {name} must be a non-empty list of ints, got {value!r}")
    return tuple(int(v) for v in value)


def parse_dflash_config(cfg: dict[str, Any]) -> DFlashConfig:
    """Parse a DFlash config.json dict (field resolution as in SGLang)."""
    text = cfg.get("text_config") or cfg
    dcfg = dict(cfg.get("dflash_config") or {})
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(
            f"DFlash num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    num_layers = int(text["num_hidden_layers"])
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DFlash draft hidden_act={text['hidden_act']!r}; only 'silu' exists")
    window = None
    if text.get("use_sliding_window", False):
        window = int(text.get("sliding_window") or 4096)
    block_size = _get(cfg, dcfg, "block_size")
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else int(block_size)
    if block_size < 2:
        raise ValueError(
            f"DFlash block_size must be >= 2 (bonus + at least one MASK), got {block_size}"
        )
    mask_id = dcfg.get("mask_token_id")
    if mask_id is not None and (isinstance(mask_id, bool) or int(mask_id) < 0):
        raise ValueError(
            f"DFlash dflash_config.mask_token_id must be a non-negative int, got {mask_id!r}"
        )
    num_target = _get(cfg, dcfg, "num_target_layers")
    return DFlashConfig(
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(text.get("head_dim") or hidden // heads),
        intermediate_size=int(text["intermediate_size"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(text),
        attention_bias=bool(text.get("attention_bias", False)),
        block_size=block_size,
        layer_types=_layer_types(text, num_layers, window),
        sliding_window=window,
        full_attention_causal=bool(text.get("is_causal", cfg.get("is_causal", False))),
        mask_token=dcfg.get("mask_token") or DEFAULT_MASK_TOKEN,
        mask_token_id=None if mask_id is None else int(mask_id),
        target_layer_ids=_optional_int_list(
            _get(cfg, dcfg, "target_layer_ids"), "target_layer_ids"
        ),
        num_target_layers=None if num_target is None else int(num_target),
        vocab_size=None if text.get("vocab_size") is None else int(text["vocab_size"]),
    )


def check_draft_matches_target(config: DFlashConfig, hidden_size: int, vocab_size: int) -> None:
    """The draft runs on the target's embeddings and LM head, so it needs the target's hidden
    size and vocabulary (read from the loaded modules, or from the target's config before any
    load)."""
    if hidden_size != config.hidden_size:
        raise ValueError(
            f"DFlash draft hidden_size={config.hidden_size} but the target hidden size is "
            f"{hidden_size}; the draft runs on target embeddings, so it must be trained for "
            "this target"
        )
    if config.vocab_size is not None and config.vocab_size != vocab_size:
        raise ValueError(
            f"DFlash draft vocab_size={config.vocab_size} but the target vocab is "
            f"{vocab_size}; the draft must share the target's tokenizer"
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang's build_target_layer_ids: one tap per draft layer, spread over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(
            f"DFlash default target_layer_ids need a target with >= 4 layers, got {num_target_layers}"
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_target_layer_ids(config: DFlashConfig, target_num_layers: int | None) -> list[int]:
    """Taps of the target (0-based layer ids; the tap is the output of that layer)."""
    num_target = target_num_layers if target_num_layers is not None else config.num_target_layers
    if num_target is None:
        if config.target_layer_ids is None:
            raise ValueError(
                "DFlash draft has no dflash_config.target_layer_ids and no num_target_layers; "
                "pass target_num_layers"
            )
        return list(config.target_layer_ids)
    if config.target_layer_ids is None:
        return default_target_layer_ids(num_target, config.num_layers)
    for i, lid in enumerate(config.target_layer_ids):
        if not 0 <= lid < num_target:
            raise ValueError(
                f"DFlash target_layer_ids[{i}]={lid} is out of range for a target with "
                f"{num_target} layers"
            )
    return list(config.target_layer_ids)


def resolve_mask_token_id(config: DFlashConfig, vocab_size: int, tokenizer: Any = None) -> int:
    """dflash_config.mask_token_id, else the tokenizer's id for dflash_config.mask_token."""
    tok_id = None
    if tokenizer is not None:
        tok_id = tokenizer.get_vocab().get(config.mask_token)
    mask_id = config.mask_token_id
    if mask_id is None:
        mask_id = tok_id
    elif tok_id is not None and tok_id != mask_id:
        raise ValueError(
            f"DFlash dflash_config.mask_token_id={mask_id} conflicts with the tokenizer id "
            f"{tok_id} of mask_token={config.mask_token!r}"
        )
    if mask_id is None:
        where = "no tokenizer was given" if tokenizer is None else "the tokenizer lacks it"
        raise ValueError(
            f"DFlash mask token id is missing: dflash_config.mask_token_id is not set and "
            f"mask_token={config.mask_token!r} cannot be resolved ({where})"
        )
    if not 0 <= mask_id < vocab_size:
        raise ValueError(
            f"DFlash mask_token_id={mask_id} is outside the target vocab ({vocab_size})"
        )
    return int(mask_id)


# ----------------------------------------------------------------------------- weights


@dataclass
class DFlashLayerWeights:
    q_proj: torch.Tensor  # [Hq*D, H]
    k_proj: torch.Tensor  # [Hkv*D, H]
    v_proj: torch.Tensor  # [Hkv*D, H]
    o_proj: torch.Tensor  # [H, Hq*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    input_layernorm: torch.Tensor  # [H]
    post_attention_layernorm: torch.Tensor  # [H]
    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def expected_weight_shapes(config: DFlashConfig, num_taps: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint names (z-lab / SGLang, without the optional `model.` prefix) -> shapes."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, num_taps * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for n in range(config.num_layers):
        p = f"layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
    return shapes


def load_dflash_state_dict(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's *.safetensors, `model.` prefix stripped (SGLang accepts both)."""
    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in DFlash draft dir {draft_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            state[name.removeprefix("model.")] = t
    return state


def check_dflash_weights(
    state: dict[str, torch.Tensor], config: DFlashConfig, num_taps: int, target_hidden: int
) -> None:
    """Raise a ValueError naming the first missing or mis-shaped tensor."""
    fc = state.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (config.hidden_size, num_taps * target_hidden):
        raise ValueError(
            f"DFlash fc.weight has shape {tuple(fc.shape)}, expected "
            f"({config.hidden_size}, {num_taps} taps x target hidden {target_hidden} = "
            f"{num_taps * target_hidden}); the draft was trained for another target or tap count"
        )
    for name, shape in expected_weight_shapes(config, num_taps).items():
        if name not in state:
            raise ValueError(f"DFlash checkpoint lacks {name!r}")
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"DFlash {name} has shape {tuple(state[name].shape)}, expected {shape}"
            )


def _layer_weights(state: dict[str, torch.Tensor], n: int) -> DFlashLayerWeights:
    p, a = f"layers.{n}.", f"layers.{n}.self_attn."
    return DFlashLayerWeights(
        q_proj=state[a + "q_proj.weight"],
        k_proj=state[a + "k_proj.weight"],
        v_proj=state[a + "v_proj.weight"],
        o_proj=state[a + "o_proj.weight"],
        q_norm=state[a + "q_norm.weight"],
        k_norm=state[a + "k_norm.weight"],
        input_layernorm=state[p + "input_layernorm.weight"],
        post_attention_layernorm=state[p + "post_attention_layernorm.weight"],
        gate_proj=state[p + "mlp.gate_proj.weight"],
        up_proj=state[p + "mlp.up_proj.weight"],
        down_proj=state[p + "mlp.down_proj.weight"],
        q_bias=state.get(a + "q_proj.bias"),
        k_bias=state.get(a + "k_proj.bias"),
        v_bias=state.get(a + "v_proj.bias"),
        o_bias=state.get(a + "o_proj.bias"),
    )


# ----------------------------------------------------------------------------- math


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: statistics in float32, `weight * x_normed` in the input dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 -> cos, sin [T, head_dim] float32 (neox layout: halves repeat)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; neox-style rotate-half RoPE computed in float32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """[Tq, Tk] bool: may query at q_pos attend to the key at k_pos?"""
    diff = q_pos[:, None] - k_pos[None, :]  # [Tq, Tk]
    visible = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        visible &= diff >= 0
    if window is not None:  # window keys including self: k >= q - (window - 1)
        visible &= diff < window
    return visible


# ----------------------------------------------------------------------------- runner


class DFlashDraftRunner:
    """DraftRunner (see reference/base.py) for a z-lab DFlash checkpoint, SGLang semantics.

    Keeps per-layer K/V of the committed context; each `draft_logits` call runs one block
    [bonus, MASK x (B-1)] against that context and discards the block's own K/V.
    """

    def __init__(
        self,
        draft_dir: str | Path,
        target_embed: nn.Embedding,
        target_lm_head: nn.Linear,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        target_num_layers: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        cfg_dict = json.loads((Path(draft_dir) / "config.json").read_text())
        self.config = parse_dflash_config(cfg_dict)
        self.dtype, self.device = dtype, torch.device(device)
        self.target_embed, self.target_lm_head = target_embed, target_lm_head
        self._validate_target(target_embed, target_lm_head)
        self.block_size = self.config.block_size
        self.target_layer_ids = resolve_target_layer_ids(self.config, target_num_layers)
        self.mask_token_id = resolve_mask_token_id(self.config, self.vocab_size, tokenizer)
        state = load_dflash_state_dict(draft_dir)
        check_dflash_weights(
            state, self.config, len(self.target_layer_ids), target_embed.embedding_dim
        )
        state = {k: v.to(device=self.device, dtype=dtype) for k, v in state.items()}
        self.layers = [_layer_weights(state, n) for n in range(self.config.num_layers)]
        self.fc, self.hidden_norm, self.norm = (
            state["fc.weight"],
            state["hidden_norm.weight"],
            state["norm.weight"],
        )
        self.reset()

    # -- validation ---------------------------------------------------------------------------

    def _validate_target(self, embed: nn.Embedding, lm_head: nn.Linear) -> None:
        cfg = self.config
        check_draft_matches_target(cfg, embed.embedding_dim, lm_head.out_features)
        if lm_head.in_features != cfg.hidden_size:
            raise ValueError(
                f"target lm_head takes {lm_head.in_features} features, draft hidden_size is "
                f"{cfg.hidden_size}"
            )
        if embed.num_embeddings != lm_head.out_features:
            raise ValueError(
                f"target embed vocab {embed.num_embeddings} != lm_head vocab {lm_head.out_features}"
            )
        self.vocab_size = lm_head.out_features

    # -- DraftRunner protocol -----------------------------------------------------------------

    @property
    def context_len(self) -> int:
        return self._ctx_len

    def reset(self) -> None:
        """Forget all context (a new request)."""
        h, d = self.config.num_kv_heads, self.config.head_dim
        empty = torch.empty(0, h, d, dtype=self.dtype, device=self.device)  # [n, Hkv, D]
        self._ctx_k = [empty] * self.config.num_layers
        self._ctx_v = [empty] * self.config.num_layers
        self._ctx_len = 0

    @torch.no_grad()
    def append_context(self, taps: torch.Tensor) -> None:
        """taps [n, n_taps * H] of newly committed target tokens at positions len..len+n-1."""
        expected = self.fc.shape[1]
        if taps.ndim != 2 or taps.shape[1] != expected:
            raise ValueError(
                f"DFlash taps must be [n, {expected}] ({len(self.target_layer_ids)} taps x "
                f"hidden {self.config.hidden_size}), got {tuple(taps.shape)}"
            )
        n = taps.shape[0]
        positions = torch.arange(self._ctx_len, self._ctx_len + n, device=self.device)  # [n]
        ctx_hidden = self.project_taps(taps.to(device=self.device, dtype=self.dtype))  # [n, H]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        for i, layer in enumerate(self.layers):
            k, v = self._kv(layer, ctx_hidden, cos, sin)  # [n, Hkv, D] each
            self._ctx_k[i] = torch.cat([self._ctx_k[i], k])
            self._ctx_v[i] = torch.cat([self._ctx_v[i], v])
        self._ctx_len += n

    @torch.no_grad()
    def draft_logits(self, bonus: int, position: int) -> torch.Tensor:
        """Block [bonus, MASK x (B-1)] at positions position.. -> logits [B-1, V] float32."""
        if position != self._ctx_len:
            raise ValueError(
                f"DFlash block position {position} must equal the committed context length "
                f"{self._ctx_len} (append the taps of every committed token first)"
            )
        hidden = self.block_hidden(bonus, position)  # [B, H]
        head_dtype = self.target_lm_head.weight.dtype
        return self.target_lm_head(hidden[1:].to(head_dtype)).float()  # [B-1, V]

    # -- pieces -------------------------------------------------------------------------------

    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [n, K*H] -> context hidden [n, H] = hidden_norm(fc(taps))."""
        return rms_norm(F.linear(taps, self.fc), self.hidden_norm, self.config.rms_norm_eps)

    def block_ids(self, bonus: int) -> torch.Tensor:
        ids = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long)  # [B]
        ids[0] = int(bonus)
        return ids.to(self.device)

    @torch.no_grad()
    def block_hidden(self, bonus: int, position: int) -> torch.Tensor:
        """Final-normed hidden states [B, H] of the block at positions position..position+B-1."""
        cfg = self.config
        ids = self.block_ids(bonus).to(self.target_embed.weight.device)
        h = self.target_embed(ids).to(device=self.device, dtype=self.dtype)  # [B, H]
        q_pos = torch.arange(position, position + self.block_size, device=self.device)  # [B]
        k_pos = torch.cat([torch.arange(self._ctx_len, device=self.device), q_pos])  # [n+B]
        cos, sin = rope_cos_sin(q_pos, cfg.head_dim, cfg.rope_theta)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_layernorm, cfg.rms_norm_eps)
            mask = visibility(q_pos, k_pos, *self._layer_mask_kind(i))  # [B, n+B]
            h = h + self._attention(i, layer, x, cos, sin, mask)
            x = rms_norm(h, layer.post_attention_layernorm, cfg.rms_norm_eps)
            h = h + F.linear(
                F.silu(F.linear(x, layer.gate_proj)) * F.linear(x, layer.up_proj), layer.down_proj
            )
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def _layer_mask_kind(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of layer i, as SGLang's _get_dflash_layer_attention_params."""
        if self.config.layer_types[i] == "sliding_attention":
            return True, self.config.sliding_window
        return self.config.full_attention_causal, None

    def _kv(
        self, layer: DFlashLayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> k (k_norm + RoPE), v: [T, Hkv, D]."""
        t, d = x.shape[0], self.config.head_dim
        k = F.linear(x, layer.k_proj, layer.k_bias).view(t, -1, d)
        v = F.linear(x, layer.v_proj, layer.v_bias).view(t, -1, d)
        k = apply_rope(rms_norm(k, layer.k_norm, self.config.rms_norm_eps), cos, sin)
        return k, v

    def _attention(
        self,
        i: int,
        layer: DFlashLayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block queries x [B, H] over context + block keys; returns o_proj output [B, H]."""
        cfg = self.config
        b, d = x.shape[0], cfg.head_dim
        q = F.linear(x, layer.q_proj, layer.q_bias).view(b, -1, d)  # [B, Hq, D]
        q = apply_rope(rms_norm(q, layer.q_norm, cfg.rms_norm_eps), cos, sin)
        k_blk, v_blk = self._kv(layer, x, cos, sin)  # [B, Hkv, D]
        k = torch.cat([self._ctx_k[i], k_blk]).transpose(0, 1)  # [Hkv, n+B, D]
        v = torch.cat([self._ctx_v[i], v_blk]).transpose(0, 1)  # [Hkv, n+B, D]
        groups = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)  # [Hq, n+B, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=mask, scale=d**-0.5
        )  # [Hq, B, D]
        out = out.transpose(0, 1).reshape(b, -1)  # [B, Hq*D]
        return F.linear(out, layer.o_proj, layer.o_bias)
