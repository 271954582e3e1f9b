"""A host-sync-free FlashInfer plan for DDTREE's tree verify.

SGLang plans the verify's masked prefill (`FlashInferIndicesUpdaterPrefill.call_begin_forward`
-> `BatchPrefillWithPagedKVCacheWrapper.plan`) from an unpacked bool mask, which it packs on
the device. DDTREE knows every length the plan needs on the host: qo_indptr from (bs, N), the
KV lengths from the host copy of the committed lengths plus N, last-page lengths of one (page
size 1). Around call_begin_forward, for a DDTREE verify with host lengths, the wrapper's plan is
called with those host tensors and a mask packed on the device straight from the tree
(tree/mask_pack.py), so the unpacked mask is never written. At Qwen3.6-27B shapes on one H100
this round is 2-10% faster than the same round under SGLang's own plan (docs/results.md, "Round
cost at 27B"); FlashInfer attends bit-equally with both (tests/unit/test_verify_plan.py). A call
this plan cannot take (no host lengths, a CUDA-graph mask buffer too small for the bit-offset
layout) gets SGLang's plan, with the unpacked mask written first (`write_mask`).

The packed layout: plan() derives the mask offsets itself from the indptrs, in bits
(`_compute_page_mask_indptr`: qo_len x kv_len per request), and the kernel adds them to its
byte pointer (`maybe_custom_mask + maybe_mask_indptr[b]`, attention/variants.cuh). So request
b's bits are packed little-endian from byte offset = the number of mask bits before it: the
buffer is as long in bytes as the unpacked mask is in bools (SGLang's graph buffer is sized for
that), and each request reads its own bytes (`pack_at_bit_offsets`).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from sglang_ddtree.adapter import compat


@dataclasses.dataclass(frozen=True)
class HostPlan:
    qo_indptr: torch.Tensor  # [bs + 1] int32, host
    lengths: torch.Tensor  # [3 bs + 2] int32, host: kv_lens, kv_indptr, mask_starts (one copy)
    last_page_len: torch.Tensor  # [bs] int32, host
    total_bits: int
    packed_bytes: int  # sum over requests of ceil(bits / 8)
    max_request_bits: int  # the longest request's mask bits
    total_kv: int  # sum over requests of S + N: the KV indices' length

    @property
    def kv_indptr(self) -> torch.Tensor:
        return _split(self.lengths)[1]

    @property
    def mask_starts(self) -> torch.Tensor:
        return _split(self.lengths)[2]


def host_plan(seq_lens_cpu: torch.Tensor, num_nodes: int) -> HostPlan:
    """The verify's FlashInfer layout from the committed lengths on the host: N query rows per
    request; S + N keys (EagleVerifyInput.generate_attn_arg_prefill's); page size 1. The sums
    in Python integers (a host tensor's values, no device): four tensors made, where torch ops
    on the lengths took about fifteen host calls a round."""
    N = num_nodes
    kv = [s + N for s in seq_lens_cpu.tolist()]  # host memory
    bits = [N * k for k in kv]
    bs = len(kv)
    if sum(bits) >= 1 << 31:  # round_memory.check bounds this at start-up: a bug if reached
        raise RuntimeError(
            f"DDTREE: a verify mask of {sum(bits)} bits overflows the plan's "
            "int32 offsets, past the start-up bound (round_memory.check)"
        )
    return HostPlan(
        qo_indptr=torch.arange(0, (bs + 1) * N, N, dtype=torch.int32),
        lengths=torch.tensor(
            [*kv, 0, *itertools.accumulate(kv), 0, *itertools.accumulate(bits)], dtype=torch.int32
        ),
        last_page_len=torch.ones(bs, dtype=torch.int32),
        total_bits=sum(bits),
        packed_bytes=sum((b + 7) // 8 for b in bits),
        max_request_bits=max(bits, default=0),
        total_kv=sum(kv),
    )


def _split(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HostPlan.lengths (or its device copy) as (kv_lens [bs], kv_indptr [bs + 1], mask_starts
    [bs + 1])."""
    bs = (lengths.numel() - 2) // 3
    return lengths[:bs], lengths[bs : 2 * bs + 1], lengths[2 * bs + 1 :]


def pack_at_bit_offsets(
    mask: torch.Tensor, starts: torch.Tensor, total_bits: int, packed_bytes: int
) -> torch.Tensor:
    """uint8 [total_bits]: request b's bits mask[starts[b]:starts[b+1]] packed little-endian
    from byte starts[b] (the rest zero). mask: the flat unpacked bool mask (at least total_bits
    long); starts [bs + 1] int32 on mask's device; packed_bytes = sum over requests of
    ceil(bits / 8) (host-known, as total_bits). One pass over the packed bytes, 8 gathers each,
    int32 indices: a few bytes of scratch per byte of the result. Sync-free."""
    dev = mask.device
    lens = starts[1:] - starts[:-1]
    pstarts = torch.zeros_like(starts)
    pstarts[1:] = torch.cumsum((lens + 7) // 8, 0)
    j = torch.arange(packed_bytes, device=dev, dtype=torch.int32)
    seg = torch.searchsorted(pstarts[1:], j, right=True, out_int32=True)
    first = (j - pstarts[seg]) * 8  # the byte's first bit within its request
    base, end = starts[seg] + first, starts[seg + 1]
    byte = torch.zeros(packed_bytes, dtype=torch.int32, device=dev)
    for k in range(8):
        bit = mask[(base + k).clamp(max=max(total_bits - 1, 0))].to(torch.int32)
        byte |= (bit & (base + k < end).to(torch.int32)) << k
    out = torch.zeros(total_bits, dtype=torch.uint8, device=dev)
    out[starts[seg] + first // 8] = byte.to(torch.uint8)
    return out


def call_begin_forward(runtime, original, *call, **kwargs):
    """AROUND FlashInferIndicesUpdaterPrefill.call_begin_forward (its arguments: updater,
    wrapper_ragged, wrapper_paged, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum,
    seq_lens, prefix_lens, kv_start_idx, kv_indptr, qo_indptr, use_ragged, spec_info, ...): a
    DDTREE verify with host lengths plans with host indptrs and a device-packed mask; every
    other call as it came. runtime: the worker factory's engaged paths (runtime.Runtime),
    bound when the hook is installed."""
    wrapper_paged, seq_lens, use_ragged, spec_info = (call[i] for i in (2, 6, 11, 12))
    args = call[13:]
    seq_lens_cpu = kwargs.get("seq_lens_cpu")
    if not _applies(wrapper_paged, seq_lens, seq_lens_cpu, use_ragged, spec_info, args, kwargs):
        write_mask(spec_info)
        return original(*call, **kwargs)
    plan = host_plan(seq_lens_cpu, int(spec_info.draft_token_num))
    capacity = compat.flashinfer_mask_capacity(wrapper_paged)  # CUDA-graph buffer, bytes
    if capacity is not None and plan.total_bits > capacity:  # the bit-offset layout is 8x
        write_mask(spec_info)
        return original(*call, **kwargs)
    # one host-to-device copy: the KV indices' lengths and offsets
    # (DDTreeVerifyInput.generate_attn_arg_prefill) and the mask offsets (the packers)
    kv_lens, kv_indptr_dev, starts = _split(plan.lengths.to(seq_lens.device, non_blocking=True))
    planned = wrapper_paged.begin_forward
    own = "begin_forward" in vars(wrapper_paged)
    from sglang_ddtree.round import verify_input

    from_tree = not spec_info.tree_mask_written  # else written: a warm-up stand-in's mask
    if from_tree:
        if spec_info.tree_visibility.shape[1] != int(spec_info.draft_token_num):
            raise RuntimeError("DDTREE: the verify's tree and its width disagree")  # a bug
        runtime.engaged.first_use("verify mask packed by tree/mask_pack.py")
    begin_forward = _packed_begin_forward(planned, plan, starts, spec_info, from_tree)
    runtime.engaged.first_use("verify plan from host lengths (round/verify_plan.py)")
    wrapper_paged.begin_forward = begin_forward
    spec_info.staged_attn_args = verify_input.StagedAttnArgs(
        kv_lens, kv_indptr_dev, plan.qo_indptr, plan.total_kv
    )
    try:
        return original(*call, **kwargs)
    finally:
        spec_info.staged_attn_args = None
        if own:
            wrapper_paged.begin_forward = planned
        else:
            del wrapper_paged.begin_forward


def _packed_begin_forward(planned, plan: HostPlan, starts, spec_info, from_tree: bool):
    """The wrapper's begin_forward (`planned`) called with the host plan's indptrs and the mask
    packed at its bit offsets (`starts`, on the device): from the tree's visibility when the
    unpacked mask was never written (`from_tree`), else from the written mask."""
    from sglang_ddtree.tree import mask_pack

    def begin_forward(qo, kv, kv_indices, last, *rest, custom_mask=None, **kw):
        if from_tree:
            packed = mask_pack.pack_tree_mask(
                spec_info.tree_visibility, starts, plan.total_bits, plan.max_request_bits
            )
        else:
            packed = pack_at_bit_offsets(
                custom_mask.reshape(-1), starts, plan.total_bits, plan.packed_bytes
            )
        del qo, kv, last  # SGLang's device copies: the host plan's own go to the plan
        host = (plan.qo_indptr, plan.kv_indptr, kv_indices, plan.last_page_len)
        return planned(*host, *rest, packed_custom_mask=packed, **kw)

    return begin_forward


def write_mask(spec_info) -> None:
    """A DDTREE verify input whose unpacked mask was left out, about to be planned by SGLang's
    plan (a call the host plan cannot take): allocated and written now
    (tree_layout.write_full_mask)."""
    from sglang_ddtree.round.verify_input import DDTreeVerifyInput
    from sglang_ddtree.tree import verify_layout as tree_layout

    if isinstance(spec_info, DDTreeVerifyInput) and not spec_info.tree_mask_written:
        vis = spec_info.tree_visibility
        spec_info.custom_mask = torch.empty(
            spec_info.tree_mask_size, dtype=torch.bool, device=vis.device
        )
        tree_layout.write_full_mask(vis, spec_info.tree_seq_lens, spec_info.custom_mask)
        spec_info.tree_mask_written = True


def _applies(wrapper_paged, seq_lens, seq_lens_cpu, use_ragged, spec_info, args, kwargs) -> bool:
    """A DDTREE tree verify (custom mask) whose exact host lengths are at hand, planned by
    FlashInfer's own plan() (not SGLang's fast_prefill_plan), with no ragged part, sliding
    window, multi-item scoring or cross-attention mask."""
    from sglang_ddtree.round.verify_input import DDTreeVerifyInput

    if not isinstance(spec_info, DDTreeVerifyInput) or spec_info.custom_mask is None:
        return False
    if seq_lens_cpu is None or len(seq_lens_cpu) != len(seq_lens) or use_ragged or args:
        return False
    if getattr(wrapper_paged.begin_forward, "func", None) is not None:  # a partial: fast plan
        return False
    items = kwargs.get("multi_item_params")
    if items is not None and items.is_enabled():
        return False
    others = ("use_sliding_window_kv_pool", "cross_attention_custom_mask", "custom_kv_indices")
    return all(kwargs.get(k) is None or kwargs.get(k) is False for k in others) and (
        kwargs.get("window_left", -1) < 0
    )
