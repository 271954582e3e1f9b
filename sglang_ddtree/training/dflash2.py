"""A DFlash2 drafter for a trained pair: PAIR/{target,draft} -> OUT/draft_dflash2, OUT/report.json
and OUT/dflash2_offline_pair.jsonl.

The data are the pair's own: the same corpus (build_corpus with the pair's seed, on the same
machine's Python), encoded with the pair's tokenizer and framed as the pair's run did; the
target and the DFlash draft are frozen as saved, and only the selector trains
(training/selector.py). The evaluation reads the saved DFlash2 drafter back and scores the four
drafters on the pair's held-out windows (training/lattice_eval.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from sglang_ddtree.training.config import h200_recipe, h200_selector, toy_recipe, toy_selector
from sglang_ddtree.training.corpus import build_corpus
from sglang_ddtree.training.data import encode_documents, eval_windows, fixed_anchors
from sglang_ddtree.training.draft_model import load_draft
from sglang_ddtree.training.lattice_eval import four_way
from sglang_ddtree.training.pipeline import deterministic, device_name, versions
from sglang_ddtree.training.selector import (
    build_selector,
    load_selector,
    save_dflash2,
    train_selector,
)
from sglang_ddtree.training.target import load_target

DRAFT_DIR = "draft_dflash2"
ROWS = "dflash2_offline_pair.jsonl"


@dataclass(frozen=True)
class DFlash2Args:
    pair: Path  # a directory holding target/ and draft/ (train_pair.py's output)
    out: Path
    minutes: float = 3.0  # the selector's training budget
    seed: int = 0  # the pair's seed: it fixes the corpus and its order
    device: str = "cuda"
    toy: bool = False
    steps: int | None = None  # fixed selector steps (default: planned from --minutes)
    batch: int | None = None  # sequences per step (default: the recipe's)
    eval_windows: int | None = None  # held-out windows scored (default: the recipe's)


def missing_pair_part(pair: str | Path) -> str | None:
    """The first of a pair's parts (target, draft) without a config.json; None for a pair."""
    return next(
        (p for p in ("target", "draft") if not (Path(pair) / p / "config.json").is_file()), None
    )


def run_dflash2(args: DFlash2Args) -> dict:
    """Train, save and evaluate the selector; returns the report (also OUT/report.json)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but CUDA is not available; use cpu")
    missing = missing_pair_part(args.pair)
    if missing:
        raise FileNotFoundError(f"{args.pair}/{missing}/config.json: not a trained pair")
    threads = torch.get_num_threads()
    if args.toy and device.type == "cpu":
        torch.set_num_threads(1)
    try:
        with deterministic(args.seed):
            return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _streams(recipe, pair: Path, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The pair's training and held-out token streams, from its corpus and its tokenizer."""
    from transformers import AutoTokenizer

    corpus = build_corpus(recipe.corpus, seed)
    tokenizer = AutoTokenizer.from_pretrained(str(pair / "target"), local_files_only=True)
    train = encode_documents(tokenizer, corpus.train, recipe.chat_fraction, seed)
    heldout = encode_documents(tokenizer, corpus.heldout, 0.0, 0)
    return train, heldout, corpus.describe()


def _run(args: DFlash2Args, device: torch.device) -> dict:
    start, pair, out = time.perf_counter(), Path(args.pair), Path(args.out)
    recipe = toy_recipe() if args.toy else h200_recipe()
    sr = toy_selector() if args.toy else h200_selector()
    if args.steps is not None:
        sr = replace(sr, train=replace(sr.train, steps=args.steps))
    if args.batch is not None:
        sr = replace(sr, train=replace(sr.train, batch=args.batch))
    if args.eval_windows is not None:
        recipe = replace(recipe, accept_windows=args.eval_windows)
    train, heldout, corpus = _streams(recipe, pair, args.seed)
    prepared = time.perf_counter()
    target = load_target(pair / "target", device)
    draft = load_draft(pair / "draft").to(device)
    draft_cfg = json.loads((pair / "draft" / "config.json").read_text())
    taps = list(draft_cfg["dflash_config"]["target_layer_ids"])
    V, H = target.get_output_embeddings().weight.shape
    sel = build_selector(V, H, sr.rank, sr.top_k, args.seed + 2, recipe.init_std)
    result = train_selector(
        sel, draft, target, taps, train, sr.train, args.minutes * 60.0, device, args.seed + 2
    )
    out.mkdir(parents=True, exist_ok=True)
    config = save_dflash2(pair / "draft", sel, out / DRAFT_DIR)
    sel = load_selector(out / DRAFT_DIR).to(device)
    hp = sr.train
    windows = eval_windows(heldout, recipe.accept_windows, hp.seq_len)
    anchors = fixed_anchors(hp.seq_len, draft.config.block_size, recipe.accept_anchors)
    table = four_way(
        draft, sel, target, taps, windows, anchors, recipe.eval_batch, device, list(sr.nodes)
    )
    report = {
        "args": {**asdict(args), "pair": str(pair), "out": str(out)},
        "selector": asdict(sr),
        "versions": versions(),
        "device": device_name(device),
        "corpus": corpus,
        "train": result.to_json(),
        "acceptance": table,
        "dflash_config": config["dflash_config"],
        "seconds": {
            "prepare": round(prepared - start, 3),
            "total": round(time.perf_counter() - start, 3),
        },
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    rows = "".join(json.dumps(r) + "\n" for r in offline_rows(report))
    (out / ROWS).write_text(rows)
    return report


def offline_rows(report: dict) -> list[dict]:
    """The four-way table as rows (OUT/dflash2_offline_pair.jsonl): one per drafter and tree
    size, each naming the device, the selector's steps and batch, and the held-out losses."""
    acc, train = report["acceptance"], report["selector"]["train"]
    common = {
        "device": report["device"],
        "selector_rank": report["dflash_config"]["selector_rank"],
        "selector_top_k": report["dflash_config"]["selector_top_k"],
        "selector_steps": report["train"]["steps"],
        "selector_batch": train["batch"],
        "blocks": acc["blocks"],
        "heldout_loss": acc["heldout_loss"],
    }
    rows = []
    for drafter, values in acc["tokens_per_round"].items():
        sizes = acc["nodes"] if drafter.startswith("ddtree") else [None]
        for nodes, tokens in zip(sizes, values, strict=True):
            rows.append({"drafter": drafter, "nodes": nodes, "tokens_per_round": tokens, **common})
    return rows
