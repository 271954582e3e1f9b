"""sglang_ddtree.gdn.tree_verify: the register-carried Gated DeltaNet tree verify and the replay
commit against their plain-torch definitions, and the state traffic they save.

CPU: the kernels run under Triton's interpreter, chosen before triton is imported, so those
tests run in a child process (as in test_tree_build_triton.py).
Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_gdn_tree_verify.py -m "not gpu"
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang_ddtree.gdn.tree_verify import (
    dfs_preorder_reference,
    relabel_parents,
    replay_path,
    replay_reference,
    root_paths,
    state_traffic,
    store_flags,
    tree_verify,
    tree_verify_reference,
)
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import (
    random_build_inputs,
    run_cpu_tests_under_triton_interpreter,
)

torch.set_num_threads(1)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter process")
INTERPRETER_TESTS = 9  # non-gpu tests the child process runs (all but this one); it must pass all


def test_cpu_kernel_tests_under_triton_interpreter():
    if INTERPRETED:
        pytest.skip("already inside the interpreter process")
    run_cpu_tests_under_triton_interpreter(__file__, INTERPRETER_TESTS)


def random_parents(bs: int, N: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, N] parents in an arbitrary parent < child order (node 0 = root, parent -1)."""
    rows = [[-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, N)]
            for _ in range(bs)]  # fmt: skip
    return torch.tensor(rows, dtype=torch.int64)


def random_inputs(bs, N, H, HV, K, V, gen, dtype=torch.float32, device="cpu"):
    T = bs * N

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = r(T, H, K).to(dtype), r(T, H, K).to(dtype), r(T, HV, V).to(dtype)
    g = -torch.rand(T, HV, generator=gen).to(device)  # log decay in (-1, 0]
    beta = torch.rand(T, HV, generator=gen).to(device)
    h0 = 0.1 * r(bs, HV, V, K)
    return q, k, v, g, beta, h0


def deepest_paths(parents: torch.Tensor, gen: torch.Generator):
    """A random node per request and its root path: (path, path_len, node), the path one column
    wider than the longest so that padding must be ignored."""
    bs, N = parents.shape
    ends = [int(torch.randint(0, N, (1,), generator=gen)) for _ in range(bs)]
    path, path_len = root_paths(parents, ends)
    padded = torch.zeros((bs, path.shape[1] + 1), dtype=torch.int64)
    padded[:, :-1] = path
    return padded, path_len, ends


# --- plain torch, no interpreter needed --------------------------------------------------------


def test_store_flags_mark_exactly_the_nodes_a_later_sibling_starts_from():
    # 0 -> 1 -> 2, 0 -> 3, 1 -> 4: node 0 (child 3) and node 1 (child 4) are reloaded from
    parents = torch.tensor([[-1, 0, 1, 0, 1]])
    assert store_flags(parents).tolist() == [[1, 1, 0, 0, 0]]
    assert state_traffic(parents) == (2, 2)  # loads at 3 and 4; SGLang: 4 loads, 5 stores
    chain = torch.tensor([[-1, 0, 1, 2]])
    assert store_flags(chain).tolist() == [[0, 0, 0, 0]] and state_traffic(chain) == (0, 0)


def test_replay_reference_reaches_the_state_the_tree_walk_computed():
    gen = torch.Generator().manual_seed(1)
    bs, N, H, HV, K, V = 3, 11, 2, 4, 8, 12
    parents = random_parents(bs, N, gen)
    q, k, v, g, beta, h0 = random_inputs(bs, N, H, HV, K, V, gen)
    _, states = tree_verify_reference(q, k, v, g, beta, h0, parents, scale=0.3)
    path, path_len, ends = deepest_paths(parents, gen)
    final = replay_reference(k, v, g, beta, h0, path, path_len, N)
    for b in range(bs):
        torch.testing.assert_close(final[b], states[b, ends[b]], rtol=1e-5, atol=1e-6)


def test_dfs_preorder_keeps_parents_first_and_cuts_state_traffic_on_ddtrees():
    """On DDTrees from the builder (best-first node order), preorder needs fewer state loads
    and stores than the builder's order, and both need far fewer than SGLang's per-node ones."""
    gen = torch.Generator().manual_seed(0)
    totals = {"best_first": [0, 0], "preorder": [0, 0]}
    bs, N = 8, 64
    root, ids, lps = random_build_inputs(gen, bs, 15, 8, 1000, mode="continuous")
    tree = build_tree_reference(root, ids, lps, N - 1)
    parents = tree.parents.clone()
    parents[:, 0] = -1
    perm = dfs_preorder_reference(parents)
    pre = relabel_parents(parents, perm)
    assert (pre[:, 1:] < torch.arange(1, N)[None, :]).all()
    assert torch.equal(torch.sort(perm, 1).values, torch.arange(N).expand(bs, N))
    for name, p in (("best_first", parents), ("preorder", pre)):
        totals[name] = list(state_traffic(p))
    sglang = [bs * (N - 1), bs * N]
    print("state loads / stores for 8 trees of 64 nodes:", totals, "SGLang:", sglang)
    assert sum(totals["preorder"]) < sum(totals["best_first"]) < sum(sglang)


# --- the kernels, under the interpreter --------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("l2norm", [True, False])
def test_tree_verify_matches_reference_in_any_parent_first_order(l2norm):
    gen = torch.Generator().manual_seed(2 + l2norm)
    bs, N, H, HV, K, V = 2, 9, 2, 4, 16, 48  # V = 48: two V blocks of 32, the second masked
    parents = random_parents(bs, N, gen)
    q, k, v, g, beta, h0 = random_inputs(bs, N, H, HV, K, V, gen)
    o, scratch = tree_verify(q, k, v, g, beta, h0, parents, scale=0.25, l2norm=l2norm)
    o_ref, states = tree_verify_reference(q, k, v, g, beta, h0, parents, scale=0.25, l2norm=l2norm)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    flags = store_flags(parents).bool()
    torch.testing.assert_close(scratch[flags], states[flags], rtol=1e-5, atol=1e-5)


@interpreter_only
def test_tree_verify_in_preorder_matches_reference_on_a_ddtree():
    gen = torch.Generator().manual_seed(5)
    bs, N, H, HV, K, V = 2, 16, 1, 2, 16, 16
    root, ids, lps = random_build_inputs(gen, bs, 6, 3, 100, mode="continuous")
    parents = build_tree_reference(root, ids, lps, N - 1).parents.clone()
    parents[:, 0] = -1
    parents = relabel_parents(parents, dfs_preorder_reference(parents))
    q, k, v, g, beta, h0 = random_inputs(bs, N, H, HV, K, V, gen, dtype=torch.bfloat16)
    o, _ = tree_verify(q, k, v, g, beta, h0, parents, scale=0.25)
    o_ref, _ = tree_verify_reference(q, k, v, g, beta, h0, parents, scale=0.25)
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)  # o is stored in bf16


@interpreter_only
def test_replay_path_matches_the_reference_state_of_the_accepted_node():
    gen = torch.Generator().manual_seed(7)
    bs, N, H, HV, K, V = 3, 10, 2, 4, 16, 40
    parents = random_parents(bs, N, gen)
    q, k, v, g, beta, h0 = random_inputs(bs, N, H, HV, K, V, gen)
    _, states = tree_verify_reference(q, k, v, g, beta, h0, parents, scale=1.0)
    path, path_len, ends = deepest_paths(parents, gen)
    out = replay_path(k, v, g, beta, h0, path, path_len)
    torch.testing.assert_close(out, states[torch.arange(bs), ends], rtol=1e-5, atol=1e-5)


@interpreter_only
@pytest.mark.parametrize("order", ["best_first", "preorder"])
def test_tree_verify_and_replay_equal_sglangs_own_verify_and_commit(order):
    """scripts/bench_gdn_tree.py's comparison, on the CPU: SGLang 0.5.17's tree-verify kernel
    (fused_sigmoid_gating_delta_rule_update with retrieve_parent_token) and its commit (the
    accepted node's stored state) against tree_verify + replay_path on the same builder trees."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent")
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_gdn_tree.py"
    spec = importlib.util.spec_from_file_location("bench_gdn_tree", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    parents = dict(zip(("best_first", "preorder"), bench.trees(2, 12, seed=3), strict=True))
    row = bench.run_one(2, 12, order, parents[order], 1, device="cpu", heads=(2, 4, 16, 32))
    assert row["max_abs_diff_o"] <= 2**-8, row  # one bf16 step at |o| < 1
    assert row["max_abs_diff_state"] < 1e-5, row


# --- the kernels on the GPU --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
def test_tree_verify_and_replay_on_gpu_at_qwen36_head_sizes():
    gen = torch.Generator().manual_seed(11)
    bs, N, H, HV, K, V = 2, 32, 16, 48, 128, 128
    parents = random_parents(bs, N, gen)
    inputs = random_inputs(bs, N, H, HV, K, V, gen, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta, h0 = inputs
    o, _ = tree_verify(q, k, v, g, beta, h0, parents.cuda(), scale=K**-0.5)
    cpu = [x.cpu() for x in inputs]
    o_ref, states = tree_verify_reference(*cpu, parents, scale=K**-0.5)
    torch.testing.assert_close(o.float().cpu(), o_ref, rtol=2e-2, atol=2e-2)
    path, path_len, ends = deepest_paths(parents, gen)
    out = replay_path(k, v, g, beta, h0, path.cuda(), path_len.cuda())
    torch.testing.assert_close(out.cpu(), states[torch.arange(bs), ends], rtol=1e-4, atol=1e-4)
