"""The accepted path moved to the front of each request's block after a DDTREE verify, in one
Triton launch.

`finalize_hook`, AROUND eagle_worker_common._finalize_accept_tree_path: one kernel writes the KV
slot pairs for the pool's own move_kv_cache, the compacted predictions, and the rows of the
accepted hidden states, which one gather then takes. SGLang gathers the path and clones the
whole [bs x N, hidden] block to rewrite its first S rows; DDTREE's next step reads only those
(worker._commit_draft_context), so the hidden states come back as the [bs x S, hidden] rows
alone, where S = B (the accept path's width). The outputs are SGLang's, value for value
(tests/unit/test_accept_path.py). It applies to DDTREE batches only; every other caller gets
SGLang's function.
"""

from __future__ import annotations


def _applies(batch) -> bool:
    from sglang_ddtree.adapter.spec import is_ddtree

    return is_ddtree(getattr(batch, "spec_algorithm", None))


def finalize_hook(
    runtime,
    original,
    batch,
    accept_index,
    accept_lens,
    predict,
    logits_output,
    bs,
    *,
    token_to_kv_pool_allocator,
    num_draft_tokens,
):
    """AROUND eagle_worker_common._finalize_accept_tree_path: for a DDTREE batch, the KV moved by
    the pool from compact_path's pairs, the compacted predictions returned, and the accepted
    hidden states' [bs x S, hidden] rows left in logits_output.hidden_states (when present).
    runtime: the worker factory's runtime.Runtime (its engaged paths), bound at install."""
    if not _applies(batch):
        return original(
            batch,
            accept_index,
            accept_lens,
            predict,
            logits_output,
            bs,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            num_draft_tokens=num_draft_tokens,
        )
    from sglang_ddtree.accept.path_triton import compact_path

    runtime.engaged.first_use("accepted path moved to the front by round/accept_path.py")
    out, kv_dst, kv_src, rows = compact_path(
        accept_index, accept_lens, batch.out_cache_loc, predict, int(num_draft_tokens)
    )
    token_to_kv_pool_allocator.get_kvcache().move_kv_cache(kv_dst, kv_src)
    hidden = logits_output.hidden_states
    if hidden is not None:
        logits_output.hidden_states = hidden.index_select(0, rows)
    return out
