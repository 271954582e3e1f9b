"""The target's side of a round, on the drafted tree: the walk that accepts the longest path the
target's tokens follow (accept_walk, beside its plain reference accept_walk_reference), the
target's token at every node (sample_target_tokens: greedy, or sampled under the request's
options), the per-node penalties, the accepted tokens a tree's first w nodes would give
(budget.py), and the kernel that moves the accepted path (path_triton.py).
"""

from .sampling import sample_target_tokens
from .walk import accept_walk
from .walk_reference import accept_walk_reference

__all__ = ["accept_walk", "accept_walk_reference", "sample_target_tokens"]
