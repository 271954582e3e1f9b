"""Helpers for tests and benchmarks: random builder inputs, a host-side structural check of a
DraftTree, SGLang's sibling links of a tree (tests/fixtures.py runs a test file's CPU tests under
Triton's interpreter).

Not used on the serving path (they sync with the host freely).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from .build_reference import sibling_links
from .inputs import LOGPROB_FLOOR
from .types import DraftTree

# Log-prob values for tie-heavy inputs: equal values, zeros, the floor, below it and -inf.
TIE_VALUES = (0.0, -0.5, -0.5, -1.0, -2.0, LOGPROB_FLOOR, 2 * LOGPROB_FLOOR, float("-inf"))

LOGPROB_MODES = ("continuous", "ties", "dirty")


def eagle_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's (retrieve_next_token, retrieve_next_sibling) [bs, N] int64 for parent-first trees
    [bs, N]: `build_reference.sibling_links` of each row."""
    rows = [sibling_links(row) for row in parents.tolist()]
    first, sibling = zip(*rows, strict=True)
    return torch.tensor(first, dtype=torch.int64), torch.tensor(sibling, dtype=torch.int64)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """CUDA work inside the block raises on any host synchronisation (torch's sync debug mode
    "error"); work queued before it is finished first, so it cannot be blamed."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def random_logprobs(g: torch.Generator, shape: tuple[int, ...], mode: str) -> torch.Tensor:
    """float32 log-probs sorted non-increasing along the last dim (except mode 'dirty').

    continuous: -|N(0, 2)|, ties almost surely absent; ties: drawn from TIE_VALUES;
    dirty: TIE_VALUES plus NaN, +inf and positive values, unsorted (tests preprocessing).
    """
    if mode == "continuous":
        lp = torch.randn(shape, generator=g).abs().mul(-2.0)
        return lp.sort(dim=-1, descending=True)[0]
    values = torch.tensor(TIE_VALUES, dtype=torch.float32)
    if mode == "ties":
        picks = values[torch.randint(len(values), shape, generator=g)]
        return picks.sort(dim=-1, descending=True)[0]
    if mode == "dirty":
        values = torch.cat([values, torch.tensor([float("nan"), float("inf"), 0.25])])
        return values[torch.randint(len(values), shape, generator=g)]
    raise ValueError(f"mode must be one of {LOGPROB_MODES}, got {mode!r}")


def random_ids(g: torch.Generator, bs: int, L: int, K: int, vocab: int) -> torch.Tensor:
    """[bs, L, K] int64 ids, distinct within each position (as topk gives), repeats across."""
    scores = torch.rand(bs, L, vocab, generator=g)
    return scores.argsort(dim=-1)[..., :K].contiguous()


def random_build_inputs(
    g: torch.Generator, bs: int, L: int, K: int, vocab: int, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(root [bs], topk_ids [bs, L, K], topk_logprobs [bs, L, K]) for the builders."""
    root = torch.randint(vocab, (bs,), generator=g)
    return root, random_ids(g, bs, L, K, vocab), random_logprobs(g, (bs, L, K), mode)


def check_tree_invariants(tree: DraftTree) -> None:
    """Raise AssertionError unless the tree is structurally sound (host-side, per request)."""
    bs, N = tree.tokens.shape
    for name in tree._fields:
        t = getattr(tree, name)
        assert t.shape[:2] == (bs, N), f"{name} has shape {tuple(t.shape)}, expected {(bs, N)}"
    for b in range(bs):
        _check_one(
            *(getattr(tree, f)[b].tolist() for f in ("tokens", "parents", "depth")),
            tree.first_child[b].tolist(),
            tree.next_sibling[b].tolist(),
            tree.visibility[b].tolist(),
            tree.scores[b].tolist(),
        )


def _check_one(tokens, parents, depth, first_child, next_sibling, visibility, scores) -> None:
    N = len(tokens)
    assert parents[0] == -1 and depth[0] == 0 and scores[0] == 0.0 and next_sibling[0] == -1
    children: dict[int, list[int]] = {i: [] for i in range(N)}
    for i in range(1, N):
        p = parents[i]
        assert 0 <= p < i, f"node {i}: parent {p} not in [0, {i})"
        assert depth[i] == depth[p] + 1, f"node {i}: depth {depth[i]}, parent depth {depth[p]}"
        assert scores[i] <= scores[p], f"node {i}: score {scores[i]} > parent's {scores[p]}"
        children[p].append(i)
    for i, kids in children.items():
        assert first_child[i] == (kids[0] if kids else -1), f"first_child[{i}]"
        for a, b in zip(kids, kids[1:] + [-1], strict=False):
            assert next_sibling[a] == b, f"next_sibling[{a}] = {next_sibling[a]}, expected {b}"
        kid_tokens = [tokens[k] for k in kids]
        assert len(set(kid_tokens)) == len(kid_tokens), f"node {i}: repeated child tokens"
    for i in range(1, N):
        assert scores[i] <= scores[i - 1], f"node {i}: not in non-increasing score order"
    for i in range(N):
        ancestors, j = set(), i
        while j != -1:
            ancestors.add(j)
            j = parents[j]
        row = {j for j in range(N) if visibility[i][j]}
        assert row == ancestors, f"visibility row {i}: {sorted(row)} != {sorted(ancestors)}"


# aten ops that read tensor contents on the host or give data-dependent shapes.
DATA_DEPENDENT_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "item"}


def assert_static_graph(fn: Callable, *args: torch.Tensor) -> torch.fx.GraphModule:
    """Trace fn with fake tensors; fail on host reads, data-dependent shapes or value branches.

    A Python branch on a tensor value raises during tracing; .item()/.tolist() show up as
    _local_scalar_dense; nonzero and boolean-mask indexing give unbacked (symbolic) sizes.
    Returns the traced graph, which can be replayed on new inputs of the same shapes.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*args)
    for node in gm.graph.nodes:
        op = str(node.target).split(".")  # "aten.nonzero.default" -> ["aten", "nonzero", ...]
        assert not (op[0] == "aten" and op[1] in DATA_DEPENDENT_OPS), node.format_node()
        val = node.meta.get("val")
        for v in val if isinstance(val, (tuple, list)) else [val]:
            if isinstance(v, torch.Tensor):
                assert all(isinstance(s, int) for s in v.shape), node.format_node()
    return gm


def assert_trees_equal(fast: DraftTree, ref: DraftTree) -> None:
    """Every field equal; scores compared bit-for-bit."""
    for name in DraftTree._fields:
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "scores":
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), f"{name} differs:\n{a}\n{b}"
