"""Runtime hooks: the places SGLang 0.5.23's plugin API does not reach. One table, applied once.

| target                                  | why                                                  |
|-----------------------------------------|------------------------------------------------------|
| DecodeCudaGraphRunner.get_spec_info     | the DFlash-family capture stand-in has no custom mask |
|                                         | on FlashInfer, so a tree verify replay would raise;   |
|                                         | DDTREE's target graphs capture with the mask buffer   |
| spec_info.create_dummy_verify_input     | warm-up stand-ins: the target needs tree fields       |
|                                         | (GDN reads retrieve_next_token when topk > 1) and the |
|                                         | draft runs B tokens, not N                            |
| TokenizerManager._validate_one_request  | (front end) reject what DDTREE cannot serve with a    |
|                                         | 400 before it is scheduled: max_tokens < 1, every     |
|                                         | limit of request_limits.py                            |
| TokenizerManager.generate_request       | (front end) n and the number of prompts bounded       |
|                                         | before SGLang makes a request of each                 |
| GDNKernelDispatcher.target_verify       | Gated DeltaNet tree verify without per-node states    |
| HybridLinearAttnBackend                 | and the commit by replaying the accepted path         |
|   .update_mamba_state_after_mtp_verify  | (state/gdn.py; SGLANG_DDTREE_GDN=sglang: off)   |
| gdn_backend.causal_conv1d_update        | the tree conv1d, every node in parallel (off:         |
|                                         | SGLANG_DDTREE_GDN=sglang)                             |
| kv_cache_configurator                   | req_to_token rows wide enough for DFlash v2's decode  |
|   .get_req_to_token_extra_context_len,  | reserve (2N past the committed length): at the        |
| init_unified_mamba_pools                |                                                       |
|                                         | context limit it overran the rows (KV slots leaked,   |
|                                         | the next row's first entries overwritten)             |
| HybridReqToTokenPool._init_mamba_pool   | the compact GDN verify scratch and the Mamba pool     |
| KVCacheConfigurator                     | sized for it (state/gdn_pool.py; off:           |
|   ._handle_max_mamba_cache              | SGLANG_DDTREE_GDN=sglang, --enable-unified-memory)    |
| Scheduler.get_internal_state            | /server_info reports the resolved options, GDN path   |
|                                         | and the DDTREE paths taken (Runtime.report)           |
| FlashInferIndicesUpdaterPrefill         | the verify's masked plan from host lengths and a      |
|   .call_begin_forward                   | device-packed mask, no read-back (verify_plan.py;     |
|                                         | off: SGLANG_DDTREE_VERIFY_PLAN=sglang)                |
| eagle_worker_common                     | the accepted path moved to the block front in one     |
|   ._finalize_accept_tree_path           | Triton launch, its hidden rows alone (accept_path.py) |
| TokenizerManager.__init__               | (front end) the HTTP app's bodies: a size bound, an   |
|                                         | OpenAI body that is not an object a 400 (not SGLang's |
|                                         | 500), a Vertex body SGLang's /generate contract check |
|                                         | (json_bodies.py)                                      |

All but the front-end ones are installed from the worker factory (scheduler process only, before
any graph capture), so other processes never import those heavy modules; each is bound there to
what it reads (`bound_hooks`: the process's runtime.Runtime or a part of it), so no hook reads a
module global. The front-end ones are registered at plugin load (`RequestCheck` holds its own
options) and applied by SGLang's load_plugins() in the server's main process.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

from sglang_ddtree.adapter import compat
from sglang_ddtree.adapter.spec import is_ddtree, serves_ddtree
from sglang_ddtree.config import DDTreeConfig, Options
from sglang_ddtree.front_door import json_bodies, request_limits
from sglang_ddtree.round import accept_path, penalties, verify_plan
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


def _check_token_ids(tokenizer_manager, ids) -> None:
    """A prompt's token ids lie in [0, vocab): SGLang 0.5.17 defines that check
    (_validate_input_ids_in_vocab) but never calls it, and the embedding lookup of an id
    outside takes the scheduler down (a fuzzed request did this to DDTREE and DFLASH alike)."""
    if not ids:
        return
    vocab = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    low, high = min(ids), max(ids)
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        raise ValueError(
            f"input_ids holds token id {bad}, outside the vocabulary [0, "
            f"{vocab if vocab is not None else 'vocab'})."
        )


def register_request_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(compat.TOKENIZER_REQUEST_VALIDATOR, RequestCheck(), HookType.BEFORE)
    HookRegistry.register(compat.TOKENIZER_GENERATE_REQUEST, _bounded_call, HookType.AROUND)
    HookRegistry.register(compat.TOKENIZER_MANAGER_INIT, _guard_json_bodies, HookType.AFTER)


async def _bounded_call(original, manager, obj, *args, **kwargs):
    """AROUND TokenizerManager.generate_request (an async generator): on a DDTREE server, a
    call's n and prompts are bounded (request_limits.check_batch) before SGLang splits it into
    one request per prompt and sample, which it does first; the refusal is a ValueError at the
    first item, as SGLang's own checks there raise. The original's items pass through, and it
    is closed with this generator (a client that goes away aborts its requests)."""
    if serves_ddtree(getattr(manager, "server_args", None)) and hasattr(obj, "sampling_params"):
        request_limits.check_batch(obj)
    items = original(manager, obj, *args, **kwargs)
    try:
        async for item in items:
            yield item
    finally:
        await items.aclose()


def _guard_json_bodies(result, manager, server_args, *args, **kwargs):
    """AFTER TokenizerManager.__init__: on a DDTREE server whose process has SGLang's HTTP server
    (imported, its app not started yet), the app's request bodies are checked before SGLang reads
    them (json_bodies.py: their size, an OpenAI body's shape, a Vertex body's fields by SGLang's
    own /generate contract). Nothing is imported here: the offline engine and other processes are
    left alone."""
    http = sys.modules.get(compat.HTTP_SERVER_MODULE)
    if http is None or not serves_ddtree(server_args):
        return None
    try:
        app = getattr(http, compat.HTTP_APP)
        json_bodies.add_to(
            app,
            vertex=compat.vertex_route(app),
            contract=getattr(http, compat.GENERATE_CONTRACT, None),
        )
    except (AttributeError, RuntimeError) as exc:  # an app already started, or none
        logger.warning("sglang_ddtree: no request-body checks on the HTTP app: %s", exc)
    return None


class RequestCheck:
    """BEFORE TokenizerManager._validate_one_request: raise ValueError (HTTP 400) for what a
    DDTREE server cannot serve. One per front-end process, made at plugin registration; its
    options are parsed once, on the first DDTREE request (validate_server_args has parsed and
    checked the same switches in this process at start-up, with the error naming the fix)."""

    @functools.cached_property
    def options(self) -> Options:
        return Options.from_env()

    def __call__(self, tokenizer_manager, obj, *args, **kwargs):
        server_args = getattr(tokenizer_manager, "server_args", None)
        if not serves_ddtree(server_args):
            return None
        ids = args[0] if args else None
        sizes = request_limits.Sizes(
            *compat.front_end_sizes(tokenizer_manager),
            labels=compat.allowed_custom_labels(server_args),
            regex_length=compat.stop_regex_length,
        )
        request_limits.check_request(obj, ids, sizes)
        _check_token_ids(tokenizer_manager, ids)
        sampling = getattr(obj, "sampling_params", None) or {}
        if isinstance(sampling, dict):
            _check_sampling(sampling, server_args, self.options.penalties)
        return None


def _check_sampling(sampling: dict, server_args, per_node: bool) -> None:
    """A request's sampling parameters; per_node: SGLANG_DDTREE_PENALTIES=1, every option of
    LOSSY_SAMPLING_OPTIONS served, each node by its own path (round/penalties.py)."""
    max_new_tokens = sampling.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_new_tokens}.")
    samples = sampling.get("n")
    if isinstance(samples, int) and not 1 <= samples <= request_limits.MAX_SAMPLES:
        # SGLang 0.5.17 expands n into n requests with no bound (n=5000: 5,000 requests)
        raise ValueError(
            f"n={samples}: between 1 and {request_limits.MAX_SAMPLES} samples per request "
            "(OpenAI's bound); send several requests for more."
        )
    min_p = sampling.get("min_p")
    if min_p and getattr(server_args, "enable_deterministic_inference", False):
        # SGLang's deterministic sampler (pytorch backend, seeded) asserts on min_p
        raise ValueError(
            f"min_p={min_p} cannot be served with --enable-deterministic-inference "
            "(SGLang's seeded sampler does not take it); leave it at 0."
        )
    for name, neutral in LOSSY_SAMPLING_OPTIONS.items():
        value = sampling.get(name)
        if value is not None and value != neutral and not per_node:
            raise ValueError(
                f"DDTREE cannot apply {name}={value} exactly inside a draft tree (the output "
                f"distribution would differ from the target's); leave it at {neutral} "
                "(this server was started with SGLANG_DDTREE_PENALTIES=0; SGLANG_DDTREE_PENALTIES=1, "
                "the default, applies it per node)."
            )


# Options SGLang's tree verify applies only approximately (penalties, and min_new_tokens's EOS
# block, are one vector for the whole tree: a node at depth d has d more tokens behind it) or not
# at all (min_p): refused unless round/penalties.py applies them per node. (logit_bias is
# the same at every node, and SGLang's tree verify adds it to every node: exact.)
LOSSY_SAMPLING_OPTIONS = {"min_p": 0.0, **penalties.PENALTIES}


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
    compat.GDN_TARGET_VERIFY: gdn.target_verify,
    compat.MAMBA_STATE_COMMIT: gdn.commit,
    compat.GDN_CONV_UPDATE: gdn.conv_update,
    compat.REQ_TO_TOKEN_HEADROOM: _row_headroom,
    compat.UNIFIED_MAMBA_POOLS: _unified_row_headroom,
    compat.MAMBA_POOL_INIT: gdn_pool.init_mamba_pool,
    compat.MAMBA_POOL_SOLVER: gdn_pool.size_mamba_pool,
    compat.FLASHINFER_PREFILL_PLAN: verify_plan.call_begin_forward,
    compat.SCHEDULER_INTERNAL_STATE: _internal_state,
    compat.EAGLE_SAMPLE: penalties.eagle_sample,
    compat.FINALIZE_TREE_PATH: accept_path.finalize_hook,
}
