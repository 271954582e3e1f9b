"""Sizes and hyperparameters of the trained pair: the H200 recipe and the CPU toy recipe.

The H200 sizes are chosen so target + draft + tokenizer fit in SIZE_LIMIT_BYTES as bf16
safetensors (checked before training from parameter counts and after saving from file sizes):

  target  Qwen3_5ForConditionalGeneration, hidden 256, 8 layers (3 Gated DeltaNet + 1 gated
          attention, twice), MLP 512, attention 2 q / 1 kv heads x 128, GDN 1 key / 2 value
          heads x 128, vocab 8192, tiny vision tower: 9.73M params = 18.56 MiB
  draft   DFlash, 3 Qwen3 layers, hidden 256, 4 q / 2 kv heads x 64, MLP 512, taps [1, 3, 5],
          block 16: 1.97M params = 3.76 MiB
  tokenizer files: about 0.5 MiB
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sglang_ddtree.training.corpus import CorpusLimits

SIZE_LIMIT_BYTES = 24 * 2**20  # target + draft + tokenizer, bf16 safetensors


@dataclass(frozen=True)
class TargetShape:
    hidden: int
    layers: int  # a multiple of 4: (3 GDN + 1 attention) per group, as Qwen3.5 / 3.6
    intermediate: int
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_head_dim: int
    mrope_section: tuple[int, int, int]  # sums to attn_head_dim * 0.25 / 2
    max_positions: int = 4096


@dataclass(frozen=True)
class DraftShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int = 16
    taps: tuple[int, ...] | None = None  # None: SGLang's default spread over [1, L-3]


@dataclass(frozen=True)
class StageHParams:
    seq_len: int
    batch: int
    lr: float
    warmup_steps: int
    steps: int | None = None  # None: planned from the time budget (see loops.plan_steps)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    log_every: int = 10
    round_steps_to: int = 50  # planned step counts are rounded down to a multiple of this
    anchors_per_seq: int = 0  # draft only: blocks per sequence
    gamma: float = 7.0  # draft only: loss weight exp(-(i-1)/gamma) for block position i


@dataclass(frozen=True)
class Recipe:
    name: str
    vocab_size: int
    target: TargetShape
    draft: DraftShape
    target_train: StageHParams
    draft_train: StageHParams
    corpus: CorpusLimits
    tokenizer_train_bytes: int
    chat_fraction: float = 0.25
    eval_windows: int = 128  # held-out windows (of target_train.seq_len) for the loss
    accept_windows: int = 64  # held-out windows for the acceptance proxy
    accept_anchors: int = 8  # blocks per acceptance window
    target_share: float = 0.6  # share of the training budget given to the target
    eval_batch: int = 32
    init_std: float = 0.02
    size_limit_bytes: int = SIZE_LIMIT_BYTES
    notes: dict = field(default_factory=dict)


def h200_recipe() -> Recipe:
    return Recipe(
        name="h200",
        vocab_size=8192,
        target=TargetShape(
            hidden=256,
            layers=8,
            intermediate=512,
            attn_heads=2,
            attn_kv_heads=1,
            attn_head_dim=128,
            gdn_key_heads=1,
            gdn_value_heads=2,
            gdn_head_dim=128,
            mrope_section=(6, 5, 5),
        ),
        draft=DraftShape(layers=3, heads=4, kv_heads=2, head_dim=64, intermediate=512),
        # Batches: autograd saves ~390 MiB per 1024-token target sequence (fp32, measured on
        # CPU) and ~72 MiB per draft sequence of 32 blocks, so 96 / 64 sequences stay far below
        # the H200's memory; the torch GDN fallback is launch-bound, so bigger batches are cheap.
        target_train=StageHParams(seq_len=1024, batch=96, lr=3e-3, warmup_steps=100),
        draft_train=StageHParams(
            seq_len=1024, batch=64, lr=3e-3, warmup_steps=100, anchors_per_seq=32
        ),
        corpus=CorpusLimits(max_train_bytes=256 * 2**20, max_heldout_bytes=2 * 2**20),
        tokenizer_train_bytes=32 * 2**20,
    )


def toy_recipe() -> Recipe:
    """Tiny sizes and fixed step counts: a CPU run of well under a minute, deterministic."""
    return Recipe(
        name="toy",
        vocab_size=512,
        target=TargetShape(
            hidden=64,
            layers=4,
            intermediate=128,
            attn_heads=2,
            attn_kv_heads=1,
            attn_head_dim=32,
            gdn_key_heads=1,
            gdn_value_heads=2,
            gdn_head_dim=32,
            mrope_section=(2, 1, 1),
        ),
        draft=DraftShape(layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=128, taps=(1, 2)),
        target_train=StageHParams(
            seq_len=64, batch=8, lr=3e-3, warmup_steps=4, steps=40, log_every=5
        ),
        draft_train=StageHParams(
            seq_len=64, batch=8, lr=3e-3, warmup_steps=4, steps=40, log_every=5, anchors_per_seq=8
        ),
        corpus=CorpusLimits(max_train_bytes=300_000, max_heldout_bytes=60_000),
        tokenizer_train_bytes=300_000,
        eval_windows=8,
        accept_windows=8,
        accept_anchors=4,
        eval_batch=8,
    )


def with_steps(recipe: Recipe, target_steps: int | None, draft_steps: int | None) -> Recipe:
    """The recipe with explicit step counts (None keeps the recipe's)."""
    tt, dt = recipe.target_train, recipe.draft_train
    if target_steps is not None:
        tt = replace(tt, steps=target_steps)
    if draft_steps is not None:
        dt = replace(dt, steps=draft_steps)
    return replace(recipe, target_train=tt, draft_train=dt)


@dataclass(frozen=True)
class SelectorRecipe:
    """The DFlash2 drafter's candidate selector (training/selector.py), trained on a pair."""

    name: str
    rank: int  # r: the codebooks' and the hidden projection's width
    top_k: int  # K: candidates per slot (DDTREE's --speculative-eagle-topk default)
    train: StageHParams
    nodes: tuple[int, ...] = (16, 32, 64)  # the offline table's tree sizes, root included


def h200_selector() -> SelectorRecipe:
    """The draft stage's batches and schedule; 2 x 8192 x 32 + 32 x 256 parameters (1 MiB bf16)."""
    return SelectorRecipe(name="h200", rank=32, top_k=8, train=h200_recipe().draft_train)


def toy_selector() -> SelectorRecipe:
    hp = replace(toy_recipe().draft_train, steps=30)
    return SelectorRecipe(name="toy", rank=8, top_k=8, train=hp, nodes=(16, 32))
