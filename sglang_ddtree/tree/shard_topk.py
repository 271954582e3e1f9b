"""The draft head's top-K log-probs under a vocabulary-sharded LM head (the tensor-parallel
wiring waits for a multi-GPU machine).

With tensor parallelism each rank holds a slice of the vocabulary's logits. Every rank must
build the same tree, so every rank must get the same global top-K: each rank reduces its slice to
its own top-K (global token ids) and the two numbers of its log-sum-exp, the ranks all-gather
those small tensors (in rank order), and each rank merges them identically (`merge_topk`):

- the global log-sum-exp from the per-shard maxima and sums, log-probs = logits - it;
- the global top-K by log-prob, ties to the lower token id (`topk_lower_id_first`). The
  single-rank builder's torch.topk orders exact ties as the device does; the sharded path fixes
  one order, so that it cannot depend on how the vocabulary was split.

The merge reads only the gathered tensors, so ranks that gathered the same bytes compute the same
bytes: the tree build after it is identical on every rank with no host sync.
"""

from __future__ import annotations

import torch


def shard_topk(logits: torch.Tensor, k: int, offset: int) -> tuple[torch.Tensor, ...]:
    """One rank's part: logits [..., Vs] float (its vocabulary slice, global ids offset +
    0..Vs-1) -> (values [..., k] (logits), ids [..., k] int64 global, max [...], sum of
    exp(logits - max) [...]). k may exceed Vs (the slice's values are padded with -inf)."""
    x = logits.float()
    top = min(k, x.shape[-1])
    values, ids = topk_lower_id_first(x, top)
    if top < k:
        pad = (*x.shape[:-1], k - top)
        values = torch.cat([values, values.new_full(pad, float("-inf"))], -1)
        ids = torch.cat([ids, ids.new_full(pad, -1)], -1)
    peak = x.amax(-1)
    return (
        values,
        torch.where(ids >= 0, ids + offset, ids),
        peak,
        (x - peak[..., None]).exp().sum(-1),
    )


def merge_topk(
    values: torch.Tensor, ids: torch.Tensor, peaks: torch.Tensor, sums: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' gathered parts (values, ids [R, ..., k'], peaks, sums [R, ...]) -> the global
    (ids [..., k] int64, log-probs [..., k] float32), largest first, ties to the lower id."""
    peak = peaks.amax(0)
    lse = peak + (sums * (peaks - peak).exp()).sum(0).log()
    flat_v = values.movedim(0, -2).flatten(-2)  # [..., R * k']
    flat_i = ids.movedim(0, -2).flatten(-2)
    top_v, top_i = _by_value_then_id(flat_v, flat_i, k)
    return top_i, top_v - lse[..., None]


def topk_lower_id_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dimension with ties broken to the lower index, deterministically
    on every device: (values, indices) [..., k], largest first."""
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return _by_value_then_id(x, ids, k)


def _by_value_then_id(values: torch.Tensor, ids: torch.Tensor, k: int):
    """The k largest of values (ties: the lower id), as (values, ids)."""
    order = torch.argsort(ids, dim=-1, stable=True)  # ascending ids first ...
    v, i = values.gather(-1, order), ids.gather(-1, order)
    rank = torch.argsort(v, dim=-1, descending=True, stable=True)[..., :k]  # ... kept among ties
    return v.gather(-1, rank), i.gather(-1, rank)
