"""The tree verify's custom mask packed for FlashInfer in one Triton launch straight from the
tree, for the host plan (round/verify_plan.py). With it the verify input does not write
the unpacked mask at all, unless the plan falls back to SGLang's for a call it cannot take,
which then gets it written.

Same bytes as `pack_at_bit_offsets` of the written mask: request b's mask bits packed
little-endian from byte starts[b] (the plan's bit offset, which FlashInfer's kernel adds
to its byte pointer), every other byte zero. `pack_at_bit_offsets` is its torch reference
(about 110 small torch operations a round, each a host launch; on the host-bound shipped pair
the profiler put that packing at 1.8 ms of a 13.9 ms DDTREE round).
Here one program packs BLOCK bytes of one request: grid (requests, blocks of the longest
request).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512  # packed bytes per program


@triton.jit
def _tree_pack_kernel(
    vis, starts, out, bs_tree, N, stride_b, stride_i, stride_j, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    start = tl.load(starts + b).to(tl.int64)
    bits = tl.load(starts + b + 1).to(tl.int64) - start
    row = tl.maximum(bits // N, 1)  # S + N: the committed prefix, then the tree's N nodes
    prefix = row - N
    byte_at = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    packed = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(8):
        bit_at = byte_at * 8 + k
        inside = bit_at < bits
        node = bit_at // row
        col = bit_at - node * row - prefix  # the tree column (negative: the prefix)
        in_tree = inside & (col >= 0) & (b < bs_tree)
        seen = tl.load(
            vis + b * stride_b + node * stride_i + col * stride_j, mask=in_tree, other=0
        ).to(tl.int32)
        bit = tl.where(in_tree, seen & 1, inside.to(tl.int32))
        packed |= bit << k
    tl.store(out + start + byte_at, packed.to(tl.uint8), mask=byte_at * 8 < bits)


def pack_tree_mask(
    visibility: torch.Tensor, starts: torch.Tensor, total_bits: int, max_request_bits: int
) -> torch.Tensor:
    """The bytes verify_plan.pack_at_bit_offsets gives for the FULL_MASK
    tree_layout.write_full_mask writes, straight from the tree: visibility [bs_tree, N, N] bool (any strides: a truncated
    tree's is a view), starts [bs + 1] int32, bs >= bs_tree (requests past bs_tree, a CUDA
    graph's padding, see everything, as SGLang pads the unpacked mask with True). Request b's
    row i: its S_b committed tokens visible, then visibility[b, i]; S_b from the plan's bits
    (N x (S_b + N)). Sync-free."""
    out = torch.zeros(total_bits, dtype=torch.uint8, device=visibility.device)
    bs, (bs_tree, N, _) = starts.numel() - 1, visibility.shape
    if bs_tree > bs:
        raise ValueError(f"the plan covers {bs} requests, the tree {bs_tree}")
    blocks = triton.cdiv(triton.cdiv(max_request_bits, 8), BLOCK)
    if bs > 0 and blocks > 0:
        vis = visibility.view(torch.uint8)
        _tree_pack_kernel[(bs, blocks)](vis, starts, out, bs_tree, N, *vis.stride(), BLOCK=BLOCK)
    return out
