"""DDTREE's identity for SGLang's scheduler, and its server-argument validation.

Identity: DDTREE is a member of the DFlash family (target aux hidden capture, DFlash draft KV
pool, draft TARGET_VERIFY graphs at width B, DFlashDraftInputV2 state relay), but not DFLASH
itself (no chain verify). Its target verify is EAGLE-style tree verify at width N.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_ddtree.adapter import compat
from sglang_ddtree.config import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    DDTreeConfig,
    DDTreeConfigError,
    DraftCheckpoint,
    Options,
    automatic_widths,
)

logger = logging.getLogger(__name__)

ALGORITHM = "DDTREE"


def is_ddtree(spec_algorithm) -> bool:
    """Whether a scheduler-side algorithm object (SGLang's enum or registry entry) is DDTREE."""
    return getattr(spec_algorithm, "name", None) == ALGORITHM


def serves_ddtree(server_args) -> bool:
    """Whether these server arguments (the front end's: the algorithm as its name) are DDTREE's."""
    return getattr(server_args, "speculative_algorithm", None) == ALGORITHM


class DDTreeSpec(CustomSpecAlgo):
    """`CustomSpecAlgo` plus what SGLang's scheduler calls on any algorithm. Every answer that
    differs from CustomSpecAlgo's default, or that a reader could doubt, says why."""

    # -- DFlash family identity ----------------------------------------------------------------
    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True  # the draft runner captures TARGET_VERIFY graphs for the block

    def supports_grammar_overlap(self) -> bool:
        return True  # the worker passes grammar_barrier into the tree verify

    def supports_prefill_shared_read_done(self) -> bool:
        # Prefill is DFlashWorkerV2's, unchanged: the target's extend, then the draft KV written
        # from its hidden states, as for DFLASH, for which SGLang answers True.
        return True

    def supports_mixed_chunk(self) -> bool:
        # A mixed step decodes the running requests one token each outside the tree round (its
        # draft state, penalty counts and GDN commit); DDTREE's round has never run inside one.
        return False

    def is_uno(self) -> bool:
        return False  # UNO's own worker, pools and request checks are keyed on this

    def supports_ragged_verify(self) -> bool:
        return False  # every request of a round verifies the same width (uniform graphs)

    def has_draft_kv(self) -> bool:
        return True  # the DFlash draft keeps KV of the committed context

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> int | None:
        # The widest verify: every automatic width is at most N, and the draft block B <= N.
        return super().resolve_max_speculative_num_draft_tokens(server_args)

    # -- enum-only methods the scheduler calls unconditionally (absent on CustomSpecAlgo) ------
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> type | None:
        # DDTREE's worker runs on CUDA only (validate_server_args), never a platform's own
        return None

    def create_future_map(
        self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    # -- widths: the draft runs the B-token block, the target verifies the N-node tree ---------
    def get_num_tokens_per_req_for_target_verify(
        self, num_draft_tokens: int, is_draft_worker: bool
    ) -> int:
        if is_draft_worker:
            from sglang.srt.runtime_context import get_spec

            return int(get_spec().speculative_dflash_block_size)
        return num_draft_tokens

    def handle_server_args(self, server_args: Any) -> None:
        apply_server_args(server_args)


def validate_server_args(server_args: Any) -> None:
    """Reject what DDTREE does not support, naming the flag and the fix (runs at startup)."""
    view = compat.resolved(server_args)
    _require(
        view.speculative_draft_model_path is not None,
        "DDTREE needs --speculative-draft-model-path (a DFlash or DFlash2 draft checkpoint).",
    )
    _require(
        str(view.device).startswith("cuda"),
        f"DDTREE runs on CUDA GPUs only, got --device {view.device}.",
    )
    prefill, decode = compat.attention_backends(server_args)
    _require(
        prefill == "flashinfer" and decode == "flashinfer",
        f"DDTREE verifies trees with FlashInfer custom masks: pass --attention-backend "
        f"flashinfer (got prefill={prefill!r}, decode={decode!r}).",
    )
    _require(view.page_size in (None, 1), f"DDTREE needs --page-size 1, got {view.page_size}.")
    _validate_sampling_and_parallelism(view)
    cfg = resolve_config(server_args)  # flag ranges (N, B, K) fail here, before any model loads
    # and the environment switches, in the main process before any scheduler starts
    opts = Options.from_env(**compat.option_modes(server_args))
    try:
        widths = automatic_widths(opts.width, cfg.block_size, cfg.num_nodes, opts.widths)
    except ValueError as exc:
        raise DDTreeConfigError(str(exc)) from None
    # pdmux shares attention backends between graph runners, which one backend per width
    # (round/widths.py) does not: name the way out
    _require(
        not widths or not getattr(view, "enable_pdmux", False),
        "DDTREE's automatic verify widths do not support --enable-pdmux; "
        "set SGLANG_DDTREE_WIDTH=fixed or drop the flag.",
    )


def _validate_sampling_and_parallelism(view: Any) -> None:
    # SGLang's two-batch overlap splits a verify input field by field
    # (two_batch_overlap.split_spec_info): the mask, the tokens, the tree links, but not the
    # tree DDTREE's own fields carry (the mask packer reads its visibility), and the split has
    # never run with DDTREE on a GPU
    _require(
        not getattr(view, "enable_two_batch_overlap", False),
        "DDTREE does not support --enable-two-batch-overlap (SGLang splits a verify batch "
        "into micro-batches field by field, and not DDTREE's tree); drop the flag.",
    )
    _require(
        not view.speculative_use_rejection_sampling,
        "DDTREE verifies with target-only tree sampling; drop "
        "--speculative-use-rejection-sampling.",
    )
    for flag in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(view, flag)
        _require(
            value is None or float(value) >= 1.0,
            f"--{flag.replace('_', '-')} {value} makes sampling lossy; DDTREE keeps the "
            f"target distribution exactly: leave it at 1.0.",
        )
    _require(
        int(view.tokenizer_worker_num or 1) == 1,
        f"DDTREE needs --tokenizer-worker-num 1 (SGLang does not load plugins in extra "
        f"tokenizer workers), got {view.tokenizer_worker_num}.",
    )
    _require(
        not view.enable_dp_attention,
        "DDTREE does not support --enable-dp-attention yet; drop the flag.",
    )
    _require(
        int(view.pp_size) == 1,
        f"DDTREE does not support pipeline parallelism: use --pp-size 1, got {view.pp_size}.",
    )
    _require(
        int(view.tp_size) == 1,
        f"DDTREE's draft head runs on one GPU: use --tp-size 1, got {view.tp_size}.",
    )
    _validate_features(view)


def _validate_features(view: Any) -> None:
    """SGLang features a DDTREE round does not serve."""
    _require(
        not (view.enable_linear_replayssm or view.enable_linear_replayssm_spec),
        "ReplaySSM verifies chains only; drop --enable-linear-replayssm(-spec) for DDTREE.",
    )
    _require(
        not view.speculative_adaptive,
        "DDTREE uses a fixed node budget: drop --speculative-adaptive.",
    )
    _require(
        view.speculative_draft_window_size is None,
        "DDTREE does not support --speculative-draft-window-size yet; drop the flag.",
    )
    _require(
        not getattr(view, "enable_watermark", False),
        "DDTREE does not support --enable-watermark (SGLang's tree watermark reads the verify's "
        "unpacked mask, which DDTREE packs from the tree without writing); drop the flag.",
    )
    _require(
        str(view.disaggregation_mode) in ("null", "None"),
        f"DDTREE does not support PD disaggregation (--disaggregation-mode "
        f"{view.disaggregation_mode}).",
    )


def resolve_config(server_args: Any, draft: DraftCheckpoint | None = None) -> DDTreeConfig:
    """(B, N, K) from the flags and the draft checkpoint's config (`draft`; None: read it),
    validated: a DFlash2 draft fixes K at its selector_top_k."""
    view = compat.resolved(server_args)
    if draft is None:
        draft = compat.draft_checkpoint(server_args)
    return DDTreeConfig.resolve(
        block_size=view.speculative_dflash_block_size,
        draft_block_size=draft.block_size,
        num_draft_tokens=view.speculative_num_draft_tokens,
        topk=view.speculative_eagle_topk,
        draft=draft,
    )


def apply_server_args(server_args: Any, draft: DraftCheckpoint | None = None) -> DDTreeConfig:
    """Write DDTREE's resolved widths and defaults into the server args (in place; SGLang
    records the writes as the plugin's resolutions)."""
    cfg = resolve_config(server_args, draft)
    server_args.speculative_dflash_block_size = cfg.block_size
    server_args.speculative_num_draft_tokens = cfg.num_nodes
    server_args.speculative_eagle_topk = cfg.topk
    # One "step": keeps the scheduler's per-decode KV reserve at 2 * N, which is what the
    # DFlash draft state reserves (DFlashDraftInputV2.prepare_for_decode).
    server_args.speculative_num_steps = 1
    if server_args.speculative_draft_attention_backend is None:
        server_args.speculative_draft_attention_backend = "flashinfer"
    if server_args.max_running_requests is None:
        server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
        logger.warning(
            "DDTREE: --max-running-requests defaults to %d (tree verify scratch grows with "
            "N x running requests); pass it explicitly to change.",
            DEFAULT_MAX_RUNNING_REQUESTS,
        )
    if server_args.enable_mixed_chunk:
        server_args.enable_mixed_chunk = False
        logger.warning("DDTREE: --enable-mixed-chunk is turned off (not supported).")
    logger.info(
        "DDTREE: block size B=%d, tree nodes N=%d (budget %d), topk K=%d",
        cfg.block_size,
        cfg.num_nodes,
        cfg.budget,
        cfg.topk,
    )
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise DDTreeConfigError(message)
