"""The transformers reference engine: DDTree on CPU or one GPU, batch 1, plain torch.

    from sglang_ddtree.reference import load_pair, generate, generate_chain, generate_plain

    target, drafter, tokenizer = load_pair(target_dir, draft_dir, "float32", "cpu")
    ids = tokenizer("def f(x):")["input_ids"]
    result = generate(target, drafter, ids, 64, budget=32, topk=8)
    print(tokenizer.decode(result.tokens), result.accept_lengths)

Command line: `python -m sglang_ddtree.reference --demo` (see __main__.py).
"""

from .engine import (
    GenerationResult,
    RoundTrace,
    Sampler,
    check_generation_args,
    generate,
    generate_chain,
    generate_plain,
    load_pair,
)
from .naive import NaiveTargetRunner
from .oracle import OracleDrafter

__all__ = [
    "GenerationResult",
    "NaiveTargetRunner",
    "OracleDrafter",
    "RoundTrace",
    "Sampler",
    "check_generation_args",
    "generate",
    "generate_chain",
    "generate_plain",
    "load_pair",
]
