"""Draft training with the target frozen, and the acceptance proxy on held-out text.

Training step (one batch of windows [b, T]):
  taps    the frozen target's hidden states of layers `target_layer_ids` (HF convention
          hidden_states[id + 1]), concatenated per token: [b, T, K*H]
  blocks  nb random anchors a per window (1 <= a <= T-B); block = [x_a, MASK x (B-1)], context =
          taps of positions < a only (see draft_model.block_visibility)
  loss    cross-entropy of block rows i = 1..B-1 against x_{a+i}, through the target's frozen
          lm_head and embeddings, weighted exp(-(i-1)/gamma) and normalised by the weight sum
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_ddtree.training.config import StageHParams
from sglang_ddtree.training.data import sample_anchors, sample_windows
from sglang_ddtree.training.draft_model import DFlashDraft, block_labels
from sglang_ddtree.training.loops import StageResult, autocast, train_loop
from sglang_ddtree.training.target import language_model


def target_taps(target: nn.Module, ids: torch.Tensor, tap_ids: list[int]) -> torch.Tensor:
    """ids [b, T] -> taps [b, T, K*H]: outputs of target layers `tap_ids`, concatenated."""
    out = language_model(target)(input_ids=ids, use_cache=False, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in tap_ids], dim=-1)


def position_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[B-1] loss weights exp(-(i-1)/gamma) for block rows i = 1..B-1."""
    i = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(i - 1) / gamma)


def weighted_block_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """logits [b, nb, B-1, V], labels [b, nb, B-1], weights [B-1] -> weighted mean CE."""
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none")
    ce = ce.view_as(labels)  # [b, nb, B-1]
    return (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])


def draft_loss(
    draft: DFlashDraft,
    target: nn.Module,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    tap_ids: list[int],
    gamma: float,
) -> torch.Tensor:
    """The training loss of one batch: ids [b, T], anchors [b, nb]."""
    with torch.no_grad():
        taps = target_taps(target, ids, tap_ids)  # [b, T, K*H]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    logits = draft.block_logits(embed, head, taps, ids, anchors)  # [b, nb, B-1, V]
    labels = block_labels(ids, anchors, draft.config.block_size)
    return weighted_block_loss(
        logits, labels, position_weights(draft.config.block_size, gamma, ids.device)
    )


def train_draft(
    draft: DFlashDraft,
    target: nn.Module,
    tap_ids: list[int],
    stream: torch.Tensor,
    hp: StageHParams,
    budget_s: float,
    device: torch.device,
    seed: int,
) -> StageResult:
    """Train the draft on random windows and anchors (one seeded generator for both)."""
    gen = torch.Generator().manual_seed(seed)
    target.requires_grad_(False).eval()
    draft.to(device)
    bs = draft.config.block_size

    def step(_: int) -> tuple[torch.Tensor, int]:
        ids = sample_windows(stream, hp.batch, hp.seq_len, gen)
        anchors = sample_anchors(hp.batch, hp.seq_len, bs, hp.anchors_per_seq, gen)
        with autocast(device):
            loss = draft_loss(draft, target, ids.to(device), anchors.to(device), tap_ids, hp.gamma)
        return loss, hp.batch * hp.anchors_per_seq * (bs - 1)

    return train_loop("draft", draft, step, hp, budget_s, device)


# ----------------------------------------------------------------------------- acceptance proxy


def _target_argmax_at(target: nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ids [r, T], pos [r, m] -> the target's argmax next token after each position: [r, m]."""
    hidden = language_model(target)(input_ids=ids, use_cache=False).last_hidden_state
    picked = hidden.gather(1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [r, m, H]
    return target.get_output_embeddings()(picked).argmax(-1)


def _chain_accepts(
    target: nn.Module, ids: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """Greedy chain acceptance per block: ids [b, T], anchors [b, nb], drafts [b, nb, B-1].

    The block's draft tokens replace ids[a+1..a+B-1]; the target (one causal pass) checks them
    in order. Returns accepted draft tokens [b, nb] (0..B-1); acceptance length = that + 1.
    """
    b, nb, m = drafts.shape
    rows = ids.repeat_interleave(nb, 0)[:, : int(anchors.max()) + m + 1].clone()  # [b*nb, L]
    a = anchors.reshape(-1, 1)  # [b*nb, 1]
    span = a + torch.arange(m, device=ids.device)  # [b*nb, B-1]: positions a..a+B-2
    rows.scatter_(1, span + 1, drafts.reshape(-1, m))
    verdict = _target_argmax_at(target, rows, span)  # [b*nb, B-1]
    match = (verdict == drafts.reshape(-1, m)).long()
    return match.cumprod(dim=1).sum(dim=1).view(b, nb)


@torch.no_grad()
def acceptance_proxy(
    draft: DFlashDraft,
    target: nn.Module,
    tap_ids: list[int],
    windows: torch.Tensor,
    anchors: torch.Tensor,
    batch: int,
    device: torch.device,
) -> dict:
    """Draft quality on held-out windows [n, T] with fixed anchors [nb] (greedy).

    top1_vs_text[i]    P(draft top-1 at block row i+1 == the held-out token)
    top1_vs_target[i]  P(draft top-1 == the target's argmax given the true prefix)
    chain_accept_len   mean greedy chain-DFlash acceptance length (accepted draft tokens + the
                       bonus) with the held-out prefix as context; histogram over 1..B
    """
    draft.eval()
    bs = draft.config.block_size
    hits_text = torch.zeros(bs - 1)
    hits_target = torch.zeros(bs - 1)
    accept_hist = torch.zeros(bs, dtype=torch.long)
    blocks = 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch].to(device)  # [w, T]
        a = anchors.to(device)[None].expand(ids.shape[0], -1)  # [w, nb]
        with autocast(device):
            taps = target_taps(target, ids, tap_ids)
            top1 = draft.block_logits(
                target.get_input_embeddings(), target.get_output_embeddings(), taps, ids, a
            ).argmax(-1)  # [w, nb, B-1]
            pos = (a[:, :, None] + torch.arange(bs - 1, device=device)).flatten(1)  # a..a+B-2
            teacher = _target_argmax_at(target, ids, pos).view_as(top1)
            accepted = _chain_accepts(target, ids, a, top1)  # [w, nb]
        hits_text += (top1 == block_labels(ids, a, bs)).sum((0, 1)).float().cpu()
        hits_target += (top1 == teacher).sum((0, 1)).float().cpu()
        accept_hist += torch.bincount(accepted.flatten().cpu(), minlength=bs)
        blocks += top1.shape[0] * top1.shape[1]
    lengths = torch.arange(1, bs + 1, dtype=torch.float32)
    return {
        "blocks": blocks,
        "top1_vs_text": (hits_text / blocks).tolist(),
        "top1_vs_target": (hits_target / blocks).tolist(),
        "chain_accept_len": float((accept_hist.float() * lengths).sum() / blocks),
        "chain_accept_len_hist": accept_hist.tolist(),
    }
