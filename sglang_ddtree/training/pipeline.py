"""corpus -> tokenizer -> target -> draft -> evaluation, writing DIR/{target,draft,report.json}.

Stages hand over through the saved checkpoints: the draft trains against the target *as saved*
(bf16 weights, upcast), and the evaluation reads both back, so the numbers describe the files
that ship.
"""

from __future__ import annotations

import contextlib
import json
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_ddtree.config import deterministic_cublas
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


def versions() -> dict:
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def device_name(device: torch.device) -> str:
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
    threads = torch.get_num_threads()
    if args.toy and device.type == "cpu":
        torch.set_num_threads(1)  # toy tensors are tiny: extra threads only add contention
    try:
        with deterministic(args.seed):
            return _run(args, recipe, device)
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Prepared:
    corpus: Corpus
    ids: dict[str, int]  # special token -> id
    vocab: int
    train_stream: torch.Tensor  # [N] int32
    heldout_stream: torch.Tensor  # [M] int32
    target_cfg: dict
    draft_cfg: dict


def _prepare(args: RunArgs, recipe: Recipe, clock: _Clock, out: Path) -> _Prepared:
    """Corpus, tokenizer (saved into out/target), token streams, both configs."""
    with clock("corpus"):
        corpus = build_corpus(recipe.corpus, args.seed)
    (out / "heldout_packages.json").write_text(json.dumps(corpus.heldout_packages, indent=1) + "\n")
    with clock("tokenizer"):
        texts = _tokenizer_texts(corpus, recipe.tokenizer_train_bytes)
        tokenizer = train_tokenizer(texts, recipe.vocab_size, out / "target")
        ids = special_ids(tokenizer)
    with clock("encode"):
        train_stream = encode_documents(tokenizer, corpus.train, recipe.chat_fraction, args.seed)
        heldout_stream = encode_documents(tokenizer, corpus.heldout, 0.0, 0)
    vocab = len(tokenizer)
    tcfg = target_config(recipe.target, vocab, ids, recipe.init_std)
    dcfg = draft_config(tcfg["text_config"], recipe.draft, ids[MASK_TOKEN])
    return _Prepared(corpus, ids, vocab, train_stream, heldout_stream, tcfg, dcfg)


def _target_stage(prep: _Prepared, recipe: Recipe, args: RunArgs, budget_s: float, device, out):
    """Train, save, reload (bf16 weights as shipped) and evaluate the target."""
    target = build_target(prep.target_cfg, args.seed)
    result = train_target(
        target, prep.train_stream, recipe.target_train, budget_s, device, args.seed
    )
    save_target(target, out / "target")
    target = load_target(out / "target", device)
    length = recipe.target_train.seq_len + 1
    windows = eval_windows(prep.heldout_stream, recipe.eval_windows, length)
    return target, result, heldout_loss(target, windows, recipe.eval_batch, device)


def _draft_stage(prep: _Prepared, recipe: Recipe, args: RunArgs, target, budget_s, device, out):
    """Train and save the draft against the frozen target, reload it, measure acceptance."""
    draft = build_draft(prep.draft_cfg, args.seed + 1, recipe.init_std)
    taps = list(prep.draft_cfg["dflash_config"]["target_layer_ids"])
    hp = recipe.draft_train
    result = train_draft(
        draft, target, taps, prep.train_stream, hp, budget_s, device, args.seed + 1
    )
    save_draft(draft, prep.draft_cfg, out / "draft")
    draft = load_draft(out / "draft").to(device)
    windows = eval_windows(prep.heldout_stream, recipe.accept_windows, hp.seq_len)
    anchors = fixed_anchors(hp.seq_len, recipe.draft.block_size, recipe.accept_anchors)
    accept = acceptance_proxy(draft, target, taps, windows, anchors, recipe.eval_batch, device)
    return result, accept


def _run(args: RunArgs, recipe: Recipe, device: torch.device) -> dict:
    clock, out = _Clock(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prep = _prepare(args, recipe, clock, out)
    with torch.device("meta"):  # parameter counts only
        target_params = param_count(build_target(prep.target_cfg, args.seed))
        draft_params = param_count(build_draft(prep.draft_cfg, args.seed, recipe.init_std))
    planned = check_planned_size(
        target_params, draft_params, tokenizer_bytes(out / "target"), recipe.size_limit_bytes
    )
    budget = training_budget(args, time.perf_counter() - clock.start)
    t_train = time.perf_counter()
    with clock("target"):
        target, tres, held = _target_stage(
            prep, recipe, args, recipe.target_share * budget, device, out
        )
    draft_budget = max(0.0, budget - (time.perf_counter() - t_train))
    with clock("draft"):
        dres, accept = _draft_stage(prep, recipe, args, target, draft_budget, device, out)
    report = {
        "args": {**asdict(args), "out": str(args.out)},
        "recipe": asdict(recipe),
        "versions": versions(),
        "device": device_name(device),
        "corpus": prep.corpus.describe(),
        "tokens": {
            "vocab_size": prep.vocab,
            "special_ids": prep.ids,
            "train_tokens": int(prep.train_stream.numel()),
            "heldout_tokens": int(prep.heldout_stream.numel()),
            "train_bytes_per_token": prep.corpus.stats["train_bytes"]
            / max(1, prep.train_stream.numel()),
        },
        "target": {"params": target_params, "train": tres.to_json(), "heldout": held},
        "draft": {
            "params": draft_params,
            "target_layer_ids": prep.draft_cfg["dflash_config"]["target_layer_ids"],
            "train": dres.to_json(),
            "acceptance": accept,
        },
        "sizes": {
            "planned_bytes": planned,
            **file_sizes(out / "target", out / "draft", recipe.size_limit_bytes),
        },
        "training_budget_s": round(budget, 1),
        "seconds": {**clock.seconds, "total": round(time.perf_counter() - clock.start, 3)},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def configure_cuda_determinism() -> None:
    """Must run before CUDA initialises: cuBLAS needs a fixed workspace for deterministic GEMMs."""
    deterministic_cublas()
