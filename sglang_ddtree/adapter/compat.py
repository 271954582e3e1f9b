"""Everything that depends on the exact SGLang release, in one place.

Supported: sglang 0.5.23 (torch 2.14.1, FlashInfer 0.7.2, sglang-kernel 0.4.10). To add a
release, read the call sites listed here against its source, then extend SUPPORTED.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
from typing import Any

SUPPORTED = ("0.5.23",)

# Runtime hook targets (see hooks.py for why each exists).
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_GDN = "sglang.srt.layers.attention.linear.gdn_backend"
_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
TARGET_GRAPH_SPEC_INFO = _RUNNER + ".get_spec_info"
DUMMY_VERIFY_INPUT = "sglang.srt.speculative.spec_info.create_dummy_verify_input"
TOKENIZER_REQUEST_VALIDATOR = _TM + "._validate_one_request"
# The tokenizer manager, made in the HTTP server's process before uvicorn starts the app: then
# json_bodies.py's middleware goes on the app (the HTTP server's module and the app's name in it).
TOKENIZER_MANAGER_INIT = _TM + ".__init__"
TOKENIZER_GENERATE_REQUEST = _TM + ".generate_request"
HTTP_SERVER_MODULE = "sglang.srt.entrypoints.http_server"
HTTP_APP = "app"
# in that module: SGLang's /generate contract check (a parsed body -> its fault, or None), and
# the Vertex AI handler's name (its route is AIP_PREDICT_ROUTE's, or /vertex_generate)
GENERATE_CONTRACT = "generate_contract_error"
VERTEX_HANDLER = "vertex_generate"
# Gated DeltaNet tree verify (per layer) and state commit (per round): state/gdn.py.
GDN_TARGET_VERIFY = _GDN + ".GDNKernelDispatcher.target_verify"
GDN_CONV_UPDATE = _GDN + ".causal_conv1d_update"
MAMBA_STATE_COMMIT = (
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend"
    ".update_mamba_state_after_mtp_verify"
)

# The tree verify's sampling (per-node penalties, the default): round/penalties.py.
EAGLE_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"

# The accepted path after a tree verify (round/accept_path.py): the Mamba commit's steps,
# and the path moved to the front of each request's block.
FINALIZE_TREE_PATH = "sglang.srt.speculative.eagle_worker_common._finalize_accept_tree_path"


def lm_head_rows(lm_head) -> tuple[int, int]:
    """This rank's LM-head rows as (the global token id of the first, how many are real
    tokens): a VocabParallelEmbedding's shard of the original vocabulary (its padding and added
    rows left out); the whole weight for a plain one."""
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        return 0, int(lm_head.weight.shape[0])
    return int(shard.org_vocab_start_index), int(shard.num_org_elements)


def tp_gather():
    """gather(t) -> [ranks, *t.shape], every rank's t in rank order (SGLang's all-gather on the
    TP group, as its own logits gather uses; captured in CUDA graphs like its other
    collectives)."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return lambda t: group.all_gather(t.unsqueeze(0).contiguous(), dim=0)


def tp_cpu_group():
    """(the TP group's CPU process group, the global rank of its first rank, whether this process
    is that rank): SGLang's gloo group beside the NCCL one, on which its scheduler broadcasts
    each round's new requests."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return group.cpu_group, group.first_rank, group.is_first_rank


def least_free_gb(device, gpu_id: int) -> float:
    """The least GPU memory free on any TP rank, GB: SGLang's own read with its MIN all-reduce
    on the TP group's CPU group (what a start-up choice every rank must make alike reads)."""
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.utils import get_available_gpu_memory as free

    return free(device, gpu_id, distributed=True, cpu_group=get_tp_group().cpu_group)


def profiler_running() -> bool:
    """Whether a torch profiler is recording (SGLang's /start_profile starts one): torch's own
    flag, which its profilers set on start and clear on stop."""
    import torch.autograd.profiler

    return bool(torch.autograd.profiler._is_profiler_enabled)


def pack_kv_reads(
    translator, plan, req_pool_indices, kv_lens, kv_indptr, kv_indices, kv_lens_sum: int, kind=None
) -> None:
    """Each request's KV slots (req_to_token[req, :kv_len], translated for the pool it reads)
    into kv_indices from kv_indptr[b]: the FlashInfer paged layout of one request per row, by
    SGLang's KV translator, as EagleVerifyInput.generate_attn_arg_prefill reads them."""
    extra = {} if kind is None else {"kind": kind}
    translator.pack_read_stream(
        plan,
        req_pool_indices=req_pool_indices,
        seq_lens=kv_lens,
        indptr=kv_indptr,
        out=kv_indices,
        num_token_blocks=None,
        kv_lens_sum=kv_lens_sum,
        **extra,
    )


# The scheduler's internal state (/server_info's internal_states): DDTREE's resolved options.
SCHEDULER_INTERNAL_STATE = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"

# FlashInfer's masked prefill plan for the tree verify (the host plan, the default): round/verify_plan.py.
FLASHINFER_PREFILL_PLAN = (
    "sglang.srt.layers.attention.flashinfer_backend.FlashInferIndicesUpdaterPrefill"
    ".call_begin_forward"
)

# The width of a request's req_to_token row beyond the context length (hooks.py): SGLang's
# allocation_sizing function, which the configurator imports by name.
_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
REQ_TO_TOKEN_HEADROOM = _CONFIGURATOR + ".get_req_to_token_extra_context_len"

# The same rows under --enable-unified-memory, sized by the caller (keyword-only arguments).
UNIFIED_MAMBA_POOLS = "sglang.srt.mem_cache.unified_memory_pool.init_unified_mamba_pools"


def decode_reserve_headroom() -> int:
    """The req_to_token row headroom DDTREE's decode rounds need beyond the context length.
    DFlashDraftInputV2.prepare_for_decode reserves `committed + 2 x
    speculative_num_draft_tokens` KV slots per running request (the overlap scheduler's double
    buffer), while SGLang's rows hold `context + 4 + speculative_num_draft_tokens` (page size
    1): a request near the context limit then has slots written past its row's end (into the
    next row) that are never freed. A running request has committed at most context - 1
    tokens, so rows of context + 2N + 4 hold every reserve (one page more where pages are
    larger). N and the page from the runtime context, as SGLang's own sizing reads them."""
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_page_size
    from sglang.srt.runtime_context import max_speculative_num_draft_tokens

    n = int(max_speculative_num_draft_tokens() or 0)
    return 4 + 2 * n + max(int(get_alloc_page_size()) - 1, 0)


def speculative_algorithm() -> str | None:
    """The speculative algorithm this process's resolved configuration names."""
    from sglang.srt.runtime_context import get_spec

    return get_spec().speculative_algorithm


# Compact GDN verify scratch (the default): state/gdn_pool.py.
MAMBA_POOL_INIT = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool._init_mamba_pool"
MAMBA_POOL_SOLVER = _CONFIGURATOR + ".KVCacheConfigurator._handle_max_mamba_cache"

# eagle_sample's target-only tree sampler, a global of its module (0.5.23 imports it from
# sglang.kernels.ops.speculative.verify_sampling when eagle_utils loads)
TREE_SAMPLER_MODULE = "sglang.srt.speculative.eagle_utils"
TREE_SAMPLER = "tree_speculative_sampling_target_only"


@contextlib.contextmanager
def tree_sampling_probs(transform):
    """For the duration: SGLang's eagle_sample hands the target probs [bs, N, V] of its
    target-only tree sampling through `transform` first (it calls its module's global
    `tree_speculative_sampling_target_only` after its top-k / top-p renormalisation; the global,
    not the kernel package's name, is what that call reads); SGLang's is put back after."""
    module = importlib.import_module(TREE_SAMPLER_MODULE)
    original = getattr(module, TREE_SAMPLER)

    def sample(*args, target_probs, **kwargs):
        return original(*args, target_probs=transform(target_probs), **kwargs)

    setattr(module, TREE_SAMPLER, sample)
    try:
        yield
    finally:
        setattr(module, TREE_SAMPLER, original)


def unpatched_hook_targets(targets) -> list[str]:
    """The targets SGLang's HookRegistry did not patch: apply_hooks logs a failure and goes on,
    so a renamed target would silently leave DDTREE's code out of the round."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t in targets if t not in HookRegistry._patched]


def scatter_mamba_states_after_mtp_verify():
    """SGLang's per-round Mamba-pool commit (states + conv windows + track slots)."""
    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
        scatter_mamba_states_after_mtp_verify as scatter,
    )

    return scatter


class UnsupportedSGLangVersion(RuntimeError):
    pass


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_sglang_version(version: str | None = None) -> str:
    """Return the installed version, or raise with the fix if it is not supported."""
    version = installed_sglang_version() if version is None else version
    if version is None:
        raise UnsupportedSGLangVersion(
            "sglang_ddtree needs sglang installed: pip install 'sglang-ddtree[serve]' "
            f"(brings sglang=={SUPPORTED[-1]})."
        )
    if version not in SUPPORTED:
        raise UnsupportedSGLangVersion(
            f"sglang_ddtree supports sglang {', '.join(SUPPORTED)}, but sglang {version} is "
            f"installed. Install a supported one: pip install 'sglang=={SUPPORTED[-1]}'."
        )
    return version


def resolved(server_args: Any) -> Any:
    """Read server args mid-resolution (SGLang stashes some resolved fields until materialised)."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:  # a plain namespace in unit tests
        return server_args
    if not hasattr(server_args, "_resolved_overrides"):
        return server_args
    return resolved_view(server_args)


def option_modes(server_args: Any) -> dict[str, bool]:
    """The server modes DDTREE's option defaults depend on (config.Options.from_env's keywords):
    --enable-unified-memory, --enable-deterministic-inference and --tp-size > 1."""
    args = resolved(server_args)
    return {
        "unified_memory": bool(getattr(args, "enable_unified_memory", False)),
        "deterministic": bool(getattr(args, "enable_deterministic_inference", False)),
        "tensor_parallel": int(getattr(args, "tp_size", 1) or 1) > 1,
    }


def attention_backends(server_args: Any) -> tuple[str | None, str | None]:
    """(prefill, decode) target attention backends, split flags falling back to the base one."""
    view = resolved(server_args)
    base = getattr(view, "attention_backend", None)
    prefill = getattr(view, "prefill_attention_backend", None) or base
    decode = getattr(view, "decode_attention_backend", None) or base
    return prefill, decode


def set_draft_block(worker, pos_offsets, spec_info) -> None:
    """DFlashWorkerV2's draft-block constants (its private `_block_pos_offsets` [B] and
    `_draft_block_spec_info`), rebuilt for DDTREE's block B (DFlashWorkerV2 made them for N)."""
    worker._block_pos_offsets = pos_offsets
    worker._draft_block_spec_info = spec_info


def draft_block_spec_info(worker):
    """The draft block's spec info DFlashWorkerV2 keeps (set_draft_block's)."""
    return worker._draft_block_spec_info


def hook_registered(target: str, hook) -> bool:
    """Whether SGLang's HookRegistry holds `hook` (or a functools.partial of it) for `target`."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return any(getattr(h, "func", h) is hook for _, h, _ in HookRegistry._hooks.get(target, ()))


def resolved_config():
    """DDTREE's (B, N, K) as SGLang resolved them for this server (its runtime context: the
    plugin's resolutions are recorded there, not written into the raw server args)."""
    from sglang.srt.runtime_context import get_spec

    from sglang_ddtree.config import DDTreeConfig

    spec = get_spec()
    return DDTreeConfig(
        block_size=int(spec.speculative_dflash_block_size),
        num_nodes=int(spec.speculative_num_draft_tokens),
        topk=int(spec.speculative_eagle_topk),
    )


def max_running_requests() -> int | None:
    """The running-request cap SGLang resolved for this server (DDTREE's default is a recorded
    resolution on this release, not a write into the raw server args)."""
    from sglang.srt.runtime_context import get_schedule

    return get_schedule().max_running_requests


def tp_size() -> int:
    """The tensor-parallel size of this server's resolved configuration."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_size or 1)


# SGLang's DFlash2 draft classes (models/dflash.py: the DFlash backbone and a CandidateSelector),
# picked by a checkpoint's `architectures` (the unit tests hold it to the release's EntryClass)
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel")


def draft_checkpoint(server_args: Any):
    """The draft config as DDTREE reads it (config.DraftCheckpoint), through SGLang's own DFlash
    config parser: its block size and, for a DFlash2 architecture, its selector's rank and K."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    from sglang_ddtree.config import DraftCheckpoint

    cfg = get_config(
        server_args.speculative_draft_model_path,
        trust_remote_code=server_args.trust_remote_code,
        revision=server_args.speculative_draft_model_revision,
        model_override_args=json.loads(server_args.json_model_override_args or "{}"),
    )
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    names = list(getattr(cfg, "architectures", None) or [])
    dflash2 = [a for a in names if a in DFLASH2_ARCHITECTURES]
    return DraftCheckpoint(
        parsed.resolve_block_size(default=None),
        bool(dflash2),
        (dflash2 or names or ["DFlashDraftModel"])[0],
        int(parsed.selector_rank or 0),
        int(parsed.selector_top_k or 0),
    )


def draft_selector(draft_model: Any) -> Any:
    """A DFlash2 draft model's CandidateSelector (its `top_k` is K); None for a DFlash draft."""
    return getattr(draft_model, "candidate_selector", None)


def attach_target_lm_head(draft_model: Any, lm_head: Any) -> None:
    """Point a DFlash2 draft's lm_head (its candidates') at the target's, as DFLASH does."""
    from sglang.srt.lora.layers import unwrap_lora_layer

    draft_model.lm_head = unwrap_lora_layer(lm_head)


def selector_lattice(draft_model: Any, hidden: Any, anchor: Any) -> tuple[Any, Any, Any]:
    """A DFlash2 drafter's lattice: hidden [bs, L, H] (block slots 1..B-1), anchor [bs] (the
    token before slot 0) -> (candidate ids [bs, L, K] int64, scores [bs, L, K, K] float32, log
    coverage [bs, L] float32 or None): the top-K over the target's LM head on [bs * L, H] rows,
    then build_lattice. The coverage, the log of the drafter's mass on its K (logsumexp of their
    unary logits - the full-vocabulary lse), takes candidate_topk's lse of the raw logits
    (TP-aware, no host sync); a drafter that scales or softcaps them gets compute_candidates,
    as DFLASH does, and no coverage: the lse of its transformed logits is not computed."""
    from sglang.srt.models.dflash import candidate_topk

    bs, L, H = hidden.shape
    rows, cfg, lse = hidden.reshape(bs * L, H), draft_model.draft_config, None
    if cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping is not None:
        ids, unary = draft_model.compute_candidates(rows)
    else:
        k = int(draft_selector(draft_model).top_k)
        ids, unary, lse = candidate_topk(rows, draft_model.lm_head, k, with_partition=True)
    ids, unary = ids.view(bs, L, -1), unary.float().view(bs, L, -1)
    scores = draft_selector(draft_model).build_lattice(
        candidate_ids=ids, unary_logits=unary, hidden_states=hidden, anchor_token_ids=anchor
    )
    return ids, scores, None if lse is None else unary.logsumexp(-1) - lse.view(bs, L)


# --- DFlashWorkerV2 internals that DDTREE's worker (a subclass) uses -----------------------------
# SGLang keeps these private; an upgrade that renames them changes only this block.


def draft_block_buffers(worker: Any, bs: int) -> tuple[Any, Any, Any, Any]:
    """DFlashWorkerV2's per-round draft-block buffers for bs requests: (block ids [bs, B],
    positions [bs, B], KV cache locations [bs, B], host sequence lengths [bs])."""
    worker._ensure_draft_block_buffers(bs)
    return (
        worker._draft_block_ids_buf[:bs],
        worker._draft_block_positions_buf[:bs],
        worker._draft_verify_out_cache_loc_buf[:bs],
        worker._draft_seq_lens_cpu_buf[:bs],
    )


def prepare_draft_block(worker: Any, **kwargs: Any) -> None:
    """SGLang's draft-block preparation kernel (bonus + MASK ids, positions, cache locations)
    with DFlashWorkerV2's mask token; kwargs as `_prepare_dflash_draft_block_unchecked` takes."""
    from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked

    _prepare_dflash_draft_block_unchecked(mask_token_id=int(worker._mask_token_id), **kwargs)


def tp_rank() -> int:
    """This process's rank in the target's tensor-parallel group."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def gather_target_verify_logits(worker: Any) -> None:
    """Undo DFlashWorkerV2's deferred vocabulary gather of the target's verify logits (it
    leaves a tensor-parallel shard for its own chain accept to gather): the tree verify's
    sampling reads whole rows."""
    processor = getattr(worker, "_target_logits_processor", None)
    if processor is not None:
        processor.defer_verify_gather = False
    worker._target_logits_processor = None


def draft_block_embeds(worker: Any, block_ids: Any) -> Any:
    """The draft block's input embeddings [bs x B, hidden], as DFlashWorkerV2's decode round
    makes them: the (gathered) target embedding or the draft's own, times its noise scale."""
    import torch
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module

    if worker._full_embed_gpu is not None:
        embeds = torch.nn.functional.embedding(block_ids, worker._full_embed_gpu)
    else:
        target = worker.target_worker.model_runner.model
        embed = unwrap_lora_layer(_resolve_dflash_embedding_module(worker.draft_model, target))
        embeds = embed(block_ids)
    if worker._noise_embed_scale != 1.0:
        embeds = embeds * worker._noise_embed_scale
    return embeds.view(-1, embeds.shape[-1])


def plan_window(worker: Any, batch: Any, seq_lens_cpu: Any, write_ids: Any, width: int) -> Any:
    """The round's KV slot plan (SGLang's KVLocPlan): the block's slots `write_ids`
    [bs x width] past each request's committed length, translated once for every pool."""
    translator = worker.target_worker.model_runner.kv_index_translator
    return translator.plan(
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        write_virtual=write_ids,
        read_extent=width,
    )


def bind_draft_plan(worker: Any, plan: Any, forward_batch: Any) -> None:
    """Give the draft block's forward batch the round's plan, in the draft pool's ids."""
    plan.bind(forward_batch, worker.draft_model_runner.kv_index_translator)


def draft_write_ids(worker: Any, plan: Any) -> Any:
    """The plan's write ids as the draft's KV pool indexes them (flat)."""
    return plan.write_ids(worker.draft_model_runner.kv_index_translator)


def draft_scope(worker: Any):
    """The draft model's tensor-parallel scope (DFlashWorkerV2 runs its draft forwards in it)."""
    from sglang.srt.speculative.spec_utils import draft_tp_context

    return draft_tp_context(worker.draft_parallel_layout)


def non_padded_tokens(tokens: int, device: Any) -> dict:
    """ForwardBatch's token counts for a batch with no padding, as DFlashWorkerV2's draft block
    gives them."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded

    on_device = (
        torch.full((), tokens, dtype=torch.int32, device=device)
        if enable_num_token_non_padded()
        else None
    )
    return {"num_token_non_padded": on_device, "global_num_token_non_padded_cpu": tokens}


def default_sampling_prewarm(worker: Any) -> Any:
    """SGLang's sampling pre-warm for a worker without a rehearsal of its own (the target's:
    no headroom reserved). DFlashWorkerV2's rehearses its chain accept, which DDTREE never
    runs."""
    return worker.target_worker.model_runner.prewarm_sampling()


def append_draft_kv(worker: Any, **kwargs: Any) -> None:
    """DFlashWorkerV2's draft-KV append from target hidden states, by cache location."""
    worker._append_target_hidden_to_draft_kv_by_loc(**kwargs)


def init_draft_cuda_graphs(worker: Any, capture: bool) -> None:
    """Capture (or not) the draft model's decode CUDA graphs through DFlashWorkerV2's draft
    worker, in the draft's parallel scope as DFlashWorkerV2 captures them."""
    from sglang.srt.speculative.spec_utils import draft_pp_context

    with draft_pp_context(), draft_scope(worker):
        worker._draft_worker.init_cuda_graphs(capture_decode_cuda_graph=capture)


def flashinfer_mask_capacity(wrapper: Any) -> int | None:
    """Bytes a FlashInfer prefill wrapper's CUDA-graph custom-mask buffer holds (None when it
    has none: not in graph mode): FlashInfer's `_custom_mask_buf`."""
    buf = getattr(wrapper, "_custom_mask_buf", None)
    graph = getattr(wrapper, "is_cuda_graph_enabled", False)
    return int(buf.numel()) if graph and hasattr(buf, "numel") else None


def set_dense_conv_windows(pool: Any, windows: list) -> None:
    """Point HybridReqToTokenPool's physical conv-window buffers at `windows` (the compact
    pool's dense per-node layout)."""
    pool._intermediate_conv_window_phys = windows


# --- the target's verify state per width (round/widths.py) ---------------------------------
# As SGLang's adaptive EAGLE builds one per step count (EAGLEWorkerV2.
# build_adaptive_runtime_state / apply_runtime_state): its own attention backend and
# DecodeCudaGraphRunner captured at that width; switching swaps both on the model runner.


def target_verify_state(model_runner: Any) -> tuple[Any, Any]:
    """(attention backend, decode CUDA-graph runner or None) the target verifies with now."""
    return model_runner.attn_backend, model_runner.decode_cuda_graph_runner


def set_target_verify_state(model_runner: Any, state: tuple[Any, Any]) -> None:
    model_runner.attn_backend, model_runner.decode_cuda_graph_runner = state


def build_target_verify_state(model_runner: Any, width: int) -> tuple[Any, Any] | None:
    """A new attention backend for the target and a DecodeCudaGraphRunner that captures the
    target verify at `width` tokens per request; None without decode CUDA graphs (then the
    model runner's own backend verifies any width)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_exec, get_spec

    if get_exec().graph.cuda_graph_config.decode.backend == Backend.DISABLED:
        return None
    if model_runner.decode_cuda_graph_runner is None:  # capture skipped (e.g. no memory left)
        return None
    workspace = model_runner.init_new_workspace
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = workspace
    # the runner's KV translator on the new backend, as SGLang binds its own at start-up
    model_runner.kv_index_translator.bind_and_verify_backends([backend])
    spec = get_spec()
    before = target_verify_state(model_runner)
    # the runner's capture reads a few things off the model runner (its backend's warm-up
    # hook) and the spec (N): both at this width while it captures
    set_target_verify_state(model_runner, (backend, before[1]))
    try:
        with spec.override(speculative_num_draft_tokens=width):
            runner = DecodeCudaGraphRunner(
                model_runner,
                attn_backend=backend,
                speculative_num_steps=spec.speculative_num_steps,
                speculative_num_draft_tokens=width,
            )
    finally:
        set_target_verify_state(model_runner, before)
    return backend, runner


def graph_batch_sizes(runner: Any) -> tuple[int, ...]:
    """The batch sizes a decode CUDA-graph runner captured (none: no runner)."""
    return tuple(sorted(getattr(runner, "capture_bs", None) or ()))


def front_end_sizes(tokenizer_manager: Any) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) as the tokenizer manager holds them
    (`model_config.vocab_size`, `context_len`; None where absent, e.g. a stand-in)."""
    vocab = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    context = getattr(tokenizer_manager, "context_len", None)
    return tuple(None if x is None else int(x) for x in (vocab, context))


def allowed_custom_labels(server_args: Any) -> tuple[str, ...]:
    """The metric labels a request's custom_labels may set (0.5.23's
    --tokenizer-metrics-allowed-custom-labels; none where absent)."""
    return tuple(getattr(server_args, "tokenizer_metrics_allowed_custom_labels", None) or ())


def vertex_route(app: Any) -> str | None:
    """The path of the HTTP app's Vertex AI route (None: the app has none)."""
    for route in getattr(app, "routes", ()):
        if getattr(getattr(route, "endpoint", None), "__name__", None) == VERTEX_HANDLER:
            return route.path
    return None


def stop_regex_length(pattern: str) -> int:
    """SGLang's measure of a stop_regex's longest match (2^30: unbounded), which sizes the tail
    its scheduler decodes and searches after every round (sampling_params.get_max_seq_length)."""
    from sglang.srt.sampling.sampling_params import get_max_seq_length

    return get_max_seq_length(pattern)
