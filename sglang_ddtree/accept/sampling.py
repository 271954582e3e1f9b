"""Target-token sampling per tree node: static shapes, no host synchronisation.

Per request b (all N nodes share its settings):
- temperature[b] == 0: greedy, argmax of the raw logits (lowest index on ties, as torch.argmax).
- otherwise: p = softmax(logits / T); top-k keeps the k most probable tokens (ties broken by
  lower token id; k <= 0 or k >= V keeps all); the kept mass is renormalised; top-p then keeps
  the smallest most-probable-first prefix whose mass reaches top_p (the first token always
  stays; top_p >= 1 keeps all); one token is drawn from the renormalised remainder.
Draws use the exponential race argmax(p_i / E_i), E_i ~ Exp(1) iid, which picks i with
probability p_i / sum(p) and needs neither multinomial nor a sync.
"""

from __future__ import annotations

import torch


def _check_sampling_inputs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a [bs, N, V] tensor, got {shape}")
    bs = logits.shape[0]
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    for name, t, is_float in (
        ("temperature", temperature, True),
        ("top_p", top_p, True),
        ("top_k", top_k, False),
    ):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (bs,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a [bs={bs}] tensor, got {shape}")
        if t.dtype.is_floating_point != is_float:
            kind = "floating point" if is_float else "an integer tensor"
            raise ValueError(f"{name} must be {kind}, got {t.dtype}")


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (probs [bs, N, V] f32 unnormalised after top-k/top-p, in sorted order; token ids).

    Rows with temperature 0 are computed at T = 1 (callers take the argmax for them).
    """
    bs, N, V = logits.shape
    t = torch.where(temperature > 0, temperature, 1.0).float()  # [bs]
    scaled = logits.float() / t[:, None, None]  # [bs, N, V]
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device)  # [V]
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k)  # [bs]
    keep_k = rank < k[:, None, None]  # [bs, 1, V]
    probs = torch.softmax(sorted_logits.masked_fill(~keep_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [bs, N, V]
    top_p = top_p.float()[:, None, None]  # [bs, 1, 1]
    keep_p = (
        (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    )  # rounding can't drop a token at p=1
    return probs.masked_fill(~keep_p, 0.0), sorted_ids


def sample_target_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [bs, N, V], temperature [bs] f32, top_p [bs] f32, top_k [bs] int -> [bs, N] int64."""
    _check_sampling_inputs(logits, temperature, top_p, top_k)
    greedy = logits.argmax(dim=-1)  # [bs, N]
    probs, sorted_ids = filtered_probs(logits, temperature, top_p, top_k)
    race = torch.empty_like(probs).exponential_(generator=generator)  # [bs, N, V] Exp(1)
    race = race.clamp_(min=torch.finfo(race.dtype).tiny)
    choice = (probs / race).argmax(dim=-1, keepdim=True)  # [bs, N, 1] index in sorted order
    sampled = sorted_ids.gather(-1, choice).squeeze(-1)  # [bs, N]
    return torch.where(temperature[:, None] > 0, sampled, greedy)
