"""Host-side checks and constants shared by the tree builders and walkers.

Every check here reads only shapes, dtypes, devices and Python ints, never tensor contents, so
it costs no device synchronisation and may run before CUDA-graph replay.
"""

from __future__ import annotations

import torch

from .types import DraftTree

# Log-probs are clamped to [LOGPROB_FLOOR, 0] (NaN and -inf become the floor) so every valid
# score is finite: L * LOGPROB_FLOOR stays far inside float32 range for any block size.
LOGPROB_FLOOR = -1.0e4

# tree_capacity saturates here instead of growing a huge Python int (K**L for K=32, L=63).
CAPACITY_CAP = 1 << 62


MAX_TOPK = 64  # the Triton tree builder's packed keys hold candidate ranks < 2**8


def tree_capacity(K: int, L: int) -> int:
    """Number of non-root prefixes sum_{d=1..L} K**d, saturating at CAPACITY_CAP."""
    total, level = 0, 1
    for _ in range(max(L, 0)):
        level = min(level * K, CAPACITY_CAP)
        total = min(total + level, CAPACITY_CAP)
    return total


def beam_widths(K: int, L: int, budget: int) -> list[int]:
    """Static beam width per depth 1..L: min(budget, K**d), enough to hold every selected node."""
    widths, level = [], 1
    for _ in range(L):
        level = min(level * K, budget)
        widths.append(level)
    return widths


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {t.dtype}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must share one device, got {devices}")


def check_build_inputs(
    root: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, budget: int
) -> tuple[int, int, int]:
    """Validate builder inputs; return (bs, L, K). Raises ValueError naming the bad values."""
    _check_tensor("root", root, 1, (torch.int64,))
    _check_tensor("topk_ids", topk_ids, 3, (torch.int64,))
    _check_tensor("topk_logprobs", topk_logprobs, 3, (torch.float32,))
    _check_same_device(root=root, topk_ids=topk_ids, topk_logprobs=topk_logprobs)
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_logprobs "
            f"{tuple(topk_logprobs.shape)} must have the same shape [bs, L, K]"
        )
    bs, L, K = topk_ids.shape
    if root.shape[0] != bs:
        raise ValueError(f"root has {root.shape[0]} entries but topk_ids has bs={bs}")
    if L < 1 or K < 1:
        raise ValueError(f"need L >= 1 draft positions and K >= 1 candidates, got L={L}, K={K}")
    if not _is_int(budget) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    capacity = tree_capacity(K, L)
    if budget > capacity:
        raise ValueError(
            f"budget={budget} exceeds the {capacity} prefixes available with K={K}, L={L}; "
            f"lower the budget or raise K"
        )
    return bs, L, K


def check_tree(tree: DraftTree) -> tuple[int, int]:
    """Validate a DraftTree's field shapes and dtypes; return (bs, N)."""
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree must be a DraftTree, got {type(tree).__name__}")
    _check_tensor("tree.tokens", tree.tokens, 2, (torch.int64,))
    bs, N = tree.tokens.shape
    for name in ("parents", "depth", "first_child", "next_sibling"):
        t = getattr(tree, name)
        _check_tensor(f"tree.{name}", t, 2, (torch.int64,))
        if tuple(t.shape) != (bs, N):
            raise ValueError(f"tree.{name} has shape {tuple(t.shape)}, expected {(bs, N)}")
    _check_tensor("tree.visibility", tree.visibility, 3, (torch.bool,))
    if tuple(tree.visibility.shape) != (bs, N, N):
        raise ValueError(
            f"tree.visibility has shape {tuple(tree.visibility.shape)}, expected {(bs, N, N)}"
        )
    return bs, N


def check_accept_inputs(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> None:
    """Validate accept-walk inputs (shapes, dtypes, max_depth) without reading contents."""
    bs, N = check_tree(tree)
    _check_tensor("target_tokens", target_tokens, 2, (torch.int64,))
    if tuple(target_tokens.shape) != (bs, N):
        raise ValueError(
            f"target_tokens has shape {tuple(target_tokens.shape)}, expected {(bs, N)} "
            f"(one target token per tree node)"
        )
    _check_same_device(tokens=tree.tokens, target_tokens=target_tokens)
    if not _is_int(max_depth) or max_depth < 1:
        raise ValueError(f"max_depth must be an int >= 1 (the draft length L), got {max_depth!r}")
