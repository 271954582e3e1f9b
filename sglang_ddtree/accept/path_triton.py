"""The Triton kernels of round/accept_path.py (the hooks, which import this module only
when a DDTREE round first needs it): SGLang's values of its generic tree code, in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _finalize_kernel(
    accept_index,
    accept_lens,
    out_cache_loc,
    predict,
    predict_out,
    kv_dst,
    kv_src,
    rows,
    stride,
    S,
    N,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    n = tl.load(accept_lens + b)
    on_path = j < S
    node = tl.load(accept_index + b.to(tl.int64) * stride + j, mask=on_path, other=-1)
    safe = tl.maximum(node, 0).to(tl.int64)  # SGLang's clamp: past the path, node 0 (unread)
    own = b.to(tl.int64) * N + j
    # the predictions: the path's at the front, the rest of the block as it was
    in_block = j < N
    took = tl.load(predict + tl.where(on_path, safe, own), mask=in_block)
    tl.store(predict_out + own, took, mask=in_block)
    tl.store(rows + b * S + j, safe, mask=on_path)
    # KV: step j's slot (the block's j-th, req_to_token[seq_len + j]) <- its node's slot
    moved = on_path & (j < n) & (node >= 0)
    dst = tl.load(out_cache_loc + own, mask=moved, other=0)
    src = tl.load(out_cache_loc + safe, mask=moved, other=0)
    tl.store(kv_dst + b * S + j, dst, mask=on_path)
    tl.store(kv_src + b * S + j, src, mask=on_path)


def compact_path(
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    predict: torch.Tensor,
    num_nodes: int,
):
    """(predict compacted, kv_dst, kv_src, rows): predict [bs x N] with each request's path moved
    to its front (SGLang's _compact_accept_to_front); the KV slot pairs [bs x S] (slot 0 to slot
    0 past a path: the pool's padding slot, a no-op); rows [bs x S] the path's node ids (clamped
    as SGLang's), for the hidden states' gather. out_cache_loc [bs x N]: the verify's slots, which
    eagle_prepare_for_verify takes from req_to_token[req, seq_len : seq_len + N]; so step j's slot
    out_cache_loc[b x N + j] is the req_to_token[req, seq_len + j] SGLang's move reads."""
    bs, S = accept_index.shape
    N = num_nodes
    if predict.numel() != bs * N or out_cache_loc.numel() < bs * N:
        raise ValueError(
            f"a verify of {bs} x {N} nodes got {predict.numel()} predictions and "
            f"{out_cache_loc.numel()} KV slots"
        )
    dev = accept_index.device
    predict_out = torch.empty_like(predict)
    kv_dst = torch.empty(bs * S, dtype=torch.int64, device=dev)
    kv_src = torch.empty_like(kv_dst)
    rows = torch.empty_like(kv_dst)
    if bs > 0:
        _finalize_kernel[(bs,)](
            accept_index,
            accept_lens,
            out_cache_loc,
            predict,
            predict_out,
            kv_dst,
            kv_src,
            rows,
            accept_index.stride(0),
            S,
            N,
            BLOCK=triton.next_power_of_2(max(N, S)),
        )
    return predict_out, kv_dst, kv_src, rows
