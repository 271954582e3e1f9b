"""Sampling penalties inside the tree, exactly (the default, SGLANG_DDTREE_PENALTIES=1, since
its GPU tests passed; 0 refuses penalties).

SGLang's tree verify (`eagle_sample`) adds one penalty vector per request to every node,
and that vector comes from a relaxed count (the scheduler cumulates one output token per round,
`ScheduleBatch.cumulate_penalty_output_tokens`). A node's distribution must be the request's
given the path to that node. So DDTREE keeps its own count of each request's output tokens on the
device (`PenaltyTable`: one row per request slot, rebuilt from the request's output at each
prefill, each round's emitted tokens added on the device), and around eagle_sample it penalises
every node's logits from that count plus the node's own path (`tree.penalties.penalize_tree`:
frequency, presence and repetition in SGLang's order; min_new_tokens's stop-token block by the
node's depth), with SGLang's shared vectors off for the call. The per-request parameters come from
the requests on the host as small pinned copies: no host sync.

The counts are exact, so DDTREE gives what SGLang's plain decoding gives without the overlap
scheduler; with it (the default) SGLang's plain server counts a request's output one
token late (its last token is cumulated before it is processed, the prompt's last token in its
place). After a retraction DDTREE keeps the request's earlier output in its count, where SGLang
restarts its penalties from zero.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from sglang_ddtree.accept.penalties import block_stops_, min_p_filter_, penalize_tree_
from sglang_ddtree.adapter import compat

# the penalties applied per node and their neutral values (the sampling-parameter names; min_p,
# the other option applied here, acts on the probabilities, `tree.penalties.min_p_filter_`)
PENALTIES = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}


class PenaltyTable:
    """Output-token counts [rows, vocab] float32 on the device, a row per request slot
    (req_pool_indices), and each min_new_tokens request's stop tokens [rows, vocab] bool, written
    once at its prefill (`restart`) rather than rebuilt from its lists every round."""

    def __init__(self, rows: int, vocab: int, device) -> None:
        self.counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.stops = torch.zeros(rows, vocab, dtype=torch.bool, device=device)

    def restart(self, reqs, req_pool_indices: torch.Tensor, first_tokens: torch.Tensor) -> None:
        """An extend batch: each request's row from its output so far (empty for a new request;
        the earlier output for one resumed after a retraction: the true count, where SGLang's
        plain server starts its penalties again from zero), plus the token this prefill sampled
        (a chunk with more to come samples a throwaway one: the next chunk's restart clears it,
        before any decode round reads the row)."""
        rows = req_pool_indices.to(torch.int64)
        self.counts.index_fill_(0, rows, 0.0)
        at, tokens = [], []
        for b, req in enumerate(reqs):
            out = list(getattr(req, "output_ids", None) or [])
            at += [b] * len(out)
            tokens += out
        if tokens:
            self._add(rows[_device(at, rows.device)], _device(tokens, rows.device), None)
        self._add(rows, first_tokens.reshape(-1)[: len(reqs)], None)
        self._write_stops(reqs, rows)

    def _write_stops(self, reqs, rows: torch.Tensor) -> None:
        """The stop-token rows of the requests that ask for min_new_tokens (the others' rows are
        never read: their floor is 0)."""
        blocked = [b for b, req in enumerate(reqs) if req.sampling_params.min_new_tokens > 0]
        if not blocked:
            return
        mine = rows[_device(blocked, rows.device)]
        self.stops.index_fill_(0, mine, False)
        at, ids = [], []
        for i, b in enumerate(blocked):
            stops = stop_tokens(reqs[b], self.stops.shape[1])
            at += [i] * len(stops)
            ids += stops
        if ids:
            self.stops[mine[_device(at, rows.device)], _device(ids, rows.device)] = True

    def observe(
        self, req_pool_indices: torch.Tensor, emitted: torch.Tensor, accept_lens: torch.Tensor
    ) -> None:
        """A round's emitted tokens: emitted [bs, W], the first accept_lens[b] of row b."""
        bs, W = emitted.shape
        valid = torch.arange(W, device=emitted.device)[None, :] < accept_lens.reshape(-1, 1)
        rows = req_pool_indices.to(torch.int64).reshape(-1, 1).expand(bs, W)
        self._add(rows.reshape(-1), emitted.reshape(-1), valid.reshape(-1))

    def _add(self, rows: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        tokens = tokens.to(torch.int64).clamp(0, self.counts.shape[1] - 1)
        ones = torch.ones(rows.shape, dtype=torch.float32, device=rows.device)
        self.counts.index_put_(
            (rows, tokens), ones if valid is None else valid.to(ones.dtype), accumulate=True
        )

    def penalize_(
        self,
        logits: torch.Tensor,
        reqs,
        req_pool_indices: torch.Tensor,
        tree_tokens: torch.Tensor,
        visibility: torch.Tensor,
        depth: torch.Tensor,
    ) -> torch.Tensor:
        """In place: [bs, N, V] logits of every node's next token with its request's penalties
        given the output so far and the node's own path (logits raw on entry; the tree's tokens
        [bs, N], visibility [bs, N, N] and depth [bs, N] as the round's verify holds them)."""
        bs, N, V = logits.shape
        dev = logits.device
        counts = self.counts[req_pool_indices.to(torch.int64)]
        if counts.shape[1] < V:  # a padded vocabulary: no output token lies beyond the table
            counts = torch.nn.functional.pad(counts, (0, V - counts.shape[1]))
        params = [[float(getattr(r.sampling_params, k)) for r in reqs] for k in PENALTIES]
        f, p, r, floor = (_device(x, dev, torch.float32) for x in params)
        penalize_tree_(logits, tree_tokens, visibility, counts[:, :V], f, p, r)
        if any(params[3]):  # min_new_tokens: no stop token while output + depth < the floor
            early = counts.sum(-1, keepdim=True) + depth.to(torch.float32) < floor[:, None]
            stops = self.stops[req_pool_indices.to(torch.int64)]
            if stops.shape[1] < V:  # a padded vocabulary: no stop token lies beyond the table
                stops = torch.nn.functional.pad(stops, (0, V - stops.shape[1]))
            block_stops_(logits, early, stops[:, :V])
        return logits


def wanted(reqs) -> bool:
    """Whether any request of the batch asks for a penalty DDTREE applies per node."""
    return any(getattr(r.sampling_params, k, v) != v for r in reqs for k, v in PENALTIES.items())


def eagle_sample(
    runtime, original, verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs
):
    """AROUND SGLang's eagle_sample: for a DDTREE verify whose batch asks for penalties, every
    node's logits penalised by its own path (in place), SGLang's shared penalty vectors hidden
    from the call; for one that asks for min_p at T > 0, every node's target probs filtered as
    SGLang's plain sampler filters them (`tree.penalties.min_p_filter_`); every other call as it
    came (SGLang's further arguments, UNO's and the watermark's, passed on as they came).
    runtime: the process's runtime.Runtime, bound at install; its `penalties` is the worker's
    table (None: off, or no worker pool yet)."""
    table = runtime.penalties
    visibility = getattr(verify_input, "tree_visibility", None)
    info = batch.sampling_info
    ddtree = table is not None and visibility is not None  # a DDTREE verify, the switch on
    penalise = ddtree and wanted(batch.reqs)
    min_p = ddtree and bool(getattr(info, "need_min_p_sampling", False))
    if not (penalise or min_p):
        return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    saved = info.acc_additive_penalties, info.acc_scaling_penalties
    with contextlib.ExitStack() as stack:
        if penalise:
            bs, N = visibility.shape[:2]
            table.penalize_(
                logits_output.next_token_logits.view(bs, N, -1),
                batch.reqs,
                batch.req_pool_indices,
                verify_input.tree_tokens,
                visibility,
                verify_input.tree_depth,
            )
            info.acc_additive_penalties = info.acc_scaling_penalties = None
            stack.callback(_restore, info, saved)
        if min_p:  # in place on SGLang's target probs, which the sampling kernel reads last
            stack.enter_context(
                compat.tree_sampling_probs(partial(min_p_filter_, min_ps=info.min_ps))
            )
        return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)


def _restore(info, saved) -> None:
    info.acc_additive_penalties, info.acc_scaling_penalties = saved


def stop_tokens(req, vocab: int) -> list[int]:
    """A request's stop tokens as SGLang's min_new_tokens penalizer takes them (stop_token_ids,
    the model's EOS ids (SGLang 0.5.23's penalizer joins Req.eos_token_ids), the tokenizer's
    additional stop tokens and its EOS), those in [0, vocab)."""
    tok = getattr(req, "tokenizer", None)
    stops = set(req.sampling_params.stop_token_ids or ())
    stops |= set(getattr(req, "eos_token_ids", None) or ())
    stops |= set(getattr(tok, "additional_stop_token_ids", None) or ())
    if getattr(tok, "eos_token_id", None) is not None:
        stops.add(tok.eos_token_id)
    return sorted(s for s in stops if s is not None and 0 <= s < vocab)


def _device(values: list, device, dtype=torch.int64) -> torch.Tensor:
    """A small host list on the device without a sync (pinned, non-blocking where there is a
    GPU)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
