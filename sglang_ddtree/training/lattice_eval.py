"""Greedy tokens per round of four drafters on held-out text, offline: the DFlash and DFlash2
chains and DDTREE's marginal and lattice trees, from one drafter pair (training/selector.py).

At temperature 0 a round accepts the longest prefix of the target's own greedy continuation
that the proposal holds as a root path, plus the bonus token; for a chain that is its matching
prefix, for a tree the deepest node whose path is such a prefix. So one greedy continuation per
block (B - 1 tokens from the target, given the held-out prefix up to the anchor) scores every
proposal exactly, without a tree-attention pass:

  dflash_chain     the draft's top-1 per slot (SGLang's DFLASH on the DFlash drafter)
  dflash2_chain    the selector's greedy walk (SGLang's DFLASH on the DFlash2 drafter)
  ddtree_marginal  DDTREE's tree from the per-position top-K (tree/build.py), N nodes
  ddtree_lattice   DDTREE's tree from the lattice (tree/lattice.py), N nodes, as served
  ddtree_lattice_coverage  the same with each slot's conditionals scaled by the drafter's
                   marginal mass on its K candidates (lattice_chain_logprobs' log_coverage)

N counts the root, as --speculative-num-draft-tokens does. The builders are the ones DDTREE
serves with; the drafter's numbers come from the files as saved.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_ddtree.training.draft_model import DFlashDraft
from sglang_ddtree.training.loops import autocast
from sglang_ddtree.training.selector import (
    Selector,
    block_features,
    block_predecessors,
    candidate_loss,
    candidates,
    lattice,
    teacher_forced_loss,
)
from sglang_ddtree.training.target import language_model
from sglang_ddtree.tree.build import build_tree
from sglang_ddtree.tree.lattice import build_lattice_tree, lattice_chain_logprobs
from sglang_ddtree.tree.types import DraftTree


def greedy_continuation(
    target: nn.Module, ids: torch.Tensor, anchors: torch.Tensor, length: int
) -> torch.Tensor:
    """ids [b, T], anchors [nb] (shared by every row) -> the target's greedy tokens after
    ids[..a] for each anchor a: [b, nb, length].

    Per anchor, one causal pass per token over the rows cut after the anchor, the tokens
    generated so far appended."""
    out = []
    for a in anchors.tolist():
        rows = ids[:, : a + 1]
        for _ in range(length):
            hidden = language_model(target)(input_ids=rows, use_cache=False).last_hidden_state
            token = target.get_output_embeddings()(hidden[:, -1:]).argmax(-1)  # [b, 1]
            rows = torch.cat([rows, token], dim=1)
        out.append(rows[:, a + 1 :])
    return torch.stack(out, dim=1)


def chain_accepted(drafts: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """drafts, greedy [..., L] -> accepted draft tokens [...]: the matching prefix's length."""
    return (drafts == greedy).long().cumprod(-1).sum(-1)


def tree_accepted(tree: DraftTree, greedy: torch.Tensor) -> torch.Tensor:
    """tree [n, N], greedy [n, L] -> accepted draft tokens [n]: the depth of the deepest node
    whose root path is a prefix of the greedy continuation."""
    depth, parents = tree.depth, tree.parents.clamp(min=0)
    want = greedy.gather(1, (depth - 1).clamp(min=0))  # [n, N]: the greedy token at its depth
    match = (tree.tokens == want) | (depth == 0)
    on_path = depth == 0
    for _ in range(greedy.shape[1]):  # a node's parent is one level up: L passes settle it
        on_path = match & (on_path.gather(1, parents) | (depth == 0))
    return (depth * on_path).max(1).values


def greedy_walk(scores: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The selector's greedy chain (upstream's `sample_path` on greedy rows): slot 0's argmax,
    then at each slot the argmax of the row of the candidate picked before. [n, L] tokens."""
    index = scores[:, 0, 0].argmax(-1)  # [n]
    path = [index]
    for e in range(1, scores.shape[1]):
        index = scores[:, e].gather(1, index[:, None, None].expand(-1, 1, scores.shape[-1]))
        index = index[:, 0].argmax(-1)
        path.append(index)
    return cand.gather(-1, torch.stack(path, 1)[:, :, None])[:, :, 0]


def _proposals(sel: Selector, hidden, logits, roots, nodes: list[int]) -> dict[str, list]:
    """Per block row (flattened [n, ...]): each drafter's chain and trees (accepts later)."""
    n, L = hidden.shape[0] * hidden.shape[1], hidden.shape[2]
    hidden, logits = hidden.reshape(n, L, -1), logits.reshape(n, L, -1).float()
    roots = roots.reshape(n)
    cand, unary = candidates(logits, sel.top_k)
    scores = lattice(sel, hidden, unary, cand, roots)  # [n, L, K, K]
    lp = torch.log_softmax(logits, -1).gather(-1, cand)  # the marginal top-K log-probs
    chain_lp = lattice_chain_logprobs(scores)
    coverage = torch.logsumexp(lp, -1)  # [n, L]: the drafter's log-mass on its K candidates
    covered = lattice_chain_logprobs(scores, coverage)
    return {
        "dflash_chain": [cand[:, :, 0]],
        "dflash2_chain": [greedy_walk(scores, cand)],
        "ddtree_marginal": [build_tree(roots, cand, lp, N - 1) for N in nodes],
        "ddtree_lattice": [build_lattice_tree(roots, cand, chain_lp, N - 1) for N in nodes],
        "ddtree_lattice_coverage": [build_lattice_tree(roots, cand, covered, N - 1) for N in nodes],
    }


@torch.no_grad()
def four_way(
    draft: DFlashDraft,
    sel: Selector,
    target: nn.Module,
    taps: list[int],
    windows: torch.Tensor,
    anchors: torch.Tensor,
    batch: int,
    device: torch.device,
    nodes: list[int],
) -> dict:
    """Mean greedy tokens per round (accepted + 1) of each drafter over held-out windows [w, T]
    with fixed anchors [nb], trees at each N of `nodes`; and the selector's held-out
    distillation loss (training/selector.py's, unweighted over slots) beside the marginal's over
    the same K candidates (the selector at zero), and the target's mean mass on them."""
    B = draft.config.block_size
    sums: dict[str, torch.Tensor] = {}
    loss = {"selector": 0.0, "marginal": 0.0, "target_mass_in_top_k": 0.0}
    weights = torch.ones(B - 1, device=device)
    batches = 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch].to(device)
        a = anchors.to(device)[None].expand(ids.shape[0], -1)
        with autocast(device):
            hidden, logits, teacher = block_features(draft, target, ids, a, taps)
            greedy = greedy_continuation(target, ids, anchors, B - 1).flatten(0, 1)
        for name, props in _proposals(sel, hidden, logits, ids.gather(1, a), nodes).items():
            got = [
                chain_accepted(p, greedy) if torch.is_tensor(p) else tree_accepted(p, greedy)
                for p in props
            ]
            sums[name] = sums.get(name, 0) + torch.stack(got).float().add(1).sum(1).cpu()
        pred = block_predecessors(ids, a, B)
        value, mass = teacher_forced_loss(sel, hidden, logits, pred, teacher, weights)
        cand, unary = candidates(logits, sel.top_k)
        loss["selector"] += float(value)
        loss["marginal"] += float(candidate_loss(unary, cand, teacher, weights)[0])
        loss["target_mass_in_top_k"] += float(mass)
        batches += 1
    blocks = windows.shape[0] * anchors.numel()
    tokens = {k: [round(float(x) / blocks, 4) for x in v] for k, v in sums.items()}
    return {
        "blocks": blocks,
        "nodes": nodes,
        "tokens_per_round": tokens,
        "heldout_loss": {k: round(v / max(batches, 1), 4) for k, v in loss.items()},
    }
