"""Sampling penalties per tree node, exactly (the reference engine, and the server through
round/penalties.py with SGLANG_DDTREE_PENALTIES=1).

A node's distribution must be the request's distribution given the path to that node. The
frequency, presence and repetition penalties depend on which tokens the context holds, and in a
tree that context is the request's output so far plus the node's own path. SGLang's penalizers
apply one count vector to every draft position, which is exact for a chain's first position
only. Here the shared counts are applied to every node as SGLang would, and then each token
that occurs on a node's path gets its value recomputed from the raw logit with the count that
path gives it. No host sync, static shapes (CUDA-graph safe).

Conventions (SGLang's penalizers, as its overlap scheduler applies them): `counts`
[bs, V] are the output tokens so far, including the root (the last committed token), so a node's
path adds nodes 1..i; the repetition penalty looks at the output tokens too (`seen`, default
counts > 0: SGLang's BatchedRepetitionPenalizer cumulates output tokens only). Order: first
x -= frequency * count + presence * (count > 0), then the repetition penalty on the result
(x * r for x < 0, x / r otherwise), as SamplingBatchInfo.apply_logits_bias adds
acc_additive_penalties before it applies acc_scaling_penalties.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Penalties:
    """A request's penalties, in SGLang's sampling-parameter terms: frequency_penalty,
    presence_penalty (output tokens), repetition_penalty (output tokens, as SGLang; 1: off),
    min_new_tokens (EOS blocked before that many generated tokens)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.repetition <= 0 or self.min_tokens < 0:
            raise ValueError(f"need repetition > 0 and min_tokens >= 0, got {self}")


class PenaltyState:
    """One request's penalty context as decoding goes: output-token counts and the tokens the
    repetition penalty sees (the output), and the penalised logits of the next token
    after the output so far (`step`) or after every node of a tree (`tree`). Host-driven, for
    the reference engine (the server would keep the same tensors on the device)."""

    def __init__(
        self, penalties: Penalties, prompt: torch.Tensor, vocab: int, eos_ids: list[int]
    ) -> None:
        device = prompt.device
        self.penalties = penalties
        self.counts = torch.zeros(1, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(1, vocab, dtype=torch.bool, device=device)  # output tokens
        self.output_len = 0
        self.eos = torch.tensor(eos_ids or [0], dtype=torch.long, device=device)
        self.block_eos = bool(eos_ids) and penalties.min_tokens > 0
        p = penalties
        self._fpr = [
            torch.tensor([x], dtype=torch.float32, device=device)
            for x in (p.frequency, p.presence, p.repetition)
        ]

    def observe(self, tokens: list[int]) -> None:
        """Tokens just emitted (in order)."""
        for t in tokens:
            self.counts[0, t] += 1
            self.seen[0, t] = True
        self.output_len += len(tokens)

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """[1, V] logits of the next token after the output so far, penalised."""
        depth = torch.zeros(1, 1, dtype=torch.long, device=logits.device)
        return self._min_tokens(self._shared(logits[None]), depth)[0]

    def tree(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        visibility: torch.Tensor,
        depth: torch.Tensor,
    ) -> torch.Tensor:
        """[N, V] logits of every node's next token (one request's tree: tokens [1, N],
        visibility [1, N, N], depth [1, N]; its root is the last emitted token), each with the
        penalties of its own path."""
        out = penalize_tree(
            logits[None], tokens, visibility, self.counts, *self._fpr, seen=self.seen
        )
        return self._min_tokens(out, depth)[0]

    def _shared(self, logits: torch.Tensor) -> torch.Tensor:
        f, p, r = (x[:, None, None] for x in self._fpr)
        return penalize(logits, self.counts[:, None], self.seen[:, None], f, p, r)

    def _min_tokens(self, logits: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        if not self.block_eos:
            return logits
        n = torch.tensor([self.output_len], device=logits.device)
        floor = torch.tensor([self.penalties.min_tokens], device=logits.device)
        return suppress_eos_before_min_tokens(logits, depth, n, floor, self.eos)


def penalize(
    x: torch.Tensor,
    count: torch.Tensor,
    seen: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """The penalties on logits x given each token's count and seen flag (broadcasting; the
    penalty tensors broadcast against x)."""
    x = x - (frequency * count + presence * (count > 0).to(x.dtype))  # SGLang: one sum, added
    return torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)


def penalize_tree(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    visibility: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """[bs, N, V] logits of every node's next token with the penalties its own path gives.

    logits [bs, N, V] raw; tokens [bs, N] the nodes' tokens (node 0 the root); visibility
    [bs, N, N] bool, [b, i, j] = j is i or an ancestor of i (DraftTree.visibility); counts
    [bs, V] output-token counts so far (root included); frequency / presence / repetition [bs]
    (0, 0, 1: off); seen [bs, V] bool (default counts > 0)."""
    counts = counts.to(logits.dtype)
    seen = counts > 0 if seen is None else seen
    f, p, r = (t.to(logits.dtype)[:, None, None] for t in (frequency, presence, repetition))
    shared = penalize(logits, counts[:, None, :], seen[:, None, :], f, p, r)
    m, idx, path_value = _on_paths(logits, tokens, visibility, counts, f, p, r)
    # every j with the same token writes the same value at (i, token), so the scatter is exact
    return shared.scatter(2, idx, torch.where(m > 0, path_value, shared.gather(2, idx)))


def _on_paths(logits, tokens, visibility, counts, f, p, r):
    """For penalize_tree(_): m [bs, N, N] (how often node j's token occurs on node i's path,
    nodes 1..i), idx (node j's token at [b, i, j]) and the penalised value of each such token
    at node i with its path's count, from the raw logits."""
    bs, N, _ = logits.shape
    on_path = visibility.clone()
    on_path[:, :, 0] = False  # the root's token is in `counts` already
    same = tokens[:, :, None] == tokens[:, None, :]  # [bs, N, N]
    m = torch.bmm(on_path.to(logits.dtype), same.to(logits.dtype))
    idx = tokens[:, None, :].expand(bs, N, N)
    path_value = penalize(
        logits.gather(2, idx),
        counts.gather(1, tokens)[:, None, :] + m,
        torch.ones_like(m, dtype=torch.bool),
        f,
        p,
        r,
    )
    return m, idx, path_value


# the most bytes penalize_tree_'s [requests, N, V] temporaries (a float and a bool) may take:
# larger batches are penalised a few requests at a time (Qwen3.6-27B's 248,320-token vocabulary
# at N = 64 is 79 MB per request; 16 requests at once would be 1.3 GB beside SGLang's logits)
TEMP_BYTES = 256 << 20


def penalize_tree_(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    visibility: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
    temp_bytes: int = TEMP_BYTES,
) -> torch.Tensor:
    """`penalize_tree` in place on logits (the server's float32 verify logits), the repetition
    penalty over the output tokens (counts > 0): the path tokens' raw values gathered first, the
    shared penalty as broadcast [bs, 1, V] operations, so that a round holds one float and one
    bool [requests, N, V] temporary at a time instead of about ten, over as many requests at
    once as `temp_bytes` holds (at least one; every element's arithmetic is the same either
    way)."""
    bs, N, V = logits.shape
    step = max(1, temp_bytes // max(N * V * (logits.element_size() + 1), 1))
    if bs > step:
        for lo in range(0, bs, step):
            hi = min(lo + step, bs)
            penalize_tree_(
                logits[lo:hi],
                tokens[lo:hi],
                visibility[lo:hi],
                counts[lo:hi],
                frequency[lo:hi],
                presence[lo:hi],
                repetition[lo:hi],
                temp_bytes,
            )
        return logits
    counts = counts.to(logits.dtype)
    f, p, r = (t.to(logits.dtype)[:, None, None] for t in (frequency, presence, repetition))
    m, idx, path_value = _on_paths(logits, tokens, visibility, counts, f, p, r)  # raw logits
    seen = counts[:, None, :] > 0  # [bs, 1, V]
    logits.sub_(f * counts[:, None, :] + p * seen.to(logits.dtype))
    r_seen = torch.where(seen, r, torch.ones_like(r))
    negative = logits < 0
    logits.mul_(torch.where(negative, r_seen, 1.0))  # x * r below zero (x * 1 is exact)
    logits.div_(torch.where(negative, 1.0, r_seen))  # x / r from zero up
    del negative
    logits.scatter_(2, idx, torch.where(m > 0, path_value, logits.gather(2, idx)))
    return logits


def suppress_eos_before_min_tokens(
    logits: torch.Tensor,
    depth: torch.Tensor,
    output_len: torch.Tensor,
    min_tokens: torch.Tensor,
    eos_ids: torch.Tensor,
) -> torch.Tensor:
    """min_tokens per node: a node at depth d follows output_len + d generated tokens (the root
    at depth 0 is the last of output_len), so its next token may be an EOS only once
    output_len + d >= min_tokens. logits [bs, N, V]; depth [bs, N]; output_len, min_tokens [bs];
    eos_ids [E] (padded with any EOS id)."""
    early = (output_len[:, None] + depth) < min_tokens[:, None]  # [bs, N]
    out = logits.clone()
    eos = eos_ids[None, None, :].expand(*depth.shape, eos_ids.numel())
    blocked = torch.where(early[:, :, None], float("-inf"), out.gather(2, eos))
    return out.scatter(2, eos, blocked)


def requests_at_once(
    num_nodes: int, vocab: int, bytes_per_value: int, temp_bytes: int = TEMP_BYTES
) -> int:
    """How many requests' [N, V] temporaries of `bytes_per_value` bytes a value fit in
    `temp_bytes` (at least one: a single request's are taken whatever their size)."""
    return max(1, temp_bytes // max(num_nodes * vocab * bytes_per_value, 1))


def min_p_filter_(
    probs: torch.Tensor, min_ps: torch.Tensor, temp_bytes: int = TEMP_BYTES
) -> torch.Tensor:
    """SGLang's min-p in place on every node's target probs [bs, N, V]: a token below min_p x
    its node's largest probability is dropped and the rest renormalised (flashinfer's
    min_p_sampling_from_probs samples the same tokens in the same proportions); requests with
    min_p 0 untouched. min_ps [bs] on probs' device. Worked a few requests at a time, so a round
    holds one bool [requests, N, V] temporary within `temp_bytes` (no host sync)."""
    bs, N, V = probs.shape
    step = requests_at_once(N, V, 1, temp_bytes)
    for lo in range(0, bs, step):
        p, m = probs[lo : lo + step], min_ps[lo : lo + step].to(probs.dtype)[:, None, None]
        p.masked_fill_(p < p.amax(-1, keepdim=True) * m, 0.0)
        p.div_(torch.where(m > 0, p.sum(-1, keepdim=True), 1.0))
    return probs


def block_stops_(
    logits: torch.Tensor, early: torch.Tensor, stops: torch.Tensor, temp_bytes: int = TEMP_BYTES
) -> torch.Tensor:
    """min_new_tokens in place: -inf on every stop token of a node that may not stop yet.
    logits [bs, N, V]; early [bs, N] bool (the node's output + depth below the floor); stops
    [bs, V] bool (each request's stop tokens). A few requests at a time: one bool
    [requests, N, V] temporary within `temp_bytes`."""
    bs, N, V = logits.shape
    step = requests_at_once(N, V, 1, temp_bytes)
    for lo in range(0, bs, step):
        hi = lo + step
        logits[lo:hi].masked_fill_(early[lo:hi, :, None] & stops[lo:hi, None, :], float("-inf"))
    return logits
