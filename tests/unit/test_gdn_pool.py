"""state/gdn_pool.py: the compact Gated DeltaNet verify scratch (DDTREE's GDN path, but
under --enable-unified-memory) in SGLang's own Mamba pool and memory solver, run on the CPU. That DDTREE's verify
and commit give SGLang's results through this scratch is tested under the Triton interpreter in
test_gdn_tree_verify.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_ddtree.config import DDTreeConfig, Options
from sglang_ddtree.gdn.tree_verify import scratch_floats
from sglang_ddtree.state import gdn, gdn_pool

pytest.importorskip("sglang.srt.mem_cache.memory_pool")

LAYERS = [0, 2, 3]
HV, V, K = 4, 32, 32  # value heads, head dims (the state dwarfs a node's inputs, as at 27B)


def cache_params(tp: int = 1):
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )

    shape = Mamba2StateShape.create(
        tp_world_size=tp,
        intermediate_size=HV * V,
        n_groups=2,
        num_heads=HV,
        head_dim=V,
        state_size=K,
        conv_kernel=4,
    )
    dtype = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    return Mamba2CacheParams(shape=shape, layers=LAYERS, dtype=dtype)


COMPACT = Options()  # the default: the compact scratch
FULL = Options(gdn_scratch="full")


def hybrid_pool(num_nodes, requests=3, slots=9, opts=COMPACT):
    """SGLang's HybridReqToTokenPool on the CPU, its Mamba pool built through the hook (bound to
    the worker factory's options `opts`, as hooks.bound_hooks binds it)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    class Pool(HybridReqToTokenPool):
        def _init_mamba_pool(self, *args, **kwargs):
            return gdn_pool.init_mamba_pool(
                opts, HybridReqToTokenPool._init_mamba_pool, self, *args, **kwargs
            )

    return Pool(
        size=requests,
        mamba_size=slots,
        mamba_spec_state_size=requests,
        max_context_len=64,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params(),
        mamba_layer_ids=LAYERS,
        enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=num_nodes,
        speculative_eagle_topk=4,
    )


def test_compact_pool_holds_the_scratch_and_the_per_node_conv_buffer():
    """The per-node conv buffer holds each node's input once ([.., N, dim, 1]), where SGLang
    keeps dense per-node windows ([.., N, dim, K - 1])."""
    from sglang.srt.mem_cache.memory_pool import MambaPool

    N, requests, slots = 6, 3, 9
    pool = hybrid_pool(N, requests, slots)
    caches = pool.get_speculative_mamba2_params_all_layers()
    assert isinstance(caches, MambaPool.SpeculativeState)
    rows = requests + 1  # SGLang's padding row
    assert caches.temporal.shape == (len(LAYERS), slots + 1, HV, V, K)
    assert caches.intermediate_ssm.shape == (len(LAYERS), rows, scratch_floats(N, HV, K, V))
    assert caches.intermediate_ssm.dtype == torch.float32
    (conv,) = caches.conv
    (windows,) = caches.intermediate_conv_window
    node = (conv.shape[2], 1)
    assert windows.shape == (len(LAYERS), rows, N, *node) and windows.dtype == conv.dtype
    layer = pool.mamba2_layer_cache(LAYERS[1])  # what the GDN backend hands the verify
    assert layer.intermediate_ssm.shape == (rows, scratch_floats(N, HV, K, V))
    assert layer.intermediate_conv_window[0].shape == (rows, N, *node)
    assert gdn_pool.is_compact(caches.intermediate_ssm)
    assert gdn_pool.is_compact(layer.intermediate_ssm)
    added = caches.intermediate_ssm.nbytes + windows.nbytes
    assert added == rows * gdn_pool.compact_bytes_per_request(cache_params(), N)
    plain = pool.mamba_pool.mamba_cache.temporal.nbytes + conv.nbytes
    assert math.isclose(pool.mamba_pool.mem_usage * (1 << 30), plain + added)


def test_sglangs_per_node_states_are_not_compact():
    assert not gdn_pool.is_compact(torch.zeros(2, 5, 6, HV, V, K))  # [layers, rows, N, ...]
    assert not gdn_pool.is_compact(torch.zeros(5, 6, HV, V, K))  # one layer
    assert not gdn_pool.is_compact(None)


def test_the_pool_hook_passes_sglangs_pool_through_unless_compact(monkeypatch):
    calls = []

    def original(req_pool, *, mamba_spec_state_size, speculative_num_draft_tokens=None):
        calls.append(speculative_num_draft_tokens)

    gdn_pool.init_mamba_pool(
        FULL, original, None, mamba_spec_state_size=3, speculative_num_draft_tokens=6
    )
    gdn_pool.init_mamba_pool(COMPACT, original, None, mamba_spec_state_size=3)  # no verify
    assert calls == [6, None]
    pool = hybrid_pool(None)  # a pool without speculative buffers stays one
    assert pool.mamba_pool.mamba_cache.__class__.__name__ == "State"


def solve(hook: bool, total_gib: float, num_nodes=64, running=16, mamba_slots=None, opts=COMPACT):
    """SGLang's `_handle_max_mamba_cache` (through the hook or not) for cache_params() with the
    radix cache on: (the memory it leaves in GiB, max_mamba_cache_size, the solver's
    speculative_num_draft_tokens after it returns)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.runtime_context import get_context, get_schedule, get_spec

    with get_context().override_server_args(
        speculative_algorithm="DFLASH",
        speculative_num_draft_tokens=num_nodes,
        max_running_requests=running,
        max_mamba_cache_size=mamba_slots,
    ):
        cfg = SimpleNamespace(
            mambaish_config=SimpleNamespace(mamba2_cache_params=cache_params()),
            server_args=get_context().server_args,
            pp_size=1,
            attn_dp_size=1,
            fused_entry_bytes=lambda kind: None,
            extra_mamba_cache_bytes_per_req=0,
            spec_algorithm=SimpleNamespace(is_none=lambda: False),
            hybrid_gdn_config=object(),
            hybrid_kda_config=None,
            model_config=None,
        )
        cfg._calculate_mamba_ratio = lambda: KVCacheConfigurator._calculate_mamba_ratio(cfg)
        solver = KVCacheConfigurator._handle_max_mamba_cache
        if hook:
            rest = gdn_pool.size_mamba_pool(opts, solver, cfg, total_gib)
        else:
            rest = solver(cfg, total_gib)
        ratio = cfg._calculate_mamba_ratio()
        return (
            rest,
            get_schedule().max_mamba_cache_size,
            get_spec().speculative_num_draft_tokens,
            ratio,
        )


def test_the_solver_reserves_the_compact_scratch_and_gives_the_rest_to_requests():
    params = cache_params()
    N, running, total = 64, 16, 0.05  # GiB
    rest_full, slots_full, _, ratio = solve(False, total, N, running)
    rest, slots, after, _ = solve(True, total, N, running)
    assert after == N  # the solver's view of N is restored
    # SGLang reserves N whole states per running request; the hook far fewer, so that the
    # same memory holds many more state slots (and so running requests: slots // ratio)
    assert slots >= 4 * slots_full and slots // ratio >= running > slots_full // ratio
    # what the compact pool then allocates fits what the solver reserved
    requests = min(running, slots // ratio)
    needed = (slots + 1) * params.mamba_cache_per_req + (
        requests + 1
    ) * gdn_pool.compact_bytes_per_request(params, N)
    assert needed <= (total - rest) * (1 << 30) <= 1.1 * needed + params.mamba_cache_per_req * 8


def test_a_configuration_that_leaves_no_kv_cache_is_refused_with_the_numbers():
    """Through SGLang's own solver: state slots asked for (--max-mamba-cache-size) and the
    compact scratch that leave nothing for the KV cache stop start-up with the memory in
    numbers and the flags that fix it; the same memory with fewer slots is fine."""
    params = cache_params()
    total = 0.05  # GiB
    too_many = int(total * (1 << 30) // params.mamba_cache_per_req) + 8
    with pytest.raises(RuntimeError, match="DDTREE: not enough GPU memory") as err:
        solve(True, total, mamba_slots=too_many)
    message = str(err.value)
    for flag in (
        "--max-mamba-cache-size",
        "--max-running-requests",
        "--speculative-num-draft-tokens",
        "--mem-fraction-static",
    ):
        assert flag in message, message
    assert f"{too_many} Mamba state slots" in message and "N = 64" in message
    rest, slots, _, _ = solve(True, total, mamba_slots=8)
    assert rest > 0 and slots == 8


def test_the_solver_is_sglangs_own_unless_compact():
    assert solve(True, 0.01, opts=FULL) == solve(False, 0.01)


def test_gdn_path_follows_the_servers_flags(monkeypatch):
    """Default: the chunked verify, the tree conv1d and the compact scratch; the root paths
    under --enable-deterministic-inference; the full scratch under --enable-unified-memory (SGLang's
    pool allocates the per-node states). The hooks are bound to the path the worker factory made
    from its options (gdn.configure). The retired SGLANG_DDTREE_GDN is refused, naming why."""
    from sglang_ddtree import config

    cfg = DDTreeConfig(block_size=16, num_nodes=32, topk=8)
    monkeypatch.delenv("SGLANG_DDTREE_GDN", raising=False)

    def path(unified=False):
        return gdn.path_of(config.Options.from_env(unified_memory=unified), 16)

    def configured():  # what the worker factory hands the GDN hooks
        return gdn.configure(config.Options.from_env(), cfg).path

    assert path() == gdn.GDNPath(16, verify="chunk", compact=True) == configured()
    assert config.Options.from_env().compact_scratch
    assert gdn.describe(path()) == (
        "ddtree (verify: chunk; commit: replay; tree conv1d: ddtree; scratch: compact)"
    )
    assert path(unified=True) == gdn.GDNPath(16, compact=False)  # SGLang's pool allocates them
    assert config.Options.from_env(unified_memory=True).gdn_scratch == "full"
    # --enable-deterministic-inference: the root paths (batch invariance)
    flags = SimpleNamespace(enable_deterministic_inference=True, enable_unified_memory=False)
    assert gdn.compat.option_modes(flags) == {
        "unified_memory": False,
        "deterministic": True,
        "tensor_parallel": False,
    }
    det = config.Options.from_env(**gdn.compat.option_modes(flags))
    assert det.gdn_verify == "paths" and gdn.path_of(det, 16) == gdn.GDNPath(16, verify="paths")
    monkeypatch.setenv("SGLANG_DDTREE_GDN", "sglang")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_GDN is no longer a switch.*always serve"):
        configured()


def test_the_gdn_path_is_resolved_once_from_the_factorys_options_and_config():
    """gdn.configure resolves the path once (the worker factory); the hooks read that object on
    every layer, and the block size is SGLang's resolved one (DDTreeConfig)."""
    state = gdn.configure(Options(gdn_verify="chunk"), DDTreeConfig(16, 32, 8))
    assert state.path == gdn.GDNPath(16, verify="chunk")
    assert state.first_conv_state is state.filled is None and state.engaged.sorted() == []


def test_sglangs_own_verify_and_commit_refuse_a_compact_scratch(monkeypatch):
    """Should a verify without a tree reach the compact pool, SGLang's kernel would write N
    whole states per row past its end: the hooks raise instead of calling it."""
    N = 4
    scratch = torch.zeros(2, scratch_floats(N, HV, K, V))
    state = gdn.GDNState(gdn.GDNPath(N))  # a verify without a tree goes to SGLang's kernel

    def never(*args, **kwargs):
        raise AssertionError("SGLang's own path was called on a compact scratch")

    with pytest.raises(RuntimeError, match="compact scratch.*--enable-unified-memory"):
        gdn.target_verify(
            state,
            never,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            intermediate_states_buffer=scratch,
            retrieve_parent_token=None,
        )
    caches = SimpleNamespace(intermediate_ssm=scratch[None])
    backend = SimpleNamespace(
        linear_attn_backend=SimpleNamespace(
            forward_metadata=SimpleNamespace(retrieve_parent_token=None),
            req_to_token_pool=SimpleNamespace(
                get_speculative_mamba2_params_all_layers=lambda: caches
            ),
        )
    )
    with pytest.raises(RuntimeError, match="compact scratch.*--enable-unified-memory"):
        gdn.commit(state, never, backend, torch.zeros(1, dtype=torch.int64), None, None, model=None)


def test_pool_hook_targets_have_the_parameters_the_hooks_use():
    import inspect

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks

    assert hooks.HOOKS[compat.MAMBA_POOL_INIT] is gdn_pool.init_mamba_pool
    assert hooks.HOOKS[compat.MAMBA_POOL_SOLVER] is gdn_pool.size_mamba_pool
    init = inspect.signature(HybridReqToTokenPool._init_mamba_pool).parameters
    assert {"mamba_spec_state_size", "speculative_num_draft_tokens"} <= set(init)
    solver = inspect.signature(KVCacheConfigurator._handle_max_mamba_cache).parameters
    assert list(solver) == ["self", "total_rest_memory"]


def test_options_are_parsed_once_and_the_factorys_reach_the_hooks(monkeypatch):
    """config.Options: every switch typed in one object; the worker factory parses it once and
    binds it into the hooks, so later environment changes do not reach them."""
    from sglang_ddtree import config
    from sglang_ddtree.plugin import hooks
    from sglang_ddtree.round.runtime import Runtime

    monkeypatch.setenv("SGLANG_DDTREE_WIDTH", "fixed")
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "0")
    parsed = config.Options.from_env()
    assert parsed == config.Options(width="fixed", penalties=False)
    assert parsed.describe().startswith("gdn_verify=chunk, gdn_scratch=compact")
    runtime = Runtime.create(parsed, DDTreeConfig(16, 32, 8))
    monkeypatch.setenv("SGLANG_DDTREE_WIDTH", "auto")
    bound = hooks.bound_hooks(runtime)
    assert set(bound) == set(hooks.HOOKS)
    for target, hook in bound.items():  # each hook holds what it reads, none reads a global
        if hook is not hooks.HOOKS[target]:
            assert hook.func is hooks.HOOKS[target]
            assert hook.args[0] in (runtime, runtime.gdn, runtime.options, runtime.cfg)
    assert bound[gdn_pool.compat.MAMBA_POOL_INIT].args[0] is parsed
    assert parsed.width == "fixed"  # the environment changed after the parse: not seen
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "yes")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_PENALTIES must be '1' or '0'"):
        config.Options.from_env()


def test_server_info_reports_the_resolved_options(monkeypatch):
    """/server_info's internal state of a DDTREE scheduler carries its options and GDN path as
    values (tests/gpu reads them there); other algorithms' state is left alone."""
    import dataclasses
    import inspect

    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_ddtree import config
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks

    assert list(inspect.signature(Scheduler.get_internal_state).parameters) == ["self", "recv_req"]
    assert hooks.HOOKS[compat.SCHEDULER_INTERNAL_STATE] is hooks._internal_state
    opts = config.Options(gdn_verify="chunk")
    from sglang_ddtree.round.runtime import Runtime

    runtime = Runtime.create(opts, DDTreeConfig(16, 32, 8))  # the worker factory's
    ddtree = SimpleNamespace(spec_algorithm=SimpleNamespace(name="DDTREE"))

    def original(scheduler, req):  # what SGLang's get_internal_state returns
        return GetInternalStateReqOutput(internal_state={"startup_time": 1.0})

    state = hooks._internal_state(runtime, original, ddtree, None).internal_state
    assert state["ddtree"]["options"] == dataclasses.asdict(opts)
    assert state["ddtree"]["gdn_path"] == gdn.describe(gdn.GDNPath(16, verify="chunk"))
    assert state["ddtree"]["engaged"] == []
    runtime.engaged.first_use("tree conv1d through sglang_ddtree.gdn.conv_tree")  # a hook's path
    runtime.gdn.first_use("GDN state commit through sglang_ddtree.gdn.tree_verify.commit_paths")
    state = hooks._internal_state(runtime, original, ddtree, None).internal_state
    assert state["ddtree"]["engaged"] == [
        "GDN state commit through sglang_ddtree.gdn.tree_verify.commit_paths",
        "tree conv1d through sglang_ddtree.gdn.conv_tree",
    ]
    dflash = SimpleNamespace(spec_algorithm=SimpleNamespace(name="DFLASH"))
    assert hooks._internal_state(runtime, original, dflash, None).internal_state == {
        "startup_time": 1.0
    }


def test_configure_says_when_the_chunked_verify_cannot_apply(monkeypatch, caplog):
    """Trees wider than the chunked verify takes run the root paths: startup says so."""
    from sglang_ddtree import config

    opts = config.Options()
    for nodes, warned in ((32, False), (256, False), (512, True)):
        caplog.clear()
        with caplog.at_level("INFO"):
            gdn.configure(opts, DDTreeConfig(block_size=16, num_nodes=nodes, topk=8))
        assert "GDN path: ddtree (verify: chunk;" in caplog.text
        assert ("wider than the chunked GDN verify takes" in caplog.text) == warned, nodes


def test_the_compact_scratch_is_sized_per_tensor_parallel_rank():
    """Tensor parallelism: SGLang's cache shapes are per rank (heads and conv channels divided by
    the TP size), and the compact buffers are sized from them: at TP 2 a rank holds half."""
    one, two = (gdn_pool.compact_bytes_per_request(cache_params(tp), num_nodes=16) for tp in (1, 2))
    assert cache_params(2).shape.temporal[0] == HV // 2
    assert two * 2 == one
