"""The shared training loop: AdamW, linear warmup + cosine decay, a time budget, bf16 autocast.

Step counts. A stage runs `hp.steps` steps when given (the toy recipe, or `--target-steps` /
`--draft-steps`). Otherwise it *plans* them: the first CALIBRATION_STEPS steps (all inside the
warmup, whose length does not depend on the total) are timed, and the total becomes the number
of steps that fit the stage's budget, rounded down to a multiple of `hp.round_steps_to`. The
weights then depend on the seed and that step count only; the report records the count, and
passing it back reproduces the run. A hard deadline (budget x 1.1 + 15 s) stops a stage that
runs long; the report then says `stopped_early`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from sglang_ddtree.training.config import StageHParams

CALIBRATION_STEPS = 10  # steps 3..9 are timed (the first ones pay for warm-up)
_TIMED_FROM = 3
_UNPLANNED = 1 << 62  # the step count before calibration has planned it


@dataclass
class StageResult:
    name: str
    steps: int
    planned_steps: int
    step_source: str  # "fixed" (given) or "planned" (from the calibration timing)
    stopped_early: bool
    seconds: float
    tokens: int
    tokens_per_s: float
    calibration_step_s: float | None
    peak_memory_gib: float | None = None  # CUDA only: torch.cuda.max_memory_allocated
    losses: list[tuple[int, float]] = field(default_factory=list)  # (last step, mean loss)

    def to_json(self) -> dict:
        return asdict(self)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; float32 (no autocast) on CPU, so CPU runs are exact and testable."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, hp: StageHParams, total: int) -> float:
    """Linear warmup over hp.warmup_steps, then cosine from hp.lr to hp.lr * min_lr_ratio."""
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return hp.lr * (hp.min_lr_ratio + (1.0 - hp.min_lr_ratio) * cosine)


def make_adamw(module: nn.Module, hp: StageHParams) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases, A_log, dt_bias, conv)."""
    decay, no_decay = [], []
    for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            (decay if p.ndim == 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": hp.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=hp.lr, betas=hp.betas, foreach=True)


def plan_steps(done: int, step_s: float, remaining_s: float, hp: StageHParams) -> int:
    """Total steps that fit: done + remaining / step time, rounded down, at least warmup + 1."""
    total = done + int(remaining_s / max(step_s, 1e-9))
    total = (total // hp.round_steps_to) * hp.round_steps_to
    return max(total, hp.warmup_steps + 1, done)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log(name: str, step: int, total: int, loss: float, lr: float, seconds: float) -> None:
    of = "?" if total >= _UNPLANNED else str(total)
    print(
        f"[{name}] step {step}/{of} loss {loss:.4f} lr {lr:.2e} {seconds:.1f}s",
        file=sys.stderr,
        flush=True,
    )


class _Planner:
    """Times steps _TIMED_FROM..CALIBRATION_STEPS and then fixes the total (planned runs only)."""

    def __init__(self, hp: StageHParams, budget_s: float, device: torch.device, start: float):
        self.hp, self.budget_s, self.device, self.start = hp, budget_s, device, start
        self.total = hp.steps if hp.steps is not None else _UNPLANNED
        self.step_s: float | None = None
        self._t0 = start

    def after_step(self, step: int) -> int:
        """Called with the number of finished steps; returns the (possibly new) total."""
        if self.hp.steps is None and step in (_TIMED_FROM, CALIBRATION_STEPS):
            _sync(self.device)
            now = time.perf_counter()
            if step == _TIMED_FROM:
                self._t0 = now
            else:
                self.step_s = (now - self._t0) / (CALIBRATION_STEPS - _TIMED_FROM)
                remaining = self.budget_s - (now - self.start)
                self.total = plan_steps(step, self.step_s, remaining, self.hp)
        return self.total


def _optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, clip: float):
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    params = [p for g in opt.param_groups for p in g["params"]]
    torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_loop(
    name: str,
    module: nn.Module,
    step_fn: Callable[[int], tuple[torch.Tensor, int]],
    hp: StageHParams,
    budget_s: float,
    device: torch.device,
) -> StageResult:
    """Run step_fn(step) -> (loss, tokens) with backward / clip / AdamW until the step count."""
    if hp.steps is None and hp.warmup_steps < CALIBRATION_STEPS:
        raise ValueError(
            f"planned step counts need warmup_steps >= {CALIBRATION_STEPS} (calibration happens "
            f"inside the warmup), got {hp.warmup_steps}"
        )
    module.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    opt = make_adamw(module, hp)
    start = time.perf_counter()
    deadline = start + 1.1 * budget_s + 15.0
    planner = _Planner(hp, budget_s, device, start)
    source = "fixed" if hp.steps is not None else "planned"
    result = StageResult(name, 0, planner.total, source, False, 0.0, 0, 0.0, None)
    pending: list[torch.Tensor] = []
    step, total = 0, planner.total
    while step < total:
        if time.perf_counter() > deadline:
            result.stopped_early = True
            break
        lr = lr_at(step, hp, total)
        loss, tokens = step_fn(step)
        _optimizer_step(opt, loss, lr, hp.grad_clip)
        pending.append(loss.detach())
        result.tokens += tokens
        step += 1
        total = planner.after_step(step)
        if step % hp.log_every == 0 or step == total:
            result.losses.append((step, torch.stack(pending).float().mean().item()))
            pending.clear()
            _log(name, step, total, result.losses[-1][1], lr, time.perf_counter() - start)
    if pending:  # stopped early between two log points
        result.losses.append((step, torch.stack(pending).float().mean().item()))
    return _finish(result, module, device, step, total, start, planner.step_s)


def _finish(result, module, device, step, total, start, step_s) -> StageResult:
    _sync(device)
    if device.type == "cuda":
        result.peak_memory_gib = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    module.eval()
    result.steps, result.planned_steps, result.calibration_step_s = step, total, step_s
    result.seconds = time.perf_counter() - start
    result.tokens_per_s = result.tokens / max(result.seconds, 1e-9)
    return result
