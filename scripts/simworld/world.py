"""The simulated world: a synthetic drafter and target, for benchmarks at real shapes with dummy
weights (benchmark tooling: the package does not import it; docs/simulation.md).

Dummy weights give the real cost of every kernel, but their drafts are never accepted, so an
end-to-end benchmark on them says nothing about speed. Under a simulated world two things, and
nothing else, come from here instead of the models:

- the drafter's per-position distributions (what DFlash's one block pass proposes): at depth d a
  top-1 probability p_d drawn around the regime's mean m_d (with probability `shared` the round's
  one draw, a difficulty carried across depths), then ranks 2.. geometric in `ratio`;
- the target's token at each verified node: rank 1 of the next depth with the drafter's p_d (a
  calibrated top-1), ranks 2.. geometric in `miss_ratio` (by default the drafter's `ratio`: a
  drafter calibrated past rank 1), its match probabilities multiplied by `off_spine` below a node
  that is not the drafter's top-1 (a drafter conditioned on the top-1 path is right less often
  off it).

Every draw is a hash of (seed, the round's root position, the root token, what is drawn), so a
round is a pure function of where it starts; the chain (DFLASH) and the tree (DDTREE) read the
same world, and the same rounds of the reference engine (`SimulatedDrafter`, `SimulatedTarget`)
give the same trees and the same accepted paths. All functions are static-shape tensor code
without host synchronisation, so they run inside CUDA graphs.

Chain acceptance: the top-1 path accepts depth d with probability E[p_1 ... p_d], which is
m_1 ... m_d for independent depths (shared 0) and a polynomial's integral over the round's draw
otherwise (`chain_acceptance`), so the regimes are calibrated by their means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from simworld import VARIABLE

RANKS = 16  # the world's ranked tokens per depth (a tree may read up to this many)
MASK32 = 0xFFFFFFFF
FIRST_ID = 16  # token ids are drawn from [FIRST_ID, vocab): clear of the lowest special ids


@dataclass(frozen=True)
class World:
    """A regime: `top1` the mean top-1 probability at depths 1, 2, ... (the last repeats for
    deeper ones); p_d is uniform on m_d +- h_d, h_d = spread * min(m_d, 1 - m_d) or less where
    that would let p_d fall to `top1_floor` (tail > 0: p_d = 1 - (1 - m_d)(1 + tail) u^tail
    instead, mostly near 1 with a tail of hard positions, spread unused), its uniform u the
    round's own (one per round) with probability `shared`, else the depth's; the drafter's rank r >= 2 holds
    (1 - p_d)(1 - ratio) ratio^(r - 2), the target's (1 - p_d)(1 - m) m^(r - 2) with
    m = miss_ratio (None: ratio); every match probability below a node that is not the top-1
    of its depth is multiplied by off_spine. tail 0, shared 0 and miss_ratio None are the world
    before any of them existed, draw for draw."""

    name: str
    top1: tuple[float, ...]
    spread: float = 0.5
    ratio: float = 0.5
    off_spine: float = 0.3
    seed: int = 0
    shared: float = 0.0
    miss_ratio: float | None = None
    tail: float = 0.0

    def __post_init__(self) -> None:
        if not self.top1 or not all(0.0 < m < 1.0 for m in self.top1):
            raise ValueError(f"top1 means must lie in (0, 1), got {self.top1}")
        for name in ("spread", "ratio", "off_spine", "shared", "miss_ratio"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value}")
        if self.tail < 0.0:
            raise ValueError(f"tail must be >= 0, got {self.tail}")
        if self.tail and min(self.top1) <= self.least_mean:
            raise ValueError(
                f"tail {self.tail} lets p_d fall to 1 - (1 - m)(1 + tail) <= "
                f"{self.top1_floor:.3f} at the least mean {min(self.top1)}: lower it"
            )
        if min(self.top1) <= self.top1_floor:
            raise ValueError(
                f"top-1 means must exceed (1 - ratio) / (2 - ratio) = "
                f"{self.top1_floor:.3f}, or rank 2 could outweigh rank 1"
            )

    @property
    def top1_floor(self) -> float:
        """The least p_d that is still its depth's most likely token (rank 2 holds
        (1 - p_d)(1 - ratio)): the draws around m_d stay above it."""
        return (1.0 - self.ratio) / (2.0 - self.ratio)

    @property
    def least_mean(self) -> float:
        """The least top-1 mean this world's draws allow: above top1_floor, and under a tail
        with 1 - (1 - m)(1 + tail) above it too."""
        return 1.0 - (1.0 - self.top1_floor) / (1.0 + self.tail)

    def means(self, depths: int) -> list[float]:
        return [self.top1[min(d, len(self.top1) - 1)] for d in range(depths)]

    def describe(self) -> str:
        means = ", ".join(f"{m:.3f}" for m in self.top1)
        extra = f", tail {self.tail}" if self.tail else ""
        extra += f", shared {self.shared}" if self.shared else ""
        if self.miss_ratio is not None:
            extra += f", miss ratio {self.miss_ratio}"
        return (
            f"{self.name}: top-1 means {means} (the last repeats), spread {self.spread}, "
            f"ratio {self.ratio}, off-spine {self.off_spine}{extra}, seed {self.seed}"
        )

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "top1": list(self.top1),
            "spread": self.spread,
            "ratio": self.ratio,
            "off_spine": self.off_spine,
            "seed": self.seed,
            "shared": self.shared,
            "miss_ratio": self.miss_ratio,
            "tail": self.tail,
        }

    def half_widths(self, means: torch.Tensor) -> torch.Tensor:
        """h_d per mean: spread * min(m, 1 - m), narrowed to keep p_d above top1_floor."""
        return torch.minimum(
            self.spread * torch.minimum(means, 1.0 - means), means - self.top1_floor
        )

    # -- the draws -----------------------------------------------------------------------------
    def keys(self, position: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """[bs] int64 round keys from the root's position and token."""
        return _mix(_mix(position.long() ^ (self.seed & MASK32)) ^ (root.long() & MASK32))

    def means_on(self, depths: int, device) -> torch.Tensor:
        """[depths] float32 top-1 means on `device`: made once, before any CUDA graph capture
        (a host copy cannot be captured), and passed to the draws as `means`."""
        return torch.tensor(self.means(depths), dtype=torch.float32, device=device)

    def probabilities(
        self, keys: torch.Tensor, depths: int, means: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[bs, depths, RANKS] float32: the drafter's rank probabilities per depth (their sum
        is below 1 by the mass past RANKS); `means` from means_on, at least `depths` long
        (None: made here)."""
        return self._ranked(self.top1_draws(keys, depths, means), self.ratio)

    def target_probabilities(
        self, keys: torch.Tensor, depths: int, means: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[bs, depths, RANKS] float32: the target's rank probabilities per depth, the
        drafter's top-1 and, past it, ranks geometric in miss_ratio (None: the drafter's)."""
        p1 = self.top1_draws(keys, depths, means)
        return self._ranked(p1, self.ratio if self.miss_ratio is None else self.miss_ratio)

    def top1_draws(
        self, keys: torch.Tensor, depths: int, means: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[bs, depths] float32 p_d: uniform on m_d +- h_d (tail > 0: 1 - (1 - m_d)(1 + tail)
        u^tail, mean m_d), the uniform u the round's own with probability `shared` (a coin per
        depth), else the depth's."""
        if means is None:
            means = self.means_on(depths, keys.device)
        means = means[:depths]
        depth = torch.arange(depths, device=keys.device)
        u = _uniform(keys[:, None], depth[None, :], 0x51ED)  # [bs, depths]
        coin = _uniform(keys[:, None], depth[None, :], 0x5A4E)  # [bs, depths]
        own = _uniform(keys, torch.zeros_like(keys), 0x40E7)  # [bs]: the round's draw
        u = torch.where(coin < self.shared, own[:, None], u)  # shared 0: every depth its own
        if self.tail:
            return 1.0 - (1.0 - means) * (1.0 + self.tail) * u**self.tail
        return means + self.half_widths(means) * (2.0 * u - 1.0)

    @staticmethod
    def _ranked(p1: torch.Tensor, ratio: float) -> torch.Tensor:
        """[bs, depths, RANKS]: p1 [bs, depths], then ranks 2..RANKS (1 - p1)(1 - ratio) ratio^k."""
        ranks = torch.arange(RANKS - 1, device=p1.device, dtype=torch.float32)
        tail = (1.0 - ratio) * ratio**ranks  # ranks 2..RANKS, shares of 1 - p1
        rest = (1.0 - p1)[..., None] * tail
        return torch.cat([p1[..., None], rest], dim=-1)

    def token_ids(self, keys: torch.Tensor, depths: int, vocab: int) -> torch.Tensor:
        """[bs, depths, RANKS + 1] int64: the ranked tokens per depth, then the token the target
        picks past them (a miss); distinct within a depth."""
        span = vocab - FIRST_ID
        if span < RANKS + 1:
            raise ValueError(
                f"a simulated world needs a vocabulary of {FIRST_ID + RANKS + 1} "
                f"tokens or more, got {vocab}"
            )
        depth = torch.arange(depths, device=keys.device)
        base = _mix(keys[:, None] ^ _mix(depth[None, :] + 0x7A3)) % span  # [bs, depths]
        step = span // (RANKS + 1)
        rank = torch.arange(RANKS + 1, device=keys.device)
        return FIRST_ID + (base[..., None] + rank * step) % span

    def draft(
        self,
        position: torch.Tensor,
        root: torch.Tensor,
        depths: int,
        topk: int,
        vocab: int,
        means: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's top-K at depths 1..depths: (ids [bs, depths, K] int64, log-probs
        [bs, depths, K] float32), as topk_logprobs_from_logits returns them."""
        if not 1 <= topk <= RANKS:
            raise ValueError(f"a simulated world ranks {RANKS} tokens per depth; topk {topk}")
        keys = self.keys(position, root)
        ids = self.token_ids(keys, depths, vocab)[..., :topk]
        return ids, self.probabilities(keys, depths, means)[..., :topk].log()

    def target_tokens(
        self,
        position: torch.Tensor,
        root: torch.Tensor,
        tokens: torch.Tensor,
        depth: torch.Tensor,
        visibility: torch.Tensor,
        vocab: int,
        means: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The target's token at each node of trees [bs, N] (node 0 the root; visibility
        [bs, N, N] ancestors-or-self): drawn at the depth below the node among that depth's
        ranked tokens by the target's rank probabilities, times off_spine below a node off the
        top-1 path."""
        keys = self.keys(position, root)
        depth = depth.long()
        depths = depth_bound(tokens.shape[1])
        ids = self.token_ids(keys, depths + 1, vocab)  # [bs, depths + 1, RANKS + 1]
        probs = self.target_probabilities(keys, depths + 1, means)  # [bs, depths + 1, RANKS]
        bs, n = tokens.shape
        # a node is on the spine when it and each ancestor is its depth's top-1 (the root is)
        at = depth.clamp(min=1) - 1  # the node's own depth, 0-based (the root reads depth 1)
        top1 = ids[:, :, 0].gather(1, at)  # [bs, N]
        own_top1 = (tokens.long() == top1) | (depth == 0)
        off = (visibility & ~own_top1[:, None, :]).any(dim=-1)  # [bs, N]
        scale = torch.where(off, self.off_spine, 1.0)  # [bs, N]
        below = depth.clamp(max=depths)  # the depth under the node, 0-based index = depth
        p = probs.gather(1, below[..., None].expand(bs, n, RANKS)) * scale[..., None]
        # each node's draw is keyed by its path (a sum over its ancestors-or-self, one per
        # depth, of hashed (depth, token)): the same path draws the same in any tree or chain
        step = _mix(tokens.long() ^ _mix(depth + 0x9E37))  # [bs, N]
        path = (visibility.long() * step[:, None, :]).sum(dim=-1) & MASK32
        u = _uniform(keys[:, None], path, 0xC0DE)
        rank = (p.cumsum(dim=-1) < u[..., None]).sum(dim=-1)  # [bs, N] in 0..RANKS
        node_ids = ids.gather(1, below[..., None].expand(bs, n, RANKS + 1))
        return node_ids.gather(2, rank[..., None]).squeeze(-1)

    def chain(
        self,
        position: torch.Tensor,
        root: torch.Tensor,
        block: int,
        vocab: int,
        means: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain of a block of `block` tokens [root, drafts...]: (drafts [bs, block - 1], the
        target's token at each of the block's positions [bs, block]), the top-1 path of the
        same world the trees read."""
        ids, _ = self.draft(position, root, block - 1, 1, vocab, means)
        drafts = ids[..., 0]
        tokens = torch.cat([root.long()[:, None], drafts], dim=1)
        depth = torch.arange(block, device=root.device).expand_as(tokens)
        visibility = torch.ones(block, block, dtype=torch.bool, device=root.device).tril()
        visibility = visibility.expand(tokens.shape[0], block, block)
        return drafts, self.target_tokens(position, root, tokens, depth, visibility, vocab, means)


def depth_bound(nodes: int) -> int:
    """The deepest depth a tree of `nodes` nodes can hold (a path), the draws' static bound."""
    return max(nodes - 1, 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors (constants below 2^31: no int64 overflow)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def _uniform(keys: torch.Tensor, index: torch.Tensor, salt: int) -> torch.Tensor:
    """Uniform float32 in [0, 1) per (key, index), broadcast."""
    h = _mix(_mix(keys ^ salt) ^ index.long())
    return (h >> 8).float() * (1.0 / (1 << 24))


def _constant(acceptance: float, depths: int = 15) -> float:
    """The per-depth mean whose chain of `depths` drafts has this mean accepted length,
    1 + sum a^d (the bonus counted), by bisection."""
    lo, hi = 1e-6, 1.0 - 1e-9
    for _ in range(80):
        a = (lo + hi) / 2
        if 1 + sum(a**d for d in range(1, depths + 1)) < acceptance:
            lo = a
        else:
            hi = a
    return round((lo + hi) / 2, 4)


def _per_depth(cumulative: tuple[float, ...]) -> tuple[float, ...]:
    """Per-depth means from a chain's cumulative acceptance (each over the one before)."""
    return tuple(round(b / a, 4) for a, b in zip((1.0, *cumulative[:-1]), cumulative, strict=True))


def chain_acceptance(world: World, depths: int) -> list[float]:
    """P(the chain accepts depth d) for d = 1..depths: E[p_1 ... p_d]. Given the round's own
    uniform u the depths are independent with E[p_e | u] = m_e + shared b_e y, where y = 2u - 1
    and b_e = h_e (E[y^k] = 1 / (k + 1) for even k, else 0) or, under a tail, y = u^tail and
    b_e = -(1 - m_e)(1 + tail) (E[y^k] = 1 / (tail k + 1)): the mean of a polynomial in y, exact
    from its coefficients (shared 0: the product of the means)."""
    means = world.means(depths)
    if not world.shared:
        return [math.prod(means[:d]) for d in range(1, depths + 1)]
    if world.tail:
        slopes = [-(1.0 - m) * (1.0 + world.tail) for m in means]
        moments = [1.0 / (world.tail * k + 1.0) for k in range(depths + 1)]
    else:
        slopes = world.half_widths(torch.tensor(means, dtype=torch.float64)).tolist()
        moments = [1.0 / (k + 1.0) if k % 2 == 0 else 0.0 for k in range(depths + 1)]
    poly, out = [1.0], []  # coefficients of y^0, y^1, ...
    for m, slope in zip(means, slopes, strict=True):
        # E[p | u] = a + b y: the uniform draw m + h y; the tail's 1 - (1 - m)(1 + tail) y
        a = m + world.shared * (1.0 - m) if world.tail else m
        b = world.shared * slope
        poly = [c * a + (poly[k - 1] * b if k else 0.0) for k, c in enumerate([*poly, 0.0])]
        out.append(sum(c * moments[k] for k, c in enumerate(poly)))
    return out


def matching_means(world: World, survival: tuple[float, ...]) -> tuple[float, ...]:
    """Per-depth means whose chain accepts depth d with probability survival[d - 1] under this
    world's spread, shared and ratio, depth by depth by bisection (E[p_1 ... p_d] rises with
    m_d), to 4 decimals."""
    means: list[float] = []
    for target in survival:
        lo, hi = world.least_mean + 1e-6, 1.0 - 1e-6
        for _ in range(60):
            mid = (lo + hi) / 2
            trial = replace(world, top1=(*means, mid))
            if chain_acceptance(trial, len(means) + 1)[-1] < target:
                lo = mid
            else:
                hi = mid
        means.append(round((lo + hi) / 2, 4))
    return tuple(means)


def chain_tau(world: World, depths: int) -> float:
    """The chain's mean tokens per round (accepted drafts + the bonus)."""
    return 1.0 + sum(chain_acceptance(world, depths))


# Published cumulative per-position chain acceptance of a Qwen3.6-27B DFlash fine-tune:
# 0.600, 0.385, 0.215, 0.108, 0.062 -> per-depth means 0.600, 0.642, 0.558, 0.502, 0.574.
_FINE_TUNE = (0.600, 0.385, 0.215, 0.108, 0.062)
REGIMES = {
    "fine_tune": World("fine_tune", _per_depth(_FINE_TUNE)),
    # narrative text: chain tau near 3.7 at block 16
    "narrative": World("narrative", (_constant(3.7),)),
    # code and math: chain tau near 8 at block 16 (z-lab's Qwen3.5-27B DFlash card: 7-9)
    "code": World("code", (_constant(8.0),)),
}
# The DDTree paper's (Ringel & Romano, arXiv 2604.12989) Figure 4 chain histogram, Qwen3-8B
# MATH-500 at T = 0, block 16: the fraction of rounds at accepted lengths 1..16, bonus included
# (docs/data/ddtree_paper_acceptance.jsonl); the `ddtree_paper` world's chain accepts each depth
# as it does, under the parameters scripts/simworld/fit.py fitted to the tree's Figures 3 and 4.
PAPER_CHAIN_HISTOGRAM = tuple(
    x / 100
    for x in (10.253, 11.887, 9.966, 8.212, 6.968, 5.525, 4.52, 4.066)
    + (3.628, 3.301, 2.966, 2.782, 2.607, 2.352, 2.344, 18.624)
)
PAPER_FIT = {"tail": 4.0, "shared": 0.3, "ratio": 0.6, "miss_ratio": 0.05, "off_spine": 0.8}


def chain_survival(histogram: tuple[float, ...]) -> tuple[float, ...]:
    """P(the chain accepts depth d), d = 1..len - 1, from a histogram of accepted lengths."""
    total = sum(histogram)
    return tuple(sum(histogram[k:]) / total for k in range(1, len(histogram)))


def histogram_world(name: str, histogram: tuple[float, ...], **params) -> World:
    """A world with these parameters whose chain accepts each depth as the histogram of its
    accepted lengths says (the means matched under these parameters)."""
    draft = World(name, (0.9,), **params)
    return replace(draft, top1=matching_means(draft, chain_survival(histogram)))


REGIMES["ddtree_paper"] = histogram_world("ddtree_paper", PAPER_CHAIN_HISTOGRAM, **PAPER_FIT)
MID_REGIME = "narrative"
PARAMETERS = ("spread", "ratio", "off_spine", "seed", "shared", "miss_ratio", "tail")


def parse(value: str | None) -> World | None:
    """A world's name as DDTREE_SIMULATE (and bench_round.py's --simulate) gives it: a regime's
    name, optionally with overrides, `code:off_spine=0.5,seed=3`; empty or None: no world."""
    if not value:
        return None
    name, _, rest = value.partition(":")
    if name not in REGIMES:
        raise ValueError(f"{VARIABLE}: unknown regime {name!r}; one of {', '.join(REGIMES)}")
    world = REGIMES[name]
    changes: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        if key not in PARAMETERS:
            raise ValueError(f"{VARIABLE}: unknown parameter {key!r} ({', '.join(PARAMETERS)})")
        try:
            changes[key] = int(raw) if key == "seed" else float(raw)
        except ValueError:
            raise ValueError(f"{VARIABLE}: {key}={raw!r} is not a number") from None
    return replace(world, **changes)


# -- the reference engine's runners over a world (reference/base.py's contracts) --------------


class SimulatedDrafter:
    """A DraftRunner whose logits put the world's log-probabilities on its ranked tokens and
    spread the rest evenly over the vocabulary (so top-K log-softmax returns them exactly)."""

    def __init__(self, world: World, block_size: int, vocab: int) -> None:
        self.world, self.block_size, self.vocab = world, block_size, vocab

    def append_context(self, taps: torch.Tensor) -> None:
        del taps

    def draft_logits(self, bonus: int, position: int) -> torch.Tensor:
        L = self.block_size - 1
        keys = self.world.keys(torch.tensor([position]), torch.tensor([bonus]))
        probs = self.world.probabilities(keys, L)[0].double()  # [L, RANKS]
        ids = self.world.token_ids(keys, L, self.vocab)[0, :, :RANKS]
        rest = (1.0 - probs.sum(-1, keepdim=True)).clamp(min=1e-30) / (self.vocab - RANKS)
        logits = rest.log().expand(L, self.vocab).clone()
        logits.scatter_(1, ids, probs.log())
        return logits.float()


class SimulatedTarget:
    """A TargetRunner whose logits pick the world's token at each node (its logit 0, the rest
    -inf); committed_len follows the commits."""

    def __init__(self, world: World, vocab: int) -> None:
        self.world, self.vocab_size, self.committed_len = world, vocab, 0

    def parameters(self):
        """The engine reads its device from the first parameter (this runner's: the CPU)."""
        yield torch.zeros(0)

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.committed_len = int(input_ids.numel())
        logits = torch.full((input_ids.numel(), self.vocab_size), -math.inf)
        logits[:, FIRST_ID] = 0.0  # the first root: any fixed token
        return logits, torch.zeros(input_ids.numel(), 1)

    def verify(self, tokens, parents, depth, visibility):
        del parents
        position = torch.tensor([self.committed_len])
        picks = self.world.target_tokens(
            position, tokens[:1], tokens[None], depth[None], visibility[None], self.vocab_size
        )[0]
        logits = torch.full((tokens.numel(), self.vocab_size), -math.inf)
        logits.scatter_(1, picks[:, None], 0.0)
        return logits, torch.zeros(tokens.numel(), 1)

    def commit(self, path: torch.Tensor) -> None:
        self.committed_len += int(path.numel())
