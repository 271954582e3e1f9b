"""integration/accept_path.py: the accepted path's commit steps and its move to the block front,
one Triton launch each, value for value SGLang's own functions (spec_utils.
_verify_commit_step_indices, eagle_worker_common._finalize_accept_tree_path), which run here
beside them: SGLang's are torch and Triton code, so on the CPU both run under Triton's
interpreter, and on the GPU both on the device.

Directly: TRITON_INTERPRET=1 python -m pytest tests/unit/test_accept_path.py -m "not gpu"
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.fixtures import interpreter_only, interpreter_process_test

# the non-GPU tests the interpreter process runs (all but this one); it must pass all
test_cpu_kernel_tests_under_triton_interpreter = interpreter_process_test(__file__, 26)

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
    return (accept_index.to(**put), accept_lens.to(**put), seq_lens.to(**put),
            slots.to(**put), predict.to(**put), hidden.to(**put))  # fmt: skip


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


@pytest.fixture()
def sglang_steps(monkeypatch):
    spec_utils = pytest.importorskip("sglang.srt.speculative.spec_utils")
    exec_ = types.SimpleNamespace(mamba=types.SimpleNamespace(mamba_track_interval=4))
    monkeypatch.setattr(spec_utils, "get_exec", lambda: exec_)
    from sglang_ddtree.integration import compat

    monkeypatch.setattr(compat, "mamba_track_interval", lambda: 4)
    return spec_utils._verify_commit_step_indices


@interpreter_only
@pytest.mark.parametrize("bs,N,S,seed", CASES)
@pytest.mark.parametrize("track", [False, True])
def test_the_commit_steps_are_sglangs(sglang_steps, bs, N, S, seed, track):
    _check_steps(sglang_steps, bs, N, S, seed, track, "cpu")


def _check_steps(sglang_steps, bs, N, S, seed, track, device):
    from sglang_ddtree.integration.accept_path import step_indices_hook

    accept_index, accept_lens, seq_lens, slots, *_ = _round(bs, N, S, seed, device)
    batch = _batch(seq_lens, slots, bs, N, track)
    args = dict(batch=batch, accept_index=accept_index, accept_lens=accept_lens,
                draft_token_num=N)  # fmt: skip
    want_last, want_track = sglang_steps(**args)
    calls = []
    got_last, got_track = step_indices_hook(lambda **kw: calls.append(kw), **args)
    assert calls == []  # DDTREE's kernel, not SGLang's function
    assert got_last.dtype == want_last.dtype and torch.equal(got_last, want_last)
    if not track:
        assert got_track is None and want_track is None
        return
    assert got_track.dtype == want_track.dtype and torch.equal(got_track, want_track)
    if bs >= 3:  # both kinds of round: crossing a tracking interval and not
        assert (want_track >= 0).any() and (want_track == -1).any()


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
    from sglang_ddtree.integration.accept_path import finalize_hook

    accept_index, accept_lens, seq_lens, slots, predict, hidden = _round(bs, N, S, seed, device)
    outputs, pools = [], []
    for ours in (False, True):
        batch = _batch(seq_lens, slots, bs, N, track=False)
        logits = types.SimpleNamespace(hidden_states=hidden.clone())
        pool = _Pool(int(slots.max()) + 1, device)
        args = (batch, accept_index, accept_lens, predict.clone(), logits, bs)
        kw = dict(token_to_kv_pool_allocator=pool, num_draft_tokens=N)
        fn = module._finalize_accept_tree_path
        out = finalize_hook(fn, *args, **kw) if ours else fn(*args, **kw)
        outputs.append((out, logits.hidden_states))
        pools.append(pool)
    (want, want_hidden), (got, got_hidden) = outputs
    assert torch.equal(got, want)
    assert torch.equal(pools[1].buf, pools[0].buf) and pools[1].moves == 1
    # ours: the path's S rows per request; SGLang's: all N rows, the path's at the front
    assert got_hidden.shape == (bs * S, hidden.shape[1])
    assert torch.equal(got_hidden.view(bs, S, -1), want_hidden.view(bs, N, -1)[:, :S])


@interpreter_only
@pytest.mark.parametrize("bs,N,S,seed", CASES[:3])
def test_the_path_moves_to_the_front_as_sglangs(bs, N, S, seed):
    _check_finalize(bs, N, S, seed, "cpu")


def test_other_batches_and_the_switch_get_sglangs_functions(monkeypatch):
    from sglang_ddtree import config
    from sglang_ddtree.integration.accept_path import finalize_hook, step_indices_hook

    seq = torch.tensor([3, 4])
    eagle = _batch(seq, torch.arange(1, 9), 2, 4, track=False, ddtree=False)
    ddtree = _batch(seq, torch.arange(1, 9), 2, 4, track=False)
    for batch, switch in ((eagle, "triton"), (ddtree, "sglang")):
        monkeypatch.setattr(config, "_active", config.Options(accept_path=switch))
        assert step_indices_hook(lambda **kw: "sglang", batch=batch, accept_index=None,
                                 accept_lens=None, draft_token_num=4) == "sglang"  # fmt: skip
        assert finalize_hook(lambda *a, **kw: "sglang", batch, None, None, None, None, 2,
                             token_to_kv_pool_allocator=None, num_draft_tokens=4) == "sglang"  # fmt: skip
    monkeypatch.delenv("SGLANG_DDTREE_ACCEPT_PATH", raising=False)
    assert config.Options.from_env().accept_path == "triton"
    monkeypatch.setenv("SGLANG_DDTREE_ACCEPT_PATH", "sglang")
    assert config.Options.from_env().accept_path == "sglang"
    monkeypatch.setenv("SGLANG_DDTREE_ACCEPT_PATH", "torch")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_ACCEPT_PATH"):
        config.Options.from_env()


def test_the_hook_targets_have_the_parameters_the_hooks_assume():
    import inspect

    spec_utils = pytest.importorskip("sglang.srt.speculative.spec_utils")
    common = pytest.importorskip("sglang.srt.speculative.eagle_worker_common")
    from sglang_ddtree.integration import accept_path, compat, hooks

    steps = inspect.signature(spec_utils._verify_commit_step_indices).parameters
    assert list(steps) == ["batch", "accept_index", "accept_lens", "draft_token_num"]
    assert all(p.kind is p.KEYWORD_ONLY for p in steps.values())
    finalize = list(inspect.signature(common._finalize_accept_tree_path).parameters)
    assert finalize == ["batch", "accept_index", "accept_lens", "predict", "logits_output", "bs",
                        "token_to_kv_pool_allocator", "num_draft_tokens"]  # fmt: skip
    assert hooks.HOOKS[compat.VERIFY_COMMIT_STEPS] is accept_path.step_indices_hook
    assert hooks.HOOKS[compat.FINALIZE_TREE_PATH] is accept_path.finalize_hook
    assert hooks.HOOKS[compat.MAMBA_TRACK_FOR_VERIFY] is accept_path.track_indices_hook
    assert list(inspect.signature(spec_utils.prepare_mamba_track_for_verify).parameters) == [
        "batch"
    ]
    # the verify's preparation imports it when it runs (after the hooks replaced it)
    eagle_utils = pytest.importorskip("sglang.srt.speculative.eagle_utils")
    prepare = inspect.getsource(eagle_utils.eagle_prepare_for_verify)
    assert "import prepare_mamba_track_for_verify" in prepare
    # run_eagle_verify calls both by their module-level names (the hooks replace those)
    source = inspect.getsource(common.run_eagle_verify)
    assert "_finalize_accept_tree_path(" in source
    assert "_verify_commit_step_indices(" in inspect.getsource(
        spec_utils.commit_mamba_states_after_verify
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bs,N,S,seed", CASES)
def test_the_accept_path_kernels_are_sglangs_on_the_gpu(sglang_steps, bs, N, S, seed):
    for track in (False, True):
        _check_steps(sglang_steps, bs, N, S, seed, track, "cuda")
    _check_finalize(bs, N, S, seed, "cuda")


def _track_batch(slots, rows=6, ddtree=True):
    """A ScheduleBatch's fields that the Mamba tracking set-up reads and writes."""
    gen = torch.Generator().manual_seed(len(slots))
    mapping = torch.randint(0, 100, (rows, 2), generator=gen, dtype=torch.int64)
    return types.SimpleNamespace(
        reqs=[types.SimpleNamespace(mamba_next_track_idx=s) for s in slots],
        req_pool_indices=torch.randperm(rows, generator=gen)[: len(slots)],
        req_to_token_pool=types.SimpleNamespace(
            req_index_to_mamba_ping_pong_track_buffer_mapping=mapping),
        mamba_track_indices=None, mamba_track_mask=torch.ones(1), mamba_track_seqlens=torch.ones(1),
        spec_algorithm=types.SimpleNamespace(name="DDTREE" if ddtree else "EAGLE"),
    )  # fmt: skip


@pytest.fixture()
def sglang_track(monkeypatch):
    """SGLang's prepare_mamba_track_for_verify, with the server's prefix-cache strategy set by
    the test and the pinned staging tensor it builds made in ordinary memory (no CUDA here)."""
    spec_utils = pytest.importorskip("sglang.srt.speculative.spec_utils")
    from sglang.srt import runtime_context
    from sglang.srt.managers import schedule_batch

    strategy = {"value": "extra_buffer"}
    args = types.SimpleNamespace(
        enable_mamba_extra_buffer=lambda: strategy["value"] != "no_buffer",
        enable_mamba_extra_buffer_lazy=lambda: strategy["value"] == "extra_buffer_lazy",
    )
    monkeypatch.setattr(spec_utils, "get_server_args", lambda: args)
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    shim = types.ModuleType("torch_unpinned")
    shim.__getattr__ = lambda name: getattr(torch, name)
    shim.tensor = lambda data, pin_memory=False, **kw: torch.tensor(data, **kw)
    monkeypatch.setattr(schedule_batch, "torch", shim)
    return spec_utils.prepare_mamba_track_for_verify, strategy


@pytest.mark.parametrize("slots", [[1], [0], [None], [1, 1, 1], [None, 0, 0]])
def test_the_tracking_buffers_of_one_slot_are_sglangs(sglang_track, slots):
    """One ping-pong slot for every request (every batch of one): the gathered buffers, their
    dtype and the cleared mask are SGLang's own function's; SGLang's is not called."""
    from sglang_ddtree.integration.accept_path import track_indices_hook

    sglang, _ = sglang_track
    want, got = _track_batch(slots), _track_batch(slots)
    sglang(want)
    track_indices_hook(lambda b: pytest.fail("SGLang's function was called"), got)
    assert got.mamba_track_indices.dtype == want.mamba_track_indices.dtype == torch.int64
    assert torch.equal(got.mamba_track_indices, want.mamba_track_indices)
    assert got.mamba_track_mask is None and got.mamba_track_seqlens is None


@pytest.mark.parametrize("case", ["mixed", "lazy", "no_buffer", "eagle", "switch", "empty"])
def test_other_tracking_cases_get_sglangs_function(sglang_track, monkeypatch, case):
    from sglang_ddtree import config
    from sglang_ddtree.integration.accept_path import track_indices_hook

    sglang, strategy = sglang_track
    slots = {"mixed": [0, 1, 0], "empty": []}.get(case, [1, 1])
    batch = _track_batch(slots, ddtree=case != "eagle")
    strategy["value"] = {"lazy": "extra_buffer_lazy", "no_buffer": "no_buffer"}.get(case, "extra_buffer")  # fmt: skip
    monkeypatch.setattr(config, "_active", config.Options(accept_path="sglang" if case == "switch" else "triton"))  # fmt: skip
    called = []
    track_indices_hook(called.append, batch)
    assert called == [batch] and batch.mamba_track_indices is None
    if case == "mixed":  # and SGLang's own function handles it
        sglang(batch)
        mapping = batch.req_to_token_pool.req_index_to_mamba_ping_pong_track_buffer_mapping
        assert torch.equal(batch.mamba_track_indices,
                           mapping[batch.req_pool_indices, torch.tensor(slots)])  # fmt: skip
