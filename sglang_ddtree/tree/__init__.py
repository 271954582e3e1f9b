"""DDTree tree module: build the draft tree, walk it against target tokens, sample targets.

Each fast function (batched torch, static shapes, no host sync, CUDA-graph safe) has a plain
reference beside it with the same signature: build_tree / build_tree_reference,
accept_walk / accept_walk_reference.
"""

from .accept import accept_walk
from .accept_reference import accept_walk_reference
from .build import build_tree, topk_logprobs_from_logits
from .build_reference import build_tree_reference
from .inputs import LOGPROB_FLOOR, tree_capacity
from .sampling import sample_target_tokens
from .types import AcceptResult, DraftTree

__all__ = [
    "LOGPROB_FLOOR",
    "AcceptResult",
    "DraftTree",
    "accept_walk",
    "accept_walk_reference",
    "build_tree",
    "build_tree_reference",
    "sample_target_tokens",
    "tree_capacity",
    "topk_logprobs_from_logits",
]
