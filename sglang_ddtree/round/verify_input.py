"""DDTree's verify input: SGLang's EAGLE tree-verify input carrying an N-node DDTree.

Subclassing `EagleVerifyInput` routes the verify through SGLang's generic tree machinery:
FlashInfer's custom-mask prefill, the Gated DeltaNet tree kernels (retrieve_next_token /
retrieve_next_sibling), greedy and target-only tree sampling, KV compaction and the tree-aware
Mamba state commit. `spec_steps = B - 1` makes `max_tree_depth` (the accept-path width) B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.eagle_info import EagleVerifyInput

from sglang_ddtree.adapter import compat
from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.tree import verify_layout as tree_layout


class StagedAttnArgs(NamedTuple):
    """What the host plan (verify_plan.call_begin_forward) stages for its one call's
    `generate_attn_arg_prefill`: the device KV lengths [bs] and offsets [bs + 1] it copied, the
    host qo offsets its wrapper plans with, and the KV indices' host-known length."""

    kv_lens: torch.Tensor
    kv_indptr: torch.Tensor
    qo_indptr: torch.Tensor
    total_kv: int


@dataclass
class DDTreeVerifyInput(EagleVerifyInput):
    """An EagleVerifyInput whose tree is an arbitrary DDTree (best-first, parent < child), with
    the tree itself for the per-node penalties (round/penalties.py): its tokens [bs, N],
    visibility [bs, N, N] and depth [bs, N] (None in shape-only stand-ins)."""

    tree_tokens: torch.Tensor | None = None
    tree_visibility: torch.Tensor | None = None
    tree_depth: torch.Tensor | None = None
    # False: custom_mask is an empty stand-in, neither allocated nor written (the host plan
    # packs the mask from the tree; verify_plan.write_mask allocates tree_mask_size bools and
    # writes them where SGLang's plan runs instead); the committed lengths
    tree_mask_written: bool = True
    tree_mask_size: int = 0
    tree_seq_lens: torch.Tensor | None = None
    # set by the host plan (verify_plan.call_begin_forward) for the plan's one call
    staged_attn_args: StagedAttnArgs | None = None

    def generate_attn_arg_prefill(
        self,
        *,
        req_pool_indices,
        paged_kernel_lens,
        paged_kernel_lens_sum,
        translator,
        plan,
        **kwargs,
    ):
        """SGLang's (kv_indices, kv_indptr, qo_indptr, custom_mask) for the FlashInfer plan. With
        the host plan's lengths staged, the KV indices are written from them by the round's
        KV translator (SGLang's own read, one launch); SGLang derives the offsets on the device
        first (five more launches a round). The qo offsets are the host plan's (its wrapper
        plans with those)."""
        staged = getattr(self, "staged_attn_args", None)
        bs, N = len(req_pool_indices), int(self.draft_token_num)
        size = paged_kernel_lens_sum + N * bs  # SGLang's KV indices' length
        # the staged lengths fit it (SGLang's sum is the host lengths'), and the mask its size
        short = self.tree_mask_written and self.custom_mask.numel() < size * N  # unpacked only
        if staged is None or len(staged.kv_lens) != bs or staged.total_kv > size or short:
            return super().generate_attn_arg_prefill(
                req_pool_indices=req_pool_indices,
                paged_kernel_lens=paged_kernel_lens,
                paged_kernel_lens_sum=paged_kernel_lens_sum,
                translator=translator,
                plan=plan,
                **kwargs,
            )
        kv_indices = torch.empty(size, dtype=torch.int32, device=req_pool_indices.device)
        compat.pack_kv_reads(
            translator,
            plan,
            req_pool_indices,
            staged.kv_lens,
            staged.kv_indptr,
            kv_indices,
            paged_kernel_lens_sum,
            **kwargs,
        )
        return kv_indices, staged.kv_indptr, staged.qo_indptr, self.custom_mask


def make_verify_input(
    cfg: DDTreeConfig,
    tokens: torch.Tensor,  # [bs, N] int64, node 0 = root
    depth: torch.Tensor,  # [bs, N] int64
    first_child: torch.Tensor,  # [bs, N] int64
    next_sibling: torch.Tensor,  # [bs, N] int64
    visibility: torch.Tensor,  # [bs, N, N] bool
    seq_lens: torch.Tensor,  # [bs] committed lengths (device)
    seq_lens_sum: int,  # host upper bound of seq_lens.sum(), sizes the mask only
    write_mask: bool = True,  # False: the host plan packs the mask from the tree itself
) -> DDTreeVerifyInput:
    bs, N = tokens.shape
    size = tree_layout.full_mask_size(N, bs, seq_lens_sum)
    # the packer reads the tree, not this mask: one mask-sized buffer a round (the packed one)
    mask = torch.empty(size if write_mask else 0, dtype=torch.bool, device=tokens.device)
    if write_mask:
        tree_layout.write_full_mask(visibility, seq_lens, mask)
    return _verify_input(
        cfg,
        N,
        mask,
        tree_tokens=tokens,
        tree_visibility=visibility,
        tree_depth=depth,
        tree_mask_written=write_mask,
        tree_mask_size=size,
        tree_seq_lens=seq_lens,
        draft_token=tokens.reshape(-1),
        positions=tree_layout.node_positions(depth, seq_lens),
        retrieve_index=tree_layout.retrieve_index(bs, N, tokens.device),
        retrieve_next_token=first_child,
        retrieve_next_sibling=next_sibling,
    )


def make_dummy_verify_input(
    cfg: DDTreeConfig, custom_mask: torch.Tensor, num_tokens_per_req: int
) -> DDTreeVerifyInput:
    """Shape-only stand-in for graph capture and warm-up runs of the target (no tree links)."""
    return _verify_input(cfg, num_tokens_per_req, custom_mask)


def _verify_input(cfg: DDTreeConfig, num_nodes: int, custom_mask, **tree) -> DDTreeVerifyInput:
    fields = dict(
        draft_token=None,
        positions=None,
        retrieve_index=None,
        retrieve_next_token=None,
        retrieve_next_sibling=None,
    )
    fields.update(tree)
    return DDTreeVerifyInput(
        custom_mask=custom_mask,
        retrieve_cum_len=None,
        spec_steps=cfg.max_depth,
        topk=cfg.topk,
        draft_token_num=num_nodes,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=None,
        seq_lens_cpu=None,
        **fields,
    )
