"""Gated DeltaNet tree verify with less state traffic (work in progress: not yet wired into SGLang).

See `tree_verify.py` and docs/benchmarks.md ("What I would change").
"""
