"""How large a tree the reference engine can verify on this machine, from the two configs alone
(the CLI checks --budget before loading anything).

A verify of N nodes keeps, for every Gated DeltaNet layer, each node's recurrent state
[Hv, Dk, Dv] and conv window (float32, until the commit), the nodes' logits [N, V], a few
hidden-state copies per layer, and, one attention layer at a time, the [heads, N, N + P]
scores: bytes(N) = lin * N + quad * N^2 (the prompt's share is small beside it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from sglang_ddtree.tree import tree_capacity

FLOAT = 4  # the engine's float32
SHARE = 0.5  # of the free memory a verify may take (the models and the cache hold the rest)
DEFAULT_BLOCK = 16  # reference/dflash.py's DEFAULT_BLOCK_SIZE (SGLang's default)


def _text_config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("text_config", cfg)


def verify_bytes(target_cfg: dict) -> tuple[int, int]:
    """(lin, quad): a verify of N nodes takes about lin * N + quad * N^2 bytes."""
    layers = int(target_cfg["num_hidden_layers"])
    kinds = target_cfg.get("layer_types") or ["full_attention"] * layers
    gdn = sum(kind == "linear_attention" for kind in kinds)
    hidden, vocab = int(target_cfg["hidden_size"]), int(target_cfg["vocab_size"])
    per_gdn = 0
    if gdn:
        hv = int(target_cfg["linear_num_value_heads"])
        dk, dv = int(target_cfg["linear_key_head_dim"]), int(target_cfg["linear_value_head_dim"])
        conv = 2 * int(target_cfg["linear_num_key_heads"]) * dk + hv * dv
        per_gdn = hv * dk * dv + conv * int(target_cfg.get("linear_conv_kernel_dim", 4))
    mlp = int(target_cfg.get("intermediate_size", 4 * hidden))
    lin = FLOAT * (gdn * per_gdn + vocab + layers * (4 * hidden + mlp))
    quad = FLOAT * int(target_cfg["num_attention_heads"]) + 1  # scores + the bool mask
    return lin, quad


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_budget(
    target: Path,
    draft: Path,
    topk: int,
    device: str = "cpu",
    available: int | None = None,
    block_size: int | None = None,
) -> tuple[int, str] | None:
    """(the largest --budget, why): the tree's capacity at the draft's block size (block_size,
    else the draft config's) and topk, or the nodes SHARE of the free memory holds, whichever is
    smaller. None when topk < 1 or the draft's block is < 2 (the engine's own checks name
    those)."""
    block = block_size
    if block is None:
        draft_cfg = json.loads((draft / "config.json").read_text())
        block = int(draft_cfg.get("block_size") or DEFAULT_BLOCK)
    if topk < 1 or block < 2:
        return None
    capacity = tree_capacity(topk, block - 1)
    lin, quad = verify_bytes(_text_config(target))
    room = SHARE * (free_bytes(device) if available is None else available)
    nodes = int((-lin + math.sqrt(lin * lin + 4 * quad * room)) / (2 * quad))  # N, root included
    if nodes - 1 < capacity:
        return max(nodes - 1, 0), (
            f"a verify of N nodes takes ~{lin / 2**20:.2f} MiB x N + "
            f"{quad} B x N^2 here, and {room / 2**30:.1f} GiB is half the "
            "free memory"
        )
    return capacity, f"what top-k {topk} fills in the draft's {block - 1} positions"
