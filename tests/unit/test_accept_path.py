"""round/accept_path.py: the accepted path's move to the block front, one Triton launch,
value for value SGLang's own function (eagle_worker_common._finalize_accept_tree_path), which
runs here beside it: on the CPU both under Triton's interpreter, on the GPU on the device.

Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_accept_path.py -m "not gpu"
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.fixtures import interpreter_only, interpreter_process_test

# the non-GPU tests the interpreter process runs (all but this one); it must pass all
test_cpu_kernel_tests_under_triton_interpreter = interpreter_process_test(__file__, 6)

CASES = [(1, 4, 4, 0), (3, 16, 8, 1), (5, 32, 16, 2), (8, 8, 8, 3), (2, 64, 16, 4)]


def _round(bs: int, N: int, S: int, seed: int, device="cpu"):
    """A DDTREE round's verify outputs: per request an accepted path of n in [1, S] nodes, each
    deeper node a later one (node ids >= depth, the root first), as global ids b x N + node,
    -1 past the path; distinct KV slots (0 is the pool's padding slot); committed lengths."""
    gen = torch.Generator().manual_seed(seed)
    accept_index = torch.full((bs, S), -1, dtype=torch.int32)
    accept_lens = torch.randint(1, S + 1, (bs,), generator=gen, dtype=torch.int32)
    if bs > 1:
        accept_lens[0], accept_lens[1] = S, 1  # a full path and the root alone
    for b in range(bs):
        node = 0
        for j in range(int(accept_lens[b])):
            if j:  # a later node at each depth, leaving room for the rest of the path
                room = N - (int(accept_lens[b]) - j)
                node = int(torch.randint(node + 1, room + 1, (1,), generator=gen))
            accept_index[b, j] = b * N + node
    seq_lens = torch.randint(1, 50, (bs,), generator=gen, dtype=torch.int64)
    slots = torch.randperm(bs * N + 40, generator=gen)[: bs * N] + 1
    predict = torch.randint(0, 1000, (bs * N,), generator=gen, dtype=torch.int32)
    hidden = torch.randn(bs * N, 6, generator=gen, dtype=torch.float32)
    put = {"device": device}
    return (
        accept_index.to(**put),
        accept_lens.to(**put),
        seq_lens.to(**put),
        slots.to(**put),
        predict.to(**put),
        hidden.to(**put),
    )


def _batch(seq_lens, slots, bs, N, track: bool, ddtree=True):
    """The fields of a ScheduleBatch the two functions read."""
    req_to_token = torch.zeros(bs, 64 + N, dtype=torch.int32, device=seq_lens.device)
    for b in range(bs):  # the verify's slots at seq_len .. seq_len + N, as SGLang assigned them
        s = int(seq_lens[b])
        req_to_token[b, s : s + N] = slots[b * N : (b + 1) * N].to(torch.int32)
    name = "DDTREE" if ddtree else "EAGLE"
    return types.SimpleNamespace(
        seq_lens=seq_lens,
        out_cache_loc=slots,
        req_pool_indices=torch.arange(bs, device=seq_lens.device),
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        mamba_track_indices=torch.arange(bs, device=seq_lens.device) if track else None,
        spec_algorithm=types.SimpleNamespace(name=name),
    )


class _Pool:
    """A KV pool of one buffer: move_kv_cache as SGLang's in-place-safe kernel (every source
    read before any target is written)."""

    def __init__(self, size: int, device):
        gen = torch.Generator().manual_seed(size)
        self.buf = torch.randn(size, 3, generator=gen).to(device)
        self.moves = 0

    def get_kvcache(self):
        return self

    def move_kv_cache(self, tgt, src):
        self.moves += 1
        self.buf[tgt] = self.buf[src].clone()


def _check_finalize(bs, N, S, seed, device):
    module = pytest.importorskip("sglang.srt.speculative.eagle_worker_common")
    from sglang_ddtree.round.accept_path import finalize_hook

    accept_index, accept_lens, seq_lens, slots, predict, hidden = _round(bs, N, S, seed, device)
    outputs, pools = [], []
    for ours in (False, True):
        batch = _batch(seq_lens, slots, bs, N, track=False)
        logits = types.SimpleNamespace(hidden_states=hidden.clone())
        pool = _Pool(int(slots.max()) + 1, device)
        args = (batch, accept_index, accept_lens, predict.clone(), logits, bs)
        kw = dict(token_to_kv_pool_allocator=pool, num_draft_tokens=N)
        fn = module._finalize_accept_tree_path
        out = finalize_hook(_runtime(), fn, *args, **kw) if ours else fn(*args, **kw)
        outputs.append((out, logits.hidden_states))
        pools.append(pool)
    (want, want_hidden), (got, got_hidden) = outputs
    assert torch.equal(got, want)
    assert torch.equal(pools[1].buf, pools[0].buf) and pools[1].moves == 1
    # ours: the path's S rows per request; SGLang's: all N rows, the path's at the front
    assert got_hidden.shape == (bs * S, hidden.shape[1])
    assert torch.equal(got_hidden.view(bs, S, -1), want_hidden.view(bs, N, -1)[:, :S])


def _runtime():
    """The worker factory's runtime (its engaged paths) that the hook is bound to."""
    from sglang_ddtree.config import DDTreeConfig, Options
    from sglang_ddtree.round.runtime import Runtime

    return Runtime.create(Options(), DDTreeConfig(block_size=4, num_nodes=8, topk=2))


@interpreter_only
@pytest.mark.parametrize("bs,N,S,seed", CASES[:3])
def test_the_path_moves_to_the_front_as_sglangs(bs, N, S, seed):
    _check_finalize(bs, N, S, seed, "cpu")


def test_other_batches_get_sglangs_function(monkeypatch):
    """A batch of another algorithm keeps SGLang's code (a DDTREE batch always takes the
    kernel; the old SGLANG_DDTREE_ACCEPT_PATH switch is refused, test_plugin.py)."""
    from sglang_ddtree.round.accept_path import finalize_hook

    seq = torch.tensor([3, 4])
    eagle = _batch(seq, torch.arange(1, 9), 2, 4, track=False, ddtree=False)
    assert (
        finalize_hook(
            _runtime(),
            lambda *a, **kw: "sglang",
            eagle,
            None,
            None,
            None,
            None,
            2,
            token_to_kv_pool_allocator=None,
            num_draft_tokens=4,
        )
        == "sglang"
    )


def test_the_hook_target_has_the_parameters_the_hook_assumes():
    import inspect

    common = pytest.importorskip("sglang.srt.speculative.eagle_worker_common")
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.plugin import hooks
    from sglang_ddtree.round import accept_path

    finalize = list(inspect.signature(common._finalize_accept_tree_path).parameters)
    assert finalize == [
        "batch",
        "accept_index",
        "accept_lens",
        "predict",
        "logits_output",
        "bs",
        "token_to_kv_pool_allocator",
        "num_draft_tokens",
    ]
    assert hooks.HOOKS[compat.FINALIZE_TREE_PATH] is accept_path.finalize_hook
    # run_eagle_verify calls it by its module-level name (the hook replaces that)
    assert "_finalize_accept_tree_path(" in inspect.getsource(common.run_eagle_verify)


def test_sglang_commits_the_tree_steps_and_tracks_itself():
    """SGLang's commit-step indices (fused, one Triton launch on the GPU) and its Mamba tracking
    set-up (an asynchronous copy, freed rows marked -1) are what a DDTREE round uses: no hook of
    DDTREE's stands in front of them."""
    from sglang_ddtree.plugin import hooks

    targets = " ".join(hooks.HOOKS)
    assert "_verify_commit_step_indices" not in targets
    assert "prepare_mamba_track_for_verify" not in targets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bs,N,S,seed", CASES)
def test_the_accept_path_kernel_is_sglangs_on_the_gpu(bs, N, S, seed):
    _check_finalize(bs, N, S, seed, "cuda")
