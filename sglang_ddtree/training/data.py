"""Token streams and deterministic batches.

Each document is a source file. Most are plain (`text <|endoftext|>`); a seeded fraction is
wrapped as a ChatML exchange (`user: Write the Python module `path`.` / `assistant: text`) so
the model also learns the chat template and to stop on <|im_end|>. Special-token strings that
occur literally inside source text stay text (`encode_special_tokens`), so only the framing
produces special ids. All documents are concatenated into one int32 stream; training windows
are random crops drawn from a seeded torch.Generator.
"""

from __future__ import annotations

import random

import numpy as np
import torch

_ENCODE_CHUNK = 512  # documents per encode_batch call (bounds memory on big corpora)


def chat_prefix(name: str) -> str:
    """The ChatML framing before a chat-wrapped document body."""
    return f"<|im_start|>user\nWrite the Python module `{name}`.<|im_end|>\n<|im_start|>assistant\n"


def _encode_bodies(backend, texts: list[str]) -> list[np.ndarray]:
    """Token ids [n_i] int32 of raw texts, special-token strings inside them encoded as text."""
    saved = backend.encode_special_tokens
    backend.encode_special_tokens = True
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    try:
        out: list[np.ndarray] = []
        for i in range(0, len(texts), _ENCODE_CHUNK):
            chunk = encode(texts[i : i + _ENCODE_CHUNK], add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=np.int32) for e in chunk)
        return out
    finally:
        backend.encode_special_tokens = saved


def encode_documents(
    tokenizer, docs: list[tuple[str, str]], chat_fraction: float, seed: int
) -> torch.Tensor:
    """docs [(name, text)] -> one stream [N] int32 of framed documents, in the given order."""
    backend = tokenizer.backend_tokenizer
    vocab = tokenizer.get_vocab()

    def ids(text: str) -> np.ndarray:  # framing text: special tokens are special here
        return np.asarray(backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    eot = np.asarray([vocab["<|endoftext|>"]], dtype=np.int32)
    chat_end = np.concatenate([[vocab["<|im_end|>"]], ids("\n")]).astype(np.int32)
    bodies = _encode_bodies(backend, [text for _, text in docs])
    rng = random.Random(seed)
    pieces: list[np.ndarray] = []
    for (name, _), body in zip(docs, bodies, strict=True):
        if rng.random() < chat_fraction:
            pieces += [ids(chat_prefix(name.split(":", 1)[-1])), body, chat_end]
        else:
            pieces += [body, eot]
    if not pieces:
        return torch.zeros(0, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(pieces))


def sample_windows(
    stream: torch.Tensor, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """Random crops of the stream: [batch, length] int64 (start offsets from `gen`)."""
    if stream.numel() < length:
        raise ValueError(f"token stream has {stream.numel()} tokens, need >= {length}")
    starts = torch.randint(0, stream.numel() - length + 1, (batch,), generator=gen)  # [b]
    idx = starts[:, None] + torch.arange(length)  # [b, length]
    return stream[idx].long()


def eval_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` evenly spaced, non-random crops: [n, length] int64 (n <= count)."""
    if stream.numel() < length:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, need >= {length}")
    n = min(count, stream.numel() // length)
    starts = torch.linspace(0, stream.numel() - length, n).long()  # [n]
    return stream[starts[:, None] + torch.arange(length)].long()


def sample_anchors(
    batch: int, length: int, block_size: int, per_seq: int, gen: torch.Generator
) -> torch.Tensor:
    """Distinct block anchors per sequence, sorted: [batch, per_seq] int64 in [1, length-B].

    Anchor a >= 1 so the block has context; a + B - 1 <= length - 1 so all its labels exist.
    """
    span = length - block_size  # anchors 1..span
    if span < per_seq:
        raise ValueError(
            f"{per_seq} anchors need sequences longer than block_size + {per_seq}, "
            f"got length {length}, block_size {block_size}"
        )
    keys = torch.rand(batch, span, generator=gen)  # [b, span]
    picked = keys.argsort(dim=1)[:, :per_seq] + 1  # [b, per_seq]
    return picked.sort(dim=1).values


def fixed_anchors(length: int, block_size: int, per_seq: int) -> torch.Tensor:
    """Evenly spaced anchors [per_seq] in [length // 4, length - B] for evaluation."""
    lo, hi = max(1, length // 4), length - block_size
    return torch.linspace(lo, hi, per_seq).long().unique()
