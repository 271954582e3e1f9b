"""The only package that imports SGLang internals: spec class, worker, verify input, hooks.

Everything version-specific lives in `compat.py`; add a new SGLang release there first.
"""
