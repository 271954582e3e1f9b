"""sglang_ddtree.gdn.tree_verify: the path-parallel Gated DeltaNet tree verify and the replay
commit against their plain-torch definitions, and against SGLang's own verify + commit.

CPU: the kernels run under Triton's interpreter, chosen before triton is imported, so those
tests run in a child process (as in test_tree_build_triton.py).
Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_gdn_tree_verify.py -m "not gpu"
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from sglang_ddtree.gdn.chunk_tree import BLOCK_NODES, MAX_NODES, PRECISIONS, chunk_tree_verify
from sglang_ddtree.gdn.reference import gdn_gating, max_path_len, root_path, tree_verify_reference
from sglang_ddtree.gdn.tree_verify import as_scratch, commit_paths, scratch_floats, tree_verify
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import (
    random_build_inputs,
)
from tests.fixtures import (
    INTERPRETED,
    conv_window_reference,
    interpreter_only,
    interpreter_process_test,
)

torch.set_num_threads(1)

# the non-GPU tests the interpreter process runs (all but this one); it must pass all
test_cpu_kernel_tests_under_triton_interpreter = interpreter_process_test(__file__, 37)


def random_parents(bs: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, N] parents in an arbitrary parent < child order (node 0 = root; its entry is junk,
    as in SGLang's retrieve_parent_token)."""
    rows = [
        [7] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, N)]
        for _ in range(bs)
    ]
    return torch.tensor(rows, dtype=torch.int64)


def builder_parents(bs: int, N: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """DDTrees from the reference builder, in its best-first node order."""
    root, ids, lps = random_build_inputs(gen, bs, block - 1, 4, 100, mode="continuous")
    return build_tree_reference(root, ids, lps, N - 1).parents.clone()


class Case:
    """One layer's verify inputs for bs trees of N nodes, a state pool with the requests in
    shuffled slots, and the plain-torch outputs and per-node states."""

    def __init__(
        self,
        parents,
        H,
        HV,
        K,
        V,
        gen,
        dtype=torch.float32,
        pool_dtype=torch.float32,
        pad_last=False,
        device="cpu",
        ref_dtype=torch.float32,
        k_std=1.0,
    ):
        bs, N = parents.shape
        T = bs * N

        def r(*shape, std=1.0):
            return (std * torch.randn(*shape, generator=gen)).to(device)

        self.parents, self.N, self.H, self.K = parents.to(device), N, H, K
        self.q, self.v = r(T, H, K).to(dtype), r(T, HV, V).to(dtype)
        # k_std < 1: every key near one shared direction (the worst case for the chunked form)
        self.k = (
            (r(1, H, K) + r(T, H, K, std=k_std)).to(dtype) if k_std < 1 else r(T, H, K).to(dtype)
        )
        self.a, self.b = r(T, HV).to(dtype), r(T, HV).to(dtype)
        self.A_log, self.dt_bias = r(HV, std=0.5), r(HV)
        self.pool = r(bs + 3, HV, V, K, std=0.1).to(pool_dtype)
        slots = torch.randperm(bs + 3, generator=gen)[:bs]
        if pad_last:
            slots[-1] = -1  # a CUDA-graph padding request
        self.slots = slots.to(torch.int32).to(device)
        self.scratch_slots = torch.randperm(bs + 1, generator=gen)[:bs].to(torch.int32).to(device)
        self.scratch = torch.full(
            (bs + 1, scratch_floats(N, HV, K, V) + 5), float("nan"), device=device
        )
        g, beta = gdn_gating(self.A_log, self.a, self.b, self.dt_bias)
        h0 = torch.stack(
            [
                self.pool[s].float()
                if s >= 0
                else torch.zeros_like(self.pool[0], dtype=torch.float32)
                for s in slots.tolist()
            ]
        )
        cpu = [x.cpu() for x in (self.q, self.k, self.v, g, beta, h0)]
        self.o_ref, self.states = tree_verify_reference(
            *cpu, parents.cpu(), scale=K**-0.5, dtype=ref_dtype
        )

    def verify(self, max_path, kernel=tree_verify, **options):
        """`kernel` on these inputs; options (e.g. a chunk_tree_verify precision) pass on."""
        return kernel(
            self.q,
            self.k,
            self.v,
            self.a,
            self.b,
            self.A_log,
            self.dt_bias,
            self.pool,
            self.slots,
            self.parents,
            self.scratch,
            self.scratch_slots,
            max_path=max_path,
            **options,
        )


# --- plain torch, no interpreter needed --------------------------------------------------------


def test_as_scratch_views_sglangs_intermediate_state_rows_without_a_copy():
    inter = torch.zeros((3, 5, 16, 2, 4, 4), dtype=torch.bfloat16)  # [L, slots, N, HV, V, K]
    rows = as_scratch(inter, 2)
    assert rows.shape == (3, 5, 16 * 2 * 4 * 4 // 2) and rows.dtype == torch.float32
    rows[1, 2, 0] = 1.0
    assert inter[1, 2].abs().sum() > 0 and inter[1, 1].abs().sum() == 0  # the same memory
    assert as_scratch(inter[1], 1).shape == (5, 16 * 2 * 4 * 4 // 2)
    # Qwen3.6-27B at N = 64: the scratch is 1.6 % of the state buffer that SGLang allocates
    assert scratch_floats(64, 48, 128, 128) < 0.016 * 64 * 48 * 128 * 128


def test_max_path_len_and_root_path():
    parents = torch.tensor([[5, 0, 1, 0, 3, 4]])
    assert root_path(parents, 0, 5) == [0, 3, 4, 5] and max_path_len(parents) == 4


# --- the kernels, under the interpreter --------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_matches_reference_in_any_parent_first_order(pool_dtype):
    gen = torch.Generator().manual_seed(2)
    parents = random_parents(3, 11, gen)
    case = Case(parents, 2, 4, 16, 48, gen, pool_dtype=pool_dtype, pad_last=True)  # V: 2 blocks
    o = case.verify(max_path=max_path_len(parents))
    torch.testing.assert_close(o, case.o_ref, rtol=1e-5, atol=1e-5)
    # the scratch rows hold g, beta, raw k and v per node for the commit
    g, beta = gdn_gating(case.A_log, case.a, case.b, case.dt_bias)
    N, H, HV, K, V = 11, 2, 4, 16, 48
    for i, row in enumerate(case.scratch_slots.tolist()):
        x, tok = case.scratch[row], slice(i * N, (i + 1) * N)
        torch.testing.assert_close(x[: N * HV].view(N, HV), g[tok], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x[N * HV : 2 * N * HV].view(N, HV), beta[tok])
        k_end = 2 * N * HV + N * HV * K
        k_per_value_head = case.k[tok].repeat_interleave(HV // H, 1)
        assert torch.equal(x[2 * N * HV : k_end].view(N, HV, K), k_per_value_head)
        assert torch.equal(x[k_end : k_end + N * HV * V].view(N, HV, V), case.v[tok])


@interpreter_only
def test_tree_verify_on_builder_trees_with_the_block_as_max_path():
    gen = torch.Generator().manual_seed(5)
    block = 6
    parents = builder_parents(2, 16, block, gen)
    assert max_path_len(parents) <= block
    case = Case(parents, 1, 2, 16, 16, gen, dtype=torch.bfloat16)
    o = case.verify(max_path=block)
    torch.testing.assert_close(o.float(), case.o_ref, rtol=2e-2, atol=2e-2)  # o is bf16


def tree_shapes(name: str, bs: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, N] parent-first trees of one shape: a chain, a star, a complete ternary tree, DDTrees
    from the builder (block 16) or random ones."""
    t = torch.arange(N)
    if name == "builder":
        return builder_parents(bs, N, 16, gen)
    if name == "random":
        return random_parents(bs, N, gen)
    rows = {"chain": t - 1, "star": torch.zeros(N, dtype=torch.int64), "ternary": (t - 1) // 3}
    return rows[name].clamp(min=0).expand(bs, N).clone()


@interpreter_only
@pytest.mark.parametrize("shape", ["chain", "star", "ternary", "builder", "random"])
def test_chunk_tree_verify_matches_the_float64_recurrence_on_every_tree_shape(shape):
    """The chunked form against the node-by-node recurrence in float64, with the last request a
    CUDA-graph padding row (slot -1). float32 tolerance: 2e-5 absolute at |o| < 1 (the chunked
    products sum in another order than the recurrence)."""
    gen = torch.Generator().manual_seed(17)
    bs, N = 3, 16 if shape == "chain" else 24  # the chain: the block's full depth
    parents = tree_shapes(shape, bs, N, gen)
    case = Case(parents, 2, 4, 32, 48, gen, pad_last=True, ref_dtype=torch.float64)
    o = case.verify(max_path=max_path_len(parents), kernel=chunk_tree_verify)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), case.o_ref, rtol=0, atol=2e-5)


@interpreter_only
def test_chunk_tree_verify_stays_exact_when_every_key_points_the_same_way():
    """The worst conditioning for the triangular solve: keys nearly parallel along a 16-deep
    chain and branching trees (one of two blocks), so that A's entries approach beta * decay.
    Same float32 tolerance against float64."""
    gen = torch.Generator().manual_seed(19)
    for shape, N in (("chain", 16), ("builder", 32), ("builder", 128)):
        parents = tree_shapes(shape, 2, N, gen)
        case = Case(parents, 1, 2, 32, 32, gen, ref_dtype=torch.float64, k_std=0.05)
        o = case.verify(max_path=16, kernel=chunk_tree_verify)
        torch.testing.assert_close(o.double(), case.o_ref, rtol=0, atol=2e-5)


@interpreter_only
@pytest.mark.parametrize("N,HV,V", [(20, 6, 40), (72, 2, 16)], ids=["one_block", "blocks"])
def test_chunk_tree_verify_leaves_the_same_scratch_and_output_as_the_root_path_kernel(N, HV, V):
    """Same contract as tree_verify: the commit's scratch words are identical, outputs agree to
    float32 rounding, bf16 inputs and a bf16 pool included, in one block of nodes and in two;
    more than MAX_NODES is refused."""
    gen = torch.Generator().manual_seed(23)
    parents = builder_parents(2, N, 8, gen)
    case = Case(parents, 2, HV, 16, V, gen, dtype=torch.bfloat16, pool_dtype=torch.bfloat16)
    o_root = case.verify(max_path=8)
    scratch_root = case.scratch.clone()
    case.scratch.fill_(float("nan"))
    o_chunk = case.verify(max_path=8, kernel=chunk_tree_verify)
    assert torch.equal(case.scratch.nan_to_num(7.0), scratch_root.nan_to_num(7.0))
    assert o_chunk.dtype == torch.bfloat16
    assert (o_chunk.float() - o_root.float()).abs().max() <= 2**-8  # one bf16 step at |o| < 1
    wide = builder_parents(1, MAX_NODES + 1, 8, gen)
    case = Case(wide, 1, 1, 16, 16, gen)
    with pytest.raises(ValueError, match=f"at most {MAX_NODES} nodes"):
        case.verify(max_path=8, kernel=chunk_tree_verify)


def wide_trees(name: str, N: int, gen: torch.Generator) -> torch.Tensor:
    """[3, N] parent-first trees wider than one block, a different one per request: "chains"
    (request r: node t's parent t - s_r for s = 1, 16, 5, chains that cross every block
    boundary, the first one chain of all N nodes), "bush" (request r: parents among the first
    2 + r nodes, depth 3 at most, most ancestors in block 0) or "mixed" (a builder DDTree of
    block 16, a random tree, chains of stride 16)."""
    t = torch.arange(N)

    def chains(s):
        return torch.where(t >= s, t - s, 0)

    def bush(r):
        return torch.randint(0, 2 + r, (N,), generator=gen).minimum((t - 1).clamp(min=0))

    if name == "chains":
        return torch.stack([chains(s) for s in (1, 16, 5)])
    if name == "bush":
        return torch.stack([bush(r) for r in range(3)])
    builder = builder_parents(1, N, 16, gen)[0]
    return torch.stack([builder, random_parents(1, N, gen)[0], chains(16)])


def blocks_case(name: str, N: int, seed: int, **kwargs) -> tuple[Case, int]:
    """(a Case of `wide_trees`: 2 key / 4 value heads of 16 x 80 (two V tiles), the last request
    a CUDA-graph padding row, the float64 reference; its longest root path)."""
    gen = torch.Generator().manual_seed(seed)
    parents = wide_trees(name, N, gen)
    case = Case(parents, 2, 4, 16, 80, gen, pad_last=True, ref_dtype=torch.float64, **kwargs)
    return case, max_path_len(parents)


@interpreter_only
@pytest.mark.parametrize(
    "N,shape",
    [
        (65, "chains"),
        (65, "mixed"),
        (100, "chains"),
        (100, "bush"),
        (128, "chains"),
        (128, "bush"),
        (128, "mixed"),
        (256, "bush"),
        (256, "mixed"),
        pytest.param(256, "chains", marks=pytest.mark.slow),  # a 256-deep chain: 256-step walks
    ],
)
def test_chunk_tree_verify_in_blocks_matches_the_float64_recurrence(N, shape):
    """Trees of 2 to 4 blocks of BLOCK_NODES (the block back substitution, root paths crossing
    blocks, a last block of one node at N = 65) against the node-by-node recurrence in float64,
    three different trees per batch, the last a padding row. The one-block float32 tolerance:
    2e-5 absolute at |o| < 1."""
    assert BLOCK_NODES < N <= MAX_NODES
    case, max_path = blocks_case(shape, N, seed=N)
    o = case.verify(max_path=max_path, kernel=chunk_tree_verify)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), case.o_ref, rtol=0, atol=2e-5)


@interpreter_only
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "split"])
def test_chunk_tree_verify_in_blocks_runs_every_precision(precision):
    """Every precision's code path through the blocks, at the same float32 tolerance: Triton's
    interpreter runs each tl.dot in float32, so this checks their algebra; what tf32 costs in
    accuracy is the GPU test's (test_chunk_tree_verify_precision_on_gpu)."""
    case, max_path = blocks_case("mixed", 128, seed=41)
    o = case.verify(max_path=max_path, kernel=chunk_tree_verify, precision=precision)
    torch.testing.assert_close(o.double(), case.o_ref, rtol=0, atol=2e-5)


@interpreter_only
@pytest.mark.parametrize("N", [128, 256])
def test_chunk_tree_verify_in_blocks_stays_finite_on_a_garbage_padding_row(N):
    """A warm-up or padding request's parents are whatever the buffer held (any int64, cycles,
    parents after their children) and its gates can be steep: its outputs and scratch words
    stay finite, and the other requests' outputs are still the recurrence's. (A parent past the
    last node read as it, its own parent with a gate at softplus 85, overflowed exp(G_i - G_j)
    without both the walk's clamp of a parent below its child and the cap of D at 1.)"""
    case, max_path = blocks_case("mixed", N, seed=43)
    gen = torch.Generator().manual_seed(44)
    case.parents[2] = torch.randint(-(2**40), 2**40, (N,), generator=gen)
    case.parents[2, ::3] = torch.randint(0, N, (len(range(0, N, 3)),), generator=gen)
    case.a[2 * N :] *= 10  # softplus past its threshold: g down to -30 exp(A_log) a node
    case.parents[2, -1], case.a[3 * N - 1] = N - 1, 85.0  # its own parent, and a steep gate
    o = case.verify(max_path=max_path, kernel=chunk_tree_verify)
    assert torch.isfinite(o).all()
    assert torch.isfinite(case.scratch[int(case.scratch_slots[2])][:-5]).all()
    ok = slice(0, 2 * N)
    torch.testing.assert_close(o[ok].double(), case.o_ref[ok], rtol=0, atol=2e-5)


@interpreter_only
@pytest.mark.parametrize("kernel", [tree_verify, chunk_tree_verify], ids=["root_paths", "chunk"])
def test_commit_replays_the_accepted_path_into_every_layer_and_the_track_slot(kernel):
    gen = torch.Generator().manual_seed(7)
    bs, N, H, HV, K, V = 3, 10, 2, 4, 16, 40
    parents = random_parents(bs, N, gen)
    layers = [Case(parents, H, HV, K, V, gen) for _ in range(2)]
    pool = torch.stack([c.pool for c in layers])  # [L, S, HV, V, K], slots shared by layers
    scratch = torch.stack([c.scratch for c in layers])
    for li, c in enumerate(layers):
        c.pool, c.scratch, c.slots = pool[li], scratch[li], layers[0].slots
        c.scratch_slots = layers[0].scratch_slots
        c.verify(max_path=N, kernel=kernel)
    # the layers' references start from the same slots: recompute them for the shared pool
    before = pool.clone()
    last = torch.tensor([int(torch.randint(0, N, (1,), generator=gen)) for _ in range(bs)])
    last[1] = -1  # no commit for request 1
    mid = root_path(parents, 0, int(last[0]))
    track_node = torch.tensor([mid[len(mid) // 2], -1, int(last[2])])
    free = [s for s in range(bs + 3) if s not in layers[0].slots.tolist()]
    track_idx = torch.tensor([free[0], free[1], free[2]], dtype=torch.int32)
    commit_paths(
        pool,
        layers[0].slots,
        scratch,
        layers[0].scratch_slots,
        parents,
        last,
        max_path=N,
        track_idx=track_idx,
        track_node=track_node,
    )
    for li in range(2):
        g, beta = gdn_gating(layers[li].A_log, layers[li].a, layers[li].b, layers[li].dt_bias)
        h0 = before[li][layers[0].slots.long()]
        _, states = tree_verify_reference(
            layers[li].q, layers[li].k, layers[li].v, g, beta, h0, parents, scale=K**-0.5
        )
        for b in range(bs):
            slot = int(layers[0].slots[b])
            if last[b] < 0:
                assert torch.equal(pool[li, slot], before[li, slot])
            else:
                torch.testing.assert_close(pool[li, slot], states[b, last[b]], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            pool[li, free[0]], states[0, track_node[0]], rtol=1e-5, atol=1e-5
        )
        assert torch.equal(pool[li, free[1]], before[li, free[1]])
        torch.testing.assert_close(pool[li, free[2]], states[2, last[2]], rtol=1e-5, atol=1e-5)


@interpreter_only
def test_tree_verify_and_commit_equal_sglangs_own_verify_and_commit():
    """scripts/bench_gdn_tree.py's comparison, on the CPU: SGLang's tree-verify kernel
    (fused_sigmoid_gating_delta_rule_update with retrieve_parent_token) and its commit (the
    accepted node's stored state) against tree_verify + commit_paths on the same builder trees."""
    from tests.fixtures import load_script

    pytest.importorskip("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent")
    bench = load_script("bench_gdn_tree")
    row = bench.run_one(2, 12, bench.trees(2, 12, seed=3), 1, device="cpu", heads=(2, 4, 16, 32))
    assert row["max_abs_diff_o"] <= 2**-8, row  # one bf16 step at |o| < 1
    assert row["chunk_max_abs_diff_o"] <= 2**-8, row  # the chunked form: the same
    assert row["max_abs_diff_state"] < 1e-5, row


# --- the kernels on the GPU --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
@pytest.mark.parametrize(
    "kernel,N",
    [(tree_verify, 32), *((chunk_tree_verify, n) for n in (32, 64, 128, 256))],
    ids=["root_paths", "chunk32", "chunk64", "chunk128", "chunk256"],
)
def test_tree_verify_and_commit_on_gpu_at_qwen36_head_sizes(kernel, N):
    """bf16 inputs, tf32 products in the chunked form: o within bf16 tolerance of the float32
    recurrence; the commit (the exact recurrence from the scratch) within 1e-4."""
    gen = torch.Generator().manual_seed(11)
    bs, H, HV, K, V, block = 2, 16, 48, 128, 128, 16
    parents = builder_parents(bs, N, block, gen)
    case = Case(parents, H, HV, K, V, gen, dtype=torch.bfloat16, device="cuda")
    o = case.verify(max_path=block, kernel=kernel)
    torch.testing.assert_close(o.float().cpu(), case.o_ref, rtol=2e-2, atol=2e-2)
    last = torch.tensor([N - 1, N // 2], device="cuda")
    pool = case.pool[None]
    commit_paths(
        pool, case.slots, case.scratch[None], case.scratch_slots, case.parents, last, max_path=block
    )
    for b in range(bs):
        got = pool[0, int(case.slots[b])].cpu()
        torch.testing.assert_close(got, case.states[b, int(last[b])], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
@pytest.mark.parametrize("N", [32, 64, 128, 256])
def test_chunk_tree_verify_precision_on_gpu(N):
    """The chunked form's products on the H200 against the float64 recurrence, float32 inputs
    (the output is not rounded to bf16): "split" (the default, hi + lo tf32 parts) within 2e-5
    of max |o|, as close as the root-path kernel's float32 FMAs; one tf32 pass for comparison
    (measured at 1.5e-3 there at N <= 64). Printed per precision."""
    gen = torch.Generator().manual_seed(29)
    parents = builder_parents(2, N, 16, gen)
    case = Case(parents, 16, 48, 128, 128, gen, device="cuda", ref_dtype=torch.float64)
    scale = float(case.o_ref.abs().max())
    errors = {}
    for precision in ("split", "tf32", "ieee"):
        o = case.verify(max_path=16, kernel=chunk_tree_verify, precision=precision)
        errors[precision] = float((o.double().cpu() - case.o_ref).abs().max()) / scale
    errors["root_paths"] = (
        float((case.verify(max_path=16).double().cpu() - case.o_ref).abs().max()) / scale
    )
    print(f"N={N}: error / max|o| against float64: {errors}")
    assert errors["split"] <= 2e-5, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
def test_chunk_and_root_paths_agree_in_bf16_at_the_binary_pairs_shapes():
    """The GPU suite's binary Qwen3.5 pair as the server runs it (bf16 q, k, v; 1 key head, 2
    value heads of 128; a 31-node complete binary tree in best-first order; block 16): the two
    kernels' bf16 outputs differ by at most one bf16 step of the largest output, and both
    stay within two of float64."""
    gen = torch.Generator().manual_seed(37)
    t = torch.arange(31)
    parents = ((t - 1) // 2).clamp(min=0).expand(2, 31).clone()
    case = Case(
        parents, 1, 2, 128, 128, gen, dtype=torch.bfloat16, device="cuda", ref_dtype=torch.float64
    )
    o_paths = case.verify(max_path=16).float().cpu()
    o_chunk = case.verify(max_path=16, kernel=chunk_tree_verify).float().cpu()
    step = 2**-8 * float(case.o_ref.abs().max())
    print(
        f"max |chunk - paths| = {float((o_chunk - o_paths).abs().max()):.3g}, bf16 step {step:.3g}"
    )
    assert (o_chunk - o_paths).abs().max() <= step
    assert max((o - case.o_ref).abs().max() for o in (o_chunk, o_paths)) <= 2 * step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
@pytest.mark.parametrize("N", [32, 128, 256])
@pytest.mark.parametrize("kernel", ["root_paths", "chunk", "chunk_tf32"])
def test_tree_verify_is_batch_invariant_on_gpu(kernel, N):
    """A request's outputs and scratch words are bit-identical alone (bs 1) and as request 3 of
    a batch of 8 (SGLang's deterministic mode asks this of every kernel in the round), in one
    block of nodes and in blocks."""
    fn = {
        "root_paths": tree_verify,
        "chunk": chunk_tree_verify,
        "chunk_tf32": partial(chunk_tree_verify, precision="tf32"),
    }[kernel]
    gen = torch.Generator().manual_seed(31)
    bs, r = 8, 3
    parents = builder_parents(bs, N, 16, gen)
    case = Case(parents, 16, 48, 128, 128, gen, dtype=torch.bfloat16, device="cuda")

    def run(rows, slots, scratch_slots, par):
        scratch = torch.zeros_like(case.scratch)
        o = fn(
            case.q[rows],
            case.k[rows],
            case.v[rows],
            case.a[rows],
            case.b[rows],
            case.A_log,
            case.dt_bias,
            case.pool,
            slots,
            par,
            scratch,
            scratch_slots,
            max_path=16,
        )
        return o, scratch

    o_all, scratch_all = run(slice(None), case.slots, case.scratch_slots, case.parents)
    rows = slice(r * N, (r + 1) * N)
    o_one, scratch_one = run(
        rows, case.slots[r : r + 1], case.scratch_slots[r : r + 1], case.parents[r : r + 1]
    )
    assert torch.equal(o_one, o_all[rows])
    row = int(case.scratch_slots[r])
    assert torch.equal(scratch_one[row], scratch_all[row])


# --- the SGLang hooks (state/gdn.py), under the interpreter ------------------------------


def test_hook_targets_exist_with_the_signatures_the_hooks_assume():
    """The two GDN hook targets in installed SGLang, called the way state/gdn.py calls
    the originals."""
    import inspect

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks
    from sglang_ddtree.state import gdn

    pytest.importorskip("sglang.srt.layers.attention.linear.gdn_backend")
    assert hooks.HOOKS[compat.GDN_TARGET_VERIFY] is gdn.target_verify
    assert hooks.HOOKS[compat.MAMBA_STATE_COMMIT] is gdn.commit
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNKernelDispatcher

    verify = list(inspect.signature(GDNKernelDispatcher.target_verify).parameters)
    assert verify[:8] == ["self", "A_log", "dt_bias", "q", "k", "v", "a", "b"]
    commit = inspect.signature(HybridLinearAttnBackend.update_mamba_state_after_mtp_verify)
    # the hook: the GDN state it is bound to, SGLang's function, then that function's parameters
    assert list(commit.parameters)[1:] == list(inspect.signature(gdn.commit).parameters)[3:]
    assert callable(compat.scatter_mamba_states_after_mtp_verify())


@interpreter_only
@pytest.mark.parametrize("verify", ["paths", "chunk"])
@pytest.mark.parametrize("compact", [False, True], ids=["sglangs_buffer", "compact_scratch"])
def test_hooks_commit_the_state_sglangs_own_tree_verify_and_commit_would(
    monkeypatch, caplog, compact, verify
):
    """One GDN layer through both hooks, as SGLang's GDN backend calls them (q [1, T, H, K], the
    pool, the per-layer intermediate buffer, retrieve_parent_token), against SGLang's own
    TritonGDNKernel.target_verify (per-node states) + its commit (the accepted node's state):
    the same outputs and the same committed states, in the request slot and the track slot.
    The hooks' scratch: SGLang's per-node state buffer (--enable-unified-memory), or the
    compact one (state/gdn_pool.py, the default); the verify: root paths (deterministic
    inference) or the chunked form (the default)."""
    import dataclasses
    from types import SimpleNamespace

    pytest.importorskip("sglang.srt.layers.attention.linear.kernels.gdn_triton")
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
    from sglang.srt.mem_cache.memory_pool import MambaPool

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.state import gdn

    gen = torch.Generator().manual_seed(13)
    bs, N, H, HV, K, V, block = 2, 12, 2, 4, 16, 16, 5
    parents = builder_parents(bs, N, block, gen)
    parents[:, 0] = 0  # SGLang's conv kernel leaves the root's entry as it finds it
    case = Case(parents, H, HV, K, V, gen, dtype=torch.bfloat16)
    T = bs * N
    L, S = 1, bs + 3
    temporal = case.pool[None].clone()  # [L, S, HV, V, K]
    inter = torch.zeros((L, bs + 1, N, HV, V, K))  # SGLang: one row per request + padding
    kwargs = dict(
        ssm_states=temporal[0],
        cache_indices=case.slots,
        query_start_loc=torch.arange(0, T + 1, N, dtype=torch.int32),
        intermediate_states_buffer=inter[0],
        intermediate_state_indices=torch.arange(bs, dtype=torch.int32),
        cache_steps=N,
        retrieve_parent_token=parents,
    )
    args = (case.A_log, case.dt_bias, case.q[None], case.k[None], case.v[None], case.a, case.b)
    kernel = TritonGDNKernel()
    o_sglang = type(kernel).target_verify(kernel, *args, **kwargs)  # SGLang's own, the reference
    last = torch.tensor([N - 1, 3])
    expected = inter[0, torch.arange(bs), last].clone()  # what SGLang's commit copies
    track_node = torch.tensor([-1, root_path(parents, 1, 3)[1]])
    expected_track = inter[0, 1, track_node[1]].clone()

    state = gdn.GDNState(gdn.GDNPath(block, verify=verify, compact=compact))  # the process's
    caplog.set_level("INFO", logger=gdn.__name__)
    inter.fill_(float("nan"))  # the hooks must not read SGLang's per-node states
    scratch = (
        torch.full((L, bs + 1, scratch_floats(N, HV, K, V)), float("nan")) if compact else inter
    )
    kwargs["intermediate_states_buffer"] = scratch[0]
    # the conv part (3 channels, K = 3): on the compact pool each row's front holds the nodes'
    # inputs [N, 3] (conv_tree's save_inputs) and the commit builds the windows from them
    conv0 = torch.randn(L, S, 3, 2, generator=gen)
    windows = torch.randn(L, bs + 1, N, 3, 2, generator=gen)
    caches = MambaPool.SpeculativeState(
        conv=[conv0.clone()],
        temporal=temporal,
        intermediate_ssm=scratch,
        intermediate_conv_window=[windows],
    )
    o_ours = gdn.target_verify(state, None, None, *args, **kwargs)
    assert o_ours.shape == o_sglang.shape and o_ours.dtype == o_sglang.dtype
    assert (o_ours.float() - o_sglang.float()).abs().max() <= 2**-8
    scattered = []
    monkeypatch.setattr(
        compat, "scatter_mamba_states_after_mtp_verify", lambda: lambda *a: scattered.append(a)
    )
    meta = SimpleNamespace(retrieve_parent_token=parents, mamba_cache_indices=case.slots)
    # the scheduler names track slots virtually (a unified pool): the commit translates them, as
    # SGLang's own commit does (here virtual = physical + 100); the state slots come physical
    pool = SimpleNamespace(
        get_speculative_mamba2_params_all_layers=lambda: caches,
        translate_mamba_indices=lambda i: torch.where(i >= 0, i - 100, i),
    )
    backend = SimpleNamespace(
        linear_attn_backend=SimpleNamespace(
            forward_metadata=meta,
            req_to_token_pool=pool,
            verify_intermediate_state_indices=torch.arange(bs + 1, dtype=torch.int32),
        )
    )
    free = next(s for s in range(S) if s not in case.slots.tolist())
    track_idx = torch.tensor([-1, free + 100], dtype=torch.int32)
    gdn.commit(state, None, backend, last, track_idx, track_node, model=None)
    for b in range(bs):
        got = temporal[0, int(case.slots[b])]
        torch.testing.assert_close(got, expected[b], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(temporal[0, free], expected_track, rtol=1e-5, atol=1e-5)
    # what the GPU tests look for in a server's log (once per process)
    kernel = "chunk_tree.chunk_tree_verify" if verify == "chunk" else "tree_verify"
    assert caplog.text.count(f"first GDN tree verify through sglang_ddtree.gdn.{kernel}") == 1
    assert caplog.text.count("first GDN state commit through sglang_ddtree.gdn") == 1
    if compact:  # the windows from the stored inputs (conv_tree.commit_windows), no scatter
        assert not scattered
        inter_rows = backend.linear_attn_backend.verify_intermediate_state_indices
        for b, (slot, node) in enumerate(
            [*zip(case.slots.tolist(), last.tolist(), strict=True), (free, int(track_node[1]))]
        ):
            b = min(b, bs - 1)  # the track slot is request 1's
            inputs = windows[0, int(inter_rows[b])].reshape(-1)[: N * 3].view(N, 3)
            history = conv0[0, int(case.slots[b])]
            want = conv_window_reference(inputs, history, parents[b], node)
            assert torch.equal(caches.conv[0][0, slot], want), (b, slot)
        return
    (conv_call,) = scattered  # the conv windows go through SGLang's scatter, states not
    assert conv_call[0].temporal.numel() == 0 and conv_call[0].conv is caches.conv
    assert dataclasses.replace(conv_call[0], temporal=temporal).intermediate_ssm is scratch


def test_an_unsupported_pool_names_the_fix():
    from sglang_ddtree.config import DDTreeConfig, Options
    from sglang_ddtree.state import gdn

    cfg = DDTreeConfig(block_size=16, num_nodes=32, topk=8)
    state = gdn.configure(Options(), cfg)
    assert state.path.max_path == 16
    # a pool whose K is not contiguous (a transposed layout): a clear error, not wrong numbers
    bs, N, H, HV, K, V = 1, 4, 1, 2, 8, 8
    pool = torch.zeros(2, HV, K, V).transpose(-1, -2)
    kwargs = dict(
        ssm_states=pool,
        cache_indices=torch.zeros(1, dtype=torch.int32),
        query_start_loc=None,
        cache_steps=N,
        retrieve_parent_token=torch.tensor([[0, 0, 1, 1]]),
        intermediate_states_buffer=torch.zeros(2, N, HV, V, K),
        intermediate_state_indices=torch.zeros(1, dtype=torch.int32),
    )
    q = torch.zeros(1, bs * N, H, K)
    v = torch.zeros(1, bs * N, HV, V)
    ab = torch.zeros(bs * N, HV)
    with pytest.raises(RuntimeError, match="cannot run on this Mamba pool.*serve it with DFLASH"):
        gdn.target_verify(
            state, None, None, torch.zeros(HV), torch.zeros(HV), q, q, v, ab, ab, **kwargs
        )
