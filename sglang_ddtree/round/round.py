"""One DDTREE decode round, start to end: the `Round` and its stages, in the order they run.

The worker (round/worker.py) makes a Round for every decode batch and calls its stages; SGLang's
own verify (`run_eagle_verify`) calls the middle ones back through the hook table
(plugin/hooks.py points each hook at the stage here):

  draft         the DFlash block [bonus, MASK x (B - 1)] through the draft runner (a CUDA graph
                at width B); in the same graph the draft head (round/draft_head.py) reads the
                target's LM head, takes the top-K per position and builds the tree
                (tree/build_triton.py)
  tree_input    the first `width` nodes of the tree as SGLang's EAGLE verify input
                (round/verify_input.py: mask, positions, retrieve links)
  verify        the target forward over the tree (run_eagle_verify), inside which SGLang calls:
    plan_verify   FlashInfer's plan of the tree mask from host lengths (round/verify_plan.py)
    verify_gdn    each Gated DeltaNet layer's tree verify (state/gdn.py), and conv_gdn its
                  causal conv1d over the tree
    sample        the target's token at every node: greedy, or target-only tree sampling at
                  T > 0 with per-node penalties (round/penalties.py)
    accept        SGLang's tree walk, then the accepted path moved to the front of each
                  request's block (round/accept_path.py)
    commit_state  the GDN state of the accepted path committed (state/gdn.py)
  commit        draft KV of the accepted tokens from their target hidden states
  observe       what the round emitted, for the penalty counts and the round dump; and
                `accepted_at_widths`, the width policy's readings (round/widths.py)

No stage waits on the host: host work reads lengths SGLang already holds on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.eagle_worker_common import run_eagle_verify
from torch.profiler import record_function

from sglang_ddtree.accept.budget import accepted_at_widths
from sglang_ddtree.adapter import compat
from sglang_ddtree.round import accept_path, penalties, verify_plan
from sglang_ddtree.round.verify_input import make_verify_input
from sglang_ddtree.state import gdn
from sglang_ddtree.tree.types import DraftTree


def own_code():
    """The context DDTREE's own per-round code runs in (SGLang's own calls are left out):
    nothing when serving. The GPU test servers' sync check replaces it from outside with torch's
    sync debug mode (tests/gpu/server_debug/ddtree_sync_check.py; the tests fail on a warning)."""
    return contextlib.nullcontext()


def profiled(name: str):
    """The stage's `record_function` range while a torch profiler runs (SGLang's
    /start_profile), else nothing: a range costs host time in every round."""
    if compat.profiler_running():
        return record_function(name)
    return contextlib.nullcontext()


@dataclasses.dataclass(eq=False)
class Round:
    """One decode round: each stage fills what the next reads."""

    worker: Any  # the DDTreeWorker: draft runner, tree head, pools, options
    batch: Any  # SGLang's ScheduleBatch of this round
    bs: int
    width: int  # the verify width: the width policy's choice, or N
    draft_input: DFlashDraftInputV2  # the draft state the last round (or the prefill) left
    positions: torch.Tensor | None = None  # [bs, B] the block's positions (draft)
    draft_slots: torch.Tensor | None = None  # [bs, B] where its draft KV goes (draft)
    tree: DraftTree | None = None  # the first `width` nodes of the built tree (tree_input)

    # -- draft (and, in the same graph, the tree build) ---------------------------------------
    def draft(self) -> None:
        """Run the DFlash block (and, in its graph, the tree build); the round gets the
        block's positions and the draft KV's write slots [bs, B]."""
        w, batch, bs, B = self.worker, self.batch, self.bs, self.worker.cfg.block_size
        # [bs, B] each: bonus + MASK x (B - 1); seq_len + 0..B-1; req_to_token slots; and the
        # host-bound lengths [bs]
        block_ids, positions, cache_loc, seq_lens_cpu = compat.draft_block_buffers(w, bs)
        with own_code():
            compat.prepare_draft_block(
                w,
                bonus_tokens=self.draft_input.bonus_tokens.view(-1),
                prefix_lens=batch.seq_lens.view(-1),
                req_pool_indices=batch.req_pool_indices.view(-1),
                req_to_token=w.model_runner.req_to_token_pool.req_to_token,
                block_ids_out=block_ids,
                positions_out=positions,
                cache_loc_out=cache_loc,
            )
            input_embeds = compat.draft_block_embeds(w, block_ids)
        committed_cpu = self._host_seq_lens()
        seq_lens_cpu.copy_(committed_cpu)
        seq_lens_cpu.add_(B)
        # the block's slots for every forward and KV write of the round (the verify's window
        # starts with them)
        plan = compat.plan_window(w, batch, committed_cpu, cache_loc.reshape(-1), B)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=cache_loc.reshape(-1),
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions.reshape(-1),
            input_embeds=input_embeds,
            spec_algorithm=w.model_runner.spec_algorithm,
            spec_info=compat.draft_block_spec_info(w),
            capture_hidden_mode=CaptureHiddenMode.NULL,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
            **compat.non_padded_tokens(bs * B, w.device),
        )
        compat.bind_draft_plan(w, plan, forward_batch)
        with torch.inference_mode(), compat.draft_scope(w):
            draft_out = w.draft_model_runner.forward(forward_batch)
            if not draft_out.can_run_graph:  # the graph ran the head already
                with own_code():
                    hidden = draft_out.logits_output.hidden_states
                    w.tree_head(hidden, block_ids.flatten(), positions.flatten())
        self.positions, self.draft_slots = positions, compat.draft_write_ids(w, plan).view(bs, B)

    # -- tree_input: the tree as SGLang's verify input ----------------------------------------
    def tree_input(self):
        """The first `width` nodes of the built tree as the EAGLE verify input (mask, positions,
        retrieve links) SGLang's verify reads."""
        w = self.worker
        self.tree = tree = w.tree_head.tree(self.bs, self.width)
        return make_verify_input(
            w.cfg,
            tree.tokens,
            tree.depth,
            tree.first_child,
            tree.next_sibling,
            tree.visibility,
            self.batch.seq_lens,
            self._seq_lens_sum_bound(),
            write_mask=False,  # the host plan packs it from the tree (verify_plan.py)
        )

    # -- verify: the target over the tree; SGLang calls the stages below inside it ------------
    def verify(self, grammar_barrier):
        """The target's tree verify, sampling, accept walk and state commit (run_eagle_verify)."""
        # the verify plans its own window (eagle_prepare_for_verify: `width` slots from each
        # request's committed length, the block's B first)
        w = self.worker
        return run_eagle_verify(
            self.batch,
            target_worker=w.target_worker,
            req_to_token_pool=w.model_runner.req_to_token_pool,
            token_to_kv_pool_allocator=w.model_runner.token_to_kv_pool_allocator,
            plan_stream=None,
            plan_stream_ctx=contextlib.nullcontext(),
            topk=w.cfg.topk,
            num_draft_tokens=self.width,
            device=w.device,
            metadata_ready_pre_pad=False,
            finalize_tree_path=True,  # accepted path's KV, predict, hidden -> block front
            grammar_barrier=grammar_barrier,
        )

    # Inside run_eagle_verify, through plugin/hooks.py (each bound there to the process's
    # runtime.Runtime or the part it reads); every one leaves other algorithms' batches to SGLang.
    plan_verify = staticmethod(verify_plan.call_begin_forward)
    verify_gdn = staticmethod(gdn.target_verify)
    conv_gdn = staticmethod(gdn.conv_update)
    sample = staticmethod(penalties.eagle_sample)
    accept = staticmethod(accept_path.finalize_hook)
    commit_state = staticmethod(gdn.commit)

    # -- commit: the accepted tokens become draft context -------------------------------------
    def commit(self, result) -> None:
        """Draft KV of the accepted path from its (front-compacted) target hidden states: per
        request the verify's `width` rows (SGLang's compaction) or the path's B rows alone
        (round/accept_path.py); the first B either way."""
        w, bs, B, width = self.worker, self.bs, self.worker.cfg.block_size, self.width
        hidden = result.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify returned no target hidden states.")
        if hidden.shape[0] not in (bs * width, bs * B):
            raise RuntimeError(
                f"DDTREE verify returned {hidden.shape[0]} hidden rows for {bs} "
                f"requests of {width} nodes"
            )
        accepted = hidden.view(bs, -1, hidden.shape[-1])[:, :B, :].reshape(bs * B, -1)
        compat.append_draft_kv(
            w,
            target_hidden=accepted,
            cache_loc=self.draft_slots.reshape(-1),
            cache_loc_2d=self.draft_slots,
            positions=self.positions.reshape(-1),
            commit_lens=result.accept_lens,
        )
        result.logits_output.hidden_states = None  # keep big buffers off the host copy

    # -- observe: what the round emitted -------------------------------------------------------
    def emitted(self, result) -> torch.Tensor:
        """[bs, B] a view of the round's tokens per request: its accepted drafts, then the
        bonus, the first accept_lens of each row."""
        return result.next_token_ids.view(self.bs, -1)[:, : self.worker.cfg.block_size]

    def observe(self, result, table, dump) -> None:
        """The emitted tokens into the penalty counts (`table`, a round/penalties.PenaltyTable or
        None) and the round dump (`dump`, or None)."""
        emitted = self.emitted(result)
        # the emitted tokens join each request's count in rounds whose batch asks for a penalty:
        # only a penalised request's row changes any logit (a neutral one's leaves them as they
        # are, whatever it holds), and a penalised request is in every round from its prefill on
        if table is not None and penalties.wanted(self.batch.reqs):
            table.observe(self.batch.req_pool_indices, emitted, result.accept_lens)
        if dump is not None:  # device-to-pinned copies; a thread writes them
            tree = self.tree
            dump.round(tree.tokens, tree.parents, tree.scores, emitted, result.accept_lens)

    def accepted_at_widths(self, result, widths) -> torch.Tensor:
        """[bs, W] the tokens the round accepted at each read width: its own, and what each
        narrower width's first nodes would have accepted (the width policy's paired readings)."""
        return accepted_at_widths(self.tree, self.emitted(result), result.accept_lens, widths)

    # -- host-side length bounds (no device sync) ---------------------------------------------
    def _host_seq_lens(self) -> torch.Tensor:
        if self.batch.seq_lens_cpu is not None:
            return self.batch.seq_lens_cpu
        if self.draft_input.nxt_kv_lens_cpu is not None:  # the allocation watermark
            return self.draft_input.nxt_kv_lens_cpu
        raise RuntimeError("DDTREE needs host sequence lengths (FlashInfer provides them).")

    def _seq_lens_sum_bound(self) -> int:
        """Host upper bound of sum(seq_lens); sizes the verify mask (too large is harmless)."""
        batch, draft_input = self.batch, self.draft_input
        if draft_input.nxt_kv_lens_sum is not None:  # the allocation watermark
            return int(draft_input.nxt_kv_lens_sum)
        if batch.seq_lens_sum is not None:
            return int(batch.seq_lens_sum)
        if batch.seq_lens_cpu is not None:
            return int(batch.seq_lens_cpu.sum())
        return len(batch.seq_lens) * self.worker.model_runner.model_config.context_len
