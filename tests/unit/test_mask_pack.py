"""tree/mask_pack.py: the tree mask packed for FlashInfer in one Triton launch straight
from the tree, byte for byte the torch path's (tree_layout.write_full_mask, then
verify_plan.pack_at_bit_offsets, whose layout test_verify_plan.py checks against FlashInfer's
reading and the GPU run), the plan hook's use of it, and the switch that selects it.

CPU: the kernel runs under Triton's interpreter, in a child process (as test_conv_tree.py).
Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_mask_pack.py -m "not gpu"
"""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.round import verify_plan
from sglang_ddtree.tree import verify_layout as tree_layout
from tests.fixtures import interpreter_only, interpreter_process_test

# the non-GPU tests the interpreter process runs (all but this one); it must pass all
test_cpu_kernel_tests_under_triton_interpreter = interpreter_process_test(__file__, 14)


def _tree(bs: int, N: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(bs, N, N, generator=gen) < 0.5) | torch.eye(N, dtype=torch.bool)


def _written(vis: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The unpacked FULL_MASK of len(seq) requests, the first len(vis) from the tree, the rest
    all True (a CUDA graph's padded requests, as SGLang pads the mask)."""
    N = vis.shape[1]
    out = torch.empty(tree_layout.full_mask_size(N, len(seq), int(seq.sum())), dtype=torch.bool)
    return tree_layout.write_full_mask(vis, seq[: len(vis)], out)


@interpreter_only
@pytest.mark.parametrize(
    "seq,N,padded",
    [
        ([5, 1, 17], 5, 0),
        ([1], 4, 0),
        ([8, 8], 16, 0),
        ([3, 30, 2, 7], 7, 0),
        ([37, 5, 120], 16, 0),
        ([3, 1021], 4, 0),
        ([9, 2, 31, 1, 1], 8, 2),
    ],
)
def test_the_tree_packer_gives_the_bytes_of_the_written_mask(seq, N, padded):
    from sglang_ddtree.tree import mask_pack

    seq = torch.tensor(seq)
    vis = _tree(len(seq) - padded, N, seed=N)
    plan = verify_plan.host_plan(seq, N)
    want = verify_plan.pack_at_bit_offsets(
        _written(vis, seq), plan.mask_starts, plan.total_bits, plan.packed_bytes
    )
    got = mask_pack.pack_tree_mask(vis, plan.mask_starts, plan.total_bits, plan.max_request_bits)
    assert torch.equal(got, want)


@interpreter_only
def test_the_tree_packer_reads_a_truncated_trees_view():
    from sglang_ddtree.tree import mask_pack

    seq, wide, N = torch.tensor([12, 3]), _tree(2, 32, seed=1), 16
    vis = wide[:, :N, :N]  # tree.budget.truncate's visibility: a strided view
    assert not vis.is_contiguous()
    plan = verify_plan.host_plan(seq, N)
    want = verify_plan.pack_at_bit_offsets(
        _written(vis.contiguous(), seq), plan.mask_starts, plan.total_bits, plan.packed_bytes
    )
    got = mask_pack.pack_tree_mask(vis, plan.mask_starts, plan.total_bits, plan.max_request_bits)
    assert torch.equal(got, want)


class _Wrapper:
    def begin_forward(self, qo, kv, kv_indices, last, *rest, **kw):
        self.kw = kw


def _sglang_call(
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
    """SGLang's call_begin_forward, reduced to what reaches the wrapper: the unpacked mask."""
    wrapper_paged.begin_forward("qo", "kv", "kv_indices", "last", custom_mask=spec_info.custom_mask)
    return spec_info.custom_mask.clone()  # what SGLang's plan would have read


def _unwritten_verify(seq: torch.Tensor, N: int):
    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round.verify_input import make_verify_input

    bs = len(seq)
    vis = _tree(bs, N, seed=7)
    links = torch.full((bs, N), -1, dtype=torch.int64)
    info = make_verify_input(
        DDTreeConfig(block_size=4, num_nodes=N, topk=2),
        torch.zeros(bs, N, dtype=torch.int64),
        torch.zeros(bs, N, dtype=torch.int64),
        links,
        links,
        vis,
        seq,
        int(seq.sum()),
        write_mask=False,
    )
    return info, vis


def _runtime(**options):
    """The worker factory's runtime (options, engaged paths) that the plan hook is bound to."""
    from sglang_ddtree.config import DDTreeConfig, Options
    from sglang_ddtree.round.runtime import Runtime

    return Runtime.create(Options(**options), DDTreeConfig(block_size=4, num_nodes=8, topk=2))


def _plan_call(runtime, info, seq, seq_lens_cpu):
    from sglang_ddtree.round.verify_plan import call_begin_forward

    wrapper = _Wrapper()
    out = call_begin_forward(
        runtime,
        _sglang_call,
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
        seq_lens_cpu=seq_lens_cpu,
    )
    return out, wrapper.kw


@interpreter_only
def test_the_plan_packs_an_unwritten_mask_from_the_tree(monkeypatch):
    runtime = _runtime()
    seq, N = torch.tensor([6, 2, 11]), 4
    info, vis = _unwritten_verify(seq, N)
    assert not info.tree_mask_written
    _, kw = _plan_call(runtime, info, seq, seq.clone())
    plan = verify_plan.host_plan(seq, N)
    want = verify_plan.pack_at_bit_offsets(
        _written(vis, seq), plan.mask_starts, plan.total_bits, plan.packed_bytes
    )
    assert "custom_mask" not in kw and torch.equal(kw["packed_custom_mask"], want)
    assert not info.tree_mask_written  # never needed
    assert info.custom_mask.numel() == 0  # the packed mask is the round's one mask-sized buffer


def test_an_unwritten_mask_is_written_before_sglangs_plan_reads_it(monkeypatch):
    """Where the host plan does not apply (here: no host lengths), SGLang's plan reads the
    unpacked mask: it is written first, as make_verify_input would have written it."""
    runtime = _runtime()
    seq, N = torch.tensor([6, 2, 11]), 4
    info, vis = _unwritten_verify(seq, N)
    assert info.custom_mask.numel() == 0 and info.tree_mask_size == _written(vis, seq).numel()
    read, kw = _plan_call(runtime, info, seq, None)
    assert "packed_custom_mask" not in kw and info.tree_mask_written
    assert torch.equal(read, _written(vis, seq))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_tree_packer_gives_the_bytes_of_the_written_mask_on_the_gpu():
    from sglang_ddtree.tree import mask_pack

    for seq, N in (([37, 5, 120], 16), ([2000, 1, 64, 900], 64), ([1], 128)):
        seq = torch.tensor(seq)
        vis = _tree(len(seq) - 1, N, seed=N)  # the last request a graph's padding
        plan = verify_plan.host_plan(seq, N)
        want = verify_plan.pack_at_bit_offsets(
            _written(vis, seq), plan.mask_starts, plan.total_bits, plan.packed_bytes
        )
        got = mask_pack.pack_tree_mask(
            vis.cuda(), plan.mask_starts.cuda(), plan.total_bits, plan.max_request_bits
        )
        assert torch.equal(got.cpu(), want), (seq, N)


def _attn_arg_kwargs(pools, seq, req_to_token) -> dict:
    """generate_attn_arg_prefill's keywords as SGLang's FlashInfer plan passes them: the
    round's KV plan over a static pool (its translator reads req_to_token as it is)."""
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    translator = KVIndexTranslator(
        req_to_token=req_to_token,
        token_to_kv_pool_allocator=None,
        token_to_kv_pool=None,
        page_size=1,
        device="cpu",
    )
    plan = translator.plan(
        req_pool_indices=pools, seq_lens=seq, seq_lens_cpu=seq, write_virtual=None
    )
    return dict(
        req_pool_indices=pools,
        paged_kernel_lens=seq,
        paged_kernel_lens_sum=int(seq.sum()),
        translator=translator,
        plan=plan,
    )


@interpreter_only
@pytest.mark.parametrize("seq,N", [([6, 2, 11], 4), ([1], 16), ([40, 3, 9, 1, 17], 8)])
def test_the_staged_lengths_give_sglangs_attention_arguments(seq, N):
    """DDTreeVerifyInput.generate_attn_arg_prefill with the host plan's lengths staged (one copy,
    one launch) gives SGLang's KV indices and offsets; unstaged it is SGLang's own."""
    from sglang_ddtree.round.verify_plan import _split

    seq = torch.tensor(seq)
    info, _ = _unwritten_verify(seq, N)
    bs = len(seq)
    req_to_token = torch.randperm(bs * 200).view(bs, 200).to(torch.int32)
    pools = torch.randperm(bs)
    args = _attn_arg_kwargs(pools, seq, req_to_token)
    want = info.generate_attn_arg_prefill(**args)  # SGLang's
    plan = verify_plan.host_plan(seq, N)
    kv_lens, kv_indptr, _ = _split(plan.lengths)
    from sglang_ddtree.round.verify_input import StagedAttnArgs

    info.staged_attn_args = StagedAttnArgs(kv_lens, kv_indptr, plan.qo_indptr, plan.total_kv)
    got = info.generate_attn_arg_prefill(**args)
    total = int(want[1][-1])
    assert total == plan.total_kv
    assert torch.equal(got[0][:total], want[0][:total]) and got[0].numel() == want[0].numel()
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[3] is want[3] is info.custom_mask


def test_the_plan_stages_its_lengths_for_its_own_call_only(monkeypatch):
    runtime = _runtime()
    seq, N = torch.tensor([6, 2, 11]), 4
    info, _ = _unwritten_verify(seq, N)
    verify_plan.write_mask(info)  # written, as a warm-up stand-in: packed by the torch reference
    seen = []

    def sglang(*call, **kwargs):
        seen.append(call[12].staged_attn_args)
        return _sglang_call(*call, **kwargs)

    from sglang_ddtree.round.verify_plan import call_begin_forward

    call_begin_forward(
        runtime,
        sglang,
        "updater",
        None,
        _Wrapper(),
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
        seq_lens_cpu=seq.clone(),
    )
    kv_lens, kv_indptr, qo, total = seen[0]
    assert kv_lens.tolist() == (seq + N).tolist() and kv_indptr.tolist() == [0, 10, 16, 31]
    assert total == 31
    assert torch.equal(qo, verify_plan.host_plan(seq, N).qo_indptr)
    assert info.staged_attn_args is None  # cleared after the call
    call_begin_forward(
        runtime,
        sglang,
        "updater",
        None,
        _Wrapper(),
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
        seq_lens_cpu=None,
    )
    assert seen[1] is None  # SGLang's plan: nothing staged
