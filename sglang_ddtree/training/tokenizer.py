"""Byte-level BPE tokenizer trained on the training corpus, with ChatML and the DFlash mask token.

Special tokens and the chat template are those of `sglang_ddtree.checkpoints.tiny` (ids 0..7:
<|endoftext|> <|im_start|> <|im_end|> <|MASK|> and the four vision specials that
Qwen3_5ForConditionalGeneration's config refers to); eos is <|im_end|>, pad <|endoftext|>.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from sglang_ddtree.checkpoints.tiny import SPECIAL_TOKENS, build_bpe_tokenizer

MASK_TOKEN = "<|MASK|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike):
    """Train a byte-level BPE on `texts`, save it (HF format, ChatML template) to `out_dir`.

    Returns the PreTrainedTokenizerFast. Special tokens come first (ids 0..7).
    """
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size <= min_vocab:
        raise ValueError(f"vocab_size must exceed {min_vocab} (bytes + specials), got {vocab_size}")
    fast = build_bpe_tokenizer(
        vocab_size, lambda tok, trainer: tok.train_from_iterator(texts, trainer)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def special_ids(tokenizer) -> dict[str, int]:
    """{special token: id} of a PreTrainedTokenizerFast (all of SPECIAL_TOKENS must exist)."""
    vocab = tokenizer.get_vocab()
    missing = [s for s in SPECIAL_TOKENS if s not in vocab]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return {s: int(vocab[s]) for s in SPECIAL_TOKENS}


def tokenizer_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the tokenizer files saved in `model_dir` (those of TOKENIZER_FILES present)."""
    return sum((Path(model_dir) / f).stat().st_size for f in _present(model_dir))


def _present(model_dir: str | os.PathLike) -> list[str]:
    return [f for f in TOKENIZER_FILES if (Path(model_dir) / f).is_file()]
