"""Gated DeltaNet tree verify by root paths, and the commit by replay (`tree_verify.py`).

Wired into SGLang by `sglang_ddtree.integration.gdn`; docs/design.md and docs/benchmarks.md.
"""
