"""Per-round decode cost at Qwen3.6-27B scale (dummy weights), DDTREE against DFLASH, NEXTN (the
built-in MTP layer with its tree) and no speculation, side by side on one GPU.

    python scripts/bench_round.py --out OUT [--variants none,dflash,nextn,ddtree32,ddtree64]
        [--batch 1,4,8,16] [--tokens 96] [--profile ddtree64]
        [--simulate WORLD --serving 1,8,16,32 [--steady-state [--max-cell-seconds 120]]]

The script sizes itself from the GPU it finds (`size_for`, on `card_info`'s name and total
memory): the target runs bf16 where its weights leave room for a verify scratch (one H200) and
`--quantization fp8` otherwise (one H100; the draft stays bf16 either way), and
--mem-fraction-static, the verify-scratch budget the speculative variants' running requests are
sized to (`max_requests`) and the most running requests follow from the card's memory. Every row
records the card (`card`, `card_gib`), `target_dtype`, `mem_fraction_static`, `scratch_gib` and
its variant's `max_running`. A variant named with `_fp8kv` (`dflash_fp8kv`, `ddtree32_auto_fp8kv`)
serves with `--kv-cache-dtype fp8_e4m3` (target and draft KV in one byte a value) and is sized for
it (`size_for`'s `kv_cache_dtype`); every row records its `kv_cache_dtype`.

`dflash_dflash2`, `ddtree32_dflash2` and `ddtree32_auto_dflash2` serve a DFlash2-shaped draft
(the same draft with SGLang's candidate selector, SELECTOR): SGLang's DFLASH on its selector's
chain, DDTREE's lattice tree at N = 32 (fixed, and the default's automatic widths).

Per variant: one server (CUDA graphs on, FlashInfer), then for each batch size b: b concurrent
requests of 1, `--tokens` / 2 and `--tokens` new tokens. Round time = the slope of request
latency against the request's decode rounds (spec_verify_ct, or new tokens - 1 for plain
decoding). Dummy weights accept at random, so this is the cost of a round, not a speed-up;
`--simulate` gives every server a world in which drafts are accepted as a real drafter's are
(scripts/simworld, put on each server's PYTHONPATH with DDTREE_SIMULATE; docs/simulation.md),
and `--serving C,...` measures end to end in it with sglang.bench_serving
(scripts/round_serving.py: short cells by default; `--steady-state` runs each cell long enough
that decode rounds, not prefills, fill it, `--runs` 2 times, capped at `--max-cell-seconds`,
with the runs' spread). Also recorded: the Gated DeltaNet verify scratch the server allocated,
the memory its weights took as SGLang logged it (`weights_gb`, target then draft: the check on
the sizing's `weights_gib`), and (for `--profile` variants) GPU time per DDTREE part from
SGLang's torch-profiler trace, using the worker's `ddtree.*` ranges (scripts/round_trace.py).
Output: OUT/round_cost_27b.jsonl (one row per measurement; docs/data/ keeps them, docs/results.md
shows them), OUT/serving_simulated_27b.jsonl (--serving's rows: round_serving.py says their
kinds), a table on stdout, OUT/bench_round.png. The unit tests check configs, variants,
the sizing on an H100 and an H200 and the rows, on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import version as installed_version
from pathlib import Path

import harness  # beside this script (scripts/harness.py)
import round_serving  # beside this script: --serving's cells
import simworld  # beside this script (scripts/simworld: the simulated world)
from harness import ADMIN_ARGS, timed_requests
from round_trace import profile_parts

QWEN36_TEXT = dict(  # Qwen3.6-27B text sizes (ddtree.md §3)
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    attn_output_gate=True,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    full_attention_interval=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    partial_rotary_factor=0.25,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    },
    tie_word_embeddings=False,
    dtype="bfloat16",
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
)
DRAFT = dict(  # a Qwen3.6-27B-DFlash-shaped draft: 5 layers, 4 sliding + 1 full, block 16
    architectures=["DFlashDraftModel"],
    model_type="qwen3",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e7,
    max_position_embeddings=262144,
    hidden_act="silu",
    use_sliding_window=True,
    sliding_window=2048,
    layer_types=["sliding_attention"] * 4 + ["full_attention"],
    num_target_layers=64,
    block_size=16,
    dflash_config={"target_layer_ids": [1, 16, 31, 46, 61]},
    tie_word_embeddings=False,
    dtype="bfloat16",
)
# The DFlash2-shaped draft (`dflash2_draft`): the same draft with SGLang's candidate selector,
# rank 32 over K = 8 candidates (the training recipe's, config.SelectorRecipe); its weights add
# two [V, 32] codebooks, 30 MiB in bf16.
SELECTOR = {"selector_rank": 32, "selector_top_k": 8}
# Prefill CUDA graphs are off: they do not touch the decode round and took 33-112 s to capture
# per server at 27B.
COMMON = [
    *ADMIN_ARGS,  # the tools' admin calls (/flush_cache, /start_profile)
    "--attention-backend",
    "flashinfer",
    "--load-format",
    "dummy",
    "--context-length",
    "8192",
    "--disable-prefill-cuda-graph",
]  # and the card's Sizing.flags(): --mem-fraction-static, the target's --quantization

GIB = 2**30
VOCAB = 1024  # the written tokenizer's (the model's vocabulary is Qwen3.6's)
_GDN_LAYERS = QWEN36_TEXT["layer_types"].count("linear_attention")
_GDN_VALUES = QWEN36_TEXT["linear_num_value_heads"] * QWEN36_TEXT["linear_value_head_dim"]
_GDN_KEYS = QWEN36_TEXT["linear_num_key_heads"] * QWEN36_TEXT["linear_key_head_dim"]
# Gated DeltaNet verify scratch: SGLang keeps every verified token's recurrent state until the
# commit, 48 layers x 48 heads x 128 x 128 per request and token (144 MiB in float32, 72 MiB in
# bfloat16), for (running requests + 1) x verify width.
GDN_STATE_MIB = _GDN_LAYERS * _GDN_VALUES * QWEN36_TEXT["linear_key_head_dim"] * 4 / 2**20
# A live Mamba slot: that state (float32) and the conv window (bf16, kernel - 1 taps): 146.8 MiB
CONV_STATE_MIB = (
    _GDN_LAYERS * (2 * _GDN_KEYS + _GDN_VALUES) * (QWEN36_TEXT["linear_conv_kernel_dim"] - 1) * 2
) / 2**20
MAMBA_SLOTS_PER_REQ = 6  # >= SGLang's mamba slots per running request (3, +2 with overlap)
# A running request's live GDN states: MAMBA_SLOTS_PER_REQ slots of 146.8 MiB, 0.86 GiB
LIVE_STATES_GIB = MAMBA_SLOTS_PER_REQ * (GDN_STATE_MIB + CONV_STATE_MIB) / 1024


def kv_kib_per_token(kv_bytes: int = 2) -> float:
    """A token's KV cache, target and draft, in KiB at `kv_bytes` a value: the target's 16
    full-attention layers (4 KV heads of 256) and the draft's 5 layers (8 KV heads of 128), a K
    and a V each: 64 + 20 KiB in bf16, 32 + 10 KiB in fp8 (--kv-cache-dtype fp8_e4m3). The
    draft's pool has a slot per target token (SGLang's DFLASH layout) whatever its window."""
    full = QWEN36_TEXT["layer_types"].count("full_attention")
    target = full * QWEN36_TEXT["num_key_value_heads"] * QWEN36_TEXT["head_dim"]
    draft = DRAFT["num_hidden_layers"] * DRAFT["num_key_value_heads"] * DRAFT["head_dim"]
    return 2 * (target + draft) * kv_bytes / 1024


def kv_bytes(kv_cache_dtype: str) -> int:
    """Bytes a KV value takes under --kv-cache-dtype `kv_cache_dtype` (`auto`: the model's
    bf16)."""
    return 1 if kv_cache_dtype.startswith("fp8") else 2


# --- Sizing from the card -------------------------------------------------------------------
# --mem-fraction-static is the share of the card SGLang's static memory takes: the weights and
# the pools (KV cache, live GDN states, verify scratch). The rest holds what the forward passes
# allocate (activations, the CUDA graphs' pools, the verify's logits), and that does not grow
# with the card: it follows the chunked-prefill size (8192 tokens on an H100 and an H200 alike)
# and the graphs' batch sizes. SGLang's own estimate of it (arg_groups/memory_hook.py, used when
# --mem-fraction-static is left unset) is 512 MB + 1.5 MB per chunked-prefill token + 128 MB +
# 2 MB per decode-graph batch size (at most 32 here): 12.7 GiB. A constant 0.85 leaves 21.0 GiB
# of an H200 (every H200 row so far was measured at 0.85, so the H200 keeps it) but 11.9 GiB of
# an H100, under that estimate: on an H100 the fraction is 1 - 12.7 / 79.6 = 0.840. fp8 does not
# change the rest (its per-token activation scales are small); what it changes is the static
# side, whose weights drop from 53.3 to 30.6 GiB (weights_gib).
MEM_FRACTION_MAX = 0.85
SGLANG_RESERVE_GIB = (512 + 1.5 * 8192 + 128 + 2 * 32) / 1024
# Of the pools (static memory less the weights) the verify scratch gets what is left beside
# KV_AND_STATES_GIB for the KV cache (target and draft), the running requests' live GDN states
# (MAMBA_SLOTS_PER_REQ slots of 146.8 MiB each: 13.8 GiB at 16 requests) and SGLang's multimodal
# reservation (0.1 GiB). 17 GiB is what one H200 at 0.85 left beside the 48 GiB budget all its
# rows were measured with (pools of 118.8 - 53.3 = 65.5 GiB), where DFLASH's 16 requests served
# four 32K-token prompts (docs/data/round_cost_27b.jsonl, sitting 8). Of it, the KV cache is what
# 16 requests' live states (13.8 GiB) and the multimodal reservation leave: KV_RESERVED_GIB,
# 3.1 GiB of bf16 KV (39K tokens at 84 KiB); with an fp8 KV cache the same tokens take half that
# and the verify scratch gets the rest (kv_and_states_gib).
KV_AND_STATES_GIB = 17.0
MULTIMODAL_GIB = 0.1
KV_RESERVED_GIB = KV_AND_STATES_GIB - 16 * LIVE_STATES_GIB - MULTIMODAL_GIB
# The target runs bf16 where its pools hold that and one DFLASH request's scratch at width 16
# (2 x 16 x 144 MiB); else fp8. On an H100 the bf16 pools are 13.6 GiB (measured there: the bf16
# weights alone needed --mem-fraction-static above 0.866).
MIN_SCRATCH_GIB = 2 * 16 * GDN_STATE_MIB / 1024
# The most running requests a card starts any variant with (a ceiling on --max-running): each
# takes MAMBA_SLOTS_PER_REQ live slots and up to COMPACT_GIB_PER_REQ of DDTREE's compact scratch
# (6.6 GB for 32 requests at N = 64 on the H200), beside KV_FLOOR_GIB of bf16 KV cache (about
# 50K tokens of target and draft KV at 64 + 20 KiB a token; the same tokens in half that with an
# fp8 KV cache: kv_floor_gib).
COMPACT_GIB_PER_REQ = 0.25
KV_FLOOR_GIB = 4.0


def kv_and_states_gib(kv_cache_dtype: str = "auto") -> float:
    """KV_AND_STATES_GIB with its KV cache's tokens in `kv_cache_dtype`: 17.0 GiB in bf16,
    15.4 in fp8."""
    return KV_AND_STATES_GIB - KV_RESERVED_GIB * (1 - kv_bytes(kv_cache_dtype) / 2)


def kv_floor_gib(kv_cache_dtype: str = "auto") -> float:
    """KV_FLOOR_GIB's tokens in `kv_cache_dtype`: 4.0 GiB in bf16, 2.0 in fp8."""
    return KV_FLOOR_GIB * kv_bytes(kv_cache_dtype) / 2


def target_params(cfg: dict = QWEN36_TEXT) -> tuple[int, int]:
    """The target's parameters as (those of linear layers, all others): its projections and MLPs
    are linear layers, which `--quantization fp8` keeps in one byte a parameter; the embedding,
    the LM head, the norms and the GDN conv and decay parameters stay bf16. Left out (under
    0.5 B together): the one-layer vision tower write_configs gives it and the MTP layer (loaded
    as NEXTN's draft only, smaller than DRAFT)."""
    h, head = cfg["hidden_size"], cfg["head_dim"]
    mlp = 3 * h * cfg["intermediate_size"]  # gate, up, down
    q = cfg["num_attention_heads"] * head
    gate = 2 if cfg["attn_output_gate"] else 1  # q_proj makes the output gate too
    attention = h * q * gate + 2 * h * cfg["num_key_value_heads"] * head + q * h
    keys = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    values = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    heads = cfg["linear_num_value_heads"]
    gdn = h * (2 * keys + 2 * values) + h * 2 * heads + values * h  # in_proj_qkvz, _ba, out_proj
    gdn_rest = (2 * keys + values) * cfg["linear_conv_kernel_dim"] + 2 * heads
    gdn_rest += cfg["linear_value_head_dim"]  # conv1d, A_log, dt_bias, the gated norm
    types = cfg["layer_types"]
    linear_layers, full = types.count("linear_attention"), types.count("full_attention")
    linear = linear_layers * (gdn + mlp) + full * (attention + mlp)
    rest = 2 * cfg["vocab_size"] * h + linear_layers * gdn_rest + full * 2 * head
    return linear, rest + (2 * len(types) + 1) * h  # and the layer norms


def draft_params(cfg: dict = DRAFT) -> int:
    """The DFlash draft's parameters: its layers, the projection of the target's hidden states
    (fc) and the norms; the embedding and the LM head are the target's (SGLang's
    DFlashDraftModel borrows them)."""
    h, head = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    layer = 2 * h * q + 2 * h * kv + 3 * h * cfg["intermediate_size"] + 2 * h + 2 * head
    fc = len(cfg["dflash_config"]["target_layer_ids"]) * h * h
    return cfg["num_hidden_layers"] * layer + fc + 2 * h


def weights_gib(target_dtype: str) -> float:
    """The target's weights in `target_dtype` ("bf16", or "fp8": a byte for each linear-layer
    parameter, two for the others) and the bf16 draft's, in GiB: 50.1 + 3.2 in bf16, 27.4 + 3.2
    with an fp8 target."""
    linear, rest = target_params()
    return ((1 if target_dtype == "fp8" else 2) * linear + 2 * rest + 2 * draft_params()) / GIB


@dataclass(frozen=True)
class Sizing:
    """How this script runs on one card (size_for)."""

    card: str
    card_gib: float  # the card's total memory
    target_dtype: str  # "bf16" or "fp8"
    mem_fraction_static: float
    pools_gib: float  # the static memory less the weights: KV cache, live states, scratch
    scratch_gib: int  # the verify-scratch budget (max_requests)
    most_running: int  # the most running requests any variant is started with
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: "auto" (the model's bf16) or "fp8_e4m3"

    def flags(self) -> list[str]:
        """The server flags of this sizing, beside COMMON."""
        fp8 = ["--quantization", "fp8"] if self.target_dtype == "fp8" else []
        kv = [] if self.kv_cache_dtype == "auto" else ["--kv-cache-dtype", self.kv_cache_dtype]
        return ["--mem-fraction-static", str(self.mem_fraction_static), *fp8, *kv]

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> Sizing:
        """The sizing on the same card with the KV cache in `kv_cache_dtype`."""
        if kv_cache_dtype == self.kv_cache_dtype:
            return self
        return size_for(self.card, self.card_gib, kv_cache_dtype)

    def draft_flags(self) -> list[str]:
        """A speculative server's: its draft stays bf16 (SGLang gives the draft the target's
        --quantization unless --speculative-draft-model-quantization says otherwise; `unquant`
        is none)."""
        fp8 = self.target_dtype == "fp8"
        return ["--speculative-draft-model-quantization", "unquant"] if fp8 else []

    def row(self) -> dict:
        """What every emitted row records of it."""
        return {
            "card": self.card,
            "card_gib": round(self.card_gib, 1),
            "target_dtype": self.target_dtype,
            "mem_fraction_static": self.mem_fraction_static,
            "scratch_gib": self.scratch_gib,
            "kv_cache_dtype": self.kv_cache_dtype,
        }


def mem_fraction(card_gib: float) -> float:
    """--mem-fraction-static on a card of `card_gib`: SGLANG_RESERVE_GIB left outside the static
    memory, and at most MEM_FRACTION_MAX (0.840 on an H100, 0.85 on an H200)."""
    return min(MEM_FRACTION_MAX, math.floor(1000 * (1 - SGLANG_RESERVE_GIB / card_gib)) / 1000)


def size_for(card: str, card_gib: float, kv_cache_dtype: str = "auto") -> Sizing:
    """The sizing on a card named `card` of `card_gib` total memory with the KV cache in
    `kv_cache_dtype` ("auto": bf16, or "fp8_e4m3"): the target bf16 where its pools hold
    kv_and_states_gib and MIN_SCRATCH_GIB, fp8 otherwise (SystemExit where neither does), the
    verify-scratch budget (whole GiB) and the running-request ceiling.
    One H200 (139.8 GiB): bf16, 0.85, 48 GiB, 55; one H100 (79.6 GiB): fp8, 0.840, 19 GiB, 29;
    with an fp8 KV cache 50 GiB, 57 and 20 GiB, 30."""
    fraction = mem_fraction(card_gib)
    kv_and_states = kv_and_states_gib(kv_cache_dtype)
    for dtype in ("bf16", "fp8"):
        pools = fraction * card_gib - weights_gib(dtype)
        if pools >= kv_and_states + MIN_SCRATCH_GIB:
            break
    else:
        raise SystemExit(
            f"{card} ({card_gib:.1f} GiB): the 27B target leaves too little memory for the "
            f"pools even in fp8 ({pools:.1f} GiB at --mem-fraction-static {fraction})"
        )
    per_request = LIVE_STATES_GIB + COMPACT_GIB_PER_REQ
    return Sizing(
        card=card,
        card_gib=card_gib,
        target_dtype=dtype,
        mem_fraction_static=fraction,
        pools_gib=round(pools, 2),
        scratch_gib=int(pools - kv_and_states),
        most_running=int((pools - kv_floor_gib(kv_cache_dtype)) / per_request),
        kv_cache_dtype=kv_cache_dtype,
    )


def card_info(device: int = 0) -> tuple[str, float]:
    """This machine's GPU: its name and total memory in GiB (the tests pass their own)."""
    import torch

    return torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[1] / GIB


def free_bytes() -> int:
    """The GPU's free memory now."""
    import torch

    return torch.cuda.mem_get_info()[0]


# SGLang's SSM-state dtype (SGLANG_MAMBA_SSM_DTYPE; float32 by default): the `_bf16ssm` variant
# halves DFLASH's verify scratch (per-position states). `_fp8kv` (a suffix on any variant) serves
# with an fp8 KV cache: kv_cache_dtype, Sizing.flags.
VARIANT_ENV = {
    "_bf16ssm": {"SGLANG_MAMBA_SSM_DTYPE": "bfloat16"},
    "_auto": {"SGLANG_DDTREE_WIDTH": "auto"},
}
# DDTREE's default picks a verify width per round (SGLANG_DDTREE_WIDTH=auto); the `ddtreeN`
# variants measure the round at N itself (fixed), `ddtreeN_auto` the default, whose server logs
# the cost table it measured per (batch bucket, width) (`width_table`).
FIXED = {"SGLANG_DDTREE_WIDTH": "fixed"}


def max_requests(width: int, scratch_gib: float, state_bytes: int = 4, cap: int = 16) -> int:
    """Running requests whose verify scratch at `width` tokens ((requests + 1) x width states)
    fits `scratch_gib`: at most cap; 0 where not even one does."""
    per_request_mib = GDN_STATE_MIB * state_bytes / 4 * width
    return max(0, min(cap, int(scratch_gib * 1024 / per_request_mib) - 1))


FP8_KV = "_fp8kv"


def kv_cache_dtype(name: str) -> str:
    """The --kv-cache-dtype variant `name` serves with: fp8_e4m3 with the `_fp8kv` suffix (SGLang
    0.5.23 takes fp8_e4m3 and fp8_e5m2; the draft's KV follows it), else auto (the model's bf16)."""
    return "fp8_e4m3" if name.endswith(FP8_KV) else "auto"


def variant_env(name: str) -> dict[str, str]:
    env = {k: v for suffix, env in VARIANT_ENV.items() if suffix in name for k, v in env.items()}
    if name.startswith("ddtree") and "_auto" not in name:
        env.update(FIXED)
    return env


def width_table(log: str) -> dict | None:
    """The last cost table an automatic-width server logged (round/worker.py): {"widths",
    "ms": {bucket: [ms or None per width]}, "chosen": "w x rounds, ..."}; None: none logged."""
    if "DDTREE widths after " not in log:
        return None
    lines = log.split("DDTREE widths after ")[-1].splitlines()[1:]
    widths = [int(w) for w in lines[0].split()[1:]]
    ms = {}
    for line in lines[1:]:
        if not line[:1].isdigit():
            break
        bucket, *cells = line.split()
        ms[int(bucket)] = [None if c == "-" else float(c) for c in cells]
    chosen = next((x for x in lines if x.startswith("widths chosen:")), "")
    return {"widths": widths, "ms": ms, "chosen": chosen.removeprefix("widths chosen:").strip()}


def variants(draft: Path, sizing: Sizing, cap: int = 16) -> dict[str, list[str]]:
    """Server flags per variant on the card `sizing` is of, beside its sizing's flags (each
    variant's: `sizing.with_kv_cache_dtype(kv_cache_dtype(name))`): every variant below and
    the same with `_fp8kv`, sized for an fp8 KV cache."""
    fp8kv = sizing.with_kv_cache_dtype("fp8_e4m3")
    table = _variants(draft, sizing.with_kv_cache_dtype("auto"), cap)
    return table | {name + FP8_KV: flags for name, flags in _variants(draft, fp8kv, cap).items()}


def _variants(draft: Path, sizing: Sizing, cap: int = 16) -> dict[str, list[str]]:
    """Server flags per variant on the card `sizing` is of. Speculative variants size the Mamba
    pool explicitly (--max-mamba-cache-size) so SGLang's verify scratch is reserved for
    max_requests() requests of the card's scratch budget rather than solved from leftover
    memory; the compact-scratch DDTREE variants and plain decoding run at most `cap` requests
    (--max-running), the others at most 16; none more than the card's most_running. A variant
    of which not even one request fits gets --max-running-requests 0 (main starts no server
    for it)."""
    cap = min(cap, sizing.most_running)

    def requests(n: int) -> list[str]:
        return [
            "--max-running-requests",
            str(n),
            "--max-mamba-cache-size",
            str(MAMBA_SLOTS_PER_REQ * n),
        ]

    def running(width: int, state_bytes: int = 4) -> list[str]:
        # SGLang's per-node scratch: at most 16 requests whatever `cap` (more leave the KV
        # cache too little memory on one H200)
        most = min(16, sizing.most_running)
        return requests(max_requests(width, sizing.scratch_gib, state_bytes, most))

    def spec(path: Path) -> list[str]:
        return [
            "--speculative-draft-model-path",
            str(path),
            "--speculative-draft-load-format",
            "dummy",
            *sizing.draft_flags(),
        ]

    topk = ["--speculative-eagle-topk", str(SELECTOR["selector_top_k"])]
    dd = ["--speculative-algorithm", "DDTREE", *spec(draft), *topk]
    dflash = ["--speculative-algorithm", "DFLASH", *spec(draft)]
    dd2 = ["--speculative-algorithm", "DDTREE", *spec(dflash2_draft(draft)), *topk]
    out = {
        "none": ["--max-running-requests", str(cap)],
        "dflash": [*dflash, *running(16)],
        # the DFlash2 draft: SGLang's DFLASH walking its selector's chain, DDTREE's lattice tree
        "dflash_dflash2": [
            "--speculative-algorithm",
            "DFLASH",
            *spec(dflash2_draft(draft)),
            *running(16),
        ],
        "ddtree32_dflash2": [*dd2, "--speculative-num-draft-tokens", "32", *requests(cap)],
        "dflash_bf16ssm": [*dflash, *running(16, 2)],
        "nextn": [  # the draft: the target's own MTP layer
            "--speculative-algorithm",
            "NEXTN",
            *sizing.draft_flags(),
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-steps",
            "3",
            "--speculative-num-draft-tokens",
            "8",
            *running(8),
        ],
    }
    out["ddtree32_auto_dflash2"] = out["ddtree32_dflash2"]
    for n in (16, 32, 64, 128):
        width = [*dd, "--speculative-num-draft-tokens", str(n)]
        # the compact scratch (the default): SGLang's default 16 requests at every N
        out[f"ddtree{n}"] = out[f"ddtree{n}_auto"] = [
            *width,
            *requests(cap),
        ]
    return out


def flag_value(flags: list[str], name: str) -> str | None:
    """The value after `name` in a server's flags (None: not there)."""
    return flags[flags.index(name) + 1] if name in flags else None


def widths_rounds(server) -> dict[str, int] | None:
    """An automatic-width server's decode rounds per width since start-up (/server_info: the
    rank whose policy chooses for every rank reports them)."""
    status, info = harness.get(server.url + "/server_info")
    states = info.get("internal_states", []) if status == 200 else []
    counted = (s.get("ddtree", {}).get("widths_chosen") for s in states)
    return next((c for c in counted if c is not None), None)


def startup_timings(log: str) -> dict[str, float]:
    """SGLang's last "Engine startup timings (s): ..." line as {name: s} (the CUDA graph parts
    under their own names, e.g. target_verify, draft_decode); {} when the log has none."""
    lines = [x for x in log.splitlines() if "Engine startup timings (s):" in x]
    if not lines:
        return {}
    found = re.findall(r"(\w+)=([0-9.]+)", lines[-1].split("Engine startup timings (s):")[1])
    return {name: float(value) for name, value in found}


def effective_max_running(log: str) -> int | None:
    """The max_running_requests SGLang settled on (it can lower the flag to fit its pools)."""
    found = re.findall(r"max_running_requests=(\d+)", log)
    return int(found[-1]) if found else None


def write_configs(root: Path) -> tuple[Path, Path]:
    from sglang_ddtree.checkpoints.tiny import PREPROCESSOR_CONFIG, write_tokenizer

    target, draft = root / "qwen36-27b-dummy", root / "qwen36-27b-dflash-dummy"
    ids = write_tokenizer(target, VOCAB)
    draft.mkdir(parents=True, exist_ok=True)
    vision = dict(
        model_type="qwen3_5",
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=5120,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[],
        in_channels=3,
    )
    cfg = dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config={**QWEN36_TEXT, "eos_token_id": ids["<|im_end|>"]},
        vision_config=vision,
        tie_word_embeddings=False,
        dtype="bfloat16",
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    (target / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    dcfg = {**DRAFT, "dflash_config": {**DRAFT["dflash_config"], "mask_token_id": ids["<|MASK|>"]}}
    (draft / "config.json").write_text(json.dumps(dcfg, indent=1))
    d2 = dflash2_draft(draft)
    d2.mkdir(parents=True, exist_ok=True)
    d2cfg = {
        **dcfg,
        "architectures": ["DFlash2DraftModel"],
        "dflash_config": {**dcfg["dflash_config"], **SELECTOR},
    }
    (d2 / "config.json").write_text(json.dumps(d2cfg, indent=1))
    return target, draft


def dflash2_draft(draft: Path) -> Path:
    """The DFlash2-shaped draft write_configs writes beside `draft` (SELECTOR)."""
    return draft.with_name(draft.name + "-dflash2")


def wait_gpu_free(baseline: int, timeout: float = 120) -> float:
    """Until the GPU has 95% of `baseline` bytes free again (a stopped server's processes can
    hold their memory for seconds, and the next server sizes its pools from what is free);
    returns the free GiB."""
    t0 = time.time()
    while True:
        free = free_bytes()
        if free >= 0.95 * baseline or time.time() - t0 > timeout:
            return free / 2**30
        time.sleep(2)


def _decode_rounds(meta: dict) -> int:
    """Decode rounds after the prefill: verify passes (speculative), or new tokens past the
    first (plain decoding, where the prefill makes the first)."""
    return meta.get("spec_verify_ct") or meta["completion_tokens"] - 1


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x; None when every x is the same."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx if sxx > 0 else None


def measure(server, bs: int, tokens: int) -> dict:
    """One batch size's round cost: the slope of each request's latency against its decode
    rounds, over batches of `bs` requests of `tokens // 2` and `tokens` new tokens (each
    repeated until it holds at least 3 requests), after a warm-up at `tokens` (the graphs, and
    an automatic server's calibration of every width at this batch's graph bucket). What all
    requests share (the prefill, the client) falls in the intercept; a request's rounds are
    counted, not assumed, so acceptance (real or simulated) varying from request to request
    is what the slope runs over. A batch of 1-token requests gives prefill_ms and stays out of
    the fit (one such batch once took 900 ms at bs 16)."""
    timed_requests(server, bs, tokens)  # warm-up
    repeat = -(-3 // bs)
    runs = {
        n: [r for _ in range(repeat) for r in timed_requests(server, bs, n)]
        for n in (1, max(2, tokens // 2), tokens)
    }
    points = [(_decode_rounds(r["meta"]), r["latency"]) for n in runs if n > 1 for r in runs[n]]
    per_round = slope(points)
    full = runs[tokens]
    accept = [r["meta"].get("spec_accept_length", 1.0) for r in full]
    return {
        "bs": bs,
        "method": "slope",
        "round_ms": 1e3 * per_round if per_round and per_round > 0 else None,
        "requests": len(points),
        "tokens_per_s": bs * tokens / max(r["latency"] for r in full[-bs:]),
        "accept_len": statistics.mean(accept),
        "prefill_ms": 1e3 * statistics.median(r["latency"] for r in runs[1]),
    }


def long_prompts(server, lengths: list[int], vocab: int, tokens: int = 32) -> list[dict]:
    """Long prompts: per prompt length, one request alone and then 4 at once, greedy, whose
    token ids share their first three quarters (the radix cache serves it to the later ones).
    Per request: HTTP status, latency, cached prompt tokens, completion tokens, or the error;
    dummy weights, so the text is not compared."""
    import random

    rows = []
    for length in lengths:
        rnd = random.Random(length)
        shared = [rnd.randrange(10, vocab) for _ in range(length * 3 // 4)]

        def one(i, shared=shared, length=length, rnd_seed=length):
            tail = random.Random(rnd_seed * 100 + i)
            ids = shared + [tail.randrange(10, vocab) for _ in range(length - len(shared))]
            t0 = time.perf_counter()
            try:
                status, out = harness.post(
                    server.url + "/generate",
                    {
                        "input_ids": ids,
                        "sampling_params": {
                            "max_new_tokens": tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    },
                    timeout=180,
                )
            except OSError as exc:  # a timeout or a dropped connection: a result
                status, out = None, repr(exc)
            meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
            return {
                "status": status,
                "latency_s": round(time.perf_counter() - t0, 3),
                "cached_tokens": meta.get("cached_tokens"),
                "completion_tokens": meta.get("completion_tokens"),
                "error": None if status == 200 else str(out)[:300],
            }

        for bs in (1, 4):
            results = harness.run_all(one, list(range(bs)), bs)
            rows.append(
                {
                    "prompt_tokens": length,
                    "bs": bs,
                    "requests": results,
                    "served": all(
                        r["status"] == 200 and r["completion_tokens"] == tokens for r in results
                    ),
                }
            )
            print(json.dumps({"long_context": rows[-1]}), flush=True)
    return rows


def gdn_scratch_gb(log: str) -> float | None:
    """The GDN verify scratch the Mamba pool allocated: SGLang's per-node states, or (the
    `_compact` variants) state/gdn_pool.py's scratch and conv windows."""
    m = re.search(r"intermediate_ssm_state_cache size: ([0-9.]+)GB", log) or re.search(
        r"compact GDN verify scratch for \d+ requests x \d+ nodes: ([0-9.]+) GB", log
    )
    return float(m.group(1)) if m else None


def simulated(value: str) -> dict | None:
    """The world --simulate names, as its rows record it (None: no simulation); a bad value
    stops here, before any server starts."""
    from simworld.world import parse

    world = parse(value)
    return world.as_dict() if world else None


def loaded_weights_gb(log: str) -> list[float]:
    """The memory each model's weights took as SGLang logged it ("Load weight end. ... mem
    usage=X GB", GiB): the target's, then the draft's; the check on weights_gib."""
    return [float(x) for x in re.findall(r"Load weight end\..*?mem usage=([0-9.]+) GB", log)]


def plot(rows: list[dict], path: Path, card: str = "one H200") -> None:
    """ms per decode round against batch size, one line per variant."""
    series = {
        name: [(r["bs"], r["round_ms"]) for r in rows if r["variant"] == name]
        for name in dict.fromkeys(r["variant"] for r in rows)
    }
    harness.line_plot(
        series,
        path,
        xlabel="batch size",
        ylabel="ms per decode round",
        title=f"Qwen3.6-27B-shaped target (dummy weights), {card}",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/root/bench_round"))
    p.add_argument("--variants", default="none,dflash,nextn,ddtree16,ddtree32,ddtree64,ddtree128")
    p.add_argument("--batch", default="1,4,8,16")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--profile", default="ddtree64", help="variants to profile at bs 1 and 8")
    p.add_argument(
        "--graph-max-bs", type=int, help="--cuda-graph-max-bs-decode (default: max --batch)"
    )
    p.add_argument("--port-base", type=int, default=32000, help="variant i listens on base + i")
    p.add_argument(
        "--max-running",
        type=int,
        default=16,
        help="the most running requests a variant is started with (the Mamba pool sized for "
        "them; at most what the card holds, its sizing's most_running)",
    )
    p.add_argument(
        "--simulate",
        default="",
        help="a simulated world for every server "
        "(scripts/simworld, DDTREE_SIMULATE on the servers: e.g. narrative), so "
        "that drafts are accepted as a real drafter's would be",
    )
    round_serving.add_arguments(p)  # --serving and its --steady-state
    p.add_argument(
        "--long-context",
        default="",
        help="after each variant's rounds, prompts of "
        "these token counts alone and 4 at once (e.g. 16384,32768); the context "
        "length becomes the largest + 1024",
    )
    return round_serving.check_args(p.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [b for v in args.variants.split(",") if "@" in v for b in v.split("@")[1].split("+")]
    graph_bs = args.graph_max_bs or max(int(b) for b in [*args.batch.split(","), *sizes])
    args.out.mkdir(parents=True, exist_ok=True)
    sizing = size_for(*card_info())
    specs = args.variants.split(",")
    for kv in dict.fromkeys(kv_cache_dtype(spec.partition("@")[0]) for spec in specs):
        print(json.dumps({"sizing": dataclasses.asdict(sizing.with_kv_cache_dtype(kv))}))
    target, draft = write_configs(args.work)
    table = variants(draft, sizing, args.max_running)
    lengths = [int(n) for n in args.long_context.split(",") if n]
    common = list(COMMON)  # and each variant's sizing's flags
    if lengths:
        common[common.index("--context-length") + 1] = str(max(lengths) + 1024)
    baseline = free_bytes()  # free before any server (others may share the GPU)
    rows = []
    world = simulated(args.simulate)
    dataset = round_serving.write_prompts(args)  # None: no --serving
    context = int(common[common.index("--context-length") + 1])

    release = installed_version("sglang")

    def emit(row: dict, kind: str = "round_cost_27b") -> None:
        card = sizing.with_kv_cache_dtype(kv_cache_dtype(row["variant"])).row()
        row = {**row, **card, "sglang": release, **({"simulate": world} if world else {})}
        if kind == "round_cost_27b":
            rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out / f"{kind}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    for i, spec in enumerate(specs):
        # NAME@B+B: that variant at those batch sizes only
        name, _, only = spec.partition("@")
        batches = [int(b) for b in (only.split("+") if only else args.batch.split(","))]
        max_req = int(flag_value(table[name], "--max-running-requests"))
        own = sizing.with_kv_cache_dtype(kv_cache_dtype(name))  # this variant's KV cache
        if max_req == 0:  # not one request's verify scratch fits the card's budget: no server
            for bs in batches:
                emit(
                    {
                        "variant": name,
                        "bs": bs,
                        "max_running": 0,
                        "error": "does not fit: one request's verify scratch exceeds the "
                        f"{own.scratch_gib} GiB budget of this card",
                    }
                )
            continue
        extra = [*common, *own.flags(), "--cuda-graph-max-bs-decode", str(graph_bs), *table[name]]
        env = variant_env(name)
        env = simworld.server_env(env, args.simulate) if world else env
        server = harness.Server(
            name, str(target), args.port_base + i, extra, env=env, log_dir=args.out
        )
        print(json.dumps({"variant": name, "gpu_free_gib": round(wait_gpu_free(baseline), 1)}))
        server.start()
        try:
            healthy_s = server.wait_healthy(timeout=900)  # from launch
            log = server.log_text()
            startup = {"healthy_s": round(healthy_s, 1), **startup_timings(log)}
            scratch, weights = gdn_scratch_gb(log), loaded_weights_gb(log)
            max_req = min(max_req, effective_max_running(log) or max_req)
            for bs in batches:
                if bs > max_req:  # what does not fit is a row too
                    emit(
                        {
                            "variant": name,
                            "bs": bs,
                            "max_running": max_req,
                            "error": f"does not fit: at most {max_req} running requests",
                        }
                    )
                    continue
                row = {
                    "variant": name,
                    "gdn_scratch_gb": scratch,
                    "weights_gb": weights,
                    "max_running": max_req,
                    "startup": startup,
                    **measure(server, bs, args.tokens),
                }
                if name in args.profile.split(",") and bs in (1, 8):
                    row["profile"] = profile_parts(server, bs, args.work)
                if "_auto" in name:
                    row["width_table"] = width_table(server.log_text())
                emit(row)
            serving = not args.serving_variants or name in args.serving_variants.split(",")
            cells = round_serving.cells if serving and dataset else lambda *a: ()
            for row in cells(server, dataset, str(target), args, max_req, context):
                row.update(variant=name, max_running=max_req)
                if "_auto" in name and row.get("kind") != "spread":
                    row["widths_rounds"] = widths_rounds(server)  # rounds per width so far
                emit(row, "serving_simulated_27b")
            if lengths:
                long_context = long_prompts(server, lengths, VOCAB)
                emit({"variant": name, "max_running": max_req, "long_context": long_context})
        except Exception as exc:  # a variant that does not fit is a result, not a crash
            emit({"variant": name, "max_running": max_req, "error": str(exc)[-500:]})
        finally:
            server.stop()
    ok = [r for r in rows if r.get("round_ms") is not None]
    print(f"\n{'variant':<10} {'bs':>3} {'ms/round':>9} {'tok/s':>8} {'accept':>7} {'GDN GB':>7}")
    for r in ok:
        print(
            f"{r['variant']:<10} {r['bs']:>3} {r['round_ms']:>9.2f} {r['tokens_per_s']:>8.1f} "
            f"{r['accept_len']:>7.2f} {r['gdn_scratch_gb'] or 0:>7.2f}"
        )
    if ok:
        plot(ok, args.out / "bench_round.png", f"one {sizing.card} ({sizing.target_dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
