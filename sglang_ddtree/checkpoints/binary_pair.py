"""A target and a DFlash draft that agree by construction, so every round accepts deep paths
through side branches: the test pair that exercises acceptance and state commit end to end.

The target (any tiny writer's checkpoint, all its layers left random) is made to speak a
two-token language {c0, c1}: a constant feature `BIAS_DIM` (every embedding carries it) lifts
c0 and c1 far above every other token, and the sign of the final hidden state's `DECISION_DIM`
picks between them. That sign is computed by the random attention / Gated DeltaNet layers from
the whole context, so the continuation is a context-dependent binary sequence with wide margins
(few bf16 near-ties).

The draft's layers are silenced (zero output projections), so its block hidden states are the
target's embeddings of [bonus, MASK...]; its final norm drops `DECISION_DIM`, so c0 and c1 tie
for first at every position. DDTree then builds a balanced binary tree (budget 31: complete to
depth 4), and whatever binary path the target takes, the walk follows it ~4 levels down,
through rank-0 and rank-1 children alike.

Its DFlash2 draft (`write_binary_dflash2`) is that draft with a random candidate selector over
the same K = 4 candidates: the selector's transition scores (a few tenths of a nat) break the
c0/c1 tie differently after each predecessor, so the tree DDTREE builds is the drafter's chain
(tree/lattice.py), not the balanced one, while the target's token stays among the two
candidates that carry the mass at every position.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from sglang_ddtree.checkpoints import tiny

BIAS_DIM, DECISION_DIM = 0, 1
BINARY_TOKENS = (100, 101)  # ordinary BPE ids in every tiny tokenizer (specials are 0..7)


def write_binary_pair(
    root: str | Path, arch: str = "qwen3", seed: int = 0, lift: float = 30.0, gain: float = 6.0
) -> tuple[Path, Path]:
    """Write `root/<arch>-binary` (target) and `root/<arch>-binary-dflash` (draft)."""
    root = Path(root)
    target = root / f"{arch}-binary"
    draft = root / f"{arch}-binary-dflash"
    writer = {"qwen3": tiny.write_tiny_qwen3, "qwen35": tiny.write_tiny_qwen35}[arch]
    writer(target, seed=seed)
    tiny.write_tiny_dflash(draft, target, seed=seed + 1, num_layers=1)
    _make_binary_target(target, lift, gain)
    _silence_draft(draft)
    return target, draft


def write_binary_dflash2(
    root: str | Path, arch: str = "qwen3", seed: int = 0, selector_top_k: int = 4
) -> Path:
    """Write `root/<arch>-binary-dflash2`: the binary draft of `write_binary_pair` (written
    first if missing) with a candidate selector of rank 8 over `selector_top_k` candidates
    (tiny.add_candidate_selector, seed + 2)."""
    root = Path(root)
    draft = root / f"{arch}-binary-dflash"
    if not (draft / "config.json").exists():
        write_binary_pair(root, arch, seed)
    out = root / f"{arch}-binary-dflash2"
    shutil.copytree(draft, out, dirs_exist_ok=True)
    return tiny.add_candidate_selector(out, 8, selector_top_k, seed + 2)


def _make_binary_target(target: Path, lift: float, gain: float, bias: float = 0.5) -> None:
    path = target / "model.safetensors"
    w = load_file(path)
    prefix = (
        "model.language_model." if "model.language_model.embed_tokens.weight" in w else "model."
    )
    embed, head = w[prefix + "embed_tokens.weight"], w["lm_head.weight"]
    c0, c1 = BINARY_TOKENS
    # Every token carries the bias feature, and no layer writes to it, so it is constant.
    embed[:, BIAS_DIM] = bias * embed.norm(dim=1).mean()
    for name, tensor in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")):
            tensor[BIAS_DIM] = 0.0
    embed[[c0, c1], DECISION_DIM] = 0.0  # the decision comes from the layers, not the token
    scale = head.norm(dim=1).mean()
    head[:, BIAS_DIM] = -lift * scale  # every other token is pushed far down ...
    head[[c0, c1]] = 0.0
    head[[c0, c1], BIAS_DIM] = lift * scale  # ... and c0, c1 far up
    head[c0, DECISION_DIM] = gain * scale
    head[c1, DECISION_DIM] = -gain * scale
    norm = w[prefix + "norm.weight"]  # final norm: unit gain on both features
    unit = 0.0 if prefix == "model.language_model." else 1.0  # Qwen3.5 norms scale by 1 + w
    norm[[BIAS_DIM, DECISION_DIM]] = unit
    _calm_gated_deltanet(w)
    save_file(w, str(path), metadata={"format": "pt"})


def _calm_gated_deltanet(w: dict) -> None:
    """Give the Gated DeltaNet layers (Qwen3.5 only) a realistic, mild decay.

    The tiny writer's random A_log (mean 1.5, std 1.6) and in_proj_a (std 0.2) make the per-step
    log-decay g = -exp(A_log) * softplus(a + dt_bias) reach -100: a float32 model still decodes
    fine, but the chunked prefill kernel then loses everything in bf16 (on CPU the teacher-forced
    and decoded log-probs of the greedy token differed by up to 10 nats; on the H200 the plain
    server disagreed with itself by 7.4). With A = 1, dt_bias = -4 and in_proj_a / 10, g stays
    near -0.02 (trained Qwen3.5 decays are of that order) and the same check gives 0.0 nats.
    """
    for name, tensor in w.items():
        if name.endswith("linear_attn.A_log"):
            tensor.fill_(0.0)
        elif name.endswith("linear_attn.dt_bias"):
            tensor.fill_(-4.0)
        elif name.endswith("linear_attn.in_proj_a.weight"):
            tensor.mul_(0.1)


def _silence_draft(draft: Path) -> None:
    path = draft / "model.safetensors"
    w = load_file(path)
    for name, tensor in w.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
    w["norm.weight"][DECISION_DIM] = 0.0  # c0 and c1 tie for every draft position
    w["norm.weight"][BIAS_DIM] = 1.0
    save_file(w, str(path), metadata={"format": "pt"})
    cfg = json.loads((draft / "config.json").read_text())
    cfg["binary_pair"] = {"tokens": list(BINARY_TOKENS), "decision_dim": DECISION_DIM}
    (draft / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def binary_fraction(tokens: list[int]) -> float:
    """Share of generated tokens that belong to the two-token language."""
    return sum(t in BINARY_TOKENS for t in tokens) / max(len(tokens), 1)
