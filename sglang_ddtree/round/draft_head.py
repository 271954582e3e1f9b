"""The draft heads: DFlash block hidden states -> the drafter's candidates -> DDTree.

A head runs as a tail hook inside the draft runner's CUDA graph (like DFLASH's greedy sampler),
so one graph replay covers draft forward, target-LM-head logits, top-K and the tree build.
Outputs land in static buffers allocated once at the largest batch (`TreeHead`); a replay only
changes contents. When the draft ran eagerly the worker calls the head itself on the same
inputs. Two heads share those buffers and `grow`:

  DraftTreeHead    a DFlash drafter: per-position top-K log-probs -> the marginal tree
                   (tree/build_triton.py on CUDA, tree/build.py)
  LatticeTreeHead  a DFlash2 drafter: its top-K candidates and the selector's pairwise scores
                   -> the tree under its first-order chain (tree/build_triton.py's lattice
                   kernel on CUDA, tree/lattice.py; docs/dflash2.md)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sglang_ddtree.accept.budget import cut_links, expected_tokens, truncate
from sglang_ddtree.adapter import compat
from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.tree import DraftTree, build_tree, topk_logprobs_from_logits
from sglang_ddtree.tree.lattice import build_lattice_tree, lattice_chain_logprobs
from sglang_ddtree.tree.shard_topk import merge_topk, shard_topk


def tree_builder(
    name: str | None = None, device: torch.device | None = None, lattice: bool = False
):
    """The tree builder a head uses: "triton" (`tree.build_triton`, one program per request:
    the default on CUDA, 0.01-0.08 ms per round on the H200 against 0.35-0.8 ms for the batched
    torch builder, docs/results.md) or "torch" (`tree.build_tree`, the default elsewhere, and
    the Triton builder's reference); `lattice`: the DFlash2 head's builders of the same two
    kinds (`build_lattice_tree_triton`, `tree.lattice.build_lattice_tree`). `name` picks one
    explicitly (scripts/bench_tree_build.py)."""
    if name is None:
        name = "triton" if device is not None and device.type == "cuda" else "torch"
    if name == "torch":
        return build_lattice_tree if lattice else build_tree
    if name == "triton":
        from sglang_ddtree.tree.build_triton import build_lattice_tree_triton, build_tree_triton

        return build_lattice_tree_triton if lattice else build_tree_triton
    raise ValueError(f"the tree builder must be 'torch' or 'triton', got {name!r}")


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocabulary-parallel LM head (tensor parallelism stays
    refused at start-up until a multi-GPU run has verified it): its rows are global token ids
    offset, offset + 1, ...; gather(t) -> [ranks, *t.shape], every rank's t in rank order (the
    TP group's all-gather)."""

    offset: int
    gather: Callable[[torch.Tensor], torch.Tensor]


class TreeHead:
    """The static tree buffers a head builds into, and what reads them: `grow` (the build, the
    readings and cut links of the read widths), `tree` (views of the last build). A subclass
    sets `build`, the builder `grow` calls, and `candidates`, what `__call__` (the draft graph's
    tail) hands it."""

    build: Callable[..., DraftTree]

    def __init__(self, cfg: DDTreeConfig, max_bs: int, device: torch.device):
        self.cfg = cfg
        N, dev = cfg.num_nodes, device
        self.tokens = torch.zeros((max_bs, N), dtype=torch.int64, device=dev)
        self.parents = torch.zeros((max_bs, N), dtype=torch.int64, device=dev)
        self.depth = torch.zeros((max_bs, N), dtype=torch.int64, device=dev)
        self.first_child = torch.zeros((max_bs, N), dtype=torch.int64, device=dev)
        self.next_sibling = torch.zeros((max_bs, N), dtype=torch.int64, device=dev)
        self.visibility = torch.zeros((max_bs, N, N), dtype=torch.bool, device=dev)
        self.scores = torch.zeros((max_bs, N), dtype=torch.float32, device=dev)
        # automatic widths (read_widths): per request, the drafter's expected tokens at each
        # width, then as many columns the width policy's readings fill with the accepted tokens
        # at each width (round/widths.py)
        self.readings: torch.Tensor | None = None
        self.reading_widths: tuple[int, ...] = ()
        # per read width w < N: first_child and next_sibling of the first w nodes, links past
        # the cut -1 (tree.budget.truncate's), written with the tree (in the draft graph)
        self.cuts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def read_widths(self, widths) -> None:
        """From the next build on (before the draft graphs are captured, so that the graphs
        compute them), the expected tokens at these widths: 1 + sum of q over the first w
        nodes of each tree (tree.budget.expected_tokens) into `readings[:, :len(widths)]`, and
        the first w nodes' links cut (`cuts`, what `tree(bs, w)` returns)."""
        widths = tuple(int(w) for w in widths)
        expected_tokens(self.scores[:1], widths)  # widths outside [1, N]: an error now
        self.readings = torch.zeros(
            (self.max_bs, 2 * len(widths)), dtype=torch.float32, device=self.scores.device
        )
        self.reading_widths = widths
        self.cuts = {}
        for w in (w for w in widths if w < self.scores.shape[1]):
            links = torch.zeros((2, self.max_bs, w), dtype=torch.int64, device=self.scores.device)
            self.cuts[w] = (links[0], links[1])

    def __call__(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """hidden_states [bs * B, H] draft block outputs; input_ids [bs * B], column 0 = root.
        The draft graph's tail hands a head the block's positions [bs * B] too; the heads build
        their trees from the drafter's candidates alone (`candidates`)."""
        del positions
        B = self.cfg.block_size
        bs = hidden_states.shape[0] // B
        hidden = hidden_states.view(bs, B, -1)[:, 1:, :]  # [bs, B-1, H]: draft positions 1..B-1
        root = input_ids.view(bs, B)[:, 0]  # [bs]
        self.grow(root, *self.candidates(hidden, root))

    def candidates(
        self, hidden: torch.Tensor, root: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[bs, B-1, H] draft hidden states and the roots [bs] -> (ids, log-probs) as `build`
        takes them."""
        raise NotImplementedError

    @property
    def max_bs(self) -> int:
        return self.tokens.shape[0]

    def grow(self, root: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> DraftTree:
        """The tree of roots [bs] over the drafter's candidates (ids [bs, B-1, K] and their
        log-probs as the head's builder takes them: [bs, B-1, K] per position, or
        [bs, B-1, K, K] conditionals on a lattice) into the static buffers, with the readings
        and the cut links of the read widths; returns the built trees (the builder's, bs
        rows)."""
        bs = root.shape[0]
        tree = self.build(root, ids, logprobs, self.cfg.budget)
        for name, value in tree._asdict().items():
            getattr(self, name)[:bs].copy_(value)
        if self.readings is not None:
            self.write_readings(tree.scores)
        for w, (first_child, next_sibling) in self.cuts.items():
            first_child[:bs].copy_(cut_links(tree.first_child, w))
            next_sibling[:bs].copy_(cut_links(tree.next_sibling, w))
        return tree

    def write_readings(self, scores: torch.Tensor) -> None:
        """readings[:bs, :W] = the expected tokens at the W read widths of trees with these
        scores [bs, N] (log q); the other W columns are left to the readings (accepted tokens)."""
        W = len(self.reading_widths)
        self.readings[: scores.shape[0], :W].copy_(expected_tokens(scores, self.reading_widths))

    def tree(self, bs: int, width: int | None = None) -> DraftTree:
        """The last built trees of the first `bs` requests (views of the static buffers); with
        a read width, their first `width` nodes (tree.budget.truncate's tree, its links cut in
        the build; other widths are cut here)."""
        N = self.cfg.num_nodes
        w = N if width is None else width
        if w != N and w not in self.cuts:
            return truncate(self.tree(bs), w)
        first_child, next_sibling = self.cuts.get(w, (self.first_child, self.next_sibling))
        return DraftTree(
            tokens=self.tokens[:bs, :w],
            parents=self.parents[:bs, :w],
            depth=self.depth[:bs, :w],
            first_child=first_child[:bs],
            next_sibling=next_sibling[:bs],
            visibility=self.visibility[:bs, :w, :w],
            scores=self.scores[:bs, :w],
        )


class DraftTreeHead(TreeHead):
    """A DFlash drafter's head: the target's LM head over the block, the top-K per position,
    the marginal tree (the builder `tree_builder` picks for the device)."""

    def __init__(
        self,
        *,
        lm_head_weight: torch.Tensor,  # [V_padded, H] target LM head (this rank's rows)
        vocab_size: int,  # V: rows of lm_head_weight that are real tokens
        cfg: DDTreeConfig,
        max_bs: int,
        shard: VocabShard | None = None,  # None: the whole vocabulary (tp = 1)
    ):
        super().__init__(cfg, max_bs, lm_head_weight.device)
        self.weight = lm_head_weight
        self.vocab_size = int(vocab_size)
        self.shard = shard
        self.build = tree_builder(device=lm_head_weight.device)

    def candidates(self, hidden: torch.Tensor, root: torch.Tensor):
        del root  # the marginal tree reads the drafter's top-K alone
        return self.topk(hidden)

    def topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[bs, B-1, H] draft hidden states -> the drafter's top-K per position: (ids
        [bs, B-1, K] int64, log-probs [bs, B-1, K] float32) over the whole vocabulary."""
        logits = self.logits(hidden)
        if self.shard is None:
            return topk_logprobs_from_logits(logits.float(), self.cfg.topk)
        # every rank merges the same gathered bytes: the same top-K, the same tree
        parts = shard_topk(logits, self.cfg.topk, self.shard.offset)
        return merge_topk(*(self.shard.gather(p) for p in parts), self.cfg.topk)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[bs, L, H] draft hidden states -> [bs, L, V] logits over this head's real rows: one
        2-D GEMM (a batched matmul against the transposed weight got cuBLAS's slow kernel at
        27B: 3.6 ms at batch 8 against 1.0 at batch 1)."""
        bs, L = hidden.shape[:2]
        rows = hidden.reshape(bs * L, -1).to(self.weight.dtype)
        return F.linear(rows, self.weight[: self.vocab_size]).view(bs, L, -1)


class LatticeTreeHead(TreeHead):
    """A DFlash2 drafter's head: its top-K candidates over the target's LM head, its selector's
    pairwise scores and each slot's log coverage (compat.selector_lattice: the target head's
    top-K and full-vocabulary lse, then build_lattice), the chain's log conditionals with each
    slot's coverage added (tree.lattice.lattice_chain_logprobs), the best-first tree under that
    chain (on CUDA tree.build_triton's lattice kernel, one program per request; elsewhere
    tree.lattice.build_lattice_tree, its reference: both bit-equal to the heap, no host sync,
    CUDA-graph safe). It returns the marginal head's DraftTree, so the verify layout, mask
    packing, accept walk, penalties, widths and commit take it as is.

    The coverage, the log of the drafter's mass on a slot's K candidates, is what the softmax
    over the K leaves out: with it each row of a slot sums to that mass rather than to 1, so a
    slot whose top-K holds little of the drafter's mass costs its paths that much (on the
    shipped pair's offline evaluation the tree with it accepts more; docs/results.md). A drafter
    that scales or softcaps its logits has none (the lse of the transformed logits is not
    computed), and its rows are the softmax over its K alone.

    The scores are not divided by the requests' temperatures: the tree is the drafter's own
    chain at T = 1, as the marginal head's tree is its per-position distributions at T = 1.
    The accept walk is lossless for any tree fixed before the target samples (docs/dflash2.md,
    "Losslessness"), so a temperature would only reshape which nodes are drafted; dividing would
    need a per-round temperature buffer staged from the host before each graph replay (as
    SGLang's selector sampler stages its own) and a rule for greedy rows (T = 0), and the width
    policy's expected tokens (`readings`) read these T = 1 scores as the drafter's
    probabilities.
    """

    def __init__(self, *, draft_model, cfg: DDTreeConfig, max_bs: int, device: torch.device):
        top_k = int(compat.draft_selector(draft_model).top_k)
        if top_k != cfg.topk:
            raise ValueError(
                f"the DFlash2 draft's selector scores {top_k} candidates per position, "
                f"DDTREE was configured for K={cfg.topk} (--speculative-eagle-topk)"
            )
        super().__init__(cfg, max_bs, device)
        self.draft_model = draft_model  # its lm_head points at the target's (worker.py)
        self.build = tree_builder(device=device, lattice=True)

    def candidates(self, hidden: torch.Tensor, root: torch.Tensor):
        return self.lattice(hidden, root)  # the root: the anchor of the selector's first slot

    def lattice(
        self, hidden: torch.Tensor, anchor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[bs, B-1, H] draft hidden states and the anchors [bs] -> the drafter's lattice:
        (candidate ids [bs, B-1, K] int64, log q_e(c | p) [bs, B-1, K, K] float32): the
        log-softmax over the K successors plus the slot's log coverage (<= 0), or without it
        for a drafter that has none."""
        ids, scores, coverage = compat.selector_lattice(self.draft_model, hidden, anchor)
        return ids, lattice_chain_logprobs(scores, coverage)
