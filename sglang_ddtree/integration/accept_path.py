"""The accepted path's bookkeeping after a DDTREE verify, in one Triton launch each where SGLang
0.5.17's generic tree code takes about fifteen small torch operations (SGLANG_DDTREE_ACCEPT_PATH=
triton, the default; `sglang` leaves SGLang's code in place). On the host-bound shipped pair each
operation is a host launch: the profile put SGLang's two functions at 0.44 and 0.64 ms of a
12.4 ms DDTREE round, inside the 45.7 launches of the round's verify (docs/benchmarks.md,
session 15). The outputs are SGLang's, value for value (tests/unit/test_accept_path.py).

- `step_indices`, AROUND spec_utils._verify_commit_step_indices: per request, the tree node of
  the last accepted step (the Mamba state commit's `last_correct_step_indices`), and the node
  whose state the prefix cache tracks when the round crosses a tracking interval (-1: none).
- `finalize`, AROUND eagle_worker_common._finalize_accept_tree_path: the accepted path moved to
  the front of each request's block. One kernel writes the KV slot pairs for the pool's own
  move_kv_cache, the compacted predictions, and the rows of the accepted hidden states, which
  one gather then takes. SGLang clones the whole [bs x N, hidden] block to rewrite its first S
  rows; DDTREE's next step reads only those (worker._commit_draft_context), so the hidden states
  come back as the [bs x S, hidden] rows alone, where S = B (the accept path's width).

- `track_indices`, AROUND spec_utils.prepare_mamba_track_for_verify (before the verify): with
  the prefix cache's Mamba tracking on, each request's tracking buffer, one gather when every
  request tracks into the same ping-pong slot (compat.set_uniform_mamba_track_indices); SGLang's
  otherwise. Host time, not launches: 0.42 ms of a sampled 12.0 ms round at c = 1 (session 17).

All three apply to DDTREE batches only; every other caller gets SGLang's function.
"""

from __future__ import annotations

from sglang_ddtree.integration import compat

TRACK_LINE = "Mamba tracking buffers of one slot gathered by integration/accept_path.py"


def _applies(batch) -> bool:
    from sglang_ddtree.config import options
    from sglang_ddtree.integration.hooks import _is_ddtree

    return options().accept_path == "triton" and _is_ddtree(getattr(batch, "spec_algorithm", None))


def step_indices_hook(original, *, batch, accept_index, accept_lens, draft_token_num):
    """AROUND spec_utils._verify_commit_step_indices: step_indices for a DDTREE batch."""
    if not _applies(batch):
        return original(batch=batch, accept_index=accept_index, accept_lens=accept_lens,
                        draft_token_num=draft_token_num)  # fmt: skip
    from sglang_ddtree.integration.accept_path_triton import step_indices
    from sglang_ddtree.integration.gdn import first_use

    first_use("accepted path's commit steps through integration/accept_path.py")

    interval = None if batch.mamba_track_indices is None else compat.mamba_track_interval()
    return step_indices(accept_index, accept_lens, batch.seq_lens, int(draft_token_num), interval)


def track_indices_hook(original, batch):
    """AROUND spec_utils.prepare_mamba_track_for_verify: the one-gather case for a DDTREE
    batch, SGLang's function for everything else."""
    if not (_applies(batch) and compat.set_uniform_mamba_track_indices(batch)):
        original(batch)
        return
    from sglang_ddtree.integration.gdn import first_use

    first_use(TRACK_LINE)


def finalize_hook(original, batch, accept_index, accept_lens, predict, logits_output, bs, *,
                  token_to_kv_pool_allocator, num_draft_tokens):  # fmt: skip
    """AROUND eagle_worker_common._finalize_accept_tree_path: for a DDTREE batch, the KV moved by
    the pool from compact_path's pairs, the compacted predictions returned, and the accepted
    hidden states' [bs x S, hidden] rows left in logits_output.hidden_states (when present)."""
    if not _applies(batch):
        return original(batch, accept_index, accept_lens, predict, logits_output, bs,
                        token_to_kv_pool_allocator=token_to_kv_pool_allocator,
                        num_draft_tokens=num_draft_tokens)  # fmt: skip
    from sglang_ddtree.integration.accept_path_triton import compact_path
    from sglang_ddtree.integration.gdn import first_use

    first_use("accepted path moved to the front by integration/accept_path.py")
    out, kv_dst, kv_src, rows = compact_path(accept_index, accept_lens, batch.out_cache_loc,
                                             predict, int(num_draft_tokens))  # fmt: skip
    token_to_kv_pool_allocator.get_kvcache().move_kv_cache(kv_dst, kv_src)
    hidden = logits_output.hidden_states
    if hidden is not None:
        logits_output.hidden_states = hidden.index_select(0, rows)
    return out
