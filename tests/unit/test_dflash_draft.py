"""DFlashDraftRunner: loading, config validation, block math vs independent references.

Float tolerance (fp32 runner vs the float64 naive reference): atol 5e-5 on logits of magnitude
up to ~8; the measured fp32 error is ~7e-6.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_ddtree.checkpoints.tiny import write_tiny_dflash, write_tiny_qwen3
from sglang_ddtree.reference.dflash import DFlashDraftRunner

LOGIT_ATOL = 5e-5
N_CTX = 11


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), seed=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def taps_of(target):
    """taps(ids, layer_ids) -> [T, len(layer_ids) * H] from a plain target forward."""

    @torch.no_grad()
    def taps(ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        hs = target(ids[None], output_hidden_states=True).hidden_states
        return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)

    return taps


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, 1000, (n,), generator=g)


def _runner(draft_dir, target, **kw) -> DFlashDraftRunner:
    return DFlashDraftRunner(draft_dir, target.get_input_embeddings(), target.lm_head, **kw)


def _edit_config(draft_dir: Path, edit) -> None:
    cfg = json.loads((draft_dir / "config.json").read_text())
    edit(cfg)
    (draft_dir / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------- naive reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D]: rotate pairs (i, i + D/2) by pos * theta^(-2i/D), as complex numbers."""
    half = x.shape[-1] // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angle = pos.double()[:, None] * freq[None, :]  # [T, D/2]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    z = torch.complex(x[..., :half], x[..., half:]) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def _allowed(cfg: dict, layer: int, q: int, k: int) -> bool:
    """SGLang: sliding layers causal with window_left = sliding_window - 1; full layers
    non-causal (ENCODER_ONLY) unless config.is_causal."""
    if cfg["layer_types"][layer] == "sliding_attention":
        return k <= q and k >= q - (cfg["sliding_window"] - 1)
    return k <= q or not cfg.get("is_causal", False)


def naive_draft_logits(draft_dir, target, taps, bonus: int) -> torch.Tensor:
    """Recompute everything in float64 from the files: all context K/V from scratch, one
    query and one head at a time."""
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(Path(draft_dir) / "model.safetensors")).items()}
    eps, theta, d = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    bsz, mask_id = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    groups = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    embed = target.get_input_embeddings().weight.double()
    n = taps.shape[0]
    ctx = _rms(taps.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    pos = torch.arange(n + bsz)
    h = embed[torch.tensor([bonus] + [mask_id] * (bsz - 1))]
    for li in range(cfg["num_hidden_layers"]):
        p = f"layers.{li}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        src = torch.cat([ctx, x])  # context rows use the projected taps, block rows the layer input
        kk = _rms(
            (src @ w[p + "self_attn.k_proj.weight"].T).view(n + bsz, -1, d),
            w[p + "self_attn.k_norm.weight"],
            eps,
        )
        kk = _rope_complex(kk, pos, theta)
        vv = (src @ w[p + "self_attn.v_proj.weight"].T).view(n + bsz, -1, d)
        qq = _rms(
            (x @ w[p + "self_attn.q_proj.weight"].T).view(bsz, -1, d),
            w[p + "self_attn.q_norm.weight"],
            eps,
        )
        qq = _rope_complex(qq, pos[n:], theta)
        out = torch.zeros(bsz, qq.shape[1], d, dtype=torch.float64)
        for qi in range(bsz):
            keys = [j for j in range(n + bsz) if _allowed(cfg, li, n + qi, j)]
            for head in range(qq.shape[1]):
                scores = torch.stack([qq[qi, head] @ kk[j, head // groups] for j in keys])
                probs = torch.softmax(scores / math.sqrt(d), dim=0)
                out[qi, head] = sum(
                    pr * vv[j, head // groups] for pr, j in zip(probs, keys, strict=True)
                )
        h = h + out.reshape(bsz, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = _rms(h, w["norm.weight"], eps)
    return h[1:] @ target.lm_head.weight.double().T


DRAFT_VARIANTS = {
    "full_noncausal": dict(num_layers=1),
    "sliding_then_full": dict(
        num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5
    ),
    "all_sliding_b8": dict(
        num_layers=2,
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=4,
        block_size=8,
    ),
    "full_causal": dict(num_layers=2, is_causal=True),
}


@pytest.mark.parametrize("variant", sorted(DRAFT_VARIANTS))
def test_block_logits_match_naive_reference(variant, tmp_path, target_dir, target, taps_of):
    draft = write_tiny_dflash(tmp_path / "d", target_dir, seed=11, **DRAFT_VARIANTS[variant])
    runner = _runner(draft, target)
    taps = taps_of(_prompt(N_CTX), runner.target_layer_ids)
    runner.append_context(taps)
    got = runner.draft_logits(bonus=123, position=N_CTX)
    want = naive_draft_logits(draft, target, taps, bonus=123)
    assert got.dtype == torch.float32 and got.shape == (runner.block_size - 1, runner.vocab_size)
    torch.testing.assert_close(got.double(), want, atol=LOGIT_ATOL, rtol=0)


# ----------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir) -> Path:
    return write_tiny_dflash(
        tmp_path_factory.mktemp("draft"),
        target_dir,
        seed=5,
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
    )


def test_loads_fields_and_shapes(draft_dir, target_dir, target, taps_of):
    runner = _runner(draft_dir, target)
    tok = AutoTokenizer.from_pretrained(target_dir)
    assert runner.block_size == 16
    assert runner.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    assert runner.target_layer_ids == [1, 2]
    runner.append_context(taps_of(_prompt(5), runner.target_layer_ids))
    logits = runner.draft_logits(7, 5)
    assert logits.shape == (15, target.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert runner.context_len == 5  # the block is not cached


def test_block_is_discarded_and_context_caching_equals_recompute(draft_dir, target, taps_of):
    ids = _prompt(14, seed=1)
    taps = taps_of(ids, [1, 2])
    incremental = _runner(draft_dir, target)
    start = 0
    for chunk in (6, 1, 4, 3):  # prefill, then rounds committing 1, 4, 3 tokens
        incremental.append_context(taps[start : start + chunk])
        start += chunk
        first = incremental.draft_logits(int(ids[start - 1]), start)
        again = incremental.draft_logits(int(ids[start - 1]), start)
        assert torch.equal(first, again)
    scratch = _runner(draft_dir, target)
    scratch.append_context(taps)
    torch.testing.assert_close(first, scratch.draft_logits(int(ids[-1]), 14), atol=1e-5, rtol=0)
    incremental.reset()
    incremental.append_context(taps)
    assert torch.equal(
        incremental.draft_logits(int(ids[-1]), 14), scratch.draft_logits(int(ids[-1]), 14)
    )


def test_sliding_window_hides_keys_beyond_the_window(tmp_path, target_dir, target, taps_of):
    window = 3
    draft = write_tiny_dflash(
        tmp_path / "sw",
        target_dir,
        seed=2,
        num_layers=2,
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=window,
        block_size=4,
    )
    taps = taps_of(_prompt(10, seed=2), [1, 2])
    base = _runner(draft, target)
    base.append_context(taps)
    ref = base.draft_logits(9, 10)
    # Block queries sit at positions 10..13; the first sees keys >= 10 - (window - 1) = 8.
    for pos, visible in ((0, False), (7, False), (8, True), (9, True)):
        changed = taps.clone()
        changed[pos] += 1.0
        runner = _runner(draft, target)
        runner.append_context(changed)
        same = torch.equal(runner.draft_logits(9, 10), ref)
        assert same != visible, f"context position {pos}: visible={visible}, unchanged={same}"


def test_full_attention_sees_the_whole_context(draft_dir, tmp_path, target_dir, target, taps_of):
    draft = write_tiny_dflash(tmp_path / "full", target_dir, seed=4, num_layers=1)
    taps = taps_of(_prompt(10, seed=3), [1, 2])
    base = _runner(draft, target)
    base.append_context(taps)
    changed = taps.clone()
    changed[0] += 1.0
    other = _runner(draft, target)
    other.append_context(changed)
    assert not torch.equal(base.draft_logits(9, 10), other.draft_logits(9, 10))


def test_bad_calls_raise(draft_dir, target, taps_of):
    runner = _runner(draft_dir, target)
    with pytest.raises(ValueError, match=r"taps must be \[n, 256\].*got \(3, 128\)"):
        runner.append_context(torch.zeros(3, 128))
    runner.append_context(taps_of(_prompt(4), [1, 2]))
    with pytest.raises(ValueError, match="position 5 must equal the committed context length 4"):
        runner.draft_logits(1, 5)


# ----------------------------------------------------------------------------- validation


def _copy_draft(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_rejects_target_with_other_hidden_size(draft_dir, target):
    embed, head = torch.nn.Embedding(target.config.vocab_size, 64), torch.nn.Linear(64, 10)
    with pytest.raises(ValueError, match="hidden_size=128 but the target hidden size is 64"):
        DFlashDraftRunner(draft_dir, embed, head)


BAD_CONFIGS = {
    "fc_in_features": (
        lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 2]),
        r"fc.weight has shape \(128, 256\), expected \(128, 3 taps x target hidden 128 = 384\)",
    ),
    "vocab": (lambda c: c.update(vocab_size=5000), "draft vocab_size=5000 but the target vocab is"),
    "no_mask_id": (
        lambda c: c["dflash_config"].pop("mask_token_id"),
        "mask token id is missing.*no tokenizer was given",
    ),
    "mask_outside_vocab": (
        lambda c: c["dflash_config"].update(mask_token_id=99999),
        "mask_token_id=99999 is outside the target vocab",
    ),
    "block_size_1": (lambda c: c.update(block_size=1), "block_size must be >= 2.*got 1"),
    "tap_out_of_range": (
        lambda c: c["dflash_config"].update(target_layer_ids=[1, 4]),
        r"target_layer_ids\[1\]=4 is out of range for a target with 4 layers",
    ),
    "sliding_without_window": (
        lambda c: c.update(use_sliding_window=False),
        "sliding_attention layers need config.sliding_window",
    ),
    "gqa_heads": (
        lambda c: c.update(num_key_value_heads=3),
        "num_attention_heads=2 is not a multiple of num_key_value_heads=3",
    ),
    "layer_types_length": (
        lambda c: c.update(layer_types=["full_attention"]),
        "one type per draft layer",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_configs_raise(case, draft_dir, tmp_path, target):
    edit, message = BAD_CONFIGS[case]
    bad = _copy_draft(draft_dir, tmp_path / case)
    _edit_config(bad, edit)
    with pytest.raises(ValueError, match=message):
        _runner(bad, target, target_num_layers=4)


def test_mask_id_resolved_from_tokenizer(draft_dir, tmp_path, target_dir, target):
    tok = AutoTokenizer.from_pretrained(target_dir)
    bad = _copy_draft(draft_dir, tmp_path / "nomask")
    _edit_config(bad, lambda c: c["dflash_config"].pop("mask_token_id"))
    assert _runner(bad, target, tokenizer=tok).mask_token_id == tok.convert_tokens_to_ids(
        "<|MASK|>"
    )
    _edit_config(bad, lambda c: c["dflash_config"].update(mask_token="<|nope|>"))
    with pytest.raises(ValueError, match="cannot be resolved \\(the tokenizer lacks it\\)"):
        _runner(bad, target, tokenizer=tok)
    _edit_config(bad, lambda c: c["dflash_config"].update(mask_token="<|MASK|>", mask_token_id=4))
    with pytest.raises(ValueError, match="mask_token_id=4 conflicts with the tokenizer id 3"):
        _runner(bad, target, tokenizer=tok)


def test_default_target_layer_ids_follow_sglang(draft_dir, tmp_path, target):
    sglang_utils = pytest.importorskip("sglang.srt.speculative.dflash_utils")
    bad = _copy_draft(draft_dir, tmp_path / "noids")
    _edit_config(bad, lambda c: c["dflash_config"].pop("target_layer_ids"))
    # 2 draft layers -> 2 taps; fc expects 2 taps, so loading works for any target depth >= 4.
    for layers in (4, 9, 64):
        runner = _runner(bad, target, target_num_layers=layers)
        assert runner.target_layer_ids == sglang_utils.build_target_layer_ids(layers, 2)


# ----------------------------------------------------------------------------- SGLang itself


class _StandInAttention(torch.nn.Module):
    """Replaces SGLang's RadixAttention: masked softmax over [context K/V; block K/V] with the
    mask SGLang's own layer declares (attn_type, sliding_window_size = window_left)."""

    def __init__(self, radix, ctx_k, ctx_v, ctx_pos, q_pos):
        super().__init__()
        self.radix, self.ctx_k, self.ctx_v, self.ctx_pos, self.q_pos = (
            radix,
            ctx_k,
            ctx_v,
            ctx_pos,
            q_pos,
        )

    def forward(self, q, k, v, forward_batch):
        from sglang.srt.layers.radix_attention import AttentionType

        r, t = self.radix, q.shape[0]
        q = q.view(t, r.tp_q_head_num, r.head_dim)
        k = torch.cat([self.ctx_k, k.view(t, -1, r.head_dim)])
        v = torch.cat([self.ctx_v, v.view(t, -1, r.head_dim)])
        k_pos = torch.cat([self.ctx_pos, self.q_pos])
        visible = torch.ones(t, k_pos.numel(), dtype=torch.bool)
        if r.attn_type != AttentionType.ENCODER_ONLY:
            visible &= k_pos[None, :] <= self.q_pos[:, None]
        if r.sliding_window_size >= 0:
            visible &= k_pos[None, :] >= self.q_pos[:, None] - r.sliding_window_size
        groups = r.tp_q_head_num // r.tp_k_head_num
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * r.scaling
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)


def _sglang_param_name(name: str) -> str:
    """SGLang fuses q/k/v into qkv_proj and gate/up into gate_up_proj."""
    name = re.sub(r"self_attn\.[qkv]_proj", "self_attn.qkv_proj", name)
    return re.sub(r"mlp\.(gate|up)_proj", "mlp.gate_up_proj", name)


@pytest.mark.slow
def test_sglang_dflash_model_loads_checkpoint_and_matches(draft_dir, target, taps_of):
    """SGLang's DFlashDraftModel, built on CPU, takes every checkpoint tensor and (with a
    stand-in attention kernel honouring its declared masks) gives our block hidden states."""
    pytest.importorskip("sglang")
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.utils.hf_transformers.config import get_config

    from tests.fixtures import sglang_cpu_model_context, use_native_forward

    runner = _runner(draft_dir, target)
    taps = taps_of(_prompt(N_CTX, seed=4), runner.target_layer_ids)
    runner.append_context(taps)
    ours = runner.block_hidden(77, N_CTX)
    ckpt = load_file(str(draft_dir / "model.safetensors"))
    with sglang_cpu_model_context(draft_dir), torch.no_grad():
        model = use_native_forward(
            DFlashDraftModel(get_config(str(draft_dir), trust_remote_code=False))
        )
        model.load_weights(list(ckpt.items()))
        params = dict(model.named_parameters())
        assert set(params) == {_sglang_param_name(n) for n in ckpt}
        for n, p in params.items():
            if "qkv_proj" in n:
                parts = [ckpt[n.replace("qkv_proj", s)] for s in ("q_proj", "k_proj", "v_proj")]
            elif "gate_up_proj" in n:
                parts = [ckpt[n.replace("gate_up_proj", s)] for s in ("gate_proj", "up_proj")]
            else:
                parts = [ckpt[n]]
            assert torch.equal(p, torch.cat(parts)), n
        ctx_hidden = model.project_target_hidden(taps)
        ctx_pos = torch.arange(N_CTX)
        q_pos = torch.arange(N_CTX, N_CTX + runner.block_size)
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(ctx_hidden)
            k = attn.apply_k_rope(ctx_pos, attn.apply_k_norm(k))
            shape = (N_CTX, attn.num_kv_heads, attn.head_dim)
            attn.attn = _StandInAttention(attn.attn, k.view(shape), v.view(shape), ctx_pos, q_pos)
        ids = runner.block_ids(77)
        embeds = target.get_input_embeddings()(ids)
        theirs = model(ids, q_pos, None, input_embeds=embeds).hidden_states
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
