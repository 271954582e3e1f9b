"""A simulated world in a server (sglang_ddtree/simulation.py): SGLANG_DDTREE_SIMULATE.

For benchmarks only, and refused at start-up unless the target's weights are dummy
(`--load-format dummy`). DDTREE's draft head takes the world's top-K in place of the drafter's
and computes the world's target token at every node in the same graph replay; the verify's greedy
tree walk reads those (round/worker.py). DFLASH's chain accept reads the same world: its
drafts are the world's top-1 path and the target's token at each position the world's
(`ChainAccept`). The models still run in full, so every cost is the real one; only which tokens
are accepted comes from the world. Greedy requests only: a sampled request's verify reads the
dummy weights' logits.
"""

from __future__ import annotations

import functools
import logging

import torch

from sglang_ddtree.adapter import compat
from sglang_ddtree.simulation import SWITCH, World

logger = logging.getLogger(__name__)


def register_hooks(world: World) -> None:
    """DFLASH's worker start-up (the dummy-weights check, for DDTREE's worker too) and its chain
    accept, for every server of this process (SGLang applies them as plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        compat.DFLASH_WORKER_INIT, functools.partial(worker_init, world), HookType.AROUND
    )
    HookRegistry.register(compat.DFLASH_CHAIN_ACCEPT, ChainAccept(world), HookType.AROUND)


def check_dummy_weights(load_format) -> None:
    if str(load_format) != "dummy":
        raise RuntimeError(
            f"{SWITCH} simulates which drafts are accepted and is for benchmarks "
            f"with dummy weights only: add --load-format dummy (got "
            f"{load_format!r}), or unset {SWITCH}."
        )


def worker_init(world: World, original, worker, server_args, *args, **kwargs):
    check_dummy_weights(getattr(server_args, "load_format", None))
    logger.warning("%s: SIMULATED ACCEPTANCE, not the models' (%s)", SWITCH, world.describe())
    return original(worker, server_args, *args, **kwargs)


class ChainAccept:
    """AROUND DFLASH's accept of a block [root, drafts] (candidates [bs, B]) at positions
    prefix_lens..: the drafts become the world's top-1 path and the target's tokens the world's,
    after the target's own argmax has been paid for."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.means: torch.Tensor | None = None  # on the worker's device, made once

    def __call__(
        self,
        original,
        worker,
        *,
        candidates,
        next_token_logits,
        target_predict=None,
        prefix_lens,
        **kwargs,
    ):
        if target_predict is None:
            target_predict = torch.argmax(next_token_logits, dim=-1)
        block = candidates.shape[1]
        if self.means is None or self.means.device != candidates.device:
            self.means = self.world.means_on(block, candidates.device)
        drafts, picks = self.world.chain(
            prefix_lens.view(-1),
            candidates[:, 0],
            block,
            compat.target_vocab_size(worker),
            self.means,
        )
        candidates[:, 1:].copy_(drafts)
        picked = picks.reshape(target_predict.shape).to(target_predict.dtype)
        return original(
            worker,
            candidates=candidates,
            next_token_logits=next_token_logits,
            target_predict=picked,
            prefix_lens=prefix_lens,
            **kwargs,
        )
