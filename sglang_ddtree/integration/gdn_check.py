"""SGLANG_DDTREE_GDN_CHECK=DIR: the chunked Gated DeltaNet tree verify checked against the
root-path kernel inside a served run (a debugging aid: it runs both kernels and reads results
back, so it costs a verify and a host sync per round).

Per node and value head, the largest difference over V as a fraction of that row's largest
root-path output (rows below 1e-6 of the call's largest are skipped).
- Without CUDA graphs (`compare` reads each call back): a call beyond TOL is logged with its
  worst node, and the first KEEP such calls' inputs, slot states, both outputs and both scratch
  rows are saved to DIR/verify_<pid>_<n>.pt (one process per tensor-parallel rank), as are the
  first SGLANG_DDTREE_GDN_CHECK_SAVE calls whatever their difference; each time the worst
  difference so far grows, a line says so.
- Inside a CUDA graph: the worst fraction of the round's calls accumulates on the device, and
  `after_round` (the commit hook, outside the graph) reads it back and logs a round beyond TOL.
Every 1000 checks (calls, or rounds in a graph) a line says how many differed.
SGLANG_DDTREE_GDN_CHECK_SERVE=paths serves the root paths' outputs instead of the chunked ones
(the commit still reads the chunked kernel's scratch): whether a served difference comes from
the outputs or from the scratch.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

TOL, KEEP = 1e-2, 4
_counts = {"calls": 0, "differed": 0, "rounds": 0, "rounds_differed": 0}
_so_far = [0.0]  # the worst fraction of the eager calls so far
_worst: list[torch.Tensor] = []  # the device accumulator of graph-captured calls


def row_error(o: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T, HV] largest |o - ref| over V per row, as a fraction of the row's largest |ref|; a
    NaN or infinity in either output counts as infinitely far."""
    ref = ref.float()
    diff = (o.float() - ref).abs().amax(-1)
    size = ref.abs().amax(-1)
    rel = torch.where(size > 1e-6 * size.max(), diff / size.clamp(min=1e-30), 0.0)
    return torch.nan_to_num(rel, nan=float("inf"))


def compare(o: torch.Tensor, args: tuple, path) -> torch.Tensor:
    """The root-path kernel on the verify's inputs (its scratch in a copy) against `o`; returns
    the outputs to serve (`o`, or the root paths' with check_serve "paths")."""
    from sglang_ddtree.gdn.tree_verify import tree_verify

    *inputs, state, slots, parents, scratch, scratch_idx = args
    ref_scratch = scratch.clone()
    ref = tree_verify(*inputs, state, slots, parents, ref_scratch, scratch_idx,
                      max_path=path.max_path)  # fmt: skip
    served = ref if path.check_serve == "paths" else o
    rel = row_error(o, ref)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # the accumulator comes from an eager call (SGLang warms up before it captures): made
        # during a capture, its zero fill would belong to that one graph
        if _worst:
            torch.maximum(_worst[0], rel.max(), out=_worst[0])
        return served
    if not _worst:
        _worst.append(torch.zeros((), device=rel.device))
    _counts["calls"] += 1
    worst = float(rel.max())
    if worst > _so_far[0]:
        _so_far[0] = worst
        logger.info("sglang_ddtree: GDN check: verify %d: worst difference so far %.3g of the "
                    "row's max |o|", _counts["calls"], worst)  # fmt: skip
    differs = worst > TOL
    _counts["differed"] += differs
    # SGLANG_DDTREE_GDN_CHECK_SAVE: the first calls, all of them; beyond, the first KEEP that differ
    keep = _counts["calls"] <= path.check_save or (differs and _counts["differed"] <= KEEP)
    scratches = (scratch, ref_scratch, scratch_idx.long())  # the rows go to the host if saved
    where = _save(o, ref, inputs, state, slots, parents, path, scratches) if keep else None
    if differs:
        _report(rel, worst, parents, where)
    if _counts["calls"] % 1000 == 0:
        logger.info("sglang_ddtree: GDN check: %d verifies checked, %d differed",
                    _counts["calls"], _counts["differed"])  # fmt: skip
    return served


def perturb(o: torch.Tensor, size: float) -> torch.Tensor:
    """o times 1 + size x sin(12.9898 i) (i the flat index): a fixed, data-independent
    relative error of at most `size`, like another kernel's rounding (SGLANG_DDTREE_GDN_PERTURB;
    graph-safe: no random state)."""
    pattern = torch.sin(torch.arange(o.numel(), device=o.device, dtype=torch.float32) * 12.9898)
    return (o.float() * (1 + size * pattern.view(o.shape))).to(o.dtype)


def after_round() -> None:
    """Read back (and reset) the worst fraction of this round's graph-captured verifies."""
    if not _worst:
        return
    worst = float(_worst[0])
    _worst[0].zero_()
    _counts["rounds"] += 1
    if worst > TOL:
        _counts["rounds_differed"] += 1
        logger.warning("sglang_ddtree: GDN check: round %d (CUDA graph): a chunked verify "
                       "differs from the root paths by %.3g of the row's max |o|",
                       _counts["rounds"], worst)  # fmt: skip
    if _counts["rounds"] % 1000 == 0:
        logger.info("sglang_ddtree: GDN check: %d rounds checked, %d differed",
                    _counts["rounds"], _counts["rounds_differed"])  # fmt: skip


def _save(o, ref, inputs, state, slots, parents, path, scratches) -> str:
    """Save one call's inputs, slot states, both outputs and both scratch rows; the file."""
    mine, theirs, rows = scratches
    scratch_rows = (mine[rows].cpu(), theirs[rows].cpu())
    where = os.path.join(path.check, f"verify_{os.getpid()}_{_counts['calls']}.pt")
    os.makedirs(path.check, exist_ok=True)
    torch.save({"inputs": [x.cpu() if torch.is_tensor(x) else x for x in inputs],
                "states": state[slots.long().clamp(min=0)].cpu(), "slots": slots.cpu(),
                "parents": parents.cpu(), "max_path": path.max_path, "chunk": o.cpu(),
                "paths": ref.cpu(), "call": _counts["calls"], "scratch_chunk": scratch_rows[0],
                "scratch_paths": scratch_rows[1]}, where)  # fmt: skip
    return where


def _report(rel, worst, parents, where: str | None) -> None:
    """Log a verify that differs: its worst node and head, and where its inputs went."""
    token, head = divmod(int(rel.argmax()), rel.shape[1])
    N = parents.shape[1]
    logger.warning("sglang_ddtree: GDN check: verify %d differs from the root paths by %.3g of "
                   "the row's max |o| at node %d (request %d), value head %d%s",
                   _counts["calls"], worst, token % N, token // N, head,
                   f"; inputs in {where}" if where else "")  # fmt: skip
