"""What DDTREE allocates beyond SGLang's pools at a server's own maximum, and the start-up checks
that it fits (`check`, from the worker once the pools exist).

Kept for the server's life (SGLANG_DDTREE_PENALTIES=1, round/penalties.py): the penalty
count table, request slots x vocabulary float32, and the stop-token table, the same in bool.

Per round, at the largest batch `max_bs`, the verify width N and the vocabulary V:
- the verify's packed custom mask, N x sum over requests of (S_b + N) bytes (verify_plan's
  bit-offset layout: as long in bytes as the unpacked mask in bools); a request's committed
  length S_b is at most its req_to_token row, so at most N x max_bs x (row + N) (the unpacked
  mask is written only for a call the host plan cannot take, verify_plan.write_mask);
- in a round whose batch asks for a penalty, min_new_tokens or min_p: each request's counts and
  stop row gathered ([bs, V] float32 and bool) and tree.penalties' [requests, N, V] temporaries
  (penalize_tree_: a float32 and a bool per value; min_p_filter_ and block_stops_: a bool),
  worked a few requests at a time within TEMP_BYTES, one request at a time beyond it.

Per width w the server may verify (round/widths.VerifyWidths, every width below N; N's are
SGLang's own, allocated with its pools): the attention buffers SGLang's FlashInfer backend
allocates for that width's verify CUDA graphs (`verify_graph_bytes`), checked against the memory
free before the width is captured (`check_width`). The rest of a round's memory (the verify
mask, the GDN scratch in the Mamba pool, the KV slots of the verified nodes) is allocated at N,
the widest width, so that every narrower width fits where N does.

The verify plan's offsets are int32 (verify_plan.HostPlan's mask offsets, and FlashInfer's own,
which its plan derives from the same lengths): N x sum(S_b + N) mask bits must stay below 2^31.
"""

from __future__ import annotations

import dataclasses

from sglang_ddtree.accept.penalties import TEMP_BYTES, requests_at_once

INT32_LIMIT = 1 << 31
GIB = 1 << 30
LOW_FREE_GIB = 1.0  # less left than this after DDTREE's share is logged (CUDA graphs need some)


@dataclasses.dataclass(frozen=True)
class RoundMemory:
    """Bytes at the maximum: `tables` kept for the server's life, `temporaries` and
    `verify_mask` a round's; `mask_bits` N x the largest sum over requests of (S_b + N)."""

    tables: int
    temporaries: int
    verify_mask: int
    mask_bits: int

    @property
    def total(self) -> int:
        return self.tables + self.temporaries + self.verify_mask

    def describe(self) -> str:
        return (
            f"{self.total / GIB:.2f} GiB: penalty tables {self.tables / GIB:.2f}, per-round "
            f"penalty temporaries {self.temporaries / GIB:.2f}, verify mask "
            f"{self.verify_mask / GIB:.2f}"
        )


def at_maximum(
    *,
    max_bs: int,
    num_nodes: int,
    vocab: int,
    rows: int,
    row: int,
    penalties: bool,
) -> RoundMemory:
    """A server's RoundMemory: `rows` request slots, `row` the req_to_token row's width (the
    longest committed length), `penalties` the per-node penalties on."""
    N = num_nodes
    bits = N * max_bs * (row + N)
    tables = temporaries = 0
    if penalties:
        tables = rows * vocab * (4 + 1)
        gathered = max_bs * vocab * (4 + 1)
        per_request = N * vocab * (4 + 1)  # penalize_tree_'s, the largest of the three
        at_once = min(max_bs, requests_at_once(N, vocab, 4 + 1, TEMP_BYTES))
        temporaries = gathered + at_once * per_request
    return RoundMemory(
        tables=tables,
        temporaries=temporaries,
        verify_mask=bits,
        mask_bits=bits,
    )


def check(memory: RoundMemory, free_gib: float | None) -> str | None:
    """Raise RuntimeError where the verify plan's int32 offsets would overflow at the maximum, or
    where DDTREE's share does not fit in `free_gib` (what SGLang's pools left; None: no GPU, not
    checked), naming the numbers and the flags that lower them. Returns a warning to log when
    under LOW_FREE_GIB would be left, else None."""
    if memory.mask_bits >= INT32_LIMIT:
        raise RuntimeError(
            f"DDTREE: the verify mask at this server's maximum is {memory.mask_bits} bits "
            "(--speculative-num-draft-tokens x --max-running-requests x (the context length + "
            "its headroom + N)), past the 2^31 that the verify plan's int32 offsets (and "
            "FlashInfer's) hold. Lower --max-running-requests, --context-length or "
            "--speculative-num-draft-tokens."
        )
    if free_gib is None:
        return None
    need = memory.total / GIB
    if need > free_gib:
        raise RuntimeError(
            f"DDTREE: its memory beside SGLang's pools at this server's maximum needs "
            f"{memory.describe()}, and {free_gib:.2f} GiB are free after SGLang's pools. Lower "
            "--max-running-requests or --mem-fraction-static, lower "
            "--speculative-num-draft-tokens, or set SGLANG_DDTREE_PENALTIES=0 (requests with "
            "penalties or min_p then get a 400)."
        )
    if free_gib - need < LOW_FREE_GIB:
        return (
            f"DDTREE: its memory at this server's maximum ({memory.describe()}) leaves "
            f"{free_gib - need:.2f} GiB free for the CUDA graphs"
        )
    return None


def verify_graph_bytes(*, max_bs: int, width: int, context_len: int, wrappers: int = 1) -> int:
    """Bytes SGLang's FlashInfer backend allocates for one width's verify CUDA graphs
    (init_cuda_graph_state at max_num_tokens = max_bs x width): per wrapper the KV indices,
    int32, and once the custom mask, a byte, each max_num_tokens x the context length."""
    return max_bs * width * context_len * (4 * wrappers + 1)


def check_width(width: int, need: int, free_gib: float, max_bs: int) -> None:
    """Raise RuntimeError, in one line naming the width, the bytes and the limit, where a
    width's verify-graph buffers (`need` bytes) are more than the `free_gib` left."""
    free = int(free_gib * GIB) if free_gib != float("inf") else None
    if free is None or need <= free:
        return
    raise RuntimeError(
        f"DDTREE: verify width {width} needs {need} bytes ({need / GIB:.2f} GiB) for its CUDA "
        f"graphs' attention buffers at {max_bs} running requests, past the {free} bytes "
        f"({free_gib:.2f} GiB) free; leave {width} out of SGLANG_DDTREE_WIDTHS, or lower "
        "--max-running-requests, --context-length or --speculative-num-draft-tokens."
    )
