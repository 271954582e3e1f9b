"""FP8 and the memory at start-up. A DDTREE verify writes its N nodes' keys and values into
SGLang's KV pool, whose cells SGLang sizes from --kv-cache-dtype; DDTREE's own share beside the
pools (state/round_memory.py: the penalty tables, a round's temporaries and its packed mask) holds
no KV cache and no weights, and the start-up check compares it with the memory SGLang's pools
left, as measured. So under FP8 the KV dtype's size enters through SGLang's pool alone: these
tests hold the pool to one byte an element in fp8_e4m3 (two in bf16), on the binary pair's
attention shape and Qwen3.6-27B's, and DDTREE's share to the same bytes whatever the dtypes."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from sglang_ddtree.state import round_memory

# (layers, KV heads, head dim) of the attention layers: the binary Qwen3 pair
# (checkpoints/tiny.py) and Qwen3.6-27B (16 gated-attention layers of 4 KV heads x 256)
SHAPES = {"binary qwen3": (4, 2, 64), "Qwen3.6-27B": (16, 4, 256)}
TOKENS = 32  # pool slots (SGLang adds a padding page)


def _pool(dtype: torch.dtype, layers: int, heads: int, dim: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=TOKENS,
        page_size=1,
        dtype=dtype,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kv_pool_holding_the_verify_nodes_takes_the_kv_dtypes_size(shape):
    """SGLang's MHATokenToKVPool (the target's full-attention KV, where the verify writes every
    node): bytes per token = layers x 2 (K, V) x heads x head dim x the dtype's size, one byte
    in fp8_e4m3 (stored as uint8) and two in bf16; what the pool allocates and what it reports
    (get_kv_size_bytes, the "KV Cache is allocated" line) agree. A pool or check that took the
    KV cache at 2 bytes would make fp8's twice what it is."""
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    layers, heads, dim = SHAPES[shape]
    per_token = {}
    for dtype, size in ((torch.bfloat16, 2), (torch.float8_e4m3fn, 1)):
        pool = _pool(dtype, layers, heads, dim)
        slots = pool.k_buffer[0].shape[0]  # TOKENS + the padding page
        allocated = sum(t.numel() * t.element_size() for t in (*pool.k_buffer, *pool.v_buffer))
        assert allocated == slots * layers * 2 * heads * dim * size, (dtype, allocated)
        assert sum(pool.get_kv_size_bytes()) == allocated
        per_token[dtype] = allocated // slots
    assert per_token[torch.float8_e4m3fn] * 2 == per_token[torch.bfloat16]


def test_ddtrees_share_beside_the_pools_takes_no_kv_dtype_or_weights():
    """round_memory.at_maximum is sized from the batch, N, the vocabulary and the request rows
    only: no KV dtype or weight dtype reaches it, so the start-up check's DDTREE share is the
    same bytes for a bf16, an FP8 and an FP8-KV server, and whether it fits follows the free
    memory SGLang's pools left (smaller KV cells leave more)."""
    params = set(inspect.signature(round_memory.at_maximum).parameters)
    assert params == {"max_bs", "num_nodes", "vocab", "rows", "row", "penalties"}
    assert not any("dtype" in f.name for f in dataclasses.fields(round_memory.RoundMemory))
    memory = round_memory.at_maximum(
        max_bs=16, num_nodes=32, vocab=248320, rows=20, row=8192 + 68, penalties=True
    )
    need = memory.total / round_memory.GIB
    with pytest.raises(RuntimeError, match="are free after SGLang's pools"):
        round_memory.check(memory, need - 0.01)
    assert round_memory.check(memory, need + round_memory.LOW_FREE_GIB + 0.01) is None
