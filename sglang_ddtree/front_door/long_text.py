"""A long prompt text is counted off the event loop before SGLang tokenizes it on the loop.

SGLang 0.5.23 tokenizes a /generate or /v1/completions text in the front end's event loop
(`TokenizerManager._tokenize_texts` calls the tokenizer there unless
--enable-dynamic-batch-tokenizer is set), before any length check: 8 MiB of text took 14 s on a
2-CPU host, and the 64 MiB the body bound lets through about two minutes. Nothing else in the
front end runs meanwhile: /health does not answer (a load balancer's probe times out and the
server is taken for dead), and every stream stalls.

`check_text_lengths` tokenizes each text longer than LONG_TEXT characters in a worker thread (the
Rust tokenizer releases the GIL, so the loop serves on) with the tokenizer SGLang then uses, and
refuses, naming the prompt, its length and the context, a text of at least the context's tokens:
SGLang refuses it too, but only after tokenizing it on the loop. A text that fits is tokenized by
SGLang as before (at most a context's worth on the loop). Off under --allow-auto-truncate, where
SGLang keeps a prompt's head instead of refusing it.
"""

from __future__ import annotations

import asyncio

LONG_TEXT = 1 << 18  # characters; SGLang tokenizes fewer on the loop in well under 100 ms


async def check_text_lengths(tokenizer, text, context: int | None) -> None:
    """Raise ValueError for the first text of `text` (a string or a list of them) that is longer
    than LONG_TEXT characters and holds at least `context` tokens."""
    texts = text if isinstance(text, list) else [text]
    long = [(i, t) for i, t in enumerate(texts) if isinstance(t, str) and len(t) > LONG_TEXT]
    if not long or context is None or tokenizer is None:
        return

    def count() -> list[int]:
        return [len(ids) for ids in tokenizer([t for _, t in long])["input_ids"]]

    for (i, t), tokens in zip(long, await asyncio.to_thread(count), strict=True):
        if tokens >= context:
            name = "text" if not isinstance(text, list) else f"text[{i}]"
            raise ValueError(
                f"{name} is {tokens} tokens ({len(t)} characters), not below the context of "
                f"{context} tokens: shorten the prompt (counted before SGLang tokenizes it on "
                "the front end's event loop, where a long text stalls every stream and /health)."
            )
