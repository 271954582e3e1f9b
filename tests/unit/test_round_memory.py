"""state/round_memory.py: DDTREE's memory beside SGLang's pools at a server's maximum, the
verify plan's int32 bound, and the per-round working sets the accounting assumes (each temporary
worked a few requests at a time within TEMP_BYTES, one request at a time beyond)."""

from __future__ import annotations

import pytest
import torch

from sglang_ddtree.accept.penalties import TEMP_BYTES, requests_at_once
from sglang_ddtree.round import verify_plan
from sglang_ddtree.state import round_memory
from sglang_ddtree.state.round_memory import GIB, INT32_LIMIT, at_maximum, check


def _memory(**overrides):
    args = dict(
        max_bs=16,
        num_nodes=32,
        vocab=248320,
        rows=20,
        row=262144 + 68,
        penalties=True,
    )
    return at_maximum(**{**args, **overrides})


def test_every_part_is_counted_at_the_maximum():
    m = _memory()
    N, bs, V = 32, 16, 248320
    assert m.mask_bits == N * bs * (262144 + 68 + N)
    assert m.verify_mask == m.mask_bits  # the packed mask alone
    assert m.tables == 20 * V * 5  # counts (float32) and stop tokens (bool)
    at_once = requests_at_once(N, V, 5)
    assert 1 <= at_once < bs and at_once * N * V * 5 <= TEMP_BYTES
    assert m.temporaries == bs * V * 5 + at_once * N * V * 5
    off = _memory(penalties=False)
    assert off.tables == off.temporaries == 0 and off.verify_mask == m.verify_mask
    # a width whose one request is past the budget: still one request at a time
    wide = _memory(num_nodes=1024)
    assert wide.temporaries == bs * V * 5 + 1024 * V * 5


def test_the_int32_offsets_bound_refuses_at_start_up_with_the_flags():
    # N x max_bs x (row + N) at 2^31: 64 x 128 x (262144 + 68 + 64) does not fit
    big = _memory(num_nodes=64, max_bs=128, row=262144 + 68)
    assert big.mask_bits >= INT32_LIMIT
    with pytest.raises(
        RuntimeError,
        match=r"2148564992 bits.*2\^31.*Lower --max-running-requests, --context-length",
    ):
        check(big, None)  # whatever the memory
    assert check(_memory(num_nodes=64, max_bs=16), None) is None  # 16 x: fits


def test_memory_is_checked_against_what_the_pools_left():
    m = _memory()
    with pytest.raises(RuntimeError, match=r"needs .* GiB.*0\.10 GiB are free"):
        check(m, 0.1)
    low = check(m, m.total / GIB + 0.5)
    assert low is not None and "leaves 0.50 GiB free" in low
    assert check(m, m.total / GIB + 5) is None
    assert check(m, None) is None  # no GPU


def test_the_host_plan_refuses_offsets_past_int32():
    """Past the start-up bound (a bug), the plan stops instead of writing wrapped offsets."""
    assert verify_plan.host_plan(torch.tensor([10, 20]), 4).total_bits == 4 * (14 + 24)
    with pytest.raises(RuntimeError, match="int32"):
        verify_plan.host_plan(torch.tensor([INT32_LIMIT // 8]), 8)


def test_the_accounting_holds_the_temporaries_a_round_makes():
    """The working set the accounting assumes: min_p_filter_ and block_stops_ allocate at most
    one bool per value of the requests they work at once, never a [batch, N, V] tensor (their
    earlier forms took three float32 ones); each op's allocation as torch's profiler records it."""
    from torch.profiler import ProfilerActivity, profile

    from sglang_ddtree.accept.penalties import block_stops_, min_p_filter_

    bs, N, V = 6, 8, 4096
    per_request = N * V  # one bool
    probs = torch.rand(bs, N, V).softmax(-1)
    logits = torch.randn(bs, N, V)
    early = torch.ones(bs, N, dtype=torch.bool)
    stops = torch.rand(bs, V) < 0.5
    for fn, args in (
        (min_p_filter_, (probs, torch.full((bs,), 0.1))),
        (block_stops_, (logits, early, stops)),
    ):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(*args, temp_bytes=2 * per_request)
        largest = max(e.self_cpu_memory_usage for e in prof.events())  # one op's allocation
        assert 0 < largest <= 2 * per_request, (fn.__name__, largest)
    assert round_memory.TEMP_BYTES == TEMP_BYTES


def test_the_check_at_n_covers_every_narrower_width_and_wide_trees_at_27b_sizes():
    """Every width a server may verify is at most N, and DDTREE's own round memory (mask and
    penalty temporaries) never shrinks as N grows, so the check at N holds for 16 to 256; at
    16 running requests and a 262,144-token context the N = 256 mask is 1.08 GB (the int32
    bound holds), and 32 running requests would pass it."""
    sizes = [_memory(num_nodes=w) for w in (16, 32, 64, 128, 256)]
    assert all(a.total <= b.total for a, b in zip(sizes, sizes[1:], strict=False))
    assert sizes[-1].mask_bits == 256 * 16 * (262144 + 68 + 256) < INT32_LIMIT
    assert check(sizes[-1], free_gib=100.0) is None
    with pytest.raises(RuntimeError, match="past the 2\\^31"):
        check(_memory(num_nodes=256, max_bs=32), free_gib=100.0)
    # a width's verify-graph buffers: checked before its capture (round/widths.VerifyWidths)
    need = round_memory.verify_graph_bytes(max_bs=16, width=256, context_len=262144)
    assert need == 16 * 256 * 262144 * 5
    round_memory.check_width(256, need, free_gib=float("inf"), max_bs=16)  # no GPU: no check
    round_memory.check_width(256, need, free_gib=6.0, max_bs=16)
    with pytest.raises(RuntimeError, match=f"verify width 256 needs {need} bytes"):
        round_memory.check_width(256, need, free_gib=4.0, max_bs=16)
