"""Test helpers: seeded tiny checkpoints (see `tiny.py`)."""

from sglang_ddtree.testing.tiny import (
    SPECIAL_TOKENS,
    write_tiny_dflash,
    write_tiny_qwen3,
    write_tiny_qwen35,
    write_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "write_tiny_dflash",
    "write_tiny_qwen3",
    "write_tiny_qwen35",
    "write_tokenizer",
]
