"""The reference engine's generate loops (batch 1; host-side control flow is fine here).

- `generate`: DDTree. One round = the paper's five steps, one call each:
  draft -> build tree -> verify -> accept -> commit.
- `generate_chain`: chain DFlash, which is the same loop with topk=1 and budget=B-1.
- `generate_plain`: the target model alone with its ordinary cache, the ground truth.

All three share one sampling rule (`sglang_ddtree.tree.sample_target_tokens`): greedy at
temperature 0, else one sample per position after temperature / top-k / top-p.
Token bookkeeping follows base.py: the first bonus comes from the last prompt position; each
round's root is the previous bonus; a round emits its accepted draft tokens then a new bonus.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from sglang_ddtree.accept import accept_walk, sample_target_tokens
from sglang_ddtree.accept.penalties import Penalties, PenaltyState
from sglang_ddtree.front_door.request_limits import MAX_TEMPERATURE, TOP_K_ALL
from sglang_ddtree.reference.base import DraftRunner, TargetRunner
from sglang_ddtree.tree import (
    AcceptResult,
    DraftTree,
    build_tree,
    topk_logprobs_from_logits,
    tree_capacity,
)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (prompt excluded), at most max_new_tokens, ends at eos if hit
    accept_lengths: list[int]  # per round: tokens emitted that round = num_accepted + 1
    rounds: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step, summed

    @property
    def mean_accept_length(self) -> float:
        """The mean of accept_lengths: accepted drafts + the bonus per round, counting the tokens
        that max_new_tokens or an eos cut from the last round (and not the prefill's token)."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def tokens_per_round(self) -> float | None:
        """Generated tokens per target verify round, as SGLang reports a request's accept length
        (spec_accept_length = completion_tokens / spec_verify_ct): the prefill's first token
        counts, the tokens that max_new_tokens or an eos cut off do not. None: no round ran."""
        return len(self.tokens) / self.rounds if self.rounds else None


class RoundTrace(NamedTuple):
    """What one DDTree round saw, for tests and tools (passed to `on_round`)."""

    topk_ids: torch.Tensor  # [1, L, K] int64 draft candidates per position, rank 0 first
    tree: DraftTree  # [1, N] nodes
    target_tokens: torch.Tensor  # [1, N] int64 target token per node
    accept: AcceptResult
    committed_len: int  # the root's position


class Sampler:
    """The target's token rule for any [n, V] logits: greedy at T=0, else seeded sampling."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        check_sampling(temperature, top_p, top_k)
        self.temperature = torch.tensor([temperature], dtype=torch.float32, device=device)
        self.top_p = torch.tensor([top_p], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([top_k], dtype=torch.int64, device=device)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, V] -> [n] int64, one independent token per row."""
        tokens = sample_target_tokens(
            logits.float()[None], self.temperature, self.top_p, self.top_k, self.generator
        )
        return tokens[0]


# ----------------------------------------------------------------------------- validation


def _max_positions(target: object) -> int | None:
    limit = getattr(target, "max_position_embeddings", None)
    model = getattr(target, "model", None)
    if limit is None and model is not None and hasattr(model, "config"):
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return limit


def _name(names: Mapping[str, str] | None, setting: str) -> str:
    """How a message calls a setting: its keyword, or the caller's name for it (the CLI's
    option, e.g. names={"top_p": "--top-p"})."""
    return setting if names is None else names.get(setting, setting)


def check_sampling(
    temperature: float, top_p: float, top_k: int, names: Mapping[str, str] | None = None
) -> None:
    """The sampling settings (no model needed: the CLI checks them before loading anything),
    within the DDTREE server's own limits (front_door/request_limits.py: a temperature in
    [0, MAX_TEMPERATURE], top_k up to SGLang's whole-vocabulary TOP_K_ALL). A NaN compares
    false with everything, so each bound is written to fail on it."""
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise ValueError(
            f"{_name(names, 'temperature')} must be a finite number in [0, {MAX_TEMPERATURE:g}] "
            f"(the DDTREE server's limit), got {temperature}"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"{_name(names, 'top_p')} must be in (0, 1], got {top_p}")
    if not 0 <= top_k <= TOP_K_ALL:
        raise ValueError(
            f"{_name(names, 'top_k')} must be in [0, {TOP_K_ALL}] (0 keeps every token; the "
            f"DDTREE server's limit), got {top_k}"
        )


def check_counts(
    max_new_tokens: int, budget: int | None = None, names: Mapping[str, str] | None = None
) -> None:
    """The checks that need no model (the CLI runs them before loading anything)."""
    if max_new_tokens < 1:
        raise ValueError(f"{_name(names, 'max_new_tokens')} must be >= 1, got {max_new_tokens}")
    if budget is not None and budget < 1:
        raise ValueError(f"{_name(names, 'budget')} must be >= 1 draft nodes, got {budget}")


def check_prompt(
    prompt_len: int,
    max_new_tokens: int,
    max_positions: int | None,
    names: Mapping[str, str] | None = None,
) -> None:
    """A non-empty prompt that leaves room for max_new_tokens in the target's context."""
    check_counts(max_new_tokens, names=names)
    prompt, new = _name(names, "prompt"), _name(names, "max_new_tokens")
    if prompt_len < 1:
        raise ValueError(f"{prompt} is empty ({prompt_len} tokens); give at least one token")
    if max_positions is not None and prompt_len + max_new_tokens > max_positions:
        raise ValueError(
            f"{prompt} ({prompt_len} tokens) + {new} ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the target's "
            f"max_position_embeddings={max_positions}"
        )


def check_tree_settings(
    block_size: int,
    budget: int,
    topk: int,
    vocab_size: int,
    names: Mapping[str, str] | None = None,
) -> None:
    """Block size, budget and top-K that a tree of depth L = block_size - 1 can be built from."""
    if block_size < 2:
        raise ValueError(f"draft block_size must be >= 2 (bonus + masks), got {block_size}")
    check_counts(1, budget, names)
    b, k = _name(names, "budget"), _name(names, "topk")
    if not 1 <= topk <= vocab_size:
        raise ValueError(f"{k} must be in [1, vocab_size={vocab_size}], got {topk}")
    capacity = tree_capacity(topk, block_size - 1)
    if budget > capacity:
        raise ValueError(
            f"{b}={budget} exceeds what {k}={topk} and depth {block_size - 1} "
            f"(block_size={block_size}) can hold: at most {capacity} nodes; lower {b} "
            f"or raise {k}"
        )


def check_generation_args(
    target: TargetRunner,
    drafter: DraftRunner,
    prompt_len: int,
    max_new_tokens: int,
    *,
    budget: int,
    topk: int,
) -> None:
    """Raise ValueError naming the values for any setting the DDTree loop cannot run with."""
    check_prompt(prompt_len, max_new_tokens, _max_positions(target))
    draft_vocab = getattr(drafter, "vocab_size", None)
    if draft_vocab is not None and draft_vocab != target.vocab_size:
        raise ValueError(
            f"draft vocab_size={draft_vocab} does not match the target's "
            f"vocab_size={target.vocab_size}"
        )
    check_tree_settings(drafter.block_size, budget, topk, target.vocab_size)


# ----------------------------------------------------------------------------- helpers


@contextmanager
def _clock(timings: dict[str, float], step: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[step] = timings.get(step, 0.0) + time.perf_counter() - start


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return set(eos_token_id)


def _emit(out: list[int], new: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Append `new` to `out`, truncating at max_new_tokens or after an eos; True when done."""
    for token in new:
        out.append(token)
        if token in eos or len(out) >= max_new_tokens:
            return True
    return False


def _as_prompt(prompt_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(-1)  # [T]


def _device_of(target: object) -> torch.device:
    model = getattr(target, "model", target)
    return next(model.parameters()).device


def _reset(drafter: DraftRunner) -> None:
    """A generation starts from an empty draft context (prefill starts the target afresh)."""
    reset = getattr(drafter, "reset", None)
    if reset is not None:
        reset()


def _committed(drafter: DraftRunner, ids: torch.Tensor, taps: torch.Tensor) -> None:
    """Tell the drafter about newly committed tokens: their target taps, and their ids if it
    wants them (the OracleDrafter does; DFlash needs only the taps)."""
    drafter.append_context(taps)
    observe = getattr(drafter, "observe", None)
    if observe is not None:
        observe(ids)


# ----------------------------------------------------------------------------- DDTree


def _draft(
    drafter: DraftRunner, root: int, position: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter pass over [root, MASK x L] -> top-K ids [1, L, K], log-probs [1, L, K] f32."""
    draft_logits = drafter.draft_logits(root, position)  # [L, V]
    return topk_logprobs_from_logits(draft_logits[None].float(), topk)


def _roots(root: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([root], dtype=torch.long, device=like.device)  # [1]


def _verify(target: TargetRunner, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """One target pass over the whole tree -> logits [N, V] and taps [N, n_taps * H]."""
    return target.verify(tree.tokens[0], tree.parents[0], tree.depth[0], tree.visibility[0])


def _penalty_state(
    penalties: Penalties | None, prompt: torch.Tensor, vocab: int, eos: set[int]
) -> PenaltyState | None:
    """The request's penalty context over a vocabulary of `vocab` logits, or None when it has
    no penalty."""
    if penalties is None or penalties == Penalties():
        return None
    return PenaltyState(penalties, prompt, vocab, sorted(eos))


def _accept(
    sampler: Sampler, tree: DraftTree, node_logits: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, AcceptResult]:
    """The target's own token at every node (greedy or one sample each), then the walk."""
    target_tokens = sampler(node_logits)[None]  # [1, N]
    return target_tokens, accept_walk(tree, target_tokens, max_depth)


def _commit(
    target: TargetRunner,
    drafter: DraftRunner,
    tree: DraftTree,
    accept: AcceptResult,
    node_taps: torch.Tensor,
) -> list[int]:
    """Keep the root + accepted nodes in the target, feed their taps to the drafter.
    -> the round's emitted tokens (accepted drafts, then the bonus)."""
    num_accepted = int(accept.num_accepted[0])
    path = accept.path[0, : num_accepted + 1]  # [a + 1] node indices, root first
    target.commit(path)
    _committed(drafter, tree.tokens[0, path], node_taps[path])
    return accept.emitted[0, : num_accepted + 1].tolist()


@torch.no_grad()
def generate(
    target: TargetRunner,
    drafter: DraftRunner,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    budget: int,
    topk: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    penalties: Penalties | None = None,
    on_round: Callable[[RoundTrace], None] | None = None,
) -> GenerationResult:
    """DDTree speculative decoding; the output is distributed exactly as `generate_plain`'s
    (with `penalties` too: every node's logits carry the penalties of its own path)."""
    device = _device_of(target)
    prompt = _as_prompt(prompt_ids, device)  # [T]
    check_generation_args(target, drafter, prompt.numel(), max_new_tokens, budget=budget, topk=topk)
    sampler = Sampler(temperature, top_p, top_k, seed, device)
    eos, timings = _eos_set(eos_token_id), {}
    depth = drafter.block_size - 1  # L

    with _clock(timings, "prefill"):
        _reset(drafter)
        logits, taps = target.prefill(prompt)  # [T, V], [T, n_taps * H]
        _committed(drafter, prompt, taps)
        pen = _penalty_state(penalties, prompt, logits.shape[-1], eos)
        root = int(sampler(pen.step(logits[-1:]) if pen else logits[-1:])[0])
    tokens: list[int] = []
    accept_lengths: list[int] = []
    done = _emit(tokens, [root], max_new_tokens, eos)
    if pen:
        pen.observe([root])
    while not done:
        position = target.committed_len
        with _clock(timings, "draft"):
            topk_ids, topk_lps = _draft(drafter, root, position, topk)  # [1, L, K] each
        with _clock(timings, "build"):
            tree = build_tree(_roots(root, topk_ids), topk_ids, topk_lps, budget)  # [1, N]
        with _clock(timings, "verify"):
            node_logits, node_taps = _verify(target, tree)  # [N, V], [N, n_taps * H]
            if pen:
                node_logits = pen.tree(node_logits, tree.tokens, tree.visibility, tree.depth)
        with _clock(timings, "accept"):
            target_tokens, accept = _accept(sampler, tree, node_logits, depth)
        with _clock(timings, "commit"):
            emitted = _commit(target, drafter, tree, accept, node_taps)  # a + 1 tokens
        if on_round is not None:
            on_round(RoundTrace(topk_ids, tree, target_tokens, accept, position))
        accept_lengths.append(len(emitted))
        root = emitted[-1]
        done = _emit(tokens, emitted, max_new_tokens, eos)
        if pen:
            pen.observe(emitted)
    return GenerationResult(tokens, accept_lengths, len(accept_lengths), timings)


def generate_chain(
    target: TargetRunner,
    drafter: DraftRunner,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    **kwargs,
) -> GenerationResult:
    """Chain DFlash: the DDTree loop with topk=1 and budget=B-1 (the argmax chain, verified as
    a path; the tree module tests that this tree is exactly the chain)."""
    return generate(
        target, drafter, prompt_ids, max_new_tokens, budget=drafter.block_size - 1, topk=1, **kwargs
    )


# ----------------------------------------------------------------------------- ground truth


def _plain_model(target: nn.Module | TargetRunner) -> nn.Module:
    """The HF causal LM behind a runner (or the model itself)."""
    if isinstance(target, nn.Module) and hasattr(target, "lm_head"):
        return target
    return target.model


@torch.no_grad()
def generate_plain(
    target: nn.Module | TargetRunner,
    prompt_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    penalties: Penalties | None = None,
) -> GenerationResult:
    """Token-by-token decoding with the target model's own transformers cache (no speculation),
    `penalties` applied to each step's logits as SGLang's penalizers would.

    `target` is the HF model or a runner holding it as `.model`; the runner's own state is not
    touched. Each step is one emitted token (accept_lengths are all 1).
    """
    model = _plain_model(target)
    device = next(model.parameters()).device
    prompt = _as_prompt(prompt_ids, device)  # [T]
    check_prompt(prompt.numel(), max_new_tokens, model_limits(model).max_position_embeddings)
    sampler = Sampler(temperature, top_p, top_k, seed, device)
    eos, timings = _eos_set(eos_token_id), {}
    tokens: list[int] = []
    input_ids, cache, done = prompt[None], None, False  # [1, T]
    vocab = model.get_output_embeddings().weight.shape[0]  # the logits' width
    pen = _penalty_state(penalties, prompt, vocab, eos)
    with _clock(timings, "decode"):
        while not done:
            start = prompt.numel() + len(tokens) - input_ids.shape[1]
            positions = torch.arange(start, start + input_ids.shape[1], device=device)[None]
            out = model(
                input_ids=input_ids,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            step = out.logits[0, -1:]
            token = int(sampler(pen.step(step) if pen else step)[0])
            done = _emit(tokens, [token], max_new_tokens, eos)
            if pen:
                pen.observe([token])
            input_ids = torch.tensor([[token]], device=device)  # [1, 1]
    return GenerationResult(tokens, [1] * len(tokens), len(tokens), timings)


class _ModelLimits(NamedTuple):
    vocab_size: int
    max_position_embeddings: int | None


def model_limits(model: nn.Module) -> _ModelLimits:
    """vocab size and context length of an HF model (text config for multimodal ones)."""
    config = model.config.get_text_config()
    return _ModelLimits(config.vocab_size, getattr(config, "max_position_embeddings", None))


# ----------------------------------------------------------------------------- loading

_TARGET_CLASSES = {  # config `architectures` -> transformers class name
    "Qwen3ForCausalLM": "Qwen3ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForConditionalGeneration",
    "Qwen3_5ForCausalLM": "Qwen3_5ForCausalLM",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_config(model_dir: str | Path, what: str) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{what} directory {str(model_dir)!r} has no config.json")
    return json.loads(path.read_text())


def target_class_name(config: dict) -> str:
    """The transformers class for a target config's `architectures`, or a ValueError."""
    architectures = config.get("architectures") or []
    known = [a for a in architectures if a in _TARGET_CLASSES]
    if not known:
        raise ValueError(
            f"target architectures {architectures} not supported; expected one of "
            f"{sorted(_TARGET_CLASSES)}"
        )
    return _TARGET_CLASSES[known[0]]


def _load_target_model(target_dir: str | Path, dtype: torch.dtype, device: str) -> nn.Module:
    import transformers

    cls = getattr(transformers, target_class_name(_read_config(target_dir, "target")))
    model = cls.from_pretrained(
        str(target_dir), dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()


def load_pair(
    target_dir: str | Path,
    draft_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    tokenizer: object = None,
) -> tuple[TargetRunner, DraftRunner, object]:
    """-> (HFTargetRunner, DFlashDraftRunner bound to the target's embeddings and lm_head,
    tokenizer). The taps are the draft's dflash_config.target_layer_ids. `tokenizer`: the
    target's, when the caller has loaded it already (the CLI does, to check the prompt)."""
    from transformers import AutoTokenizer

    from sglang_ddtree.reference.dflash import DFlashDraftRunner
    from sglang_ddtree.reference.target import HFTargetRunner

    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    _read_config(draft_dir, "draft")  # a clear error before loading the target
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    model = _load_target_model(target_dir, dtype, device)
    # The runner checks the draft against the target: hidden size, vocab, block size, taps,
    # and the mask token (config id, else the tokenizer's id for dflash_config.mask_token).
    drafter = DFlashDraftRunner(
        str(draft_dir),
        model.get_input_embeddings(),
        model.get_output_embeddings(),
        dtype,
        device,
        target_num_layers=model.config.get_text_config().num_hidden_layers,
        tokenizer=tokenizer,
    )
    target = HFTargetRunner(model, list(drafter.target_layer_ids))
    return target, drafter, tokenizer
