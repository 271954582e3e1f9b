"""HFTargetRunner: tree verify equals sequential decoding of every root-to-node path, and commit
equals a plain prefill of the committed tokens (Qwen3 attention-only, Qwen3.5 hybrid GDN).

Tolerance (`assert_close`): |actual - expected| <= tol * (scale + |expected|), scale = max(1,
max |expected|) of the whole tensor, tol = 1e-4 for float32 models and 1e-6 for float64 copies.
The tree path sums in a different order than sequential decoding (an elementwise conv instead of
conv1d, one masked attention over P + N keys instead of P + d + 1, batched delta-rule steps) and
a plain prefill uses the chunked delta-rule kernel instead of the recurrent one. In float32 that
moves results by up to ~5e-6 of the tensor's scale on these models (the residual stream reaches
|x| ~ 70, so a per-element rtol alone would be meaningless for its small entries); 1e-4 leaves
~20x headroom. The float64 copies run verify against sequential decoding: attention and MLPs in
float64, transformers' delta-rule kernels in float32 internally but the same kernel on both sides;
they agree to ~1e-13 (1e-6 only because logits are returned as float32: one ulp). A wrong state
(a sibling's recurrence, a shifted conv window, a wrong RoPE position) moves outputs by >= 1e-2
of scale: the negative control measures that gap.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from sglang_ddtree.checkpoints.tiny import write_tiny_qwen3, write_tiny_qwen35
from sglang_ddtree.reference.gdn_tree import conv_window_index, depth_levels
from sglang_ddtree.reference.target import (
    GDN,
    HFTargetRunner,
    ancestor_visibility,
    plain_greedy_generate,
    tree_attention_mask,
)

TOL = {torch.float32: 1e-4, torch.float64: 1e-6}
TAPS = [0, 2, 3]  # 3 = last layer: HF's hidden_states[-1] is the final-normed output
ALPHABET = 6  # few distinct draft tokens, so branches repeat tokens


pytestmark = pytest.mark.usefixtures("one_thread")


def _long_memory(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Slow GDN decay (A in [0.02, 0.5] instead of [0, 16]) so states carry many steps back."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.02, 0.5, generator=gen).log())
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, torch.dtype], torch.nn.Module]:
    """Tiny checkpoints written to disk and loaded back; float32 and float64 copies of each."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("targets")
    qwen3_dir = write_tiny_qwen3(root / "qwen3", seed=1)
    qwen35_dir = write_tiny_qwen35(root / "qwen35", seed=2)
    fp32 = {
        "qwen3": Qwen3ForCausalLM.from_pretrained(qwen3_dir).eval(),
        "qwen35": _long_memory(Qwen3_5ForConditionalGeneration.from_pretrained(qwen35_dir), 3),
        "qwen35_causal": _long_memory(Qwen3_5ForCausalLM.from_pretrained(qwen35_dir), 4),
    }
    out = {(name, torch.float32): m.eval() for name, m in fp32.items()}
    out.update({(name, torch.float64): copy.deepcopy(m).double() for name, m in fp32.items()})
    return out


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


# ----------------------------------------------------------------------------- helpers


def random_tree(rng: random.Random, n: int, max_depth: int, spine: int = 0):
    """(tokens, parents, depth, visibility) of a random topological tree with n nodes.

    The first `spine` + 1 nodes form a chain (so depths up to `spine` exist); later nodes pick
    a parent among the earlier nodes of depth < max_depth, half the time the previous node.
    """
    parents, depth = [-1], [0]
    for i in range(1, n):
        eligible = [j for j in range(i) if depth[j] < max_depth]
        if i <= spine:
            p = i - 1
        elif depth[i - 1] < max_depth and rng.random() < 0.5:
            p = i - 1
        else:
            p = rng.choice(eligible)
        parents.append(p)
        depth.append(depth[p] + 1)
    tokens = [rng.randrange(ALPHABET) for _ in range(n)]
    return (
        torch.tensor(tokens),
        torch.tensor(parents),
        torch.tensor(depth),
        ancestor_visibility(parents),
    )


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def step(model, cache, token: torch.Tensor):
    """One plain cached decode step -> (logits [V], taps [n_taps * H]); mutates cache."""
    out = model(
        input_ids=token.view(1, 1), past_key_values=cache, use_cache=True, output_hidden_states=True
    )
    taps = torch.cat([out.hidden_states[t + 1][0, -1] for t in TAPS])
    return out.logits[0, -1].float(), taps


@torch.no_grad()
def sequential_reference(model, cache, tokens: torch.Tensor, parents: torch.Tensor):
    """Every node decoded one token at a time after its parent's sequential state.

    -> (logits [N, V], taps [N, ...], caches[i] = plain cache after node i's whole path).
    """
    logits, taps, caches = [], [], []
    for i, p in enumerate(parents.tolist()):
        c = copy.deepcopy(cache if p < 0 else caches[p])
        node_logits, node_taps = step(model, c, tokens[i])
        logits.append(node_logits)
        taps.append(node_taps)
        caches.append(c)
    return torch.stack(logits), torch.stack(taps), caches


def advance(runner: HFTargetRunner, rng: random.Random, rounds: int) -> list[int]:
    """`rounds` random verify + commit rounds; returns the committed tokens in order."""
    committed = []
    for _ in range(rounds):
        tokens, parents, depth, vis = random_tree(rng, rng.randint(1, 10), 4)
        runner.verify(tokens, parents, depth, vis)
        path = path_to(parents.tolist(), rng.randrange(len(tokens)))
        runner.commit(torch.tensor(path))
        committed += tokens[path].tolist()
    return committed


def cache_tensors(cache) -> dict[str, torch.Tensor]:
    """Every tensor the cache holds: attention KV, GDN conv and recurrent states.

    GDN layers hold their states as {state_idx: tensor} dicts (transformers 5.19): each entry
    counts, so a state that went missing or was never written shows up as a key mismatch.
    """
    out = {}
    for i, layer in enumerate(cache.layers):
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                out[f"{i}.{name}"] = value
            elif isinstance(value, dict):
                out.update({f"{i}.{name}.{k}": v for k, v in value.items() if v is not None})
    return out


def assert_close(actual, expected, what: str, dtype: torch.dtype = torch.float32) -> None:
    """See the module docstring: tolerance relative to the tensor's scale, tol by model dtype."""
    tol = TOL[dtype]
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def assert_caches_close(actual, expected, dtype: torch.dtype) -> None:
    a, e = cache_tensors(actual), cache_tensors(expected)
    assert a.keys() == e.keys()
    for name in a:
        assert_close(a[name], e[name], name, dtype)


# ----------------------------------------------------------------------------- tree planning


def test_conv_window_index_and_levels_by_hand():
    """Rows index cat(committed window [4], nodes): slot 3 = newest committed input, 4 + m =
    node m. Each row is oldest-first and ends with the node itself."""
    parents = [-1, 0, 1, 0, 3, 4, 5]  # two branches: 0-1-2 and 0-3-4-5-6
    assert conv_window_index(parents, 4).tolist() == [
        [1, 2, 3, 4],  # root: three committed inputs, then itself
        [2, 3, 4, 5],
        [3, 4, 5, 6],
        [2, 3, 4, 7],  # node 3 skips its sibling 1
        [3, 4, 7, 8],
        [4, 7, 8, 9],
        [7, 8, 9, 10],  # deep enough: ancestors only
    ]
    assert [lv.tolist() for lv in depth_levels(parents)] == [[0], [1, 3], [2, 4], [5], [6]]


# ----------------------------------------------------------------------------- verify


@DTYPES
@pytest.mark.parametrize("name", ["qwen3", "qwen35", "qwen35_causal"])
@pytest.mark.parametrize(
    "seed, prompt_len, rounds, n", [(0, 1, 0, 24), (1, 3, 2, 24), (2, 11, 3, 17)]
)
def test_verify_equals_sequential_paths(models, name, dtype, seed, prompt_len, rounds, n):
    """Every node's logits, taps, KV and GDN conv/recurrent states equal decoding its
    root-to-node path token by token from the same committed state (after 0-3 commits)."""
    model, rng = models[name, dtype], random.Random(seed)
    runner = HFTargetRunner(model, TAPS)
    runner.prefill(torch.tensor([rng.randrange(runner.vocab_size) for _ in range(prompt_len)]))
    advance(runner, rng, rounds)
    tokens, parents, depth, vis = random_tree(rng, n, max_depth=8, spine=rng.randint(0, 8))
    before = copy.deepcopy(runner.cache)

    logits, taps = runner.verify(tokens, parents, depth, vis)

    after = cache_tensors(runner.cache)  # nothing committed: the live cache is bit-for-bit intact
    for key, value in cache_tensors(before).items():
        assert torch.equal(after[key], value), key
    ref_logits, ref_taps, ref_caches = sequential_reference(model, before, tokens, parents)
    assert logits.dtype == torch.float32 and logits.shape == (n, runner.vocab_size)
    assert taps.shape == (n, len(TAPS) * runner.hidden_size)
    assert_close(logits, ref_logits, "logits", dtype)
    assert_close(taps, ref_taps, "taps", dtype)
    state = runner.last_verify
    for idx, kind in enumerate(runner.layer_types):
        if kind == GDN:
            # state 0 of the layer, batch row 0
            ref_conv = torch.stack([c.layers[idx].conv_states[0][0] for c in ref_caches])
            ref_ssm = torch.stack([c.layers[idx].recurrent_states[0][0] for c in ref_caches])
            assert_close(state.conv_states[idx], ref_conv, f"layer {idx} conv windows", dtype)
            assert_close(state.recurrent_states[idx], ref_ssm, f"layer {idx} ssm states", dtype)
        else:
            ref_k = torch.stack([c.layers[idx].keys[0, :, -1] for c in ref_caches], dim=1)
            ref_v = torch.stack([c.layers[idx].values[0, :, -1] for c in ref_caches], dim=1)
            assert_close(state.keys[idx][0], ref_k, f"layer {idx} keys", dtype)
            assert_close(state.values[idx][0], ref_v, f"layer {idx} values", dtype)


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_identical_branches_give_identical_nodes(models, name):
    """Sibling subtrees with the same tokens are the same paths: same outputs; other paths differ."""
    runner = HFTargetRunner(models[name, torch.float32], TAPS)
    runner.prefill(torch.tensor([5, 9, 2, 7, 1]))
    parents = [-1, 0, 0, 1, 2, 2]
    tokens = torch.tensor([3, 4, 4, 1, 1, 2])
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    logits, taps = runner.verify(tokens, torch.tensor(parents), depth, ancestor_visibility(parents))
    assert_close(logits[2], logits[1], "twin depth-1 nodes")
    assert_close(logits[4], logits[3], "twin depth-2 nodes")
    assert_close(taps[4], taps[3], "twin depth-2 taps")
    assert (logits[5] - logits[4]).abs().max() > 1e-2


def flattened_forward(model, runner: HFTargetRunner, tokens, depth, visibility) -> torch.Tensor:
    """The bug from the design doc: a plain HF forward of the tree as one sequence, with the
    tree attention mask and tree positions, from a copy of the committed cache."""
    cache = copy.deepcopy(runner.cache)
    mask = tree_attention_mask(visibility, runner.committed_len, model.dtype)
    positions = (runner.committed_len + depth)[None]
    with torch.no_grad():
        out = model(
            input_ids=tokens[None],
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
        )
    return out.logits[0].float()


@pytest.mark.parametrize("seed", [0, 1])
def test_flattening_is_right_for_attention_and_wrong_for_gdn(models, seed):
    """Negative control. On the attention-only target the flattened forward equals verify (the
    mask and positions are right); on the hybrid target it differs by >= 1e-2 of the logits'
    scale (100x the float32 tolerance) at every node whose path is not a prefix of the flattened
    order, so the equality tests above would catch a verify that let siblings share state."""
    rng = random.Random(seed)
    tokens, parents, depth, vis = random_tree(rng, 16, max_depth=6, spine=2)
    on_chain = [path_to(parents.tolist(), i) == list(range(i + 1)) for i in range(16)]
    assert not all(on_chain)
    for name in ("qwen3", "qwen35"):
        model = models[name, torch.float32]
        runner = HFTargetRunner(model, TAPS)
        runner.prefill(torch.tensor([rng.randrange(runner.vocab_size) for _ in range(6)]))
        logits, _ = runner.verify(tokens, parents, depth, vis)
        flat = flattened_forward(model, runner, tokens, depth, vis)
        if name == "qwen3":
            assert_close(flat, logits, "flattened attention-only tree")
            continue
        gap = (flat - logits).abs().amax(-1) / logits.abs().max()  # [N], relative to scale
        for i in range(16):
            if on_chain[i]:
                assert gap[i] < TOL[torch.float32], (i, gap[i])
            else:
                assert gap[i] > 100 * TOL[torch.float32], (i, gap[i])


# ----------------------------------------------------------------------------- commit


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
@pytest.mark.parametrize("prompt_len", [2, 9])
def test_commit_equals_plain_prefill(models, name, prompt_len):
    """For every accepted depth 0..8: commit leaves the cache a plain prefill of the committed
    tokens would build (KV of kept positions, GDN conv + recurrent states), and the next verify
    agrees with a fresh runner's. prompt_len 2 < kernel - 1 reaches the zero-padded conv slots."""
    model, rng, dtype = models[name, torch.float32], random.Random(prompt_len), torch.float32
    runner = HFTargetRunner(model, TAPS)
    max_depth = 8
    for accepted in range(max_depth + 1):
        prompt = [rng.randrange(runner.vocab_size) for _ in range(prompt_len)]
        runner.prefill(torch.tensor(prompt))
        tokens, parents, depth, vis = random_tree(rng, 20, max_depth, spine=max_depth)
        runner.verify(tokens, parents, depth, vis)
        node = rng.choice([i for i in range(20) if depth[i] == accepted])
        path = path_to(parents.tolist(), node)
        runner.commit(torch.tensor(path + [-1] * (max_depth - accepted)))  # -1 padding allowed

        committed = torch.tensor(prompt + tokens[path].tolist())
        fresh = HFTargetRunner(model, TAPS)
        fresh.prefill(committed)
        assert runner.committed_len == fresh.committed_len == len(committed)
        assert runner.cache.get_seq_length() == len(committed)
        assert_caches_close(runner.cache, fresh.cache, dtype)
        if GDN in runner.layer_types:  # the GDN states were among the tensors compared
            assert any(".recurrent_states." in k for k in cache_tensors(runner.cache))
        assert runner.last_verify is None

        nxt = random_tree(rng, 7, 3)
        for a, b, what in zip(
            runner.verify(*nxt), fresh.verify(*nxt), ("logits", "taps"), strict=True
        ):
            assert_close(a, b, f"next verify {what} after depth {accepted}", dtype)


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_repeated_rounds_match_plain_decoding(models, name):
    """24 rounds of random-tree verify + random-path commit, then one more token: its logits and
    taps equal a plain uncached forward of the whole committed sequence."""
    model, rng = models[name, torch.float32], random.Random(7)
    runner = HFTargetRunner(model, TAPS)
    prompt = [rng.randrange(runner.vocab_size) for _ in range(4)]
    runner.prefill(torch.tensor(prompt))
    committed = prompt
    for _ in range(24):
        tokens, parents, depth, vis = random_tree(rng, rng.randint(1, 16), 6)
        runner.verify(tokens, parents, depth, vis)
        path = path_to(parents.tolist(), rng.randrange(len(tokens)))
        runner.commit(torch.tensor(path))
        committed = committed + tokens[path].tolist()
    assert runner.committed_len == len(committed) > 40

    last = torch.tensor([rng.randrange(runner.vocab_size)])
    root_only = (torch.tensor([-1]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))
    logits, taps = runner.verify(last, *root_only)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([committed + last.tolist()]), output_hidden_states=True)
    ref_taps = torch.cat([out.hidden_states[t + 1][0, -1] for t in TAPS])
    assert_close(logits[0], out.logits[0, -1].float(), "final logits")
    assert_close(taps[0], ref_taps, "final taps")


def _greedy_walk(node_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
    """Follow the target's argmax through the tree -> (path root-first, bonus token)."""
    path = [0]
    while True:
        target = int(node_logits[path[-1]].argmax())
        children = [c for c in range(len(tokens)) if parents[c] == path[-1] and tokens[c] == target]
        if not children:
            return path, target
        path.append(children[0])


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_greedy_tree_walk_equals_plain_greedy(models, name):
    """Integer-exact: verify + greedy accept walk + commit over trees that hide the true greedy
    continuation among decoys emits exactly the tokens of plain greedy decoding."""
    model, rng = models[name, torch.float32], random.Random(11)
    runner = HFTargetRunner(model, TAPS)
    prompt = torch.tensor([rng.randrange(runner.vocab_size) for _ in range(5)])
    truth = runner.greedy_generate_plain(prompt, 40).tolist()
    with torch.no_grad():  # teacher-forced argmax of one uncached forward agrees
        full = model(input_ids=torch.tensor([prompt.tolist() + truth[:-1]])).logits[0, 4:]
    assert full.argmax(-1).tolist() == truth

    logits, _ = runner.prefill(prompt)
    out, accepted = [int(logits[-1].argmax())], 0
    while len(out) < len(truth):
        tokens, parents, depth, vis = random_tree(rng, rng.randint(1, 12), 5)
        for node in path_to(parents.tolist(), rng.randrange(len(tokens)))[1:]:
            k = len(out) - 1 + int(depth[node])  # hide the truth along one path
            if k < len(truth):
                tokens[node] = truth[k]
        tokens[0] = out[-1]
        path, bonus = _greedy_walk(runner.verify(tokens, parents, depth, vis)[0], tokens, parents)
        runner.commit(torch.tensor(path))
        accepted += len(path) - 1
        out += tokens[path[1:]].tolist() + [bonus]
    assert out[: len(truth)] == truth
    assert accepted > 10  # the trees were really accepted into, not just their roots


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_half_precision_runs_and_keeps_cache_dtypes(models, name):
    """Dtype plumbing in bfloat16: verify returns float32 logits, stays within bf16 noise of
    sequential decoding (8 mantissa bits over 4 layers of reordered sums: measured ~3e-2 of the
    logits' scale, tolerance 0.1), and commit keeps every cache tensor's dtype: bfloat16, except
    the GDN recurrent states, which transformers 5.19 keeps in its kernels' float32."""
    model = copy.deepcopy(models[name, torch.float32]).to(torch.bfloat16)
    rng = random.Random(5)
    runner = HFTargetRunner(model, TAPS)
    runner.prefill(torch.tensor([rng.randrange(runner.vocab_size) for _ in range(5)]))
    advance(runner, rng, 2)
    tokens, parents, depth, vis = random_tree(rng, 12, 6, spine=4)
    before = copy.deepcopy(runner.cache)
    logits, taps = runner.verify(tokens, parents, depth, vis)
    ref_logits, _, _ = sequential_reference(model, before, tokens, parents)
    assert logits.dtype == torch.float32 and taps.dtype == torch.bfloat16
    assert (logits - ref_logits).abs().max() < 0.1 * ref_logits.abs().max()
    runner.commit(torch.tensor(path_to(parents.tolist(), 11)))
    dtypes = {k: v.dtype for k, v in cache_tensors(runner.cache).items()}
    assert dtypes == {k: v.dtype for k, v in cache_tensors(before).items()}
    for key, dtype in dtypes.items():
        assert dtype == (torch.float32 if ".recurrent_states." in key else torch.bfloat16), key


def test_plain_greedy_generate_handles_zero_tokens(models):
    assert (
        plain_greedy_generate(models["qwen3", torch.float32], torch.tensor([1, 2]), 0).numel() == 0
    )


# ----------------------------------------------------------------------------- boundaries


def test_bad_inputs_are_refused(models):
    runner = HFTargetRunner(models["qwen35", torch.float32], TAPS)
    tokens, parents, depth, vis = random_tree(random.Random(0), 6, 3, spine=3)
    with pytest.raises(RuntimeError, match="prefill"):
        runner.verify(tokens, parents, depth, vis)
    runner.prefill(torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="verify"):
        runner.commit(torch.tensor([0]))
    bad_parents = parents.clone()
    bad_parents[3] = 4
    with pytest.raises(ValueError, match="parent"):
        runner.verify(tokens, bad_parents, depth, vis)
    with pytest.raises(ValueError, match="depth"):
        runner.verify(tokens, parents, depth + (torch.arange(6) == 2).long(), vis)
    with pytest.raises(ValueError, match="visibility"):
        runner.verify(tokens, parents, depth, torch.ones(6, 6, dtype=torch.bool))
    runner.verify(tokens, parents, depth, vis)
    with pytest.raises(ValueError, match="chain"):
        runner.commit(torch.tensor([0, 2]))  # node 2's parent is 1
    with pytest.raises(ValueError, match="tap layer"):
        HFTargetRunner(models["qwen3", torch.float32], [4])
