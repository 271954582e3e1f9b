"""A compact Gated DeltaNet verify scratch in SGLang's Mamba pool (DDTREE's GDN path).

SGLang gives every running request N full recurrent states per GDN layer for a verify
(`intermediate_ssm` [layers, requests + 1, N, HV, V, K]: 9.7 GB per request at 27B and N = 64)
and sizes the Mamba pool for it, which caps DDTREE at 4 running requests at N = 64 on an H200.
DDTREE's own verify (state/gdn.py) keeps only each node's inputs, `scratch_floats` words
per request and layer (1.6 % of that). Two hooks size the pool for what DDTREE uses (except
under --enable-unified-memory, whose pool SGLang allocates itself with its per-node states):

- `init_mamba_pool` (around HybridReqToTokenPool._init_mamba_pool): SGLang builds the pool
  without speculative buffers; we add `intermediate_ssm` as float32 rows of `scratch_floats`
  words [layers, requests + 1, words] and the per-node conv buffer: each node's input once,
  [layers, requests + 1, N, dim, 1] (gdn/conv_tree.py's save_inputs and commit_windows), where
  SGLang keeps dense per-node windows [.., N, dim, K - 1].
- `size_mamba_pool` (around KVCacheConfigurator._handle_max_mamba_cache): SGLang charges the
  speculative buffers as N extra states per request; we run its solver with the number of
  states that covers the compact buffers instead, so the memory goes to more requests.

Only DDTREE's verify and commit can read a compact scratch: the GDN hooks refuse SGLang's own
path on it (state/gdn.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math

import torch

from sglang_ddtree.adapter import compat
from sglang_ddtree.config import Options

logger = logging.getLogger(__name__)


def compact_bytes_per_request(cache_params, num_nodes: int) -> int:
    """Bytes of the compact speculative buffers per request, all GDN layers: the verify scratch
    (float32) and the per-node conv buffer (the conv dtype; `conv_window`'s width)."""
    from sglang_ddtree.gdn.tree_verify import scratch_floats

    HV, V, K = cache_params.shape.temporal
    conv = sum(math.prod(conv_window(shape)) for shape in cache_params.shape.conv)
    per_layer = 4 * scratch_floats(num_nodes, HV, K, V)
    per_layer += num_nodes * conv * cache_params.dtype.conv.itemsize
    return per_layer * len(cache_params.layers)


def size_mamba_pool(opts: Options, original, configurator, total_rest_memory):
    """SGLang's solver with its N per-request speculative states replaced by the fewest whole
    states that hold the compact buffers (the solver charges `mamba_cache_per_req` per state;
    `opts`: the worker factory's, bound when the hook is installed)."""
    if configurator.spec_algorithm.is_none() or not opts.compact_scratch:
        return original(configurator, total_rest_memory)
    from sglang.srt.runtime_context import get_spec, max_speculative_num_draft_tokens

    params = configurator.mambaish_config.mamba2_cache_params
    spec = get_spec()
    N = int(max_speculative_num_draft_tokens() or spec.speculative_num_draft_tokens)
    per_request = compact_bytes_per_request(params, N)
    states = math.ceil(per_request / params.mamba_cache_per_req)
    logger.info(
        "sglang_ddtree: Mamba pool sized for %d verify state(s) per request instead of %d "
        "(compact GDN scratch)",
        states,
        spec.speculative_num_draft_tokens,
    )
    # The solver reads N from this leaf only; the scoped override restores it on return, before
    # the pool (which takes N from server_args) and anything else reads it.
    with spec.override(speculative_num_draft_tokens=states):
        rest = original(configurator, total_rest_memory)
    if rest <= 0:  # nothing left for the KV cache: refuse now, before any pool or graph
        from sglang.srt.runtime_context import get_schedule

        slots = get_schedule().max_mamba_cache_size
        raise RuntimeError(
            f"DDTREE: not enough GPU memory. Of the {total_rest_memory:.2f} GiB that "
            f"--mem-fraction-static leaves after the weights, {slots} Mamba state slots (plus "
            f"SGLang's padding slot; {params.mamba_cache_per_req / (1 << 20):.2f} MiB each) and "
            f"the compact GDN verify scratch for N = {N} "
            f"({per_request / (1 << 20):.2f} MiB per running request, "
            f"reserved as {states} whole states) leave {rest:.2f} GiB for the KV cache. Lower "
            "--max-mamba-cache-size or "
            "--max-running-requests, lower --speculative-num-draft-tokens, or raise "
            "--mem-fraction-static."
        )
    return rest


def init_mamba_pool(opts: Options, original, req_pool, *args, **kwargs):
    """SGLang's Mamba pool, its speculative buffers replaced by the compact ones (`opts`: the
    worker factory's, bound when the hook is installed)."""
    call = inspect.signature(original).bind(req_pool, *args, **kwargs)
    call.apply_defaults()
    params = call.arguments
    N = params.get("speculative_num_draft_tokens")
    if N is None or not opts.compact_scratch:
        return original(*call.args, **call.kwargs)
    params["speculative_num_draft_tokens"] = None  # SGLang: no speculative buffers
    original(*call.args, **call.kwargs)
    attach_compact_scratch(req_pool.mamba_pool, params["mamba_spec_state_size"], N)
    return None


def attach_compact_scratch(pool, spec_state_size: int, num_nodes: int) -> None:
    """Turn a MambaPool built without speculative buffers into one with DDTREE's compact ones
    (one row per request plus SGLang's padding row)."""
    from sglang.srt.mem_cache.memory_pool import MambaPool

    from sglang_ddtree.gdn.tree_verify import scratch_floats

    cache = pool.mamba_cache
    temporal = cache.temporal  # [layers, slots, HV, V, K]
    layers, rows = temporal.shape[0], spec_state_size + 1
    HV, V, K = temporal.shape[2:]
    scratch = temporal.new_zeros(
        (layers, rows, scratch_floats(num_nodes, HV, K, V)), dtype=torch.float32
    )
    windows = [
        conv.new_zeros((layers, rows, num_nodes, *conv_window(conv.shape[2:])))
        for conv in cache.conv
    ]
    fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
    pool.mamba_cache = MambaPool.SpeculativeState(
        **fields, intermediate_ssm=scratch, intermediate_conv_window=windows
    )
    compat.set_dense_conv_windows(pool, windows)
    added = sum(t.numel() * t.element_size() for t in (scratch, *windows))
    pool.mem_usage = getattr(pool, "mem_usage", 0.0) + added / (1 << 30)
    logger.info(
        "sglang_ddtree: compact GDN verify scratch for %d requests x %d nodes: %.3f GB "
        "(SGLang's per-node states would take %.2f GB)",
        spec_state_size,
        num_nodes,
        added / (1 << 30),
        layers * rows * num_nodes * temporal[0, 0].numel() * temporal.element_size() / (1 << 30),
    )


def conv_window(shape) -> tuple:
    """A node's share of the compact per-node conv buffer for a conv state of `shape`
    (dim, K - 1): its input once, (dim, 1)."""
    return (*shape[:-1], 1)


def is_compact(intermediate_ssm) -> bool:
    """Whether a (per-layer or all-layer) intermediate_ssm is the compact scratch, which only
    DDTREE's verify and commit can use: SGLang's has N, HV, V, K after its row dimensions."""
    return intermediate_ssm is not None and intermediate_ssm.dim() <= 3
