"""Test-only helpers shared by tests/unit and tests/gpu (not shipped in the package)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/NAME.py as a module, as `python scripts/NAME.py` would see its imports (scripts/
    on sys.path for its siblings, such as scripts/harness.py); registered under NAME in
    sys.modules (dataclasses look their module up by name)."""
    import importlib.util

    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_pairs(tmp_path_factory, archs, block_size: int) -> dict:
    """arch ("qwen3" | "qwen35") -> the reference engine's (target runner, DFlash draft runner,
    tokenizer), float32 on the CPU, on seeded tiny checkpoints (target seed 0, draft seed 1)."""
    from sglang_ddtree.checkpoints.tiny import (
        write_tiny_dflash,
        write_tiny_qwen3,
        write_tiny_qwen35,
    )
    from sglang_ddtree.reference.engine import load_pair

    writers = {"qwen3": write_tiny_qwen3, "qwen35": write_tiny_qwen35}
    out = {}
    for arch in archs:
        root = tmp_path_factory.mktemp(arch)
        writers[arch](root / "target", seed=0)
        write_tiny_dflash(root / "draft", root / "target", seed=1, block_size=block_size)
        out[arch] = load_pair(root / "target", root / "draft", "float32", "cpu")
    return out


def shared_penalties_for_every_node(state, logits, tokens, visibility, depth):
    """A wrong `PenaltyState.tree` for negative controls: the output so far's penalties on every
    node (SGLang's linear penalizers on a tree), not each node's own path."""
    return state._min_tokens(state._shared(logits[None]), depth)[0]


# Triton kernels on the CPU: a test file's CPU tests run again in a child process under Triton's
# interpreter (`interpreter_process_test`); the ones that need it are `interpreter_only`.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter process")


def interpreter_process_test(test_file: str, expected_passed: int):
    """The test that runs `test_file`'s non-GPU tests under the interpreter (skipped inside that
    process), requiring exactly `expected_passed` passes there; assign it to a test_ name."""

    def test_cpu_kernel_tests_under_triton_interpreter():
        if INTERPRETED:
            pytest.skip("already inside the interpreter process")
        run_cpu_tests_under_triton_interpreter(test_file, expected_passed)

    return test_cpu_kernel_tests_under_triton_interpreter


def run_cpu_tests_under_triton_interpreter(test_file: str, expected_passed: int) -> None:
    """Run `test_file`'s non-GPU tests in a child pytest with TRITON_INTERPRET=1 (Triton picks its
    interpreter when imported, so the parent process cannot switch) and require exactly
    `expected_passed` passes and no failure."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        test_file,
        "-m",
        "not gpu",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert re.search(rf"\b{expected_passed} passed", tail) and "failed" not in tail, tail


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def sglang_cpu_model_context(model_path: str | os.PathLike) -> Iterator[None]:
    """Let SGLang 0.5.23 model classes be *constructed* (and load weights) on a CPU-only box.

    Test-only: checks that SGLang's own `load_weights` accepts our checkpoints. It publishes
    ServerArgs for `model_path` (radix cache off: SGLang's hybrid cache checks want CUDA) at
    world rank 0, builds one-rank gloo process groups, and patches, for the duration of the
    block only: RoPE's platform flag (CPU path instead of vllm/sgl-kernel), the row-parallel
    linear's symmetric-memory context (a CUDA allocator) and `torch.get_device_module` (GDN
    layers ask the accelerator for its current device). Everything is undone on exit.
    Modules built here run their `forward_native` paths only after `use_native_forward`.
    """
    import sglang.srt.layers.linear as sgl_linear
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(model_path), device="cpu", disable_radix_cache=True)
    patches = [
        (rope_base, "_is_cpu", True),
        (sgl_linear, "use_symmetric_memory", lambda *a, **k: contextlib.nullcontext()),
        (torch, "get_device_module", lambda *a: torch.cpu),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:  # a failure part-way through still undoes the patches and the groups
        # The process's place (world rank 0) gives every rank SGLang's layers read: all 0.
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
        ps.init_distributed_environment(
            backend="gloo",
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        ps.initialize_model_parallel()  # widths from the published ServerArgs: all 1
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
        for obj, name, value in saved:
            setattr(obj, name, value)
        reset_context()


def use_native_forward(module: torch.nn.Module) -> torch.nn.Module:
    """Route SGLang MultiPlatformOps (RMSNorm, RoPE, SiluAndMul) to their torch-native paths."""
    for sub in module.modules():
        if hasattr(sub, "forward_native") and hasattr(sub, "_forward_method"):
            sub._forward_method = sub.forward_native
    return module


def conv_window_reference(inputs, history, parents, node: int):
    """[dim, K - 1]: a tree node's conv window from its own input and its ancestors' (inputs
    [N, dim]; parents: root 0), the history columns ([dim, K - 1], newest last) above the root;
    a plain walk."""
    import torch

    km1 = history.shape[-1]
    cols, cur = [], node
    for _ in range(km1):
        cols.append(inputs[cur] if cur >= 0 else history[:, km1 + cur])
        cur = int(parents[cur]) if cur > 0 else cur - 1
    return torch.stack(cols[::-1], dim=-1)


def chi_square_pvalue(counts, probs) -> float:
    """Goodness of fit of counts [cells] to probs [cells] (numpy arrays); zero-probability cells
    must be empty; cells expected < 5 are pooled."""
    from scipy import stats

    assert counts[probs == 0].sum() == 0, "a token outside the support was drawn"
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


H100 = ("NVIDIA H100 80GB HBM3", 79.6)  # torch's name and total memory (GiB) of one card


def offline_bench_round(monkeypatch, bench, log: str = "") -> list:
    """scripts/bench_round.py (`bench`, as load_script gives it) with no GPU and no server: one
    H100 with 70 GiB free, servers that start at once and whose log reads `log`, rounds of
    20 ms, no plot. Returns the servers started, in order (each keeps name, port, args, env)."""
    started = []

    class Server:
        def __init__(self, name, model, port, args, env=None, log_dir=None):
            self.name, self.port, self.args, self.env = name, port, args, env
            started.append(self)

        def start(self):
            pass

        def wait_healthy(self, timeout):
            return 1.0

        def log_text(self):
            return log

        def stop(self):
            pass

    measured = {"round_ms": 20.0, "tokens_per_s": 100.0, "accept_len": 1.0}
    monkeypatch.setattr(bench, "card_info", lambda: H100)
    monkeypatch.setattr(bench, "free_bytes", lambda: 70 * 2**30)
    monkeypatch.setattr(bench.harness, "Server", Server)
    monkeypatch.setattr(bench, "measure", lambda server, bs, tokens: {"bs": bs, **measured})
    monkeypatch.setattr(bench, "plot", lambda rows, path, card: None)
    return started
