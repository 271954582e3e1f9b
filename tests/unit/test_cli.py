"""The reference CLI: output on tiny checkpoints, and one-line errors with exit status 2."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sglang_ddtree.reference.__main__ as cli
from sglang_ddtree.checkpoints.tiny import write_tiny_dflash, write_tiny_qwen3
from sglang_ddtree.reference.__main__ import encode_prompt, main

REPO = Path(__file__).resolve().parents[2]
TEMPERATURE_RULE = "--temperature must be a finite number in [0, 100] (the DDTREE server's limit)"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cli")
    write_tiny_qwen3(root / "target", seed=0)
    write_tiny_dflash(root / "draft", root / "target", seed=1, block_size=8)
    yield root / "target", root / "draft"
    torch.set_num_threads(threads)


def _bad_draft(good: Path, out: Path, edit) -> Path:
    """A copy of the good draft whose config.json went through `edit(config)`."""
    shutil.copytree(good, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _no_model_load(*args, **kwargs):
    raise AssertionError("a model was loaded before every setting was checked")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the CLI: a refused option exits through the parser's
    error (SystemExit), a run returns its status."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prints_text_and_acceptance_lengths(pair, capsys):
    target, draft = pair
    args = ["--target", target, "--draft", draft, "--prompt", "def f(x):", "--budget", "6"]
    code, out, err = _run(capsys, *args, "--topk", "2", "--max-new-tokens", "12", "--compare-chain")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("prompt: 'def f(x):' (") and "tokens, chat template)" in lines[0]
    assert lines[1].startswith("=== DDTree budget=6 topk=2 (12 tokens,")
    lengths = [line for line in lines if line.startswith("per round, accepted drafts + bonus: [")]
    means = [line for line in lines if line.startswith("tokens per round: ")]
    assert len(lengths) == len(means) == 2  # DDTree, then chain DFlash
    first = json.loads(lengths[0].removeprefix("per round, accepted drafts + bonus: "))
    assert 11 <= sum(first) <= 11 + 7  # 1 token came from prefill; the last round may overshoot
    assert all(1 <= n <= 8 for n in first)
    rounds = len(first)
    assert means[0] == f"tokens per round: {12 / rounds:.2f} (12 tokens / {rounds} verify rounds)"
    assert "=== chain DFlash block_size=8" in out
    assert lines[-1] == "DDTree vs chain DFlash at temperature 0: identical text"
    head, tree_row, chain_row, note = lines[-5:-1]  # the side-by-side table
    assert head.split() == ["tokens", "rounds", "tokens/round", "tokens/s"]
    assert note.startswith("tokens/round: tokens / target verify rounds, SGLang's accept length")
    assert tree_row.split()[:2] == ["DDTree", "12"] and chain_row.split()[:3] == [
        "chain",
        "DFlash",
        "12",
    ]
    assert tree_row.split()[2] == str(rounds) and tree_row.split()[3] == f"{12 / rounds:.2f}"
    assert float(tree_row.split()[4]) > 0


def test_demo_runs_from_a_cache_dir(tmp_path, capsys):
    code, out, err = _run(capsys, "--demo", "--cache-dir", tmp_path, "--max-new-tokens", "24")
    assert code == 0, err
    assert (tmp_path / "qwen35-binary" / "config.json").exists()
    assert (tmp_path / "qwen35-binary-dflash" / "config.json").exists()
    assert "per round, accepted drafts + bonus: [" in out
    assert "DDTree vs chain DFlash at temperature 0: identical text" in out
    # a code model completes the prompt: no chat template unless asked
    assert (
        out.splitlines()[0].startswith("prompt: 'def fibonacci(n):' (")
        and "plain completion" in out
    )
    tree_mean, chain_mean = (
        float(line.split()[3]) for line in out.splitlines() if line.startswith("tokens per round")
    )
    assert tree_mean > chain_mean + 1.0  # the tree covers both continuations, the chain one


def test_chat_template_is_default_when_the_tokenizer_has_one(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pair[0]))
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    chat, plain = encode_prompt(tokenizer, "x = 1", None), encode_prompt(tokenizer, "x = 1", False)
    assert chat[0] == start and start not in plain
    assert encode_prompt(tokenizer, "x = 1", True) == chat
    assert tokenizer.decode(chat).endswith("<|im_start|>assistant\n")


def _drop_mask_token(config: dict) -> None:
    config["dflash_config"].pop("mask_token_id")
    config["dflash_config"]["mask_token"] = "<|NO_SUCH_MASK|>"


@pytest.mark.parametrize(
    "extra, edit, message",
    [
        (["--temperature", "nan"], None, f"{TEMPERATURE_RULE}, got nan"),
        (["--temperature", "inf"], None, f"{TEMPERATURE_RULE}, got inf"),
        (["--temperature", "-0.5"], None, f"{TEMPERATURE_RULE}, got -0.5"),
        (["--temperature", "1e300"], None, f"{TEMPERATURE_RULE}, got 1e+300"),
        (["--temperature", "100.5"], None, f"{TEMPERATURE_RULE}, got 100.5"),
        (["--top-p", "nan"], None, "--top-p must be in (0, 1], got nan"),
        (["--top-p", "0"], None, "--top-p must be in (0, 1], got 0.0"),
        (["--top-k", "-1"], None, "--top-k must be in [0, 1073741824] (0 keeps every token"),
        (["--top-k", str(2**63)], None, "--top-k must be in [0, 1073741824] (0 keeps every"),
        (["--max-new-tokens", "0"], None, "--max-new-tokens must be >= 1, got 0"),
        (["--max-new-tokens", "-3"], None, "--max-new-tokens must be >= 1, got -3"),
        (["--device", "tpu"], None, "--device tpu: the reference engine runs on cpu or cuda"),
        (["--device", "meta"], None, "--device meta: the reference engine runs on cpu or cuda"),
        (["--budget", "0"], None, "--budget must be >= 1 draft nodes, got 0"),
        (["--topk", "0"], None, "--topk must be >= 1 (candidates per draft position), got 0"),
        (["--topk", "100000"], None, "--topk must be in [1, vocab_size="),
        (["--seed", str(2**64)], None, "--seed must be in [-2**63, 2**64 - 1] (torch's seeds)"),
        (
            ["--topk", "1", "--budget", "8"],
            None,
            "--budget 8 is larger than what fits: at most 7 "
            "nodes (what top-k 1 fills in the draft's 7 positions)",
        ),
        (["--budget", "10000000"], None, "--budget 10000000 is larger than what fits: at most "),
        (
            ["--max-new-tokens", "5000"],
            None,
            "--prompt (3 tokens) + --max-new-tokens (5000) = 5003 exceeds",
        ),
        (["--prompt", ""], None, "--prompt is empty (0 tokens)"),
        ([], lambda c: c.update(block_size=1), "block_size must be >= 2"),
        ([], lambda c: c.update(vocab_size=999), "vocab_size=999"),
        ([], lambda c: c.update(hidden_size=64), "hidden_size=64"),
        ([], _drop_mask_token, "mask token id is missing"),
        ([], lambda c: c.pop("num_hidden_layers"), "its config.json has no 'num_hidden_layers'"),
    ],
)
def test_bad_inputs_exit_2_with_one_line_before_any_model_loads(
    pair, tmp_path, capsys, monkeypatch, extra, edit, message
):
    target, draft = pair
    monkeypatch.setattr(cli, "load_pair", _no_model_load)
    if edit is not None:
        draft = _bad_draft(draft, tmp_path / "draft", edit)
    args = ["--target", target, "--draft", draft, "--prompt", "x = 1", "--no-chat", *extra]
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    if edit is not None:  # a draft config's fault names --draft and the folder
        assert err.startswith(f"error: --draft {draft}: "), err


def test_module_entry_point_exit_status(pair):
    """`python -m sglang_ddtree.reference` itself: status 2, one line, no traceback."""
    target, draft = pair
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = ["--target", target, "--draft", draft, "--prompt", "x", "--budget", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_ddtree.reference", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert error_lines == ["error: --budget must be >= 1 draft nodes, got 0"], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_a_missing_or_non_model_directory_is_named_before_any_load(pair, tmp_path, capsys, flag):
    target, draft = pair
    paths = {"--target": target, "--draft": draft}
    for bad, message in (
        (tmp_path / "nope", "does not exist"),
        (tmp_path, "is not a model checkpoint (no config.json in it)"),
    ):
        args = {**paths, flag: bad}
        code, out, err = _run(
            capsys, "--target", args["--target"], "--draft", args["--draft"], "--prompt", "x"
        )
        assert code == 2 and out == ""
        assert err == f"error: {flag} {bad} {message}\n", err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_a_gpu_is_one_line(pair, capsys):
    target, draft = pair
    code, out, err = _run(
        capsys, "--target", target, "--draft", draft, "--prompt", "x", "--device", "cuda"
    )
    assert code == 2 and out == ""
    assert err == "error: --device cuda: this machine has no CUDA device; use --device cpu\n"


def test_the_budget_limit_is_the_trees_capacity_or_the_memory(pair):
    from sglang_ddtree.reference.memory import max_budget, verify_bytes

    target, draft = pair  # draft block 8: depth 7
    largest, why = max_budget(target, draft, topk=2, available=2**40)
    assert largest == 2 + 4 + 8 + 16 + 32 + 64 + 128 and "top-k 2" in why
    lin, quad = verify_bytes(json.loads((target / "config.json").read_text()))
    room = 2**24
    largest, why = max_budget(target, draft, topk=8, available=room)
    n = largest + 1
    assert lin * n + quad * n * n <= room / 2 < lin * (n + 1) + quad * (n + 1) ** 2
    assert "free memory" in why


def test_help_shows_every_default_and_tells_topk_from_top_k(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 32)" in text and "(default: 8)" in text and "(default: cpu)" in text
    for flag, default in (("--max-new-tokens", "64"), ("--seed", "0"), ("--dtype", "float32")):
        options = text[text.index("options:") :]  # past the usage line
        after = options[options.index(f"{flag} ") :]  # its own entry, up to the next option
        entry = after[: after.index(" --", len(flag))]
        assert f"(default: {default})" in entry, entry
    assert "draft tree: candidates per draft position" in text and "(not --top-k)" in text
    assert "sampling: keep the target's k most likely tokens" in text and "(not --topk)" in text


def _prompt_line(out: str) -> str:
    return out.splitlines()[0]


def test_the_prompt_comes_from_a_file_or_stdin_verbatim(pair, tmp_path, capsys, monkeypatch):
    target, draft = pair
    common = [
        "--target",
        target,
        "--draft",
        draft,
        "--no-chat",
        "--max-new-tokens",
        "2",
        "--budget",
        "4",
    ]
    text = "def f(x):\n    return x  # ünïcode\n"
    (tmp_path / "prompt.txt").write_bytes(text.encode("utf-8"))
    code, out, err = _run(capsys, *common, "--prompt-file", tmp_path / "prompt.txt")
    assert code == 0, err
    assert _prompt_line(out).startswith(f"prompt: {text!r} (")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x = 1\n")))
    code, out, err = _run(capsys, *common, "--prompt-file", "-")
    assert code == 0, err
    assert _prompt_line(out).startswith("prompt: 'x = 1\\n' (")


def test_a_prompt_file_that_is_missing_or_not_utf8_is_one_line(pair, tmp_path, capsys, monkeypatch):
    target, draft = pair
    monkeypatch.setattr(cli, "load_pair", _no_model_load)
    common = ["--target", target, "--draft", draft]
    code, out, err = _run(capsys, *common, "--prompt-file", tmp_path / "nope.txt")
    assert (code, out) == (2, "")
    assert err == f"error: --prompt-file {tmp_path / 'nope.txt'}: No such file or directory\n"
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    code, out, err = _run(capsys, *common, "--prompt-file", tmp_path / "latin1.txt")
    assert (code, out) == (2, "")
    assert err == (
        f"error: --prompt-file {tmp_path / 'latin1.txt'} is not valid UTF-8: "
        "byte 0xe9 at offset 3\n"
    )
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff")))
    code, out, err = _run(capsys, *common, "--prompt-file", "-")
    assert err == "error: --prompt-file - is not valid UTF-8: byte 0xff at offset 3\n"


def test_prompt_and_prompt_file_together_are_refused(pair, capsys):
    target, draft = pair
    with pytest.raises(SystemExit) as stop:
        main(
            ["--target", str(target), "--draft", str(draft), "--prompt", "x", "--prompt-file", "-"]
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not allowed with argument --prompt" in err, err


def test_a_prompt_that_is_not_utf8_is_one_line(pair, capsys, monkeypatch):
    """Python hands argv bytes that are not UTF-8 over as lone surrogates (surrogateescape)."""
    target, draft = pair
    monkeypatch.setattr(cli, "load_pair", _no_model_load)
    bad = b"def f\xff(x):".decode("utf-8", "surrogateescape")
    code, out, err = _run(capsys, "--target", target, "--draft", draft, "--prompt", bad)
    assert (code, out) == (2, "")
    assert err == "error: --prompt is not valid UTF-8: byte 0xff at offset 5\n"


def test_module_entry_point_with_bad_bytes_and_a_bad_device_is_one_line(pair):
    """The real process: argv bytes that are not UTF-8, and a device torch does not know,
    each end with status 2 and one line, no traceback."""
    target, draft = pair
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    base = [
        sys.executable,
        "-m",
        "sglang_ddtree.reference",
        "--target",
        str(target),
        "--draft",
        str(draft),
    ]
    cases = [
        (
            ["--prompt", b"def f\xff(x):"],
            "error: --prompt is not valid UTF-8: byte 0xff at offset 5",
        ),
        (
            ["--prompt", "x", "--device", "tpu"],
            "error: --device tpu: the reference engine runs on cpu or cuda; use --device cpu",
        ),
    ]
    for extra, line in cases:
        proc = subprocess.run([*base, *extra], capture_output=True, env=env, cwd=REPO, timeout=300)
        stderr = proc.stderr.decode("utf-8", "replace")
        assert proc.returncode == 2, stderr
        assert [x for x in stderr.splitlines() if x.startswith("error: ")] == [line], stderr
        assert "Traceback" not in stderr and proc.stdout == b""


def test_a_cuda_index_beyond_the_machines_devices_is_named(monkeypatch):
    from sglang_ddtree.reference.preflight import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    check_device("cuda")
    with pytest.raises(
        ValueError,
        match=r"^--device cuda:2: this machine has 2 CUDA device\(s\), "
        r"cuda:0 to cuda:1$",
    ):
        check_device("cuda:2")
    with pytest.raises(ValueError, match="runs on cpu or cuda"):
        check_device("cuda:x")


def test_show_tree_prints_and_draws_every_round_outside_the_timing(
    pair, tmp_path, capsys, monkeypatch
):
    """--show-tree: an outline per round on stdout and round_NNN.svg per round; the drawing
    runs inside the DDTree loop, and its time is left out of the summary's tokens/s."""
    import time as clock

    from sglang_ddtree.tree import show

    drawn, draw = [], show.render_picture
    pause = 2.0  # far longer than a tiny model's round

    def slow_render(record, path, *args, **kwargs):
        clock.sleep(pause)
        drawn.append(draw(record, path, *args, **kwargs))

    monkeypatch.setattr(show, "render_picture", slow_render)
    target, draft = pair
    code, out, err = _run(
        capsys,
        "--target",
        target,
        "--draft",
        draft,
        "--prompt",
        "x = 1",
        "--no-chat",
        "--max-new-tokens",
        "6",
        "--budget",
        "6",
        "--topk",
        "2",
        "--show-tree",
        tmp_path / "trees",
    )
    assert code == 0, err
    rounds = sum(line.startswith("--- round ") for line in out.splitlines())
    assert rounds >= 1 and [p.name for p in drawn][:1] == ["round_001.svg"]
    assert sorted(p.name for p in (tmp_path / "trees").iterdir()) == [p.name for p in drawn]
    row = next(line for line in out.splitlines() if line.startswith("DDTree "))
    tokens, tokens_per_s = int(row.split()[1]), float(row.split()[4])
    assert tokens_per_s > tokens / (pause * rounds)  # the pauses are not in the time
