"""Gated DeltaNet over a token tree: each kernel beside its plain-torch definition.

- `reference.py`: the node-by-node definitions (the tests' referee) and root-path helpers;
- `chunk_tree.py`: the tree verify in the chunked form (the default, N <= 256: one block of
  64 nodes, or up to four by block back substitution);
- `tree_verify.py`: the tree verify by root paths (wider trees, deterministic mode, or asked
  for) and the commit by replay (every path);
- `conv_tree.py`: the tree's causal conv1d with every node in parallel.

Wired into SGLang by `sglang_ddtree.state.gdn`; docs/design.md, and docs/results.md for
their timings.
"""
