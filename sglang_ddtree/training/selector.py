"""A DFlash2 drafter for a trained pair: the pair's DFlash draft, frozen, plus a trained
candidate selector (SGLang 0.5.23's `CandidateSelector`; docs/dflash2.md, section 1).

What is trained. The backbone stays the DFlash draft as trained, so the DFlash2 drafter's
per-position distributions, and so its top-K candidates, are the DFlash draft's own: the
selector is the only difference between the two drafters, and any change in acceptance is its.
Its three tensors, under SGLang's checkpoint names:

  candidate_selector.predecessor_codebook     A [V, r]  zeros at the start
  candidate_selector.successor_codebook       S [V, r]  N(0, init_std)
  candidate_selector.hidden_projection.weight W [r, H]  N(0, init_std)

and the score of candidate c at slot e (block row e + 1) after token p, with h_e the draft's
final-normed hidden state of that row and unary_e the raw logits of the target's LM head:

  s_e(p, c) = unary_e(c) + < A[p] * (W h_e), S[c] >           (SGLang's `_score_edges`)

over the top-K of unary_e. A starts at zero, so the untrained selector's rows all equal the
marginal's (the lattice then carries no pairwise information).

Loss. Distillation from the target under teacher forcing: slot e's predecessor is the text's
token x_{a+e} (the anchor itself for slot 0), and its teacher the target's own next-token
distribution p(. | x_{<=a+e}), from the same target pass that gives the draft its context. The
loss is the cross-entropy of q = softmax over the K candidates of s_e(x_{a+e}, .), the
conditional that upstream's walk samples from and that DDTREE's lattice tree ranks children by,
against the target's probabilities of those candidates: -sum_c p(c) log q(c), so that a slot
counts by the target's mass on its candidates (none where the drafter missed every likely
token), weighted exp(-e / gamma) as the draft's block loss. The target and not the text's tokens (the
draft's own labels): a round accepts what the target would emit, and on a small pair the two
often differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_ddtree.training.config import StageHParams
from sglang_ddtree.training.data import sample_anchors, sample_windows
from sglang_ddtree.training.draft import position_weights
from sglang_ddtree.training.draft_model import DFlashDraft, block_labels
from sglang_ddtree.training.loops import StageResult, autocast, train_loop
from sglang_ddtree.training.target import language_model

PREFIX = "candidate_selector."


class Selector(nn.Module):
    """The candidate selector's parameters, named as SGLang's `CandidateSelector` (float32)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edge_query(self, hidden: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], predecessors [..., P] token ids -> A[p] * (W h): [..., P, r]."""
        projected = self.hidden_projection(hidden.float())  # [..., r]
        return self.predecessor_codebook[predecessors] * projected[..., None, :]

    def scores(
        self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor, pred: torch.Tensor
    ) -> torch.Tensor:
        """hidden [..., H], unary and cand [..., K], pred [..., P] -> s(p, c) [..., P, K]."""
        keys = self.successor_codebook[cand]  # [..., K, r]
        edge = torch.einsum("...pr,...cr->...pc", self.edge_query(hidden, pred), keys)
        return unary.float()[..., None, :] + edge


def build_selector(
    vocab_size: int, hidden_size: int, rank: int, top_k: int, seed: int, init_std: float
) -> Selector:
    """A zero predecessor codebook, the other two N(0, init_std) (CPU, float32, seeded)."""
    gen = torch.Generator().manual_seed(seed)
    sel = Selector(vocab_size, hidden_size, rank, top_k)
    with torch.no_grad():
        sel.successor_codebook.normal_(0.0, init_std, generator=gen)
        sel.hidden_projection.weight.normal_(0.0, init_std, generator=gen)
    return sel


def candidates(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (ids [..., K] int64, their raw logits [..., K] float32), by logit."""
    values, ids = torch.topk(logits, top_k, dim=-1, sorted=True)
    return ids, values.float()


def lattice(
    sel: Selector,
    hidden: torch.Tensor,
    unary: torch.Tensor,
    cand: torch.Tensor,
    anchor: torch.Tensor,
) -> torch.Tensor:
    """The served lattice: hidden [n, L, H], unary and cand [n, L, K], anchor [n] ->
    scores [n, L, K, K], slot e's predecessors the candidates of slot e - 1 (the anchor for
    slot 0, so its K rows are equal), as SGLang's `CandidateSelector.build_lattice`."""
    K = cand.shape[-1]
    pred = torch.cat([anchor[:, None, None].expand(-1, 1, K), cand[:, :-1]], dim=1)
    return sel.scores(hidden, unary, cand, pred)


def block_predecessors(ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The text's predecessor of each slot: ids[a..a+B-2] -> [b, nb, B-1]."""
    return block_labels(ids, anchors - 1, block_size)


def candidate_loss(
    scores: torch.Tensor, cand: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores and cand [..., L, K], teacher [..., L, V] (the target's next-token logits for each
    slot), weights [L] -> (the cross-entropy of the softmax over the K candidates against the
    target's probabilities of those candidates, -sum_c p(c) log q(c), so that a slot counts
    by the target's mass on its candidates; weighted over slots, averaged over blocks; that
    mass, averaged over slots)."""
    p = torch.log_softmax(teacher.float(), dim=-1).gather(-1, cand).exp()  # [..., L, K]
    ce = -(p * torch.log_softmax(scores, dim=-1)).sum(-1)  # [..., L]
    blocks = ce.numel() // ce.shape[-1]
    return (ce * weights).sum() / (weights.sum() * blocks), p.sum(-1).mean()


def teacher_forced_loss(
    sel: Selector,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    pred: torch.Tensor,
    teacher: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., L, H], logits and teacher [..., L, V], pred [..., L], weights [L] -> the
    selector's `candidate_loss`, each slot's predecessor the text's token."""
    cand, unary = candidates(logits, sel.top_k)  # [..., L, K]
    scores = sel.scores(hidden, unary, cand, pred[..., None])[..., 0, :]  # [..., L, K]
    return candidate_loss(scores, cand, teacher, weights)


def block_features(
    draft: DFlashDraft, target: nn.Module, ids: torch.Tensor, anchors: torch.Tensor, taps: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target pass and the frozen drafter over block rows 1..B-1: (the draft's
    final-normed hidden [b, nb, L, H], its logits through the target's LM head [b, nb, L, V],
    the target's own next-token logits at positions a..a+B-2 given the text [b, nb, L, V])."""
    L = draft.config.block_size - 1
    head = target.get_output_embeddings()
    with torch.no_grad():
        out = language_model(target)(input_ids=ids, use_cache=False, output_hidden_states=True)
        context = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)  # [b, T, K*H]
        hidden = draft.block_hidden(target.get_input_embeddings(), context, ids, anchors)[:, :, 1:]
        pos = (anchors[:, :, None] + torch.arange(L, device=ids.device)).flatten(1)  # [b, nb*L]
        last = out.last_hidden_state
        picked = last.gather(1, pos[:, :, None].expand(-1, -1, last.shape[-1]))
        return hidden, head(hidden), head(picked).view(*anchors.shape, L, -1)


def train_selector(
    sel: Selector,
    draft: DFlashDraft,
    target: nn.Module,
    taps: list[int],
    stream: torch.Tensor,
    hp: StageHParams,
    budget_s: float,
    device: torch.device,
    seed: int,
) -> StageResult:
    """Train the selector on random windows and anchors, draft and target frozen."""
    gen = torch.Generator().manual_seed(seed)
    target.requires_grad_(False).eval()
    draft.requires_grad_(False).eval()
    sel.to(device)
    B = draft.config.block_size
    weights = position_weights(B, hp.gamma, device)

    def step(_: int) -> tuple[torch.Tensor, int]:
        ids = sample_windows(stream, hp.batch, hp.seq_len, gen).to(device)
        anchors = sample_anchors(hp.batch, hp.seq_len, B, hp.anchors_per_seq, gen).to(device)
        with autocast(device):
            hidden, logits, teacher = block_features(draft, target, ids, anchors, taps)
        pred = block_predecessors(ids, anchors, B)
        loss, _ = teacher_forced_loss(sel, hidden, logits, pred, teacher, weights)
        return loss, hp.batch * hp.anchors_per_seq * (B - 1)

    return train_loop("selector", sel, step, hp, budget_s, device)


# ----------------------------------------------------------------------------- checkpoint


def save_dflash2(draft_dir: Path, sel: Selector, out: Path) -> dict:
    """The DFlash2 drafter: the draft's config and weights as they are, the selector's three
    tensors added (bf16, as the draft's) and its rank and K in `dflash_config`; the
    architecture SGLang 0.5.23 builds `DFlash2DraftModel` for. Returns the config."""
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"] = {
        **cfg["dflash_config"],
        "selector_rank": int(sel.predecessor_codebook.shape[1]),
        "selector_top_k": sel.top_k,
    }
    weights = load_file(str(Path(draft_dir) / "model.safetensors"))
    for name, value in sel.state_dict().items():
        weights[PREFIX + name] = value.detach().to("cpu", torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def load_selector(path: Path, dtype: torch.dtype = torch.float32) -> Selector:
    """The selector of a saved DFlash2 drafter (weights upcast to `dtype`, strict names)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    state = {
        k[len(PREFIX) :]: v
        for k, v in load_file(str(Path(path) / "model.safetensors")).items()
        if k.startswith(PREFIX)
    }
    V, r = state["predecessor_codebook"].shape
    sel = Selector(V, cfg["hidden_size"], r, int(cfg["dflash_config"]["selector_top_k"]))
    sel.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return sel.to(dtype)
