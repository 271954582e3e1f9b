"""T > 0: DDTree's emitted tokens are distributed exactly like plain sampling from the target.

Setup: a tiny seeded Qwen3 target verified by HFTargetRunner, the OracleDrafter (drafts ranked
by the target's own logits, so round 1 often accepts depth 1-3 nodes, side branches included),
temperature 1.5 with top-k 4. The first NUM_TOKENS emitted tokens then have at most
4**NUM_TOKENS outcomes whose exact probabilities we enumerate with plain forwards (no cache):
P(t1..tn) = prod_i softmax(top4(logits(prompt + t<i) / T)). A chi-square goodness-of-fit test
at ALPHA = 1e-3 (cells with expected count < 5 pooled) compares DDTree over seeds 0..SAMPLES-1
with it. Deterministic: fixed checkpoint seed and sampling seeds.

Negative control: the same test must reject a wrong rule, every node's target token sampled
from the root's distribution instead of its own (a "wrong node" bug).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import Qwen3ForCausalLM

from sglang_ddtree.accept.penalties import Penalties, PenaltyState
from sglang_ddtree.checkpoints.tiny import write_tiny_qwen3
from sglang_ddtree.reference import engine
from sglang_ddtree.reference.engine import RoundTrace, generate
from sglang_ddtree.reference.oracle import OracleDrafter
from sglang_ddtree.reference.target import HFTargetRunner
from tests.fixtures import shared_penalties_for_every_node

PROMPT = [100, 200, 300, 400]
TEMPERATURE = 1.5
TOP_K = 4
NUM_TOKENS = 3
ALPHA = 1e-3
SAMPLES = 1500
CONTROL_SAMPLES = 400


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = write_tiny_qwen3(tmp_path_factory.mktemp("qwen3_sampling") / "target", seed=0)
    yield Qwen3ForCausalLM.from_pretrained(path, attn_implementation="sdpa").float().eval()
    torch.set_num_threads(threads)


@torch.no_grad()
def exact_distribution(
    model, prompt: list[int], num_tokens: int, penalties: Penalties | None = None
) -> dict[tuple[int, ...], float]:
    """Plain definition: top-k of logits / T, renormalised, chained over num_tokens steps;
    with `penalties`, each step's logits first penalised by the output tokens before it."""
    dist = {(): 1.0}
    for _ in range(num_tokens):
        prefixes = list(dist)
        ids = torch.tensor([prompt + list(p) for p in prefixes])  # [P, T + len]
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].double()
        if penalties is not None:
            logits = torch.stack(
                [
                    _penalised(row, prompt, list(p), penalties)
                    for row, p in zip(logits, prefixes, strict=True)
                ]
            )
        logits = logits / TEMPERATURE
        values, tokens = logits.topk(TOP_K, dim=-1)  # [P, k]
        probs = values.softmax(dim=-1)  # [P, k]
        dist = {
            prefix + (int(t),): dist[prefix] * float(q)
            for prefix, row_t, row_q in zip(prefixes, tokens, probs, strict=True)
            for t, q in zip(row_t, row_q, strict=True)
        }
    return dist


def _penalised(logits, prompt: list[int], output: list[int], pen: Penalties):
    """One step's penalties, written out token by token (the definition, not the engine's), as
    SGLang 0.5.23 applies them: over the output tokens, the additive ones first, then the
    repetition penalty on the result (`prompt` is not looked at)."""
    out = logits.clone()
    for t in set(output):
        out[t] -= pen.frequency * output.count(t) + pen.presence
        out[t] = out[t] * pen.repetition if out[t] < 0 else out[t] / pen.repetition
    return out


def chi_square_pvalue(counts: Counter, dist: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit; cells with expected < 5 (and any impossible outcome) share one bin."""
    total = sum(counts.values())
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, p in dist.items():
        if p * total >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(p * total)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += p * total
    pooled_obs += sum(n for outcome, n in counts.items() if outcome not in dist)
    if pooled_obs or pooled_exp:
        observed.append(pooled_obs)
        expected.append(max(pooled_exp, 1e-9))
    scale = total / sum(expected)  # exact sums for scipy
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def sample_ddtree(
    model, num_samples: int, penalties: Penalties | None = None
) -> tuple[Counter, Counter]:
    """-> (counts of the first NUM_TOKENS tokens, counts of round-1 accepted depth / side)."""
    target = HFTargetRunner(model, [1])
    oracle = OracleDrafter(model, block_size=4, noise=0.3, lookahead=0)
    counts, shape = Counter(), Counter()
    for seed in range(num_samples):
        traces: list[RoundTrace] = []
        result = generate(
            target,
            oracle,
            PROMPT,
            NUM_TOKENS,
            budget=6,
            topk=3,
            temperature=TEMPERATURE,
            top_k=TOP_K,
            seed=seed,
            on_round=traces.append,
            penalties=penalties,
        )
        counts[tuple(result.tokens)] += 1
        first = traces[0]
        accepted = int(first.accept.num_accepted[0])
        shape[f"depth{accepted}"] += 1
        path = first.accept.path[0, 1 : accepted + 1]
        ranks0 = first.topk_ids[0, first.tree.depth[0, path] - 1, 0]
        shape["side"] += bool((first.tree.tokens[0, path] != ranks0).any())
    return counts, shape


@pytest.mark.slow
def test_ddtree_sampling_matches_target_distribution(model):
    dist = exact_distribution(model, PROMPT, NUM_TOKENS)
    assert abs(sum(dist.values()) - 1) < 1e-9 and len(dist) == TOP_K**NUM_TOKENS
    counts, shape = sample_ddtree(model, SAMPLES)
    # The tree is really exercised: round 1 accepts drafts, deep ones and side branches too.
    assert shape["depth1"] + shape["depth2"] + shape["depth3"] >= SAMPLES // 4, shape
    assert shape["depth2"] + shape["depth3"] >= SAMPLES // 20, shape
    assert shape["side"] >= SAMPLES // 20, shape
    pvalue = chi_square_pvalue(counts, dist)
    assert pvalue > ALPHA, f"DDTree sampling differs from the target's (p={pvalue:.2e})"


@pytest.mark.slow
def test_negative_control_wrong_node_samples_are_detected(model, monkeypatch):
    real = engine.sample_target_tokens

    def root_samples_for_every_node(logits, *args, **kwargs):  # [1, N, V] -> [1, N]
        return real(logits[:, :1].expand_as(logits).contiguous(), *args, **kwargs)

    monkeypatch.setattr(engine, "sample_target_tokens", root_samples_for_every_node)
    dist = exact_distribution(model, PROMPT, NUM_TOKENS)
    counts, _ = sample_ddtree(model, CONTROL_SAMPLES)
    pvalue = chi_square_pvalue(counts, dist)
    assert pvalue < ALPHA, f"the test missed a wrong acceptance rule (p={pvalue:.2e})"


# Negative penalties (SGLang takes frequency / presence in [-2, 2], repetition in (0, 2]) lift the
# tokens already seen, so the root's and the path's tokens become top-4 candidates and each
# node's own counts decide its distribution (positive ones barely move this tiny model's top 4).
PENALTIES = Penalties(frequency=-2.0, presence=-1.0, repetition=0.7)


@pytest.mark.slow
def test_ddtree_sampling_with_penalties_matches_the_penalised_target(model):
    """With frequency, presence and repetition penalties every node samples
    from the distribution its own path gives, so DDTree's tokens follow plain penalised
    sampling exactly."""
    dist = exact_distribution(model, PROMPT, NUM_TOKENS, PENALTIES)
    assert dist != exact_distribution(model, PROMPT, NUM_TOKENS)  # the penalties matter here
    counts, shape = sample_ddtree(model, SAMPLES, PENALTIES)
    assert shape["depth1"] + shape["depth2"] + shape["depth3"] >= SAMPLES // 4, shape
    assert shape["depth2"] + shape["depth3"] >= SAMPLES // 30, shape
    pvalue = chi_square_pvalue(counts, dist)
    assert pvalue > ALPHA, f"DDTree's penalised sampling differs (p={pvalue:.2e})"


@pytest.mark.slow
def test_negative_control_shared_penalty_counts_are_detected(model, monkeypatch):
    """SGLang's linear penalizers on a tree (the output so far for every node, not the node's
    path) sample the wrong distribution below the root; the same test must reject it."""

    monkeypatch.setattr(PenaltyState, "tree", shared_penalties_for_every_node)
    dist = exact_distribution(model, PROMPT, NUM_TOKENS, PENALTIES)
    counts, _ = sample_ddtree(model, CONTROL_SAMPLES, PENALTIES)
    pvalue = chi_square_pvalue(counts, dist)
    assert pvalue < ALPHA, f"the test missed per-node penalty counts (p={pvalue:.2e})"
