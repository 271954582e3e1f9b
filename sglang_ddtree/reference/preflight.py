"""What the reference CLI refuses before any model loads: every option's value, the device, the
prompt's bytes, the output folders, and the pair's two configs checked against each other and
against the prompt and tree settings.

Each check raises ValueError with one line naming the option, its value and the limit (the CLI
hands it to its parser's error: status 2). The engine and the draft runner keep their own
checks for callers that load models directly; these read only the two config.json files and
the tokenizer, so a bad setting costs no model load. The limits are the engine's own
(engine.check_*: the sampling ones are the DDTREE server's) and torch's (the seed).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from sglang_ddtree.reference.dflash import (
    DFlashConfig,
    check_draft_matches_target,
    parse_dflash_config,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)
from sglang_ddtree.reference.engine import (
    check_counts,
    check_prompt,
    check_sampling,
    check_tree_settings,
    target_class_name,
)

# the CLI's option for each engine setting, for the engine's checks to name (engine._name)
FLAGS = {
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "max_new_tokens": "--max-new-tokens",
    "budget": "--budget",
    "topk": "--topk",
    "prompt": "--prompt",
}
SEEDS = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed and Generator.manual_seed take
DEVICE_TYPES = ("cpu", "cuda")  # what the reference engine is tested on


def check_device(device: str) -> None:
    """--device names a CPU, or a CUDA device this machine has."""
    try:
        parsed = torch.device(device)
    except RuntimeError:  # torch's message lists every backend it knows, over several lines
        parsed = None
    if parsed is None or parsed.type not in DEVICE_TYPES:
        raise ValueError(
            f"--device {device}: the reference engine runs on cpu or cuda; use --device cpu"
        )
    if parsed.type == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device; use --device cpu")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(
            f"--device {device}: this machine has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )


def _utf8(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{source} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        ) from None


def prompt_text(prompt: str | None, prompt_file: str | None) -> str | None:
    """The prompt as valid UTF-8 text: --prompt, or the bytes of --prompt-file read verbatim
    ('-': standard input). Python hands over argv bytes that are not UTF-8 as lone surrogates
    (surrogateescape), which the tokenizer rejects with a traceback; they are refused here."""
    if prompt_file is None:
        if prompt is None:
            return None
        return _utf8(prompt.encode("utf-8", "surrogateescape"), "--prompt")
    source = f"--prompt-file {prompt_file}"
    try:
        raw = sys.stdin.buffer.read() if prompt_file == "-" else Path(prompt_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"{source}: {exc.strerror or exc}") from None
    return _utf8(raw, source)


def check_options(args) -> None:
    """The options that need no file: counts, sampling, seed, device, and --cache-dir only
    where --demo reads it."""
    check_counts(args.max_new_tokens, args.budget, FLAGS)
    if args.topk < 1:  # its upper bound, the vocabulary, is the target config's
        raise ValueError(f"--topk must be >= 1 (candidates per draft position), got {args.topk}")
    check_sampling(args.temperature, args.top_p, args.top_k, FLAGS)
    low, high = SEEDS
    if not low <= args.seed <= high:
        raise ValueError(f"--seed must be in [-2**63, 2**64 - 1] (torch's seeds), got {args.seed}")
    check_device(args.device)
    if args.cache_dir is not None and not args.demo:
        raise ValueError(
            f"--cache-dir {args.cache_dir}: only --demo reads it (where it writes its seeded "
            "pair); add --demo or drop --cache-dir"
        )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"its config.json is not valid JSON ({exc})"
    if isinstance(exc, KeyError):
        return f"its config.json has no {exc} field"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


@contextmanager
def about(flag: str, value: object, what: str = "") -> Iterator[None]:
    """A ValueError, KeyError, TypeError or OSError raised inside (a config without a field,
    a folder that cannot be written) as one ValueError naming the option and its value."""
    try:
        yield
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(f"{flag} {value}: {what}{_reason(exc)}") from None


def writable_dir(flag: str, path: str | Path) -> Path:
    """The folder an option names, made (with its parents) and written to once, so that a
    folder that cannot be made or written is refused before any model loads."""
    folder = Path(path)
    with about(flag, path, "cannot make or write this folder: "):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(20, "it is a file, not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    return folder


def _config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


class PairConfig(NamedTuple):
    """What the checks read from the two configs."""

    vocab: int
    max_positions: int | None
    draft: DFlashConfig


def read_pair(target_dir: Path, draft_dir: Path) -> PairConfig:
    """The checks that `load_pair` and the draft runner make after loading, from the two
    configs alone: the target's architecture, the draft against the target (hidden size,
    vocabulary, taps). An error names --target or --draft."""
    with about("--target", target_dir):
        target_cfg = _config(target_dir)
        target_class_name(target_cfg)
        text = target_cfg.get("text_config") or target_cfg
        vocab, hidden = int(text["vocab_size"]), int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
    with about("--draft", draft_dir):
        draft = parse_dflash_config(_config(draft_dir))
        check_draft_matches_target(draft, hidden, vocab)
        resolve_target_layer_ids(draft, layers)
    return PairConfig(vocab, text.get("max_position_embeddings"), draft)


def check_tree(pair: PairConfig, budget: int, topk: int) -> None:
    """--budget and --topk against the draft's block and the vocabulary."""
    check_tree_settings(pair.draft.block_size, budget, topk, pair.vocab, FLAGS)


def check_prompt_ids(
    pair: PairConfig,
    dirs: tuple[Path, Path],
    tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int,
    source: str,
) -> None:
    """What needs the tokenizer: a tokenizer at all (transformers makes an empty one of a folder
    without tokenizer files), the draft's mask token, and the prompt (named by `source`, --prompt
    or --prompt-file FILE): ids in the target's vocabulary, and room in its context for
    --max-new-tokens."""
    target_dir, draft_dir = dirs
    if len(tokenizer) < 2:
        raise ValueError(
            f"--target {target_dir}: its tokenizer has {len(tokenizer)} token(s); the folder "
            "holds no tokenizer files (tokenizer.json, tokenizer_config.json)"
        )
    with about("--draft", draft_dir):
        resolve_mask_token_id(pair.draft, pair.vocab, tokenizer)
    check_prompt(len(prompt_ids), max_new_tokens, pair.max_positions, {**FLAGS, "prompt": source})
    if max(prompt_ids) >= pair.vocab:
        raise ValueError(
            f"{source}: its token id {max(prompt_ids)} is outside the target's vocabulary "
            f"(vocab_size={pair.vocab})"
        )
