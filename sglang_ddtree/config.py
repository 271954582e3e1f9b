"""DDTree settings: one frozen dataclass, validated once, with errors that name the flag and the fix.

DDTREE reuses SGLang's speculative flags (no new CLI flags):

  --speculative-draft-model-path       a DFlash draft checkpoint (required)
  --speculative-dflash-block-size B    DFlash block size; default: the draft config's block_size
  --speculative-num-draft-tokens N     tree node budget *including the root* = target verify
                                       width; default 2 * B (32 for the z-lab drafters)
  --speculative-eagle-topk K           candidates per draft position = max children per node;
                                       default 8; must be >= 2 (SGLang's tree verify through
                                       Gated DeltaNet layers only engages for topk > 1); a
                                       DFlash2 draft fixes it: its selector_top_k

The tree has N - 1 draft nodes and depth at most B - 1.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from sglang_ddtree.tree.inputs import MAX_TOPK, tree_capacity

DEFAULT_TOPK = 8
DEFAULT_BUDGET_PER_BLOCK = 2  # N = 2 * B unless given
MAX_NUM_NODES = 1024  # SGLang's tree kernels index nodes with small ints
DEFAULT_MAX_RUNNING_REQUESTS = 16  # GDN scratch grows with N x running requests


class DDTreeConfigError(ValueError):
    """A DDTREE server flag is missing, out of range or incompatible; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class DraftCheckpoint:
    """What DDTREE reads of the draft checkpoint's config (adapter/compat.draft_checkpoint).

    A DFlash2 draft (one of SGLang's DFlash2 architectures) scores K candidates per position
    and the transitions between neighbouring positions' candidates (docs/dflash2.md); its K is
    dflash_config.selector_top_k, which SGLang requires beside selector_rank."""

    block_size: int | None = None  # its block_size; None: unset
    dflash2: bool = False  # a DFlash2 architecture (candidate selector)
    architecture: str = "DFlashDraftModel"  # the architecture named, for messages
    selector_rank: int = 0  # dflash_config.selector_rank (0: none)
    selector_top_k: int = 0  # dflash_config.selector_top_k, the drafter's K (0: none)


@dataclasses.dataclass(frozen=True)
class DDTreeConfig:
    block_size: int  # B: DFlash block, the draft proposes B - 1 positions
    num_nodes: int  # N: verify width, root included
    topk: int  # K: candidates per position

    @property
    def budget(self) -> int:
        """Draft nodes per tree (root excluded), the paper's node budget."""
        return self.num_nodes - 1

    @property
    def max_depth(self) -> int:
        return self.block_size - 1

    @classmethod
    def resolve(
        cls,
        *,
        block_size: int | None,
        draft_block_size: int | None,
        num_draft_tokens: int | None,
        topk: int | None,
        vocab_size: int | None = None,
        draft: DraftCheckpoint | None = None,
    ) -> DDTreeConfig:
        """Fill defaults and validate. `draft_block_size` is what the draft config says;
        `draft` the rest of it (a DFlash2 draft fixes K)."""
        B = _resolve_block(block_size, draft_block_size)
        if draft is not None and draft.dflash2:
            K = _resolve_selector_topk(topk, draft)
        else:
            K = _resolve_topk(topk, vocab_size)
        return cls(block_size=B, num_nodes=_resolve_nodes(num_draft_tokens, B, K, draft), topk=K)


def _resolve_block(block_size: int | None, draft_block_size: int | None) -> int:
    B = _positive_int(block_size, "--speculative-dflash-block-size")
    if B is None:
        B = draft_block_size if draft_block_size is not None else 16
    if B < 2:
        raise DDTreeConfigError(
            f"DDTREE needs a DFlash block size >= 2 (the draft proposes B - 1 tokens), got "
            f"B={B}; pass --speculative-dflash-block-size 16 or fix the draft config."
        )
    if draft_block_size is not None and B != draft_block_size:
        raise DDTreeConfigError(
            f"--speculative-dflash-block-size {B} differs from the draft checkpoint's "
            f"block_size {draft_block_size}; a DFlash draft is trained for one block size. "
            f"Drop the flag or pass {draft_block_size}."
        )
    return B


def _resolve_topk(topk: int | None, vocab_size: int | None) -> int:
    K = _positive_int(topk, "--speculative-eagle-topk")
    K = DEFAULT_TOPK if K is None else K
    if K < 2:
        raise DDTreeConfigError(
            f"DDTREE needs --speculative-eagle-topk >= 2, got {K}. SGLang verifies trees "
            f"through Gated DeltaNet layers only when topk > 1; for a chain use "
            f"--speculative-algorithm DFLASH."
        )
    if K > MAX_TOPK:
        raise DDTreeConfigError(
            f"--speculative-eagle-topk {K} exceeds the largest supported ({MAX_TOPK}); "
            f"trees gain little past K = 8. Use --speculative-eagle-topk 8."
        )
    if vocab_size is not None and K > vocab_size:
        raise DDTreeConfigError(
            f"--speculative-eagle-topk {K} exceeds the vocabulary size {vocab_size}."
        )
    return K


def _resolve_selector_topk(topk: int | None, draft: DraftCheckpoint) -> int:
    """K of a DFlash2 draft: its selector_top_k, which --speculative-eagle-topk may only repeat."""
    K, name = draft.selector_top_k, draft.architecture
    if not (draft.selector_rank and K):
        raise DDTreeConfigError(
            f"The draft checkpoint is a {name} but its dflash_config has no candidate selector "
            f"(selector_rank={draft.selector_rank}, selector_top_k={K}); a DFlash2 draft needs "
            f"both, or serve it as a DFlash draft (architectures: DFlashDraftModel)."
        )
    given = _positive_int(topk, "--speculative-eagle-topk")
    if given is not None and given != K:
        raise DDTreeConfigError(
            f"--speculative-eagle-topk {given} differs from the DFlash2 draft checkpoint's "
            f"selector_top_k {K} (the candidates its selector scores per position); drop the "
            f"flag or pass --speculative-eagle-topk {K}."
        )
    if not 2 <= K <= MAX_TOPK:
        raise DDTreeConfigError(
            f"The DFlash2 draft checkpoint's selector_top_k is {K}; DDTREE needs 2 <= K <= "
            f"{MAX_TOPK} (--speculative-eagle-topk); serve this draft with "
            f"--speculative-algorithm DFLASH."
        )
    return K


def _resolve_nodes(
    num_draft_tokens: int | None, B: int, K: int, draft: DraftCheckpoint | None = None
) -> int:
    N = _positive_int(num_draft_tokens, "--speculative-num-draft-tokens")
    N = DEFAULT_BUDGET_PER_BLOCK * B if N is None else N
    if N < B:
        raise DDTreeConfigError(
            f"DDTREE needs --speculative-num-draft-tokens (tree nodes incl. the root) >= the "
            f"DFlash block size: got N={N} < B={B}. Use N >= {B}, e.g. {2 * B}."
        )
    if N > MAX_NUM_NODES:
        raise DDTreeConfigError(
            f"--speculative-num-draft-tokens {N} exceeds the largest supported tree "
            f"({MAX_NUM_NODES} nodes)."
        )
    capacity = min(tree_capacity(K, B - 1), N)
    if N - 1 > capacity and draft is not None and draft.dflash2:
        raise DDTreeConfigError(
            f"--speculative-num-draft-tokens {N} asks for {N - 1} draft nodes, but a tree of "
            f"depth <= {B - 1} over the DFlash2 draft checkpoint's selector_top_k {K} "
            f"candidates holds at most {capacity}; pass --speculative-num-draft-tokens "
            f"<= {capacity + 1}."
        )
    if N - 1 > capacity:
        raise DDTreeConfigError(
            f"A tree of depth <= {B - 1} with {K} candidates per position holds at most "
            f"{capacity} draft nodes, but --speculative-num-draft-tokens {N} asks for {N - 1}. "
            f"Raise --speculative-eagle-topk or lower --speculative-num-draft-tokens."
        )
    return N


def _positive_int(value: object, flag: str) -> int | None:
    if value is None:
        return None
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        raise DDTreeConfigError(f"{flag} must be an integer, got {value!r}.") from None
    if as_int != value and not isinstance(value, str):
        raise DDTreeConfigError(f"{flag} must be an integer, got {value!r}.")
    if as_int < 1:
        raise DDTreeConfigError(f"{flag} must be >= 1, got {as_int}.")
    return as_int


# --- the environment: the package reads os.environ here and nowhere else ---------------------


# The switches a user sets, all of them (README, "Tune it"); tests/unit/test_plugin.py fails on
# one more. Debugging aids are test tooling (tests/gpu/server_debug), not switches.
SWITCHES = (
    "SGLANG_DDTREE_WIDTH",
    "SGLANG_DDTREE_WIDTHS",
    "SGLANG_DDTREE_PENALTIES",
    "SGLANG_DDTREE_DUMP_ROUNDS",
    "SGLANG_DDTREE_DUMP_EVERY",
)


@dataclasses.dataclass(frozen=True)
class Options:
    """Every DDTREE environment switch (SWITCHES), typed, validated together, and what the
    server's flags decide beside them.

    width         SGLANG_DDTREE_WIDTH         auto | fixed: auto verifies each round the width
                                              (of `widths`) with the most expected tokens per
                                              ms at the running batch (round/widths.py);
                                              fixed: always --speculative-num-draft-tokens;
                                              fixed under --enable-deterministic-inference
                                              and, unless asked for auto, at --tp-size > 1
                                              (there rank 0 chooses for every rank)
    widths        SGLANG_DDTREE_WIDTHS        comma-separated verify widths for auto, each in
                                              [B, N]; None: B, 2B, 4B ... below N, and N
    penalties     SGLANG_DDTREE_PENALTIES     1 | 0: 1 serves frequency / presence /
                                              repetition penalties, min_new_tokens and min_p,
                                              each node by its own path
                                              (round/penalties.py; exact on the GPU);
                                              0 refuses them with 400 (the memory way out)
    dump_rounds   SGLANG_DDTREE_DUMP_ROUNDS   a JSON-lines file for sampled rounds; None: off
    dump_every    SGLANG_DDTREE_DUMP_EVERY    every how many rounds (100)
    From the server's flags, not switches:
    gdn_verify    chunk (the chunked verify; trees over 256 nodes take the root paths), or
                  paths (root paths, batch-invariant) under --enable-deterministic-inference
    gdn_scratch   compact (state/gdn_pool.py), or full where SGLang allocates the per-node
                  states itself: --enable-unified-memory
    Switches that were retired are refused at start-up, naming what replaced them
    (RETIRED_SWITCHES, DEBUG_SWITCHES).
    """

    gdn_verify: str = "chunk"
    gdn_scratch: str = "compact"
    dump_rounds: str | None = None
    dump_every: int = 100
    width: str = "auto"
    widths: tuple[int, ...] | None = None
    penalties: bool = True

    @classmethod
    def from_env(
        cls,
        unified_memory: bool = False,
        deterministic: bool = False,
        tensor_parallel: bool = False,
    ) -> Options:
        """Parse and check every switch; an error names the switch and the fix.
        unified_memory (--enable-unified-memory): SGLang's unified pool allocates the per-node
        GDN states itself, so the scratch is full. deterministic
        (--enable-deterministic-inference): the GDN verify takes the root paths, whose served
        tokens are batch-invariant (the chunked verify's were not in the GPU suite).
        tensor_parallel (--tp-size > 1): a fixed width unless asked for auto (`_width_mode`)."""
        _refuse_retired_switches()
        every = env_value("SGLANG_DDTREE_DUMP_EVERY", "100")
        if not every.isdigit() or int(every) < 1:
            raise ValueError(f"SGLANG_DDTREE_DUMP_EVERY must be a whole number >= 1, got {every!r}")
        opts = cls(
            gdn_verify="paths" if deterministic else "chunk",
            gdn_scratch="full" if unified_memory else "compact",
            dump_rounds=env_value("SGLANG_DDTREE_DUMP_ROUNDS") or None,
            dump_every=int(every),
            width=_width_mode(deterministic, tensor_parallel),
            widths=_widths("SGLANG_DDTREE_WIDTHS"),
            penalties=env_choice("SGLANG_DDTREE_PENALTIES", ("1", "0")) == "1",
        )
        opts._check()
        return opts

    @property
    def compact_scratch(self) -> bool:
        """Whether the compact GDN verify scratch is in use."""
        return self.gdn_scratch == "compact"

    def _check(self) -> None:
        if self.widths is not None and self.width != "auto":
            raise ValueError(
                "SGLANG_DDTREE_WIDTHS lists the widths SGLANG_DDTREE_WIDTH=auto "
                "chooses among; drop it, or set SGLANG_DDTREE_WIDTH=auto."
            )

    def describe(self) -> str:
        """One line of every resolved switch (the server logs it at startup)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def _widths(name: str) -> tuple[int, ...] | None:
    """A comma-separated list of whole numbers >= 1 (unset: None), or an error naming it."""
    text = env_value(name)
    if text is None or not text.strip():
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(
            f"{name} must be comma-separated widths >= 1 (e.g. 16,32,64), got {text!r}"
        )
    return tuple(sorted({int(part) for part in parts}))


# Switches that were retired, and what replaced each: a server refuses to start with one set,
# since a silently ignored switch would mislead.
RETIRED_SWITCHES = {
    "SGLANG_DDTREE_TREE_BUILDER": "the device picks the tree builder (Triton on CUDA, torch "
    "elsewhere)",
    "SGLANG_DDTREE_SYNC_CHECK": "the sync check is test tooling (tests/gpu/server_debug, "
    "DDTREE_SYNC_CHECK=1 there; docs/debugging.md)",
    "SGLANG_DDTREE_GDN_VERIFY": "the chunked GDN verify serves, the root paths under "
    "--enable-deterministic-inference (to debug: tests/gpu/server_debug, DDTREE_GDN_VERIFY "
    "there)",
    "SGLANG_DDTREE_GDN_PRECISION": "the chunked GDN verify's products run split "
    "(to debug: tests/gpu/server_debug, DDTREE_GDN_PRECISION there)",
    "SGLANG_DDTREE_CONV": "DDTREE's tree conv1d serves",
    "SGLANG_DDTREE_GDN_SCRATCH": "the GDN scratch is compact, full where SGLang allocates the "
    "per-node states (--enable-unified-memory)",
    "SGLANG_DDTREE_GDN": "DDTREE's Gated DeltaNet tree verify, conv1d and commit always serve "
    "(3-6x faster than SGLang's per-node verify at 27B head sizes, docs/results.md; SGLang's "
    "kernels stay the reference in the tests and scripts/bench_gdn_tree.py)",
    "SGLANG_DDTREE_LOGPROBS": "logprobs are always served",
    "SGLANG_DDTREE_MASK_PACK": "the verify plan packs the mask from the tree",
    "SGLANG_DDTREE_VERIFY_PLAN": "the verify is planned from host lengths with the mask packed "
    "from the tree (round/verify_plan.py), measured faster than SGLang's own plan",
    "SGLANG_DDTREE_ACCEPT_PATH": "round/accept_path.py always moves the accepted path",
    "SGLANG_DDTREE_SIMULATE": "the simulated world is benchmark tooling (scripts/simworld, "
    "DDTREE_SIMULATE there, which scripts/bench_round.py --simulate sets; docs/simulation.md)",
}
# debugging aids that were server switches: the check's SERVE and the perturbation change
# served tokens, and the check reads back and saves on the decode thread
DEBUG_SWITCHES = (
    "SGLANG_DDTREE_GDN_CHECK",
    "SGLANG_DDTREE_GDN_CHECK_SERVE",
    "SGLANG_DDTREE_GDN_CHECK_SAVE",
    "SGLANG_DDTREE_GDN_PERTURB",
)


def _refuse_retired_switches() -> None:
    """A server does not start with a retired switch set: the message says what replaced it."""
    for name, instead in RETIRED_SWITCHES.items():
        if env_value(name) is not None:
            raise ValueError(f"{name} is no longer a switch: {instead}. Unset {name}.")
    for name in DEBUG_SWITCHES:
        if env_value(name) is not None:
            raise ValueError(
                f"{name} is no longer a server switch: the GDN check and perturbation are "
                "debugging aids that change served tokens or stop the decode loop, run from "
                "test tooling (tests/gpu/server_debug, DDTREE_GDN_* there; docs/debugging.md). "
                f"Unset {name}."
            )


def _width_mode(deterministic: bool, tensor_parallel: bool) -> str:
    """SGLANG_DDTREE_WIDTH: fixed by default under deterministic inference, and at tp > 1 until a
    multi-GPU run has checked the shared choice there (auto at tp > 1: rank 0 chooses and
    broadcasts each round, round/widths.RankWidths, so that no two ranks verify different
    widths in one round and wait on each other's collectives)."""
    return env_choice(
        "SGLANG_DDTREE_WIDTH",
        ("auto", "fixed"),
        default="fixed" if deterministic or tensor_parallel else "auto",
    )


def env_choice(name: str, options: tuple[str, ...], default: str | None = None) -> str:
    """The value of switch `name`, one of `options` (default: the first), or an error naming it."""
    choice = os.environ.get(name, options[0] if default is None else default)
    if choice not in options:
        listed = " or ".join(repr(o) for o in options)
        raise ValueError(f"{name} must be {listed}, got {choice!r}.")
    return choice


def env_value(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def cache_home() -> Path:
    """Where the package writes what it can rebuild (the demo's seeded pair)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang_ddtree"


def deterministic_cublas() -> None:
    """cuBLAS's deterministic workspace (training), unless the caller set one."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


# --- the widths an automatic server chooses among (round/widths.py chooses) -------------------


def verify_widths(
    block_size: int,
    num_nodes: int,
    given: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The verify widths a server runs, increasing, the largest N = num_nodes: `given` (each in
    [B, N]; N is added), else B, 2B, 4B, ... below N, and N. Widths start at the DFlash block B:
    a B-node DDTree holds at least the chain's expected tokens (the best B-node tree, which the
    chain is one of) at the chain's verify width, so the chain itself is not a separate choice."""
    B, N = block_size, num_nodes
    if given is None:
        widths = {N}
        w = B
        while w < N:
            widths.add(w)
            w *= 2
        return tuple(sorted(widths))
    bad = [w for w in given if not B <= w <= N]
    if bad:
        raise ValueError(
            f"SGLANG_DDTREE_WIDTHS {list(given)}: every width must be in [B, N] = "
            f"[{B}, {N}] (--speculative-dflash-block-size, "
            f"--speculative-num-draft-tokens); {bad} are not."
        )
    return tuple(sorted({*given, N}))


def automatic_widths(
    width: str, block_size: int, num_nodes: int, given: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The verify widths a server chooses among per round: `verify_widths` with
    SGLANG_DDTREE_WIDTH=auto (`width`) and several of them; () where every round runs at N."""
    widths = verify_widths(block_size, num_nodes, given)
    return widths if width == "auto" and len(widths) > 1 else ()
