"""DDTreeWorker: SGLang's DFLASH worker with the chain verify replaced by a DDTree tree verify.

Inherited from DFlashWorkerV2 unchanged: draft TP worker and model, mask token, memory pools,
attention backends, prefill (target prefill + draft KV of the prompt), idle batches, and the
draft-KV materialisation from target hidden states. Replaced: the decode round, and the draft
graph's tail: DDTREE's draft head (round/draft_head.py) for a DFlash draft, and for a DFlash2
draft the lattice head in place of DFLASH's selector sampler. DFLASH's selector sampler is never
built (this worker's init_cuda_graphs replaces the one that builds it) and its chain sample
(`_selector_sample`, set only by DFLASH's own decode round) stays None, so DFLASH's chain accept
never runs; the tree verify samples through eagle_sample as for a DFlash draft.

Its decode round is a `Round` (round/round.py), whose stages run in order: draft (with the tree
build in the same graph), tree_input, verify (SGLang's tree verify, calling the round's
plan_verify, GDN, sample, accept and commit_state stages back through plugin/hooks.py), observe
and commit. This class makes the round and chooses its width; it also owns what lives across
rounds: the draft head, the verify widths and their policy (round/widths.py), the penalty
counts, and the start-up checks of DDTREE's memory. While a torch profiler runs, each part is a
`record_function` range named `ddtree.*` for SGLang's /start_profile traces.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import (
    build_block_pos_offsets,
    make_draft_block_spec_info,
    make_draft_input_v2,
)
from sglang.srt.utils import get_available_gpu_memory

from sglang_ddtree.adapter import compat
from sglang_ddtree.config import DDTreeConfig, Options, automatic_widths
from sglang_ddtree.round import round as stages
from sglang_ddtree.round.draft_head import DraftTreeHead, LatticeTreeHead, TreeHead, VocabShard
from sglang_ddtree.round.penalties import PenaltyTable
from sglang_ddtree.round.round import Round
from sglang_ddtree.round.round_dump import RoundDump
from sglang_ddtree.round.runtime import Runtime
from sglang_ddtree.round.widths import RankWidths, RoundReadings, VerifyWidths, WidthPolicy
from sglang_ddtree.state import round_memory

logger = logging.getLogger(__name__)


# the width policy's table goes to the log when a batch bucket's calibration completes, after
# these rounds, and every _WIDTH_LOG_EVERY rounds
_WIDTH_LOG_ROUNDS = (100, 1000)
_WIDTH_LOG_EVERY = 5000


class _DropWidthMismatch(logging.Filter):
    """DFlashWorkerV2 warns "DFLASH block size mismatch" because DDTREE's verify width N is not
    the draft's block B; for DDTREE that is the design (the draft runs at width B), not a
    misconfiguration, and the worker logs both below."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("DFLASH block size mismatch")


def _check_lm_head(lm_head) -> None:
    """The draft heads read the target's LM head weight as it is: a quantized one would give
    garbage (SGLang's candidate_topk refuses it too, at a DFlash2 drafter's first call)."""
    if lm_head.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        method = type(getattr(lm_head, "quant_method", None)).__name__
        raise ValueError(
            "DDTREE drafts through the target's LM head, which this checkpoint quantizes "
            f"(lm_head.weight is {lm_head.weight.dtype}, {method}); serve a checkpoint that "
            "keeps lm_head unquantized (ModelOpt exclude_modules, compressed-tensors ignore: "
            "lm_head). Qwen's FP8 checkpoints and --quantization fp8 keep it in bf16."
        )


def tree_head(lm_head, cfg: DDTreeConfig, max_bs: int, gather=None) -> DraftTreeHead:
    """The draft head on the target's LM head: its real rows (`compat.lm_head_rows`); given the
    TP group's `gather` (a vocabulary-parallel head, tp > 1), a VocabShard that merges the
    ranks' top-K through it, so every rank builds the same tree. Start-up
    still refuses --tp-size > 1 (adapter/spec.py) until a multi-GPU run has verified the
    rest."""
    _check_lm_head(lm_head)
    offset, rows = compat.lm_head_rows(lm_head)
    shard = VocabShard(offset=offset, gather=gather) if gather is not None else None
    return DraftTreeHead(
        lm_head_weight=lm_head.weight,
        vocab_size=rows,
        cfg=cfg,
        max_bs=max_bs,
        shard=shard,
    )


def lattice_head(draft_model, lm_head, cfg: DDTreeConfig, max_bs: int) -> LatticeTreeHead:
    """A DFlash2 drafter's head: its selector over its candidates on the target's LM head,
    which the draft model's `lm_head` points at from here on, before any draft graph is
    captured (as DFLASH's worker sets it). Under tensor parallelism SGLang's candidate_topk
    gathers the global top-K (and the full-vocabulary lse) itself, and the selector's codebooks
    are replicated."""
    _check_lm_head(lm_head)
    compat.attach_target_lm_head(draft_model, lm_head)
    return LatticeTreeHead(
        draft_model=draft_model, cfg=cfg, max_bs=max_bs, device=lm_head.weight.device
    )


def draft_tail(head: TreeHead):
    """The draft graph's tail hook: the head on the block's hidden states, ids and positions."""

    def tail(runner, out, forward_batch, num_tokens):
        del runner, num_tokens
        if out.hidden_states is None:
            raise RuntimeError("DDTREE's draft forward returned no hidden states to capture.")
        head(out.hidden_states, forward_batch.input_ids, forward_batch.positions)

    return tail


class DDTreeWorker(DFlashWorkerV2):
    """SGLang constructs the worker class itself, with its own arguments: the worker factory
    hands it this process's Runtime through `bound_to` (a subclass that passes it on)."""

    @classmethod
    def bound_to(cls, runtime: Runtime) -> type[DDTreeWorker]:
        class Bound(cls):
            def __init__(self, server_args, gpu_id, nccl_port, target_worker):
                super().__init__(server_args, gpu_id, nccl_port, target_worker, runtime)

        Bound.__name__ = Bound.__qualname__ = cls.__name__
        return Bound

    def __init__(self, server_args, gpu_id, nccl_port, target_worker, runtime: Runtime):
        # before DFlashWorkerV2's start-up, which may call methods overridden here
        self.runtime = runtime  # the options, (B, N, K) and hook state, shared with the hooks
        dflash_logger = logging.getLogger(DFlashWorkerV2.__module__)
        width_note = _DropWidthMismatch()
        dflash_logger.addFilter(width_note)
        try:
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
        finally:
            dflash_logger.removeFilter(width_note)
        self.cfg = runtime.cfg
        self._tp_rank = compat.tp_rank()
        # DFlashWorkerV2 took N (the verify width) for its block size; the DFlash block is B.
        self.block_size = self.cfg.block_size
        self.speculative_num_draft_tokens = self.cfg.num_nodes
        self.draft_model.set_block_size(self.cfg.block_size)
        # DDTREE's tree sampling reads the full vocabulary's logits (DFLASH's chain defers the
        # vocabulary gather into its own accept step)
        compat.gather_target_verify_logits(self)
        compat.set_draft_block(
            self,
            build_block_pos_offsets(length=self.cfg.block_size, device=self.device),
            make_draft_block_spec_info(draft_token_num=self.cfg.block_size, device=self.device),
        )
        self._tp_size = compat.tp_size()
        self.tree_head = self._build_tree_head()
        # SGLANG_DDTREE_DUMP_ROUNDS: sampled rounds as JSON lines (off: None, and no cost)
        self._round_dump = RoundDump.from_options(self.options) if self._tp_rank == 0 else None
        self._widths: VerifyWidths | None = None  # SGLANG_DDTREE_WIDTH=auto (init_cuda_graphs)
        self._readings: RoundReadings | None = None
        self._rank_widths: RankWidths | None = None  # auto at tp > 1: rank 0's choice, shared
        self._graphs_on = False  # the target's decode CUDA graphs (init_cuda_graphs)
        self._eager_warned: set[int] = set()
        # SGLANG_DDTREE_PENALTIES=1: the count table, made in alloc_memory_pool (the scheduler
        # builds this worker before any request pool exists)
        self._penalties: PenaltyTable | None = None
        if self._tp_rank == 0:
            logger.info(
                "DDTREE worker ready: B=%d, N=%d (budget %d), K=%d, draft head %s for bs<=%d",
                self.cfg.block_size,
                self.cfg.num_nodes,
                self.cfg.budget,
                self.cfg.topk,
                type(self.tree_head).__name__,
                self.tree_head.max_bs,
            )

    def _build_tree_head(self) -> TreeHead:
        """The draft head at the largest batch: the lattice head for a DFlash2 draft (one with a
        candidate selector), else the DFlash head."""
        graph_bs = get_exec().graph.cuda_graph_config.decode.bs or [1]
        max_bs = max(max(graph_bs), int(compat.max_running_requests() or 1))
        lm_head = self.target_worker.model_runner.model.lm_head
        if compat.draft_selector(self.draft_model) is not None:
            return lattice_head(self.draft_model, lm_head, self.cfg, max_bs)
        gather = compat.tp_gather() if self._tp_size > 1 else None
        return tree_head(lm_head, self.cfg, max_bs, gather)

    def init_cuda_graphs(self):
        capture = get_exec().graph.cuda_graph_config.decode.backend != Backend.DISABLED
        if capture and self._free_gb() < 1.0:
            capture = False
            logger.warning("DDTREE: draft CUDA graphs disabled (less than 1 GB free).")
        self._ask_for_readings()  # before the capture: the draft graphs compute them
        if capture:
            # Fold the draft head (top-K or the DFlash2 lattice, and the tree build) into the
            # draft graph, after the draft forward; DFLASH's own tail (its greedy head or
            # selector sampler) is never built here
            self.draft_model_runner.capture_tail_hooks.append(draft_tail(self.tree_head))
        compat.init_draft_cuda_graphs(self, capture)
        self._init_widths(capture)
        self._graphs_on = compat.target_verify_state(self.target_worker.model_runner)[1] is not None

    def _free_gb(self) -> float:
        """GPU memory free for a start-up capture, GB: at tp > 1 the least of every rank's, so
        that every rank captures the same graphs (a capture runs the target's collectives)."""
        if self._tp_size > 1:
            return compat.least_free_gb(self.device, self.gpu_id)
        return get_available_gpu_memory(self.device, self.gpu_id)

    def _ask_for_readings(self) -> None:
        """SGLANG_DDTREE_WIDTH=auto with several widths: the draft head computes the policy's
        expected tokens at each (round/widths.RoundReadings reads them)."""
        widths = self._automatic_widths()
        if widths:
            self.tree_head.read_widths(widths)

    @property
    def options(self) -> Options:
        """This process's DDTREE options, parsed once by the worker factory."""
        return self.runtime.options

    def _automatic_widths(self) -> tuple[int, ...]:
        opts = self.options
        return automatic_widths(opts.width, self.cfg.block_size, self.cfg.num_nodes, opts.widths)

    def _init_widths(self, capture: bool) -> None:
        """SGLANG_DDTREE_WIDTH=auto: the target's verify graphs at every width and the policy
        (capture: whether decode CUDA graphs are on and memory was left for the draft's)."""
        configured = widths = self._automatic_widths()
        if widths:
            free_gb = None  # VerifyWidths reads this GPU's
            if self._tp_size > 1:  # every rank captures and verifies the same widths
                self._rank_widths = RankWidths(*compat.tp_cpu_group())
                free_gb = self._free_gb
            self._widths = VerifyWidths(
                self.target_worker.model_runner, widths, capture, free_gb=free_gb
            )
            widths = self._widths.widths  # what was captured
            if self._rank_widths is not None:
                widths = self._rank_widths.agree(configured, widths)
                self._widths.keep(widths)
        if len(widths) <= 1:
            self._widths = self._rank_widths = None
            if self._tp_rank == 0:
                logger.info("DDTREE verify width: fixed at %d", self.cfg.num_nodes)
            return
        if self._rank_widths is not None and not self._rank_widths.is_source:
            return  # rank 0's policy chooses for every rank
        policy = WidthPolicy(widths, buckets=self._widths.buckets)
        head = self.tree_head
        if head.readings is None:  # a buffer made now would never be written by the graphs
            raise RuntimeError(
                "DDTREE: the draft head's width readings were not asked for "
                "before the draft graphs (_ask_for_readings): a bug"
            )
        self._readings = RoundReadings(policy, head.readings, head.reading_widths)
        self.runtime.widths = policy  # /server_info's widths_chosen
        if self._tp_rank == 0:
            logger.info(
                "DDTREE verify width: auto among %s (graph batch sizes %s)",
                ", ".join(map(str, widths)),
                list(self._widths.buckets) or "eager",
            )

    def _choose_width(self, bs: int) -> int:
        """This round's verify width (host only: readings of earlier rounds, no waiting; at
        tp > 1 rank 0's, broadcast to the other ranks)."""
        if self._rank_widths is not None:
            local = self._policy_width(bs) if self._rank_widths.is_source else None
            width = self._rank_widths.share(local)
            self.speculative_num_draft_tokens = width  # /metrics: sglang:spec_num_draft_tokens
            return width
        if self._readings is None:
            return self.cfg.num_nodes
        return self._policy_width(bs)

    def _policy_width(self, bs: int) -> int:
        """The policy's width for this round, from the readings that have arrived."""
        self._readings.poll()
        policy = self._readings.policy
        width = policy.choose(bs)
        self._readings.start(bs, width)
        self.speculative_num_draft_tokens = width  # /metrics: sglang:spec_num_draft_tokens
        logged = policy.rounds in _WIDTH_LOG_ROUNDS or policy.rounds % _WIDTH_LOG_EVERY == 0
        if (policy.newly_calibrated() or logged) and self._tp_rank == 0:
            logger.info(
                "DDTREE widths after %d rounds (ms per round by batch bucket):\n%s",
                policy.rounds,
                policy.table(),
            )
        return width

    def forward_batch_generation(
        self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None
    ):
        extend = batch.forward_mode.is_extend() or batch.is_extend_in_batch
        if extend or batch.forward_mode.is_idle():  # DFlashWorkerV2's prefill / idle step
            result = super().forward_batch_generation(
                batch, on_publish, grammar_barrier, pp_proxy_tensors
            )
            if self._penalties is not None and extend:
                self._penalties.restart(batch.reqs, batch.req_pool_indices, result.next_token_ids)
            return result
        draft_input = batch.spec_info  # the DFlash draft state the last round (or prefill) left
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError(f"DDTREE expected DFlashDraftInputV2, got {type(draft_input)}")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs = len(batch.seq_lens)
        with stages.own_code():
            width = self._choose_width(bs)
            rnd = Round(worker=self, batch=batch, bs=bs, width=width, draft_input=draft_input)
        with stages.profiled("ddtree.draft_and_build"):
            rnd.draft()  # draft + build (one graph replay)
        with stages.own_code(), stages.profiled("ddtree.verify_input"):
            batch.spec_info = rnd.tree_input()
        verify_at = self._widths.use(width) if self._widths else contextlib.nullcontext()
        with stages.profiled("ddtree.verify_accept_commit"), verify_at:
            result = rnd.verify(grammar_barrier)
        if not result.can_run_cuda_graph:
            self._note_eager_verify(bs, width)
        rnd.observe(result, self._penalties, self._round_dump)
        batch.spec_info = draft_input
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        with stages.own_code(), stages.profiled("ddtree.draft_context"):
            rnd.commit(result)
            result.next_draft_input = make_draft_input_v2(
                bonus_tokens=result.next_draft_input.bonus_tokens,
                new_seq_lens=result.new_seq_lens,
            )
            if self._readings is not None and self._readings.current is not None:  # measured
                self._readings.finish(rnd.accepted_at_widths(result, self.tree_head.reading_widths))
        return result

    def _note_eager_verify(self, bs: int, width: int) -> None:
        """A verify that ran without the target's CUDA graph (a host cost of a few ms on a small
        target): warned once per width while graphs are on, counted in the widths table."""
        if self._readings is not None:
            self._readings.policy.eager[width] += 1
        if self._graphs_on and width not in self._eager_warned and self._tp_rank == 0:
            self._eager_warned.add(width)
            logger.warning(
                "DDTREE: a verify at width %d, batch %d, ran without CUDA graphs "
                "(later ones are counted in the widths table)",
                width,
                bs,
            )

    def prewarm_sampling(self):
        """SGLang's start-up sampling rehearsal: DFlashWorkerV2's rehearses its chain accept,
        which a DDTREE round never runs; the tree verify samples through eagle_sample."""
        return compat.default_sampling_prewarm(self)

    def alloc_memory_pool(self, *args, **kwargs):
        """DFlashWorkerV2's (the draft's pools, sharing the target's request pool), then the
        check of DDTREE's own memory at this server's maximum and the penalty table, both sized
        from that pool."""
        out = super().alloc_memory_pool(*args, **kwargs)
        self._check_round_memory()
        self._penalties = self._penalty_table()
        return out

    def _check_round_memory(self) -> None:
        """DDTREE's memory beside SGLang's pools at this server's maximum (round_memory.py:
        the penalty tables, a round's temporaries and verify mask at the largest batch, N and
        context) against what SGLang's pools left, and the verify plan's int32 offsets: a
        configuration that does not fit stops the start-up here with the numbers."""
        target = self.target_worker.model_runner  # the target's pools and vocabulary
        rows, row = target.req_to_token_pool.req_to_token.shape
        memory = round_memory.at_maximum(
            max_bs=self.tree_head.max_bs,
            num_nodes=self.cfg.num_nodes,
            vocab=target.model_config.vocab_size,
            rows=rows,
            row=row,
            penalties=self.options.penalties,
        )
        on_gpu = torch.device(self.device).type == "cuda"
        free = get_available_gpu_memory(self.device, self.gpu_id) if on_gpu else None
        warning = round_memory.check(memory, free)
        if self._tp_rank == 0:
            logger.info(
                "DDTREE memory beside SGLang's pools at this server's maximum: %s",
                memory.describe(),
            )
            if warning:
                logger.warning(warning)

    def _penalty_table(self) -> PenaltyTable | None:
        """SGLANG_DDTREE_PENALTIES=1: the output-token counts per request slot on the device
        (round/penalties.py), handed to the eagle_sample hook through the runtime."""
        if not self.options.penalties:
            return None
        # the target's pool and vocabulary, the penalised logits' width
        target = self.target_worker.model_runner
        rows = target.req_to_token_pool.req_to_token.shape[0]
        vocab = target.model_config.vocab_size
        table = PenaltyTable(rows, vocab, self.device)
        if self._tp_rank == 0:  # beside SGLang's pools, which were sized without it
            logger.info(
                "DDTREE penalty counts: %d request slots x %d tokens, %.2f GiB (off: "
                "SGLANG_DDTREE_PENALTIES=0)",
                rows,
                vocab,
                rows * vocab * 5 / (1 << 30),
            )
        self.runtime.penalties = table
        return table
