"""sglang_ddtree.gdn.conv_tree: the tree conv1d with every node in parallel against SGLang's
own `causal_conv1d_update` tree path: the same outputs, intermediate windows and parent links.

CPU: both kernels run under Triton's interpreter, in a child process (as test_gdn_tree_verify.py).
Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_conv_tree.py -m "not gpu"
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from sglang_ddtree.gdn.conv_tree import commit_windows, conv_tree
from sglang_ddtree.tree import build_tree_reference
from sglang_ddtree.tree.testing import (
    eagle_links,
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
test_cpu_kernel_tests_under_triton_interpreter = interpreter_process_test(__file__, 14)


def trees(bs: int, N: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    root, ids, lps = random_build_inputs(gen, bs, 7, 4, 100, mode="continuous")
    parents = build_tree_reference(root, ids, lps, N - 1).parents.clone()
    parents[:, 0] = -1
    return parents


def run_both(
    parents,
    dim,
    dtype,
    pad_last=False,
    device="cpu",
    seed=0,
    rows_reversed=False,
    ours_width=None,
    **ours,
):
    """Ours (with the keyword arguments `ours`) and SGLang's on the same inputs:
    {name: (o, windows, parents), "setup": (x, the conv state before, slots, rows)}.
    rows_reversed: the intermediate rows in the reverse of the batch order (they need not
    follow it); ours_width: the last dimension of our window buffer (default K - 1; 1 for the
    compact pool's inputs once)."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    gen = torch.Generator().manual_seed(seed)
    bs, N = parents.shape
    KW, slots = 4, bs + 2

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    x = r(bs, N, dim).transpose(1, 2)  # [bs, dim, N] view, as SGLang's GDN backend passes it
    weight, bias = r(dim, KW), r(dim)
    state0 = r(slots, dim, KW - 1)
    idx = torch.randperm(slots, generator=gen)[:bs].to(torch.int32).to(device)
    if pad_last:
        idx[-1] = -1
    inter_idx = torch.arange(bs, dtype=torch.int32, device=device)
    if rows_reversed:
        inter_idx = inter_idx.flip(0)
    nxt, sib = (t.to(device) for t in eagle_links(parents))
    out = {"setup": (x, state0, idx, inter_idx), "weights": (weight, bias)}
    for name, fn in (("sglang", causal_conv1d_update), ("ours", partial(conv_tree, **ours))):
        state = state0.clone()
        width = KW - 1 if name == "sglang" or ours_width is None else ours_width
        windows = torch.zeros((bs + 1, N, dim, width), dtype=dtype, device=device)
        par = torch.full((bs, N), 99, dtype=torch.int64, device=device)
        o = fn(
            x,
            state,
            weight,
            bias,
            "silu",
            conv_state_indices=idx,
            intermediate_conv_window=windows,
            intermediate_state_indices=inter_idx,
            retrieve_next_token=nxt,
            retrieve_next_sibling=sib,
            retrieve_parent_token=par,
        )
        out[name] = (o, windows, par)
    return out


TILINGS = {
    "per_slot": {},
    "window_tile": {"window_tile": True, "block_n": 32, "block_t": 8},
    "ancestor_table": {"ancestor_table": True},
}


@interpreter_only
@pytest.mark.parametrize("tiling", TILINGS)
def test_conv_tree_equals_sglangs_tree_conv(tiling):
    """float32 (the interpreter's bfloat16 arithmetic is not the GPU's; the GPU test below runs
    bfloat16, the serving dtype). Both ways of storing the windows."""
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    parents = trees(3, 13, seed=1)
    out = run_both(
        parents,
        dim=40,
        dtype=torch.float32,
        pad_last=True,  # 40: a masked block
        **TILINGS[tiling],
    )
    (o, win, par), (o_s, win_s, par_s) = out["ours"], out["sglang"]
    live = slice(0, 2)  # request 2 is padding: SGLang writes nothing for it (ours: its parents)
    assert torch.equal(par[live], par_s[live])
    expected = parents.clamp(min=0)
    expected[:, 0] = 0
    assert torch.equal(par, expected)  # the parents of the tree, root 0 as SGLang leaves it
    assert torch.equal(o[live], o_s[live])
    assert torch.equal(win[:2], win_s[:2])


@interpreter_only
@pytest.mark.parametrize("tiling", TILINGS)
def test_conv_tree_on_deep_chains_reads_the_history_above_the_root(tiling):
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    parents = torch.tensor([[-1, 0, 1, 2, 3, 0, 5]])  # depth 4 chain and a side branch
    out = run_both(parents, dim=8, dtype=torch.float32, seed=3, **TILINGS[tiling])
    (o, win, _), (o_s, win_s, _) = out["ours"], out["sglang"]
    assert torch.equal(o, o_s) and torch.equal(win, win_s)


@interpreter_only
def test_an_ancestor_table_from_an_earlier_layer_serves_the_later_layers():
    """conv_tree(ancestors=...): the table the first layer's tree_parents wrote, read by a later
    layer with fill_parents=False, gives SGLang's outputs and windows; a table with the parents
    kernel, of the wrong shape or not contiguous is refused."""
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    from sglang_ddtree.gdn.conv_tree import tree_parents

    parents = trees(3, 13, seed=4)
    out = run_both(parents, dim=40, dtype=torch.float32, pad_last=True, seed=4)
    x, state0, idx, inter_idx = out["setup"]
    bs, N = parents.shape
    nxt, sib = eagle_links(parents)
    par = torch.zeros((bs, N), dtype=torch.int64)
    table = torch.zeros((bs, N, 3), dtype=torch.int32)
    tree_parents(nxt, sib, par, table)
    windows = torch.zeros((bs + 1, N, 40, 3))
    o = conv_tree(
        x,
        state0.clone(),
        *out["weights"],
        "silu",
        conv_state_indices=idx,
        intermediate_conv_window=windows,
        intermediate_state_indices=inter_idx,
        retrieve_next_token=nxt,
        retrieve_next_sibling=sib,
        retrieve_parent_token=par,
        fill_parents=False,
        ancestors=table,
    )
    o_s, win_s, _ = out["sglang"]
    assert torch.equal(o[:2], o_s[:2]) and torch.equal(windows[:2], win_s[:2])
    call = partial(
        conv_tree,
        x,
        state0.clone(),
        *out["weights"],
        "silu",
        conv_state_indices=idx,
        intermediate_conv_window=windows,
        intermediate_state_indices=inter_idx,
        retrieve_next_token=nxt,
        retrieve_next_sibling=sib,
        retrieve_parent_token=par,
    )
    for bad in (
        dict(ancestors=table),
        dict(ancestors=table[:, :-1], fill_parents=False),
        dict(ancestors=table.transpose(1, 2).contiguous().transpose(1, 2), fill_parents=False),
    ):
        with pytest.raises(ValueError, match="earlier tree_parents"):
            call(**bad)


def inputs_case(bs, N, dim, seed, pad_last=False):
    """SGLang's tree conv (windows) and ours with save_inputs into the compact pool's
    [.., N, dim, 1] buffer, rows out of batch order: (results, x, conv state, slots, rows)."""
    out = run_both(
        trees(bs, N, seed),
        dim,
        torch.float32,
        pad_last,
        seed=seed,
        rows_reversed=True,
        ours_width=1,
        save_inputs=True,
    )
    return out, *out.pop("setup")


@interpreter_only
def test_conv_tree_can_store_each_nodes_input_once():
    """save_inputs: the same outputs and parents as SGLang's kernel, and each live request's row
    of the window buffer begins with its nodes' inputs as [N, dim]."""
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    bs, N, dim = 3, 13, 40
    got, x, _, _, inter_idx = inputs_case(bs, N, dim, seed=8, pad_last=True)
    (o, buf, par), (o_s, _, par_s) = got["ours"], got["sglang"]
    assert torch.equal(o[:2], o_s[:2]) and torch.equal(par[:2], par_s[:2])
    for b in range(2):
        front = buf[int(inter_idx[b])].reshape(-1)[: N * dim].view(N, dim)
        assert torch.equal(front, x[b].transpose(0, 1))


@interpreter_only
def test_the_window_commit_from_inputs_equals_sglangs_committed_windows():
    """commit_windows over two layers: each request's slot gets SGLang's per-node window of its
    accepted node (SGLang's scatter copies exactly that), the track slot its track node's, from
    the slot's own history above the root; the padding request's slot and all others stay."""
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    bs, N, dim, km1 = 3, 13, 40, 3
    # one tree for both layers (a verify's layers share it): layer 1's inputs (another case's
    # random numbers) are read through layer 0's parents
    got1, x1, state1, idx, inter_idx = inputs_case(bs, N, dim, seed=9, pad_last=True)
    _, x2, state2, _, _ = inputs_case(bs, N, dim, seed=10, pad_last=True)
    parents = got1["ours"][2]
    nodes = torch.tensor([N - 1, 0, 5])  # request 1: the root only; request 2: padding
    states = torch.stack([state1, state2])  # [layers, slots, dim, K - 1]
    inputs = torch.full((2, bs + 1, N, dim, km1), float("nan"))
    for layer, x in enumerate((x1, x2)):
        for b in range(bs):
            inputs[layer, int(inter_idx[b])].view(-1)[: N * dim] = x[b].transpose(0, 1).reshape(-1)
    free = next(s for s in range(states.shape[1]) if s not in idx.tolist())
    path = []
    cur = int(nodes[0])
    while cur > 0:
        path.append(cur)
        cur = int(parents[0, cur])
    free2 = next(s for s in range(states.shape[1]) if s not in [*idx.tolist(), free])
    # request 1 has a track slot but no track step this round (-1): that slot must stay
    track_idx = torch.tensor([free, free2, -1], dtype=torch.int32)
    track_node = torch.tensor([path[-1] if path else 0, -1, -1])
    before = states.clone()
    commit_windows(states, inputs, idx, inter_idx, parents, nodes, track_idx, track_node)
    (_, windows_s, _) = got1["sglang"]
    for layer, x in enumerate((x1, x2)):
        for b in range(2):
            slot = int(idx[b])
            want = conv_window_reference(
                x[b].transpose(0, 1), before[layer, slot], parents[b], int(nodes[b])
            )
            assert torch.equal(states[layer, slot], want), (layer, b)
            if layer == 0:  # SGLang's own per-node window of that node
                assert torch.equal(states[0, slot], windows_s[int(inter_idx[b]), int(nodes[b])])
        track_want = conv_window_reference(
            x[0].transpose(0, 1), before[layer, int(idx[0])], parents[0], int(track_node[0])
        )
        assert torch.equal(states[layer, free], track_want)
    touched = {int(idx[0]), int(idx[1]), free}
    for s in range(states.shape[1]):
        if s not in touched:
            assert torch.equal(states[:, s], before[:, s]), s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
@pytest.mark.parametrize("tiling", ["default", "window_tile", "ancestor_table"])
def test_conv_tree_equals_sglangs_tree_conv_on_gpu_in_bf16_at_qwen36_width(tiling):
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    parents = trees(4, 64, seed=2)
    kw = {
        "default": {},
        "window_tile": {"window_tile": True, "block_n": 128},
        "ancestor_table": {"ancestor_table": True},
    }[tiling]
    out = run_both(parents, dim=10240, dtype=torch.bfloat16, device="cuda", **kw)
    (o, win, par), (o_s, win_s, par_s) = out["ours"], out["sglang"]
    assert torch.equal(par, par_s) and torch.equal(win, win_s)
    assert (o.float() - o_s.float()).abs().max() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
def test_inputs_once_and_the_window_commit_equal_sglangs_scatter_on_gpu_in_bf16():
    """At Qwen3.6-27B's conv width in bf16: SGLang's tree conv + its own scatter of the accepted
    node's window against conv_tree(save_inputs=True) + commit_windows, request and track
    slots, bit for bit."""
    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
        fused_conv_window_scatter_with_mask,
    )

    bs, N, dim, KW, dev = 4, 64, 10240, 4, "cuda"
    gen = torch.Generator(device=dev).manual_seed(3)
    parents = trees(bs, N, seed=2)
    x = torch.randn(bs, N, dim, generator=gen, device=dev).bfloat16().transpose(1, 2)
    weight = torch.randn(dim, KW, generator=gen, device=dev).bfloat16()
    bias = torch.randn(dim, generator=gen, device=dev).bfloat16()
    states = torch.randn(1, bs + 4, dim, KW - 1, generator=gen, device=dev).bfloat16()
    idx = torch.arange(1, bs + 1, dtype=torch.int32, device=dev)
    rows = torch.arange(bs, dtype=torch.int32, device=dev)
    nxt, sib = (t.to(dev) for t in eagle_links(parents))
    nodes = torch.tensor([N - 1, 0, 7, 33], device=dev)
    track_idx = torch.tensor([bs + 1, -1, bs + 2, -1], dtype=torch.int32, device=dev)
    track_node = torch.tensor([5, -1, 1, -1], device=dev)
    results = []
    for kind in ("sglang", "ours"):
        state = states.clone()
        buf = torch.zeros((1, bs + 1, N, dim, KW - 1), dtype=torch.bfloat16, device=dev)
        par = torch.zeros((bs, N), dtype=torch.int64, device=dev)
        fn = causal_conv1d_update if kind == "sglang" else partial(conv_tree, save_inputs=True)
        fn(
            x,
            state[0].clone(),
            weight,
            bias,
            "silu",
            conv_state_indices=idx,
            intermediate_conv_window=buf[0],
            intermediate_state_indices=rows,
            retrieve_next_token=nxt,
            retrieve_next_sibling=sib,
            retrieve_parent_token=par,
        )
        if kind == "sglang":
            fused_conv_window_scatter_with_mask(state, buf, idx, nodes)
            fused_conv_window_scatter_with_mask(state, buf, track_idx, track_node)
        else:
            commit_windows(state, buf, idx, rows, par, nodes, track_idx, track_node)
        results.append(state)
    assert torch.equal(results[0], results[1])


def test_conv_hook_target_exists_and_the_hook_passes_everything_else_through(monkeypatch):
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks
    from sglang_ddtree.state import gdn

    module = pytest.importorskip("sglang.srt.layers.attention.linear.gdn_backend")
    assert callable(module.causal_conv1d_update)
    assert compat.GDN_CONV_UPDATE.rsplit(".", 1) == [module.__name__, "causal_conv1d_update"]
    assert hooks.HOOKS[compat.GDN_CONV_UPDATE] is gdn.conv_update
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "sglang"

    tree = {k: object() for k in gdn._CONV_TREE_ARGS}
    state = gdn.GDNState(gdn.GDNPath(16, compact=False))
    single = {"conv_state_indices": object()}  # a decode step, not a tree
    assert gdn.conv_update(state, original, 1, 2, 3, None, "silu", **single) == "sglang"
    extra = {**tree, "num_accept_tokens": object()}  # a call conv_tree does not cover
    assert gdn.conv_update(state, original, 1, 2, 3, None, "silu", **extra) == "sglang"
    # a 6th positional argument
    assert gdn.conv_update(state, original, 1, 2, 3, None, "silu", None, **tree) == "sglang"
    # on the compact pool the commit reads the nodes' inputs: a tree call SGLang's kernel would
    # take instead (its per-node windows) is refused, a non-tree call still passes
    state = gdn.GDNState(gdn.GDNPath(16))
    with pytest.raises(RuntimeError, match="compact GDN pool.*--enable-unified-memory"):
        gdn.conv_update(state, original, 1, 2, 3, None, "silu", **extra)
    assert gdn.conv_update(state, original, 1, 2, 3, None, "silu", **single) == "sglang"
    assert len(calls) == 4


def test_the_conv_hook_stores_inputs_once_on_the_compact_pool_only(monkeypatch):
    """On DDTREE's compact pool the hook asks conv_tree for the nodes' inputs (the commit builds
    the windows from them, conv_tree.commit_windows); on SGLang's pool for SGLang's windows."""
    import sglang_ddtree.gdn.conv_tree as conv_module
    from sglang_ddtree.state import gdn

    seen = []
    monkeypatch.setattr(conv_module, "conv_tree", lambda *a, **k: seen.append(k["save_inputs"]))
    tree = {k: torch.zeros(2, 3) for k in gdn._CONV_TREE_ARGS}
    for compact in (True, False):
        state = gdn.GDNState(gdn.GDNPath(16, compact=compact))
        x = torch.zeros(1)
        gdn.conv_update(state, None, x, torch.zeros(1), torch.zeros(1), None, "silu", **tree)
    assert seen == [True, False]


@interpreter_only
def test_conv_hook_runs_conv_tree_when_enabled(monkeypatch, caplog):
    mod = pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    import sglang_ddtree.gdn.conv_tree as conv_module
    from sglang_ddtree.state import gdn

    state = gdn.GDNState(gdn.GDNPath(16, compact=False))
    caplog.set_level("INFO", logger=gdn.__name__)
    used = []
    plain = conv_module.conv_tree
    monkeypatch.setattr(conv_module, "conv_tree", lambda *a, **k: used.append(1) or plain(*a, **k))
    original = mod.causal_conv1d_update
    hooked = lambda *a, **k: gdn.conv_update(state, original, *a, **k)  # noqa: E731
    monkeypatch.setattr(mod, "causal_conv1d_update", hooked)  # run_both's "sglang" side: hooked
    out = run_both(trees(2, 9, seed=4), dim=24, dtype=torch.float32)
    (o, win, par), (o_h, win_h, par_h) = out["ours"], out["sglang"]
    assert used == [1]  # the hook went to conv_tree, with SGLang's call passed through intact
    assert "first tree conv1d through sglang_ddtree.gdn.conv_tree" in caplog.text  # GPU tests
    assert torch.equal(o, o_h) and torch.equal(win, win_h) and torch.equal(par, par_h)


@interpreter_only
def test_the_hook_fills_the_parents_in_the_first_layer_only(monkeypatch):
    """Two GDN layers of one verify through the hook: the first layer's call runs the parents
    kernel, the second reads the same buffer (its own parents kernel skipped: a stale buffer
    would change its windows), and both equal SGLang's kernel."""
    mod = pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    import sglang_ddtree.gdn.conv_tree as conv_module
    from sglang_ddtree.state import gdn

    hooks = gdn.GDNState(gdn.GDNPath(16, compact=False))  # the process's, once
    filled = []
    plain = conv_module.tree_parents
    monkeypatch.setattr(
        conv_module, "tree_parents", lambda *a, **k: filled.append(1) or plain(*a, **k)
    )
    gen = torch.Generator().manual_seed(6)
    parents = trees(2, 11, seed=6)
    bs, N = parents.shape
    dim, KW = 16, 4
    nxt, sib = eagle_links(parents)
    par = torch.full((bs, N), 99, dtype=torch.int64)  # SGLang's one buffer for every layer
    layers = [
        (
            torch.randn(bs, N, dim, generator=gen).transpose(1, 2),
            torch.randn(bs + 1, dim, KW - 1, generator=gen),
            torch.randn(dim, KW, generator=gen),
            torch.randn(dim, generator=gen),
        )
        for _ in range(2)
    ]
    idx = torch.arange(bs, dtype=torch.int32)
    for _ in range(2):  # two rounds: the first layer refills every round
        for x, state, weight, bias in layers:
            got, want = [], []
            for fn, out in (
                (lambda *a, **k: gdn.conv_update(hooks, mod.causal_conv1d_update, *a, **k), got),
                (mod.causal_conv1d_update, want),
            ):
                windows = torch.zeros((bs + 1, N, dim, KW - 1))
                own = torch.full((bs, N), 99, dtype=torch.int64)
                buf = par if out is got else own
                # the pool's per-layer conv state (fixed: the hook knows layers by it); SGLang's
                # kernel rolls it, so SGLang gets a copy
                o = fn(
                    x,
                    state if out is got else state.clone(),
                    weight,
                    bias,
                    "silu",
                    conv_state_indices=idx,
                    intermediate_conv_window=windows,
                    intermediate_state_indices=idx,
                    retrieve_next_token=nxt,
                    retrieve_next_sibling=sib,
                    retrieve_parent_token=buf,
                )
                out += [o, windows]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        par_after = par.clone()
        par.fill_(99)  # the next round's tree: the first layer must fill it again
    assert filled == [1, 1]  # once per round, in the first layer
    # a layer handed a parent buffer the first layer did not fill fills it itself
    x, state, weight, bias = layers[1]
    other = torch.full((bs, N), 99, dtype=torch.int64)
    gdn.conv_update(
        hooks,
        mod.causal_conv1d_update,
        x,
        state,
        weight,
        bias,
        "silu",
        conv_state_indices=idx,
        intermediate_conv_window=torch.zeros((bs + 1, N, dim, KW - 1)),
        intermediate_state_indices=idx,
        retrieve_next_token=nxt,
        retrieve_next_sibling=sib,
        retrieve_parent_token=other,
    )
    assert filled == [1, 1, 1] and torch.equal(other, par_after)


@interpreter_only
def test_bench_conv_checks_agree_on_the_cpu():
    """scripts/bench_gdn_tree.py --conv's configuration and checks, small, under the interpreter."""
    from tests.fixtures import load_script

    pytest.importorskip("sglang.kernels.ops.mamba.causal_conv1d_triton")
    bench = load_script("bench_gdn_tree")
    row = bench.run_conv(
        2,
        12,
        bench.trees(2, 12, seed=5),
        1,
        dim=24,
        device="cpu",
        tilings=["t8n16w4tile", "t16n32w4nosave"],
    )
    assert row["conv_max_abs_diff_o"] == 0.0, row
    assert row["conv_t8n16w4tile_equal"] and "conv_t16n32w4nosave_equal" not in row, row
    assert row["conv_windows_equal"] and row["conv_parents_equal"], row
    assert row["conv_inputs_equal"], row
