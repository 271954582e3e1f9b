"""The draft tree: build it from the drafter's per-position distributions (or a DFlash2
lattice), lay it out for the verify, draw it. The target's side (the walk, sampling, penalties)
is sglang_ddtree.accept.

Each fast function (batched torch, static shapes, no host sync, CUDA-graph safe) has a plain
reference beside it with the same signature: build_tree / build_tree_reference.
"""

from .build import build_tree, topk_logprobs_from_logits
from .build_reference import build_tree_reference
from .inputs import LOGPROB_FLOOR, tree_capacity
from .types import AcceptResult, DraftTree

__all__ = [
    "LOGPROB_FLOOR",
    "AcceptResult",
    "DraftTree",
    "build_tree",
    "build_tree_reference",
    "tree_capacity",
    "topk_logprobs_from_logits",
]
