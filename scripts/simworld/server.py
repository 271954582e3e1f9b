"""The simulated world in a server (world.py): the patches DDTREE_SIMULATE installs
(sitecustomize.py), all of them here, each applied once.

For benchmarks only, and refused at start-up unless the target's weights are dummy
(`--load-format dummy`). DDTREE's draft head takes the world's top-K in place of the drafter's
and computes the world's target token at every node in the same graph replay (`SimulatedHead`,
made by the worker in place of its DraftTreeHead); the verify's greedy tree walk reads those
(`simulated_verify`, around Round.verify). DFLASH's chain accept reads the same world: its
drafts are the world's top-1 path and the target's token at each position the world's
(`ChainAccept`). The models still run in full, so every cost is the real one; only which tokens
are accepted comes from the world. Greedy requests only: a sampled request's verify reads the
dummy weights' logits.

`install` patches a module now if it is loaded, else as soon as it is imported: importing
SGLang's workers at start-up would load them in every process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import logging
import sys
from collections.abc import Callable, Mapping

import torch

from sglang_ddtree.round.draft_head import DraftTreeHead
from simworld import VARIABLE
from simworld.world import FIRST_ID, World, depth_bound, parse

logger = logging.getLogger("simworld")

DFLASH_WORKER = "sglang.srt.speculative.dflash_worker_v2"  # DFlashWorkerV2: start-up, accept
DDTREE_WORKER = "sglang_ddtree.round.worker"  # makes the draft head; its round's verify
DDTREE_ROUND = "sglang_ddtree.round.round"
TREE_GREEDY = "verify_tree_greedy_func"  # eagle_sample's greedy tree verify, a module global
PATCHED = "_simworld"  # set on each patched module: a second install is refused


class SimulatedHead(DraftTreeHead):
    """DDTREE's draft head in a world: the drafter's top-K is computed (its cost paid) and set
    aside for the world's, and the world's target token at every node of the built tree lands
    in `simulated_picks` [max_bs, N], in the same call (and so the same graph replay)."""

    def __init__(self, world: World, **kwargs) -> None:
        super().__init__(**kwargs)
        self.world = world
        self.simulated_picks = torch.zeros_like(self.tokens)
        # the per-depth means on the device, made before any graph capture (the draws' `means`)
        N = self.cfg.num_nodes
        self.world_means = world.means_on(depth_bound(N) + 1, self.tokens.device)

    def __call__(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """DraftTreeHead's call; rounds are keyed by the root's position (positions [bs * B])."""
        B, K, V = self.cfg.block_size, self.cfg.topk, self.vocab_size
        bs = hidden_states.shape[0] // B
        self.topk(hidden_states.view(bs, B, -1)[:, 1:, :])  # the drafter's cost, not its tokens
        root = input_ids.view(bs, B)[:, 0]
        position = positions.view(bs, B)[:, 0]
        ids, logprobs = self.world.draft(position, root, B - 1, K, V, self.world_means)
        tree = self.grow(root, ids, logprobs)
        picks = self.world.target_tokens(
            position, root, tree.tokens, tree.depth, tree.visibility, V, self.world_means
        )
        self.simulated_picks[:bs].copy_(picks)

    def random_rounds(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """One call on `batch` independent rounds, each at a random position with a random root
        token (and zero hidden states): their trees and simulated picks, as a server's round
        would leave them. Returns (position [batch], root [batch])."""
        B = self.cfg.block_size
        position = torch.randint(0, 1 << 30, (batch,), generator=generator)
        root = torch.randint(FIRST_ID, self.vocab_size, (batch,), generator=generator)
        ids = torch.zeros(batch, B, dtype=torch.int64)
        ids[:, 0] = root
        positions = position[:, None] + torch.arange(B)
        self(torch.zeros(batch * B, self.weight.shape[1]), ids.flatten(), positions.flatten())
        return position, root


@contextlib.contextmanager
def tree_greedy_targets(targets: torch.Tensor):
    """For the duration: SGLang's eagle_sample verifies its greedy tree against `targets`
    [bs, width] (the world's token at each node) instead of the argmax it computed; SGLang's
    function is put back after (eagle_sample reads the module global at call time)."""
    from sglang_ddtree.adapter import compat

    module = importlib.import_module(compat.TREE_SAMPLER_MODULE)
    original = getattr(module, TREE_GREEDY)

    def verify(*args, target_predict, **kwargs):
        # contiguous: a width below N slices each row, and the kernel takes dense rows only
        picked = targets.reshape(target_predict.shape).to(target_predict.dtype).contiguous()
        return original(*args, target_predict=picked, **kwargs)

    setattr(module, TREE_GREEDY, verify)
    try:
        yield
    finally:
        setattr(module, TREE_GREEDY, original)


def simulated_verify(original: Callable) -> Callable:
    """Round.verify with the world's target tokens in place of the target's argmax."""

    @functools.wraps(original)
    def verify(self, grammar_barrier):
        picks = self.worker.tree_head.simulated_picks
        with tree_greedy_targets(picks[: self.bs, : self.width]):
            return original(self, grammar_barrier)

    return verify


def check_dummy_weights(load_format) -> None:
    if str(load_format) != "dummy":
        raise RuntimeError(
            f"{VARIABLE} simulates which drafts are accepted and is for benchmarks "
            f"with dummy weights only: add --load-format dummy (got "
            f"{load_format!r}), or unset {VARIABLE}."
        )


def worker_init(world: World, original, worker, server_args, *args, **kwargs):
    """DFlashWorkerV2's start-up (DDTREE's worker's too): refused without dummy weights."""
    check_dummy_weights(getattr(server_args, "load_format", None))
    logger.warning("%s: SIMULATED ACCEPTANCE, not the models' (%s)", VARIABLE, world.describe())
    return original(worker, server_args, *args, **kwargs)


class ChainAccept:
    """Around DFLASH's accept of a block [root, drafts] (candidates [bs, B]) at positions
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
        vocab = int(worker.target_worker.model_runner.model_config.vocab_size)
        drafts, picks = self.world.chain(
            prefix_lens.view(-1), candidates[:, 0], block, vocab, self.means
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


def patch_dflash(world: World, module) -> None:
    """DFlashWorkerV2's start-up checked (worker_init) and its chain accept in the world."""
    cls = module.DFlashWorkerV2
    init, accept, chain = cls.__init__, cls._accept_block, ChainAccept(world)

    @functools.wraps(init)
    def __init__(self, server_args, *args, **kwargs):
        return worker_init(world, init, self, server_args, *args, **kwargs)

    @functools.wraps(accept)
    def _accept_block(self, **kwargs):
        return chain(accept, self, **kwargs)

    cls.__init__, cls._accept_block = __init__, _accept_block


def patch_ddtree(world: World, module) -> None:
    """DDTREE's worker makes a SimulatedHead, and its round's verify reads the head's picks."""
    module.DraftTreeHead = functools.partial(SimulatedHead, world)
    stages = sys.modules[DDTREE_ROUND]  # the worker module imports it
    stages.Round.verify = simulated_verify(stages.Round.verify)


def install(world: World) -> None:
    """The world's patches, each on its module now if loaded, else once it is imported."""
    patches = {DFLASH_WORKER: patch_dflash, DDTREE_WORKER: patch_ddtree}
    pending = {}
    for name, patch in patches.items():
        if name in sys.modules:
            apply(patch, world, sys.modules[name])
        else:
            pending[name] = functools.partial(apply, patch, world)
    if pending:
        sys.meta_path.insert(0, AfterImport(pending))


def install_from_env(environ: Mapping[str, str]) -> World | None:
    """`install` of the world VARIABLE names (unset or empty: nothing)."""
    world = parse(environ.get(VARIABLE))
    if world is not None:
        install(world)
    return world


def apply(patch: Callable, world: World, module) -> None:
    if getattr(module, PATCHED, False):
        raise RuntimeError(f"{VARIABLE}: {module.__name__} is patched already")
    patch(world, module)
    setattr(module, PATCHED, True)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds each pending module with the other finders and patches it once it has run."""

    def __init__(self, pending: dict[str, Callable]) -> None:
        self.pending = pending

    def find_spec(self, fullname, path, target=None):
        patch = self.pending.pop(fullname, None)
        if patch is None:
            return None
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        finders = [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]
        spec = next(filter(None, (f.find_spec(fullname, path, target) for f in finders)), None)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec
