"""CLI: DDTree on the transformers reference engine.

    python -m sglang_ddtree.reference --demo
    python -m sglang_ddtree.reference --target DIR --draft DIR --prompt TEXT [--compare-chain]
    python -m sglang_ddtree.reference --target DIR --draft DIR --prompt-file FILE  ('-': stdin)

Every option is checked before any model loads: a bad one prints one line to stderr naming
the option, its value and the limit, and exits with status 2 (as argparse's own errors do).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from sglang_ddtree import DEMO_PAIR_DIR
from sglang_ddtree.config import cache_home
from sglang_ddtree.front_door.request_limits import MAX_TEMPERATURE
from sglang_ddtree.reference.engine import generate, generate_chain, load_pair
from sglang_ddtree.reference.preflight import (
    PairConfig,
    about,
    check_options,
    check_prompt_ids,
    check_tree,
    prompt_text,
    read_pair,
    writable_dir,
)

DEMO_PROMPT = "def fibonacci(n):"
EXIT_USAGE = 2


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    # ArgumentDefaultsHelpFormatter prints "(default: ...)" only for options that have a help
    # string, so every option with a default has one.
    p = _OneLineParser(
        prog="python -m sglang_ddtree.reference",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", help="target checkpoint dir (Qwen3 / Qwen3.5)")
    p.add_argument("--draft", help="DFlash draft checkpoint dir")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help=f"prompt text (--demo: {DEMO_PROMPT!r})")
    prompt.add_argument(
        "--prompt-file", metavar="FILE", help="the prompt from FILE, verbatim ('-': standard input)"
    )
    p.add_argument(
        "--budget",
        type=int,
        default=32,
        help="draft tree: nodes to verify per round, the root excluded",
    )
    p.add_argument(
        "--topk",
        type=int,
        default=8,
        help="draft tree: candidates per draft position, i.e. the most children a "
        "node can have (not --top-k)",
    )
    _add_sampling(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--compare-chain", action="store_true", help="also run chain DFlash")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the tokenizer has one; off for --demo, "
        "whose code model completes the prompt)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the eos token")
    p.add_argument("--seed", type=int, default=0, help="torch's seed and the sampler's")
    p.add_argument("--device", default="cpu", help="cpu, or cuda when there is a GPU")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the models' dtype",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="run DDTree and chain DFlash on the shipped demo pair (or a tiny seeded one)",
    )
    p.add_argument("--cache-dir", help="where --demo writes the tiny seeded pair")
    p.add_argument(
        "--show-tree",
        metavar="DIR",
        help="print each DDTree round's tree and draw it to DIR/round_NNN.svg",
    )
    return p


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help=f"sampling temperature, in [0, {MAX_TEMPERATURE:g}] (0: greedy)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus probability")
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sampling: keep the target's k most likely tokens at temperature > 0; "
        "0 = all (not --topk)",
    )


def _demo_dirs(cache_dir: str | None) -> tuple[Path, Path]:
    """The pair --demo runs: the trained pair shipped in sglang_ddtree/assets/demo/ when
    present, else the seeded agreeing "binary" pair on the hybrid Qwen3.5 architecture
    (testing/binary_pair.py: random Gated DeltaNet + attention layers, a two-token language,
    a draft that ties its two tokens) written once to the cache dir: a tree covers both
    continuations at every depth, a chain only one."""
    from sglang_ddtree.checkpoints.binary_pair import write_binary_pair

    shipped = DEMO_PAIR_DIR / "target", DEMO_PAIR_DIR / "draft"
    if cache_dir is None and all((d / "config.json").exists() for d in shipped):
        return shipped
    root = Path(cache_dir) if cache_dir else cache_home() / "demo"
    target, draft = root / "qwen35-binary", root / "qwen35-binary-dflash"
    if not (draft / "config.json").exists():
        with about("--cache-dir", root, "cannot write the demo pair there: "):
            write_binary_pair(root, "qwen35", seed=0)
    return target, draft


def uses_chat(tokenizer, chat: bool | None) -> bool:
    """--chat / --no-chat, or by default whether the tokenizer has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat


def encode_prompt(tokenizer, prompt: str, chat: bool | None) -> list[int]:
    """Token ids of the prompt, through the chat template when asked (or when there is one)."""
    if uses_chat(tokenizer, chat):
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _report(name: str, tokenizer, result) -> None:
    print(f"=== {name} ({len(result.tokens)} tokens, {result.rounds} rounds)")
    print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    print(f"per round, accepted drafts + bonus: {result.accept_lengths}")
    print(
        f"tokens per round: {_per_round(result)} "
        f"({len(result.tokens)} tokens / {result.rounds} verify rounds)"
    )


def _per_round(result) -> str:
    per_round = result.tokens_per_round
    return "-" if per_round is None else f"{per_round:.2f}"


TOKENS_PER_ROUND = (
    "tokens/round: tokens / target verify rounds, SGLang's accept length (spec_accept_length); "
    "the prefill makes the first token"
)


def _summary(rows: list[tuple[str, object, float]]) -> str:
    """The side-by-side table: tokens, rounds, tokens per round and tokens/s per method."""
    lines = [f"{'':<14} {'tokens':>6} {'rounds':>6} {'tokens/round':>12} {'tokens/s':>9}"]
    for name, result, seconds in rows:
        lines.append(
            f"{name:<14} {len(result.tokens):>6} {result.rounds:>6} "
            f"{_per_round(result):>12} "
            f"{len(result.tokens) / max(seconds, 1e-9):>9.1f}"
        )
    return "\n".join([*lines, TOKENS_PER_ROUND])


def check_paths(args: argparse.Namespace) -> None:
    """The checkpoint dirs exist and hold a config.json."""
    for flag in ("target", "draft"):
        path = Path(getattr(args, flag))
        if not path.exists():
            raise ValueError(f"--{flag} {path} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"--{flag} {path} is not a model checkpoint (no config.json in it)")


def check_budget_fits(
    args: argparse.Namespace, block_size: int | None = None, available: int | None = None
) -> None:
    """--budget against the largest tree that the draft's block and --topk can hold and that
    this machine's free memory holds (from the two configs, before loading)."""
    from sglang_ddtree.reference.memory import max_budget

    target, draft = Path(args.target), Path(args.draft)
    with about("--target", target):
        limit = max_budget(target, draft, args.topk, args.device, available, block_size)
    if limit is None:
        return  # the engine's own checks name these settings
    largest, why = limit
    if args.budget > largest:
        raise ValueError(
            f"--budget {args.budget} is larger than what fits: at most {largest} nodes ({why})"
        )


def resolve_inputs(args: argparse.Namespace) -> PairConfig:
    """The settings that need no model: first those that need no file (counts, sampling, seed,
    device), then the demo's defaults, the prompt's text (from --prompt-file too), the
    checkpoint dirs, their configs, and the budget against the tree's capacity and the free
    memory."""
    check_options(args)
    args.prompt = prompt_text(args.prompt, args.prompt_file)
    if args.demo:
        target_dir, draft_dir = _demo_dirs(args.cache_dir)
        args.target, args.draft = args.target or target_dir, args.draft or draft_dir
        args.prompt = DEMO_PROMPT if args.prompt is None else args.prompt
        args.compare_chain = True  # the demo shows DDTree and chain DFlash side by side
        args.chat = False if args.chat is None else args.chat  # a code model: completion
    missing = [f"--{k}" for k in ("target", "draft", "prompt") if getattr(args, k) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or use --demo)")
    check_paths(args)
    pair = read_pair(Path(args.target), Path(args.draft))
    check_budget_fits(args, pair.draft.block_size)
    check_tree(pair, args.budget, args.topk)  # --topk against the vocabulary too
    return pair


def tokenize_and_check(args: argparse.Namespace, pair: PairConfig) -> tuple[object, list[int]]:
    """(tokenizer, prompt ids), once every setting has been checked against the two configs
    and the tokenizer: --chat, the draft's mask token, the prompt against the context."""
    from transformers import AutoTokenizer

    with about("--target", args.target, "its tokenizer does not load: "):
        tokenizer = AutoTokenizer.from_pretrained(str(args.target), local_files_only=True)
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--chat: the tokenizer of --target {args.target} has no chat template; drop --chat"
        )
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat)
    source = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
    dirs = Path(args.target), Path(args.draft)
    check_prompt_ids(pair, dirs, tokenizer, prompt_ids, args.max_new_tokens, source)
    return tokenizer, prompt_ids


def check_args(args: argparse.Namespace) -> tuple[object, list[int]]:
    """Every option, before any model loads -> (tokenizer, prompt ids). After this only loading
    the models is left; --show-tree's folder is made last, once everything else passed."""
    pair = resolve_inputs(args)
    tokenizer, prompt_ids = tokenize_and_check(args, pair)
    if args.show_tree is not None:
        writable_dir("--show-tree", args.show_tree)
    return tokenizer, prompt_ids


def run(args: argparse.Namespace, tokenizer, prompt_ids: list[int]) -> int:
    """Load the pair and generate, once `check_args` has passed."""
    torch.manual_seed(args.seed)
    target, drafter, _ = load_pair(args.target, args.draft, args.dtype, args.device, tokenizer)
    chat = "chat template" if uses_chat(tokenizer, args.chat) else "plain completion"
    print(f"prompt: {args.prompt!r} ({len(prompt_ids)} tokens, {chat})")
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sampling.update(seed=args.seed, eos_token_id=eos)
    budget, topk = args.budget, args.topk
    shower = _TreeShower(args.show_tree, tokenizer) if args.show_tree else None
    t0 = time.perf_counter()
    tree = generate(
        target,
        drafter,
        prompt_ids,
        args.max_new_tokens,
        budget=budget,
        topk=topk,
        on_round=shower,
        **sampling,
    )
    drawing = shower.seconds if shower else 0.0
    rows = [("DDTree", tree, time.perf_counter() - t0 - drawing)]
    _report(f"DDTree budget={args.budget} topk={args.topk}", tokenizer, tree)
    if args.compare_chain:
        t0 = time.perf_counter()
        chain = generate_chain(target, drafter, prompt_ids, args.max_new_tokens, **sampling)
        rows.append(("chain DFlash", chain, time.perf_counter() - t0))
        _report(f"chain DFlash block_size={drafter.block_size}", tokenizer, chain)
    print(_summary(rows))
    if args.compare_chain and args.temperature == 0:
        same = "identical" if chain.tokens == tree.tokens else "DIFFERENT"
        print(f"DDTree vs chain DFlash at temperature 0: {same} text")
    return 0


class _TreeShower:
    """on_round callback of --show-tree: the round's outline on stdout, its picture in out_dir.
    It runs inside the DDTree loop, so it keeps its own time for the summary to leave out."""

    def __init__(self, out_dir: str, tokenizer) -> None:
        from sglang_ddtree.tree.show import token_decoder

        self.out_dir, self.decode = Path(out_dir), token_decoder(tokenizer)
        self.rounds, self.seconds = 0, 0.0

    def __call__(self, trace) -> None:
        from sglang_ddtree.tree.show import from_round, render_picture, render_text

        t0 = time.perf_counter()
        self.rounds += 1
        record = from_round(trace.tree, trace.accept)
        print(f"--- round {self.rounds}\n{render_text(record, self.decode)}")
        path = self.out_dir / f"round_{self.rounds:03d}.svg"
        try:
            render_picture(record, path, self.decode, title=f"round {self.rounds}")
        except OSError as exc:
            raise OSError(
                f"--show-tree {self.out_dir}: cannot write {path.name}: {exc.strerror or exc}"
            ) from None
        self.seconds += time.perf_counter() - t0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging  # past --help, which needs none

    hf_logging.set_verbosity_error()  # stderr is for our one-line errors
    hf_logging.disable_progress_bar()
    try:
        tokenizer, prompt_ids = check_args(args)
    except (ValueError, OSError) as exc:
        parser.error(_one_line(exc))  # one line, status 2, no model loaded
    try:
        return run(args, tokenizer, prompt_ids)
    except (ValueError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
