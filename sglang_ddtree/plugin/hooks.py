"""Runtime hooks: the places SGLang 0.5.23's plugin API does not reach. One table, applied once.
The round's stages that SGLang's verify calls are the `Round`'s (round/round.py); the rest
adapt SGLang's start-up (graphs, pools, rows) and /server_info to DDTREE.

| target                                  | why                                                  |
|-----------------------------------------|------------------------------------------------------|
| DecodeCudaGraphRunner.get_spec_info     | the DFlash-family capture stand-in has no custom mask |
|                                         | on FlashInfer, so a tree verify replay would raise;   |
|                                         | DDTREE's target graphs capture with the mask buffer   |
| spec_info.create_dummy_verify_input     | warm-up stand-ins: the target needs tree fields       |
|                                         | (GDN reads retrieve_next_token when topk > 1) and the |
|                                         | draft runs B tokens, not N                            |
| GDNKernelDispatcher.target_verify       | Gated DeltaNet tree verify without per-node states    |
| HybridLinearAttnBackend                 | and the commit by replaying the accepted path         |
|   .update_mamba_state_after_mtp_verify  | (state/gdn.py)                                       |
| gdn_backend.causal_conv1d_update        | the tree conv1d, every node in parallel               |
| kv_cache_configurator                   | req_to_token rows wide enough for DFlash v2's decode  |
|   .get_req_to_token_extra_context_len,  | reserve (2N past the committed length): at the        |
| init_unified_mamba_pools                |                                                       |
|                                         | context limit it overran the rows (KV slots leaked,   |
|                                         | the next row's first entries overwritten)             |
| HybridReqToTokenPool._init_mamba_pool   | the compact GDN verify scratch and the Mamba pool     |
| KVCacheConfigurator                     | sized for it (state/gdn_pool.py; off:                 |
|   ._handle_max_mamba_cache              | --enable-unified-memory)                              |
| Scheduler.get_internal_state            | /server_info reports the resolved options, GDN path   |
|                                         | and the DDTREE paths taken (Runtime.report)           |
| FlashInferIndicesUpdaterPrefill         | the verify's masked plan from host lengths and a      |
|   .call_begin_forward                   | device-packed mask, no read-back (verify_plan.py)     |
| eagle_worker_common                     | the accepted path moved to the block front in one     |
|   ._finalize_accept_tree_path           | Triton launch, its hidden rows alone (accept_path.py) |

They are installed from the worker factory (scheduler process only, before any graph capture),
so other processes never import those heavy modules; each is bound there to what it reads
(`bound_hooks`: the process's runtime.Runtime or a part of it), so no hook reads a module
global. The front door's hooks (front_door/checks.py) are registered at plugin load.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from sglang_ddtree.adapter import compat
from sglang_ddtree.adapter.spec import is_ddtree
from sglang_ddtree.config import DDTreeConfig
from sglang_ddtree.round import accept_path, penalties, verify_plan
from sglang_ddtree.round.round import Round
from sglang_ddtree.round.runtime import Runtime
from sglang_ddtree.state import gdn, gdn_pool

logger = logging.getLogger(__name__)


def install_runtime_hooks(runtime: Runtime) -> None:
    """Register and apply HOOKS bound to this process's runtime (once per process: a second
    install would leave the first runtime's hooks in place, so it is refused)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if compat.hook_registered(compat.GDN_TARGET_VERIFY, gdn.target_verify):
        raise RuntimeError(
            "DDTREE's runtime hooks are already installed in this process; one "
            "DDTREE worker factory call per scheduler process."
        )
    for target, hook in bound_hooks(runtime).items():
        HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    missing = compat.unpatched_hook_targets(HOOKS)
    if missing:
        raise RuntimeError(
            f"DDTREE's runtime hooks could not be applied to {missing} (SGLang's "
            "log above says why); DDTREE cannot serve without them."
        )
    logger.info("sglang_ddtree: runtime hooks installed: %s", ", ".join(HOOKS))


def bound_hooks(runtime: Runtime) -> dict[str, Callable]:
    """HOOKS, each bound to what it reads of this process: the GDN hooks to the GDN state, the
    Mamba pool's to the options, the graph stand-ins to (B, N, K), the rest to the runtime; the
    row headroom hooks read nothing of it."""
    part = {
        gdn.target_verify: runtime.gdn,
        gdn.commit: runtime.gdn,
        gdn.conv_update: runtime.gdn,
        gdn_pool.init_mamba_pool: runtime.options,
        gdn_pool.size_mamba_pool: runtime.options,
        _target_graph_spec_info: runtime.cfg,
        _dummy_verify_input: runtime.cfg,
        verify_plan.call_begin_forward: runtime,
        _internal_state: runtime,
        penalties.eagle_sample: runtime,
        accept_path.finalize_hook: runtime,
    }
    return {
        target: functools.partial(hook, part[hook]) if hook in part else hook
        for target, hook in HOOKS.items()
    }


def _target_graph_spec_info(cfg: DDTreeConfig, original, runner, *args, **kwargs):
    model_runner = runner.model_runner
    if not is_ddtree(model_runner.spec_algorithm) or model_runner.is_draft_worker:
        return original(runner, *args, **kwargs)
    from sglang_ddtree.round.verify_input import make_dummy_verify_input

    return make_dummy_verify_input(cfg, runner.buffers.custom_mask, runner.captured_req_width)


def _dummy_verify_input(
    cfg: DDTreeConfig, original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker
):
    if not is_ddtree(spec_algorithm):
        return original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker)
    if is_draft_worker:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput

        return DFlashVerifyInput(
            draft_token=None,
            positions=None,
            draft_token_num=num_tokens_per_req,
            custom_mask=None,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
    from sglang_ddtree.round.verify_input import make_dummy_verify_input

    return make_dummy_verify_input(cfg, custom_mask, num_tokens_per_req)


def _internal_state(runtime: Runtime, original, scheduler, *args, **kwargs):
    """AROUND Scheduler.get_internal_state: a DDTREE server's /server_info also carries its
    resolved options and GDN path (internal_states[i]["ddtree"]: Runtime.report), as values."""
    out = original(scheduler, *args, **kwargs)  # GetInternalStateReqOutput
    state = getattr(out, "internal_state", None)
    if isinstance(state, dict) and is_ddtree(getattr(scheduler, "spec_algorithm", None)):
        state["ddtree"] = runtime.report()
    return out


def _ddtree_headroom(extra: int) -> int:
    """The req_to_token rows' width beyond the context: SGLang's `extra`, and on a DDTREE server
    at least the decode rounds' reserve (compat.decode_reserve_headroom)."""
    from sglang_ddtree.adapter.spec import ALGORITHM

    if compat.speculative_algorithm() != ALGORITHM:
        return extra
    return max(extra, compat.decode_reserve_headroom())


def _row_headroom(original):
    """AROUND get_req_to_token_extra_context_len: _ddtree_headroom of SGLang's."""
    return _ddtree_headroom(original())


def _unified_row_headroom(original, *args, **kwargs):
    """AROUND init_unified_mamba_pools (--enable-unified-memory), whose caller computes the rows'
    width itself: _ddtree_headroom of that."""
    if "extra_max_context_len" in kwargs:
        kwargs["extra_max_context_len"] = _ddtree_headroom(kwargs["extra_max_context_len"])
    return original(*args, **kwargs)


HOOKS = {
    compat.TARGET_GRAPH_SPEC_INFO: _target_graph_spec_info,
    compat.DUMMY_VERIFY_INPUT: _dummy_verify_input,
    compat.GDN_TARGET_VERIFY: Round.verify_gdn,
    compat.MAMBA_STATE_COMMIT: Round.commit_state,
    compat.GDN_CONV_UPDATE: Round.conv_gdn,
    compat.REQ_TO_TOKEN_HEADROOM: _row_headroom,
    compat.UNIFIED_MAMBA_POOLS: _unified_row_headroom,
    compat.MAMBA_POOL_INIT: gdn_pool.init_mamba_pool,
    compat.MAMBA_POOL_SOLVER: gdn_pool.size_mamba_pool,
    compat.FLASHINFER_PREFILL_PLAN: Round.plan_verify,
    compat.SCHEDULER_INTERNAL_STATE: _internal_state,
    compat.EAGLE_SAMPLE: Round.sample,
    compat.FINALIZE_TREE_PATH: Round.accept,
}
