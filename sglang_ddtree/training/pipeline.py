"""corpus -> tokenizer -> target -> draft -> evaluation, writing DIR/{target,draft,report.json}.

Stages hand over through the saved checkpoints: the draft trains against the target *as saved*
(bf16 weights, upcast), and the evaluation reads both back, so the numbers describe the files
that ship.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_ddtree.training.config import Recipe, h200_recipe, toy_recipe, with_steps
from sglang_ddtree.training.corpus import Corpus, build_corpus
from sglang_ddtree.training.data import encode_documents, eval_windows, fixed_anchors
from sglang_ddtree.training.draft import acceptance_proxy, train_draft
from sglang_ddtree.training.draft_model import build_draft, draft_config, load_draft, save_draft
from sglang_ddtree.training.target import (
    build_target,
    heldout_loss,
    load_target,
    param_count,
    save_target,
    target_config,
    train_target,
)
from sglang_ddtree.training.tokenizer import (
    MASK_TOKEN,
    special_ids,
    tokenizer_bytes,
    train_tokenizer,
)


@dataclass(frozen=True)
class RunArgs:
    out: Path
    minutes: float = 10.0  # training budget (target + draft); corpus, tokenizer, eval extra
    seed: int = 0
    device: str = "cuda"
    toy: bool = False
    target_steps: int | None = None
    draft_steps: int | None = None
    total_minutes: float | None = None  # wall-clock cap on the whole run (see training_budget)


EVAL_RESERVE_S = 45.0  # saving, reloading and both evaluations, kept out of a total_minutes cap


def training_budget(args: RunArgs, elapsed_s: float) -> float:
    """Seconds for target + draft training: --minutes, shortened so that a --total-minutes run
    still has EVAL_RESERVE_S left after training (corpus and tokenizer took `elapsed_s`)."""
    budget = args.minutes * 60.0
    if args.total_minutes is not None:
        budget = min(budget, args.total_minutes * 60.0 - elapsed_s - EVAL_RESERVE_S)
    if budget <= 0:
        raise RuntimeError(
            f"no time left to train: --total-minutes {args.total_minutes} but preparation took "
            f"{elapsed_s:.0f} s and evaluation needs {EVAL_RESERVE_S:.0f} s"
        )
    return budget


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seed every RNG and ask torch for deterministic kernels; restore the global flags after."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
    )
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark = saved[2]


class _Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - t, 3)


def _tokenizer_texts(corpus: Corpus, cap: int) -> list[str]:
    """The first `cap` bytes of training documents (already in seeded order)."""
    texts, total = [], 0
    for _, text in corpus.train:
        if total >= cap:
            break
        texts.append(text)
        total += len(text.encode("utf-8"))
    return texts


def file_sizes(target_dir: Path, draft_dir: Path, limit: int) -> dict:
    """Bytes of the shipped weights and tokenizer; raises if they exceed `limit`."""
    target_w = sum(f.stat().st_size for f in target_dir.glob("*.safetensors"))
    draft_w = sum(f.stat().st_size for f in draft_dir.glob("*.safetensors"))
    tok = tokenizer_bytes(target_dir)
    total = target_w + draft_w + tok
    if total > limit:
        raise RuntimeError(
            f"target {target_w} + draft {draft_w} + tokenizer {tok} = {total} bytes exceeds the "
            f"limit {limit}; shrink the recipe"
        )
    return {
        "target_safetensors": target_w,
        "draft_safetensors": draft_w,
        "tokenizer": tok,
        "total": total,
        "limit": limit,
        "total_mib": round(total / 2**20, 3),
    }


def check_planned_size(target_params: int, draft_params: int, tok_bytes: int, limit: int) -> int:
    """bf16 bytes of the planned pair + tokenizer; raises before training if over the limit."""
    planned = 2 * (target_params + draft_params) + tok_bytes
    if planned > limit:
        raise RuntimeError(
            f"planned sizes: 2 x ({target_params} target + {draft_params} draft params) + "
            f"{tok_bytes} tokenizer bytes = {planned} > {limit}; shrink the recipe"
        )
    return planned


def _versions() -> dict:
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def run(args: RunArgs) -> dict:
    """Run the whole recipe; returns the report (also written to DIR/report.json)."""
    recipe = with_steps(
        toy_recipe() if args.toy else h200_recipe(), args.target_steps, args.draft_steps
    )
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda was asked for but CUDA is not available; use --device cpu"
        )
    with deterministic(args.seed):
        return _run(args, recipe, device)


def _run(args: RunArgs, recipe: Recipe, device: torch.device) -> dict:
    clock, out = _Clock(), Path(args.out)
    target_dir, draft_dir = out / "target", out / "draft"
    out.mkdir(parents=True, exist_ok=True)
    with clock("corpus"):
        corpus = build_corpus(recipe.corpus, args.seed)
    (out / "heldout_packages.json").write_text(json.dumps(corpus.heldout_packages, indent=1) + "\n")
    with clock("tokenizer"):
        texts = _tokenizer_texts(corpus, recipe.tokenizer_train_bytes)
        tokenizer = train_tokenizer(texts, recipe.vocab_size, target_dir)
        ids = special_ids(tokenizer)
    with clock("encode"):
        train_stream = encode_documents(tokenizer, corpus.train, recipe.chat_fraction, args.seed)
        heldout_stream = encode_documents(tokenizer, corpus.heldout, 0.0, 0)
    vocab = len(tokenizer)
    tcfg = target_config(recipe.target, vocab, ids, recipe.init_std)
    dcfg = draft_config(tcfg["text_config"], recipe.draft, ids[MASK_TOKEN])
    target = build_target(tcfg, args.seed)
    draft = build_draft(dcfg, args.seed + 1, recipe.init_std)
    planned = check_planned_size(
        param_count(target),
        param_count(draft),
        tokenizer_bytes(target_dir),
        recipe.size_limit_bytes,
    )
    budget = training_budget(args, time.perf_counter() - clock.start)
    t_train = time.perf_counter()
    with clock("target_train"):
        tres = train_target(
            target,
            train_stream,
            recipe.target_train,
            recipe.target_share * budget,
            device,
            args.seed,
        )
        save_target(target, target_dir)
    del target
    target = load_target(target_dir, device)
    with clock("target_eval"):
        windows = eval_windows(heldout_stream, recipe.eval_windows, recipe.target_train.seq_len + 1)
        held = heldout_loss(target, windows, recipe.eval_batch, device)
    draft_budget = max(0.0, budget - (time.perf_counter() - t_train))
    taps = list(dcfg["dflash_config"]["target_layer_ids"])
    with clock("draft_train"):
        dres = train_draft(
            draft,
            target,
            taps,
            train_stream,
            recipe.draft_train,
            draft_budget,
            device,
            args.seed + 1,
        )
        save_draft(draft, dcfg, draft_dir)
    draft = load_draft(draft_dir).to(device)
    with clock("accept_eval"):
        acc_windows = eval_windows(
            heldout_stream, recipe.accept_windows, recipe.draft_train.seq_len
        )
        anchors = fixed_anchors(
            recipe.draft_train.seq_len, recipe.draft.block_size, recipe.accept_anchors
        )
        accept = acceptance_proxy(
            draft, target, taps, acc_windows, anchors, recipe.eval_batch, device
        )
    report = {
        "args": {**asdict(args), "out": str(args.out)},
        "recipe": asdict(recipe),
        "versions": _versions(),
        "device": _device_name(device),
        "corpus": corpus.describe(),
        "tokens": {
            "vocab_size": vocab,
            "special_ids": ids,
            "train_tokens": int(train_stream.numel()),
            "heldout_tokens": int(heldout_stream.numel()),
            "train_bytes_per_token": corpus.stats["train_bytes"] / max(1, train_stream.numel()),
        },
        "target": {"params": param_count(target), "train": tres.to_json(), "heldout": held},
        "draft": {
            "params": param_count(draft),
            "target_layer_ids": taps,
            "train": dres.to_json(),
            "acceptance": accept,
        },
        "sizes": {
            "planned_bytes": planned,
            **file_sizes(target_dir, draft_dir, recipe.size_limit_bytes),
        },
        "training_budget_s": round(budget, 1),
        "seconds": {**clock.seconds, "total": round(time.perf_counter() - clock.start, 3)},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def configure_cuda_determinism() -> None:
    """Must run before CUDA initialises: cuBLAS needs a fixed workspace for deterministic GEMMs."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
