"""Tensor parallelism (the CPU part): at --tp-size t each rank runs DDTREE's Gated DeltaNet kernels
on its own shard, HV / t value heads and H / t key heads of the recurrence, its slice of each of
the conv's q / k / v channel blocks, and a compact scratch sized from SGLang's per-rank state
shapes. A rank's result is the matching slice of the one-GPU result, bit for bit.

- The recurrence and the replay commit treat each value head on its own (value head i reads
  key head i // (HV / H), which a shard of both keeps), so the shards' outputs and committed
  states are slices of the whole's.
- The tree conv1d and its window commit are depthwise: every channel on its own.
- The compact scratch follows the pool SGLang builds per rank (configs/qwen3_next.py's
  `mamba2_cache_params` at its attention-TP size): a rank holds 1 / t of the one-GPU bytes.

What a multi-GPU machine still has to show: the same through SGLang's sharded GDN layers
(their q / k / v split of mixed_qkv), NCCL and CUDA graphs at t > 1.

CPU: the kernels run under Triton's interpreter, in a child process (as test_gdn_tree_verify.py).
Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_tp_shards.py -m "not gpu"
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.gdn.chunk_tree import chunk_tree_verify
from sglang_ddtree.gdn.conv_tree import commit_windows, conv_tree
from sglang_ddtree.gdn.tree_verify import commit_paths, scratch_floats, tree_verify
from sglang_ddtree.tree.testing import eagle_links
from tests.fixtures import INTERPRETED, interpreter_only, interpreter_process_test
from tests.unit.test_gdn_tree_verify import Case, random_parents

torch.set_num_threads(1)

# the kernel tests the interpreter process runs (the scratch sizing runs here); it must pass all
test_cpu_kernel_tests_under_triton_interpreter = interpreter_process_test(__file__, 6)

ROOT = Path(__file__).resolve().parents[2]


def head_shard(case: Case, rank: int, tp: int) -> dict:
    """Rank `rank`'s inputs of a verify: its key heads, value heads, gates and pool rows (each a
    contiguous copy, as a rank holds its own tensors), and a scratch sized for its heads."""
    H, HV = case.q.shape[1] // tp, case.v.shape[1] // tp
    kh, vh = slice(rank * H, (rank + 1) * H), slice(rank * HV, (rank + 1) * HV)
    bs, N = case.parents.shape
    K, V = case.q.shape[2], case.v.shape[2]
    return dict(
        q=case.q[:, kh].contiguous(),
        k=case.k[:, kh].contiguous(),
        v=case.v[:, vh].contiguous(),
        a=case.a[:, vh].contiguous(),
        b=case.b[:, vh].contiguous(),
        A_log=case.A_log[vh].contiguous(),
        dt_bias=case.dt_bias[vh].contiguous(),
        state=case.pool[:, vh].contiguous(),
        state_idx=case.slots,
        parents=case.parents,
        scratch=torch.zeros((bs + 1, scratch_floats(N, HV, K, V))),
        scratch_idx=case.scratch_slots,
    )


@interpreter_only
@pytest.mark.parametrize("kernel", [tree_verify, chunk_tree_verify], ids=["root_paths", "chunk"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_ranks_verify_and_commit_are_its_slice_of_the_whole(kernel, tp):
    """Qwen3.6-27B's head ratio (48 value heads on 16 key heads: 3 a key head) at 4 and 12 value
    heads: on each rank's shard the verify's outputs and the replay commit's states (a commit
    slot and a prefix-cache track slot) equal the one-GPU run's slice of them."""
    gen = torch.Generator().manual_seed(11)
    bs, N, H, HV, K, V = 2, 9, 4, 12, 16, 24
    parents = random_parents(bs, N, gen)
    case = Case(parents, H, HV, K, V, gen)
    whole = case.verify(max_path=N, kernel=kernel)
    free = [s for s in range(bs + 3) if s not in case.slots.tolist()]
    last = torch.tensor([N - 1, 3])
    track_idx, track_node = torch.tensor([free[0], -1], dtype=torch.int32), torch.tensor([0, -1])

    def commit(state, scratch, scratch_idx):
        commit_paths(
            state[None],
            case.slots,
            scratch[None],
            scratch_idx,
            parents,
            last,
            max_path=N,
            track_idx=track_idx,
            track_node=track_node,
        )

    pool = case.pool.clone()
    commit(pool, case.scratch, case.scratch_slots)
    assert not torch.equal(pool, case.pool)  # the commit moved the slots it names
    vh = HV // tp
    for rank in range(tp):
        shard = head_shard(case, rank, tp)
        o = kernel(**shard, max_path=N)
        assert torch.equal(o, whole[:, rank * vh : (rank + 1) * vh]), rank
        commit(shard["state"], shard["scratch"], shard["scratch_idx"])
        assert torch.equal(shard["state"], pool[:, rank * vh : (rank + 1) * vh]), rank


@interpreter_only
@pytest.mark.parametrize("tp", [2, 4])
def test_each_ranks_tree_conv_and_window_commit_are_its_channels_of_the_whole(tp):
    """A rank's conv channels are its slice of each of the q, k and v blocks (SGLang shards the
    blocks one by one): conv_tree and commit_windows on them give the one-GPU run's values of
    those channels, outputs and committed windows alike."""
    gen = torch.Generator().manual_seed(5)
    bs, N, KW, blocks = 2, 7, 4, (8, 8, 16)  # q, k, v channels (key 2 x 4, value 4 x 4)
    dim, slots = sum(blocks), bs + 2
    parents = random_parents(bs, N, gen)
    parents[:, 0] = -1
    tokens = torch.randn(bs, N, dim, generator=gen)  # x is its [bs, dim, N] view, as SGLang's
    weight, bias = torch.randn(dim, KW, generator=gen), torch.randn(dim, generator=gen)
    state0 = torch.randn(slots, dim, KW - 1, generator=gen)
    idx = torch.randperm(slots, generator=gen)[:bs].to(torch.int32)
    rows = torch.arange(bs, dtype=torch.int32)
    nxt, sib = eagle_links(parents)
    nodes = torch.tensor([N - 1, 2])

    def run(x, state, weight, bias):
        inputs = torch.zeros((bs + 1, N, x.shape[1], KW - 1))
        par = torch.zeros((bs, N), dtype=torch.int64)
        o = conv_tree(
            x,
            state,
            weight,
            bias,
            "silu",
            conv_state_indices=idx,
            intermediate_conv_window=inputs,
            intermediate_state_indices=rows,
            retrieve_next_token=nxt,
            retrieve_next_sibling=sib,
            retrieve_parent_token=par,
            save_inputs=True,
        )
        states = state[None].contiguous()
        commit_windows(states, inputs[None], idx, rows, par, nodes)
        return o, states[0]

    o_all, state_all = run(tokens.transpose(1, 2), state0.clone(), weight, bias)
    assert not torch.equal(state_all, state0)
    starts = torch.tensor((0, *blocks)).cumsum(0).tolist()
    for rank in range(tp):
        mine = torch.cat(
            [
                torch.arange(s + rank * n // tp, s + (rank + 1) * n // tp)
                for s, n in zip(starts, blocks, strict=False)
            ]
        )
        x = tokens[:, :, mine].contiguous().transpose(1, 2)  # the rank's own tensor
        o, state = run(
            x, state0[:, mine].contiguous(), weight[mine].contiguous(), bias[mine].contiguous()
        )
        assert torch.equal(o, o_all[:, mine]), rank
        assert torch.equal(state, state_all[:, mine]), rank


@pytest.mark.skipif(INTERPRETED, reason="no kernel: runs in the parent process")
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_compact_scratch_is_sized_per_rank_from_sglangs_own_shapes(monkeypatch, tp):
    """At Qwen3.6-27B's sizes, SGLang's per-rank GDN state shapes (its config at attention-TP
    size t) give each rank 1 / t of the one-GPU compact buffers, at every verify width."""
    qwen3_next = pytest.importorskip("sglang.srt.configs.qwen3_next")
    q35 = pytest.importorskip("sglang.srt.configs.qwen3_5")
    from sglang_ddtree.state.gdn_pool import compact_bytes_per_request

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_round  # its Qwen3.6-27B text sizes
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    cfg = q35.Qwen3_5TextConfig(**bench_round.QWEN36_TEXT)

    def params(t: int):  # SGLang reads the linear layers' TP width from its runtime context
        monkeypatch.setattr(qwen3_next, "get_parallel", lambda: SimpleNamespace(attn_tp_size=t))
        monkeypatch.setattr(qwen3_next, "linear_attn_tp_size", lambda: t)
        return cfg.mamba2_cache_params

    one, rank = params(1), params(tp)
    assert rank.shape.temporal == (48 // tp, 128, 128)  # value heads split, head sizes kept
    assert [c[0] for c in rank.shape.conv] == [10240 // tp]  # q, k, v channels, split
    for N in (16, 32, 64):
        assert compact_bytes_per_request(rank, N) * tp == compact_bytes_per_request(one, N)
