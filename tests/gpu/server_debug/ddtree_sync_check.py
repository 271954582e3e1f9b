"""The sync check for a served run (test tooling, not a server switch): DDTREE's own per-round
code under torch's CUDA sync debug mode ("warn"), so that a host synchronisation in it logs a
warning; the GPU suite's servers run with it (tests/gpu/servers.py ENV) and fail on one. A server
gets it by starting with this folder first on PYTHONPATH and DDTREE_SYNC_CHECK=1 (its
`sitecustomize` installs it in every process, SGLang's spawned scheduler included).

`install` replaces `sglang_ddtree.round.round.own_code`, the context the round's own
steps run in (SGLang's own calls stay outside it), as that module is imported: importing it at
start-up would load SGLang's workers in every process.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys

WORKER = "sglang_ddtree.round.round"


@contextlib.contextmanager
def sync_debug():
    """torch's CUDA sync debug mode at "warn" inside, the previous mode after."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def patch(worker) -> None:
    """The round module's own steps under the sync check."""
    worker.own_code = sync_debug


def install() -> None:
    """Patch the round module now if it is loaded, else as soon as it is imported."""
    if WORKER in sys.modules:
        patch(sys.modules[WORKER])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the round module with the other finders and patches it once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != WORKER:
            return None
        sys.meta_path.remove(self)  # one import; the other finders locate it
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec
