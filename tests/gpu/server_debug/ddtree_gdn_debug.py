"""Debugging aids for DDTREE's Gated DeltaNet tree verify inside a served run (test tooling, not
server switches: the check reads results back and saves files, and serving the root paths or
perturbing the outputs changes the served tokens). A server gets them by starting with this
folder first on PYTHONPATH (its `sitecustomize` installs them in every process, SGLang's spawned
scheduler included) and one of:

    DDTREE_GDN_CHECK=DIR          every chunked verify checked against the root-path kernel
    DDTREE_GDN_CHECK_SERVE=paths  with the check: serve the root paths' outputs (the commit
                                  still reads the chunked kernel's scratch): a wrong token that
                                  stays comes from the scratch, one that goes from the outputs
    DDTREE_GDN_CHECK_SAVE=N       with the check, without CUDA graphs: also save the inputs and
                                  both outputs of the first N verifies, for a float64 replay
    DDTREE_GDN_PERTURB=EPS        every tree-verify output off by a fixed pattern of at most EPS
                                  relative size, like another kernel's rounding (a fragile model,
                                  or a kernel bug?)
    DDTREE_GDN_VERIFY=paths       serve the root-path verify where the chunked one would run
    DDTREE_GDN_PRECISION=P        the chunked verify's float32 products at P (chunk_tree
                                  PRECISIONS: tf32, tf32x3, ieee; servers run split)

tests/gpu/diagnose_gdn.py starts such a server. `install` wraps the kernels where DDTREE's GDN
hooks import them at each call (sglang_ddtree.gdn.chunk_tree.chunk_tree_verify, tree_verify's
tree_verify and commit_paths) and, for the root paths, the GDN path's choice
(sglang_ddtree.state.gdn.GDNPath.chunked), so the package carries none of this.

The check: per node and value head, the largest difference over V as a fraction of that row's
largest root-path output (rows below 1e-6 of the call's largest are skipped).
- Without CUDA graphs (`compare` reads each call back): a call beyond TOL is logged with its
  worst node, and the first KEEP such calls' inputs, slot states, both outputs and both scratch
  rows are saved to DIR/verify_<pid>_<n>.pt (one process per tensor-parallel rank), as are the
  first DDTREE_GDN_CHECK_SAVE calls whatever their difference; each time the worst difference
  so far grows, a line says so. A save that fails (a full disk, an unwritable DIR) is logged
  once and saving stops; the check goes on.
- Inside a CUDA graph: the worst fraction of the round's calls accumulates on the device, and
  `after_round` (before the commit, outside the graph) reads it back and logs a round beyond TOL.
Every 1000 checks (calls, or rounds in a graph) a line says how many differed.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

logger = logging.getLogger("sglang_ddtree.gdn_debug")

TOL, KEEP = 1e-2, 4


@dataclasses.dataclass(frozen=True)
class Settings:
    check: str | None = None  # DDTREE_GDN_CHECK: where the check saves
    serve: str = "chunk"  # DDTREE_GDN_CHECK_SERVE: whose outputs a checked verify serves
    save: int = 0  # DDTREE_GDN_CHECK_SAVE: checked calls saved whatever they differ
    perturb: float = 0.0  # DDTREE_GDN_PERTURB: `perturb`'s size
    verify: str = "chunk"  # DDTREE_GDN_VERIFY: "paths" serves the root paths
    precision: str = "split"  # DDTREE_GDN_PRECISION: the chunked verify's products

    @classmethod
    def from_env(cls, environ) -> Settings:
        from sglang_ddtree.gdn.chunk_tree import PRECISIONS

        out = cls(
            check=environ.get("DDTREE_GDN_CHECK") or None,
            serve=environ.get("DDTREE_GDN_CHECK_SERVE", "chunk"),
            save=int(environ.get("DDTREE_GDN_CHECK_SAVE", "0")),
            perturb=float(environ.get("DDTREE_GDN_PERTURB", "0")),
            verify=environ.get("DDTREE_GDN_VERIFY", "chunk"),
            precision=environ.get("DDTREE_GDN_PRECISION", "split"),
        )
        if out.serve not in ("chunk", "paths") or out.save < 0 or not 0 <= out.perturb < 1:
            raise ValueError(
                f"DDTREE_GDN_CHECK_SERVE chunk | paths, _SAVE >= 0, "
                f"DDTREE_GDN_PERTURB in [0, 1); got {out}"
            )
        if out.verify not in ("chunk", "paths") or out.precision not in PRECISIONS:
            raise ValueError(
                f"DDTREE_GDN_VERIFY chunk | paths, DDTREE_GDN_PRECISION one of "
                f"{PRECISIONS}; got {out}"
            )
        if (out.serve != "chunk" or out.save) and not out.check:
            raise ValueError(
                "DDTREE_GDN_CHECK_SERVE / _SAVE belong to the GDN check; set "
                "DDTREE_GDN_CHECK=DIR too."
            )
        return out

    @property
    def active(self) -> bool:
        return bool(
            self.check or self.perturb or self.verify != "chunk" or self.precision != "split"
        )


def row_error(o: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T, HV] largest |o - ref| over V per row, as a fraction of the row's largest |ref|; a
    NaN or infinity in either output counts as infinitely far."""
    ref = ref.float()
    diff = (o.float() - ref).abs().amax(-1)
    size = ref.abs().amax(-1)
    rel = torch.where(size > 1e-6 * size.max(), diff / size.clamp(min=1e-30), 0.0)
    return torch.nan_to_num(rel, nan=float("inf"))


def perturb(o: torch.Tensor, size: float) -> torch.Tensor:
    """o times 1 + size x sin(12.9898 i) (i the flat index): a fixed, data-independent
    relative error of at most `size`, like another kernel's rounding (graph-safe: no random
    state)."""
    pattern = torch.sin(torch.arange(o.numel(), device=o.device, dtype=torch.float32) * 12.9898)
    return (o.float() * (1 + size * pattern.view(o.shape))).to(o.dtype)


class Checker:
    """The check's state in one process: counts, the worst difference so far, the graphs'
    device accumulator, whether saving still works. `root_paths`: the root-path kernel
    (tree_verify as the package defines it, not a wrapped one)."""

    def __init__(self, settings: Settings, root_paths) -> None:
        self.settings, self.root_paths = settings, root_paths
        self.counts = {"calls": 0, "differed": 0, "rounds": 0, "rounds_differed": 0}
        self.so_far = 0.0
        self.worst: list[torch.Tensor] = []  # the device accumulator of graph-captured calls
        self.saving = True

    def compare(self, o: torch.Tensor, args: tuple, max_path: int) -> torch.Tensor:
        """The root-path kernel on the verify's inputs (its scratch in a copy) against `o`;
        returns the outputs to serve (`o`, or the root paths' with serve "paths")."""
        *inputs, state, slots, parents, scratch, scratch_idx = args
        ref_scratch = scratch.clone()
        ref = self.root_paths(
            *inputs, state, slots, parents, ref_scratch, scratch_idx, max_path=max_path
        )
        served = ref if self.settings.serve == "paths" else o
        rel = row_error(o, ref)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # the accumulator comes from an eager call (SGLang warms up before it captures):
            # made during a capture, its zero fill would belong to that one graph
            if self.worst:
                torch.maximum(self.worst[0], rel.max(), out=self.worst[0])
            return served
        if not self.worst:
            self.worst.append(torch.zeros((), device=rel.device))
        self._eager(
            o,
            ref,
            rel,
            (inputs, state, slots, parents, max_path),
            (scratch, ref_scratch, scratch_idx.long()),
        )
        return served

    def _eager(self, o, ref, rel, call, scratches) -> None:
        counts = self.counts
        counts["calls"] += 1
        worst = float(rel.max())
        if worst > self.so_far:
            self.so_far = worst
            logger.info(
                "sglang_ddtree: GDN check: verify %d: worst difference so far %.3g of "
                "the row's max |o|",
                counts["calls"],
                worst,
            )
        differs = worst > TOL
        counts["differed"] += differs
        # the first `save` calls, all of them; beyond, the first KEEP that differ
        keep = counts["calls"] <= self.settings.save or (differs and counts["differed"] <= KEEP)
        where = self._save(o, ref, call, scratches) if keep else None
        if differs:
            _report(rel, worst, call[3], where, counts["calls"])
        if counts["calls"] % 1000 == 0:
            logger.info(
                "sglang_ddtree: GDN check: %d verifies checked, %d differed",
                counts["calls"],
                counts["differed"],
            )

    def after_round(self) -> None:
        """Read back (and reset) the worst fraction of this round's graph-captured verifies."""
        if not self.worst:
            return
        worst = float(self.worst[0])
        self.worst[0].zero_()
        self.counts["rounds"] += 1
        if worst > TOL:
            self.counts["rounds_differed"] += 1
            logger.warning(
                "sglang_ddtree: GDN check: round %d (CUDA graph): a chunked verify "
                "differs from the root paths by %.3g of the row's max |o|",
                self.counts["rounds"],
                worst,
            )
        if self.counts["rounds"] % 1000 == 0:
            logger.info(
                "sglang_ddtree: GDN check: %d rounds checked, %d differed",
                self.counts["rounds"],
                self.counts["rounds_differed"],
            )

    def _save(self, o, ref, call, scratches) -> str | None:
        """Save one call's inputs, slot states, both outputs and both scratch rows; the file, or
        None once saving has failed (logged once: the check goes on without it)."""
        if not self.saving:
            return None
        inputs, state, slots, parents, max_path = call
        mine, theirs, rows = scratches
        where = os.path.join(self.settings.check, f"verify_{os.getpid()}_{self.counts['calls']}.pt")
        record = {
            "inputs": [x.cpu() if torch.is_tensor(x) else x for x in inputs],
            "states": state[slots.long().clamp(min=0)].cpu(),
            "slots": slots.cpu(),
            "parents": parents.cpu(),
            "max_path": max_path,
            "chunk": o.cpu(),
            "paths": ref.cpu(),
            "call": self.counts["calls"],
            "scratch_chunk": mine[rows].cpu(),
            "scratch_paths": theirs[rows].cpu(),
        }
        try:
            os.makedirs(self.settings.check, exist_ok=True)
            torch.save(record, where)
        except OSError as exc:
            self.saving = False
            logger.warning(
                "sglang_ddtree: GDN check: saving to %s failed (%s); the check goes "
                "on without saving",
                self.settings.check,
                exc,
            )
            return None
        return where


def _report(rel, worst, parents, where: str | None, call: int) -> None:
    """Log a verify that differs: its worst node and head, and where its inputs went."""
    token, head = divmod(int(rel.argmax()), rel.shape[1])
    N = parents.shape[1]
    logger.warning(
        "sglang_ddtree: GDN check: verify %d differs from the root paths by %.3g of "
        "the row's max |o| at node %d (request %d), value head %d%s",
        call,
        worst,
        token % N,
        token // N,
        head,
        f"; inputs in {where}" if where else "",
    )


def install(settings: Settings):
    """Wrap the GDN kernels where DDTREE's hooks import them at each call: the chunked verify
    checked (and its outputs perturbed), the root-path kernel perturbed, and the round's graph
    check read before each commit; with verify "paths" the GDN path takes the root paths.
    Returns the Checker (None without the check)."""
    from sglang_ddtree.gdn import chunk_tree, tree_verify

    chunk, paths, commit = (
        chunk_tree.chunk_tree_verify,
        tree_verify.tree_verify,
        tree_verify.commit_paths,
    )
    checker = Checker(settings, paths) if settings.check else None

    def checked_chunk(*args, max_path, **kwargs):
        kwargs.setdefault("precision", settings.precision)
        o = chunk(*args, max_path=max_path, **kwargs)
        if checker is not None:
            o = checker.compare(o, args, max_path)
        return perturb(o, settings.perturb) if settings.perturb else o

    def perturbed_paths(*args, **kwargs):
        o = paths(*args, **kwargs)
        return perturb(o, settings.perturb) if settings.perturb else o

    def commit_after_check(*args, **kwargs):
        if checker is not None:
            checker.after_round()
        return commit(*args, **kwargs)

    chunk_tree.chunk_tree_verify = checked_chunk
    tree_verify.tree_verify = perturbed_paths
    tree_verify.commit_paths = commit_after_check
    if settings.verify == "paths":
        from sglang_ddtree.state import gdn

        gdn.GDNPath.chunked = lambda self, nodes: False
    logger.warning("sglang_ddtree: GDN debugging aids installed (test tooling): %s", settings)
    return checker
