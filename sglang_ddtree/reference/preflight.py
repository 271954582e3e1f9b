"""What the reference CLI refuses before any model loads: the device, the prompt's bytes, and the
pair's two configs checked against each other and against the prompt and tree settings.

Each check raises ValueError with one line naming the value and the limit. The engine and the
draft runner keep their own checks for callers that load models directly; these read only the
two config.json files and the tokenizer, so a bad setting costs no model load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from sglang_ddtree.reference.dflash import (
    check_draft_matches_target,
    parse_dflash_config,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)
from sglang_ddtree.reference.engine import check_prompt, check_tree_settings, target_class_name

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


def _config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def check_pair(
    target_dir: Path,
    draft_dir: Path,
    tokenizer,
    prompt_len: int,
    max_new_tokens: int,
    *,
    budget: int,
    topk: int,
) -> None:
    """The checks that `load_pair`, the draft runner and `check_generation_args` make after
    loading, made from the configs and the tokenizer alone: the target's architecture, the
    draft against the target (hidden size, vocabulary, taps, mask token), the prompt against the
    context, and the tree settings against the draft's block."""
    target_cfg = _config(target_dir)
    target_class_name(target_cfg)
    text = target_cfg.get("text_config") or target_cfg
    vocab = int(text["vocab_size"])
    draft = parse_dflash_config(_config(draft_dir))
    check_draft_matches_target(draft, int(text["hidden_size"]), vocab)
    resolve_target_layer_ids(draft, int(text["num_hidden_layers"]))
    resolve_mask_token_id(draft, vocab, tokenizer)
    check_prompt(prompt_len, max_new_tokens, text.get("max_position_embeddings"))
    check_tree_settings(draft.block_size, budget, topk, vocab)
