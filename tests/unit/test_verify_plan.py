"""round/verify_plan.py: the verify's FlashInfer plan from host lengths (the default).

The layout must be the one SGLang's EAGLE verify gives FlashInfer (qo / kv indptrs), the packed
mask must read back bit for bit the way FlashInfer's kernel reads it (byte pointer +
the plan's bit offsets, little-endian, attention/variants.cuh), and the hook must hand plan()
host tensors and the packed mask only for a DDTREE verify with host lengths."""

from __future__ import annotations

import inspect

import pytest
import torch

from sglang_ddtree.round.verify_plan import host_plan, pack_at_bit_offsets
from sglang_ddtree.tree import verify_layout as tree_layout


def _tree_mask(seq_lens: torch.Tensor, N: int, gen: torch.Generator) -> torch.Tensor:
    bs = len(seq_lens)
    vis = torch.rand(bs, N, N, generator=gen) < 0.5
    vis |= torch.eye(N, dtype=torch.bool)
    out = torch.empty(tree_layout.full_mask_size(N, bs, int(seq_lens.sum())), dtype=torch.bool)
    return tree_layout.write_full_mask(vis, seq_lens, out)


def test_the_host_layout_is_the_eagle_verify_layout():
    seq = torch.tensor([5, 1, 17])
    plan = host_plan(seq, 4)
    assert plan.qo_indptr.tolist() == [0, 4, 8, 12] and plan.qo_indptr.device.type == "cpu"
    assert plan.kv_indptr.tolist() == [0, 9, 14, 35]  # cumsum(S + N), generate_attn_arg_prefill
    assert plan.last_page_len.tolist() == [1, 1, 1]
    # FlashInfer's _compute_page_mask_indptr: qo_len * ((kv_indptr diff - 1) * 1 + last_page_len)
    assert plan.mask_starts.tolist() == [0, 36, 56, 140] and plan.total_bits == 140
    assert plan.packed_bytes == 5 + 3 + 11  # ceil(36 / 8) + ceil(20 / 8) + ceil(84 / 8)
    assert plan.total_bits == tree_layout.full_mask_size(4, 3, int(seq.sum()))
    assert plan.max_request_bits == 84
    fields = (plan.qo_indptr, plan.kv_indptr, plan.last_page_len, plan.mask_starts)
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in fields)
    empty = host_plan(torch.tensor([], dtype=torch.int64), 4)
    assert empty.kv_indptr.tolist() == [0] and (empty.total_bits, empty.max_request_bits) == (0, 0)


@pytest.mark.parametrize("seq", [[5, 1, 17], [1], [8, 8], [3, 30, 2, 7]])
def test_the_packed_mask_reads_back_as_the_kernel_reads_it(seq):
    gen = torch.Generator().manual_seed(len(seq))
    seq, N = torch.tensor(seq), 5
    mask = _tree_mask(seq, N, gen)
    plan = host_plan(seq, N)
    packed = pack_at_bit_offsets(mask, plan.mask_starts, plan.total_bits, plan.packed_bytes)
    assert packed.dtype == torch.uint8 and packed.numel() == plan.total_bits
    for b in range(len(seq)):
        kv_len = int(seq[b]) + N
        base = int(
            plan.mask_starts[b]
        )  # the plan's bit offset, used by the kernel as a byte offset
        for q in range(N):
            for k in range(kv_len):
                off = q * kv_len + k
                bit = (int(packed[base + off // 8]) >> (off % 8)) & 1
                assert bit == int(mask[base + off]), (b, q, k)


def test_the_packed_bytes_are_those_checked_on_the_gpu():
    """Byte for byte the packing that was run through FlashInfer on the H200 (one entry
    per mask bit, bits summed into bytes at the request's bit offset)."""
    gen = torch.Generator().manual_seed(9)
    seq, N = torch.tensor([37, 5, 120]), 16
    mask = _tree_mask(seq, N, gen)
    plan = host_plan(seq, N)
    starts = plan.mask_starts.long()
    p = torch.arange(plan.total_bits)
    seg = torch.searchsorted(starts[1:], p, right=True)
    local = p - starts[seg]
    ref = torch.zeros(plan.total_bits, dtype=torch.int32)
    ref.index_add_(0, starts[seg] + local // 8, mask[: plan.total_bits].int() << (local % 8).int())
    got = pack_at_bit_offsets(mask, plan.mask_starts, plan.total_bits, plan.packed_bytes)
    assert torch.equal(got, ref.to(torch.uint8))


class _Wrapper:
    def __init__(self):
        self.calls = []

    def begin_forward(self, qo, kv, kv_indices, last, *rest, **kw):
        self.calls.append((qo, kv, kv_indices, last, rest, kw))


def _sglang_like(
    updater,
    wrapper_ragged,
    wrapper_paged,
    req_pool_indices,
    paged_kernel_lens,
    paged_kernel_lens_sum,
    seq_lens,
    prefix_lens,
    kv_start_idx,
    kv_indptr,
    qo_indptr,
    use_ragged,
    spec_info,
    **kwargs,
):
    """What SGLang's call_begin_forward does with a tree verify: device indptrs, unpacked mask."""
    N = spec_info.draft_token_num
    qo = torch.arange(0, (len(seq_lens) + 1) * N, N, dtype=torch.int32)
    kv = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(seq_lens + N, 0).int()])
    wrapper_paged.begin_forward(
        qo,
        kv,
        "kv_indices",
        torch.ones(len(seq_lens), dtype=torch.int32),
        4,
        2,
        64,
        1,
        q_data_type="bf16",
        custom_mask=spec_info.custom_mask,
        non_blocking=True,
    )
    return "planned"


def _spec_info(mask, N):
    from sglang_ddtree.round.verify_input import DDTreeVerifyInput

    info = object.__new__(DDTreeVerifyInput)
    info.custom_mask, info.draft_token_num = mask, N
    return info


@pytest.fixture()
def verify_plan_on(monkeypatch):
    pytest.importorskip("sglang.srt.speculative.eagle_info")
    from sglang_ddtree.config import DDTreeConfig, Options
    from sglang_ddtree.round.runtime import Runtime

    # the worker factory's runtime, as the hook is bound to it
    yield Runtime.create(Options(), DDTreeConfig(4, 8, 2))


def test_the_hook_plans_a_ddtree_verify_from_the_host(verify_plan_on):
    from sglang_ddtree.round.verify_plan import call_begin_forward

    gen = torch.Generator().manual_seed(0)
    seq, N = torch.tensor([6, 2]), 3
    mask = _tree_mask(seq, N, gen)
    info, wrapper = _spec_info(mask, N), _Wrapper()
    args = (
        "updater",
        None,
        wrapper,
        None,
        seq,
        int(seq.sum()),
        seq,
        None,
        None,
        None,
        None,
        False,
        info,
    )
    planned = call_begin_forward(verify_plan_on, _sglang_like, *args, seq_lens_cpu=seq.clone())
    assert planned == "planned"
    qo, kv, kv_indices, last, rest, kw = wrapper.calls[-1]
    plan = host_plan(seq, N)
    assert torch.equal(qo, plan.qo_indptr) and torch.equal(kv, plan.kv_indptr)
    assert torch.equal(last, plan.last_page_len) and kv_indices == "kv_indices"
    assert "custom_mask" not in kw and rest == (4, 2, 64, 1) and kw["q_data_type"] == "bf16"
    packed = pack_at_bit_offsets(mask, plan.mask_starts, plan.total_bits, plan.packed_bytes)
    assert torch.equal(kw["packed_custom_mask"], packed)
    assert "begin_forward" not in vars(wrapper)  # the wrapper's own plan is back
    # no host lengths, or the switch off: SGLang's call as it was
    call_begin_forward(verify_plan_on, _sglang_like, *args, seq_lens_cpu=None)
    assert "custom_mask" in wrapper.calls[-1][5]
    # a CUDA-graph wrapper whose mask buffer cannot hold the bit-offset layout: SGLang's call
    wrapper.is_cuda_graph_enabled, wrapper._custom_mask_buf = True, torch.zeros(plan.total_bits - 1)
    call_begin_forward(verify_plan_on, _sglang_like, *args, seq_lens_cpu=seq.clone())
    assert "custom_mask" in wrapper.calls[-1][5]
    wrapper._custom_mask_buf = torch.zeros(plan.total_bits)
    call_begin_forward(verify_plan_on, _sglang_like, *args, seq_lens_cpu=seq.clone())
    assert "packed_custom_mask" in wrapper.calls[-1][5]


def test_the_hook_target_has_the_parameters_the_hook_assumes():
    module = pytest.importorskip("sglang.srt.layers.attention.flashinfer_backend")
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks
    from sglang_ddtree.round import verify_plan

    params = list(
        inspect.signature(module.FlashInferIndicesUpdaterPrefill.call_begin_forward).parameters
    )
    assert params[:13] == [
        "self",
        "wrapper_ragged",
        "wrapper_paged",
        "req_pool_indices",
        "paged_kernel_lens",
        "paged_kernel_lens_sum",
        "seq_lens",
        "prefix_lens",
        "kv_start_idx",
        "kv_indptr",
        "qo_indptr",
        "use_ragged",
        "spec_info",
    ]
    assert {"seq_lens_cpu", "multi_item_params", "window_left"} <= set(params)
    assert compat.FLASHINFER_PREFILL_PLAN.endswith(
        "FlashInferIndicesUpdaterPrefill.call_begin_forward"
    )
    assert hooks.HOOKS[compat.FLASHINFER_PREFILL_PLAN] is verify_plan.call_begin_forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_attends_the_same_with_the_host_plan_and_the_packed_mask():
    """On the GPU, FlashInfer's masked paged prefill as SGLang plans the verify (device
    indptrs, the unpacked mask) and as the host plan does (host indptrs, the mask packed at the
    plan's bit offsets): the same outputs, bit for bit, for a batch of 3 trees."""
    flashinfer = pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(1)
    seq, N, Hq, Hk, D = torch.tensor([37, 5, 120]), 16, 8, 2, 128
    mask = _tree_mask(seq, N, gen).cuda()
    kv_total = int((seq + N).sum())
    k = torch.randn(kv_total, 1, Hk, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(kv_total, 1, Hk, D, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(len(seq) * N, Hq, D, generator=gen).to("cuda", torch.bfloat16)
    plan = host_plan(seq, N)
    indices = torch.arange(kv_total, dtype=torch.int32, device="cuda")
    outs = []
    for host in (False, True):
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        if host:
            packed = pack_at_bit_offsets(
                mask, plan.mask_starts.cuda(), plan.total_bits, plan.packed_bytes
            )
            w.plan(
                plan.qo_indptr,
                plan.kv_indptr,
                indices,
                plan.last_page_len,
                Hq,
                Hk,
                D,
                1,
                packed_custom_mask=packed,
                q_data_type=torch.bfloat16,
            )
        else:
            w.plan(
                plan.qo_indptr.cuda(),
                plan.kv_indptr.cuda(),
                indices,
                plan.last_page_len.cuda(),
                Hq,
                Hk,
                D,
                1,
                custom_mask=mask[: plan.total_bits],
                q_data_type=torch.bfloat16,
            )
        outs.append(w.run(q, (k, v)))
    assert torch.equal(outs[0], outs[1])
