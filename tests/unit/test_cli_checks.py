"""The reference CLI checks every option before any model loads: each bad value ends with one
line naming the option (status 2, the parser's error), and the demo's table counts tokens per
round as SGLang does."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import sglang_ddtree.reference.__main__ as cli
from sglang_ddtree.checkpoints.tiny import write_tiny_dflash, write_tiny_qwen3
from sglang_ddtree.reference.engine import GenerationResult
from sglang_ddtree.reference.preflight import PairConfig, check_prompt_ids, writable_dir

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cli_checks")
    write_tiny_qwen3(root / "target", seed=0)
    write_tiny_dflash(root / "draft", root / "target", seed=1, block_size=8)
    yield root / "target", root / "draft"
    torch.set_num_threads(threads)


def _no_model_load(*args, **kwargs):
    raise AssertionError("a model was loaded before every option was checked")


def _refused(capsys, monkeypatch, *argv) -> str:
    """The one stderr line of a run refused before any model loads (status 2, no stdout)."""
    monkeypatch.setattr(cli, "load_pair", _no_model_load)
    with pytest.raises(SystemExit) as stop:
        cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert stop.value.code == 2 and captured.out == "", captured
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.removeprefix("error: ").rstrip("\n")


def _copy(src: Path, dst: Path, edit=None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a checkpoint dir, its config.json through `edit`, the files `drop` removed."""
    shutil.copytree(src, dst)
    if edit is not None:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    for name in drop:
        (dst / name).unlink()
    return dst


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a file"
    path.write_text("")
    return path


# option -> (its bad arguments, given tmp_path and the pair; what the error line starts with)
BAD = {
    "--target": (lambda t, p: ["--target", t / "nope"], "--target {t}/nope does not exist"),
    "--draft": (lambda t, p: ["--draft", t], "--draft {t} is not a model checkpoint"),
    "--prompt": (lambda t, p: ["--prompt", "", "--no-chat"], "--prompt is empty (0 tokens)"),
    "--prompt-file": (
        lambda t, p: ["--prompt-file", t / "no.txt"],
        "--prompt-file {t}/no.txt: No such file or directory",
    ),
    "--budget": (lambda t, p: ["--budget", "-1"], "--budget must be >= 1 draft nodes, got -1"),
    "--topk": (lambda t, p: ["--topk", "0"], "--topk must be >= 1"),
    "--temperature": (
        lambda t, p: ["--temperature", "1e300"],
        "--temperature must be a finite number in [0, 100] (the DDTREE server's limit), got 1e+300",
    ),
    "--top-p": (lambda t, p: ["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    "--top-k": (lambda t, p: ["--top-k", "-2"], "--top-k must be in [0, 1073741824]"),
    "--max-new-tokens": (
        lambda t, p: ["--max-new-tokens", "0"],
        "--max-new-tokens must be >= 1, got 0",
    ),
    "--seed": (lambda t, p: ["--seed", str(-(2**63) - 1)], "--seed must be in [-2**63, 2**64 - 1]"),
    "--device": (lambda t, p: ["--device", "npu"], "--device npu: the reference engine runs on"),
    "--dtype": (lambda t, p: ["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    "--cache-dir": (lambda t, p: ["--cache-dir", t], "--cache-dir {t}: only --demo reads it"),
    "--show-tree": (
        lambda t, p: ["--show-tree", _a_file(t) / "trees"],
        "--show-tree {t}/a file/trees: cannot make or write this folder: Not a directory",
    ),
    "--chat": (
        lambda t, p: [
            "--chat",
            "--target",
            _copy(p[0], t / "plain", drop=("chat_template.jinja",)),
        ],
        "--chat: the tokenizer of --target {t}/plain has no chat template; drop --chat",
    ),
}
# options that are switches with nothing to check (--no-chat is --chat's other half)
SWITCHES = {"--compare-chain", "--ignore-eos", "--demo", "--help", "--no-chat"}


def test_every_option_has_a_check_here():
    options = {
        flag
        for action in cli.build_parser()._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }
    assert options == set(BAD) | SWITCHES


@pytest.mark.parametrize("flag", sorted(BAD))
def test_each_bad_option_is_one_line_naming_it_before_any_model_loads(
    pair, tmp_path, capsys, monkeypatch, flag
):
    bad, message = BAD[flag]
    target, draft = pair
    prompt = [] if flag == "--prompt-file" else ["--prompt", "x = 1"]
    base = ["--target", target, "--draft", draft, *prompt, "--max-new-tokens", "4"]
    err = _refused(capsys, monkeypatch, *base, *bad(tmp_path, pair))
    assert err.startswith(message.format(t=tmp_path)), err
    assert flag in err


@pytest.mark.parametrize(
    "where, reason",
    [
        ("file", "cannot make or write this folder: it is a file, not a folder"),
        ("under a file", "cannot make or write this folder: Not a directory"),
        ("proc", "cannot make or write this folder: No such file or directory"),
        ("read-only", "cannot make or write this folder: Permission denied"),
    ],
)
def test_a_show_tree_folder_that_cannot_be_written_is_refused_before_any_model_loads(
    pair, tmp_path, capsys, monkeypatch, where, reason
):
    """It used to fail on the first round's picture, after both models had loaded, with an
    OSError that named no option."""
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    if where == "read-only" and IS_ROOT:
        pytest.skip("root writes to a read-only folder")
    folder = {
        "file": _a_file(tmp_path),
        "under a file": _a_file(tmp_path) / "trees",
        "proc": Path("/proc/no-such-dir/trees"),
        "read-only": tmp_path / "locked" / "trees",
    }[where]
    if where == "read-only":
        (tmp_path / "locked").mkdir(mode=0o500)
    target, draft = pair
    args = ["--target", target, "--draft", draft, "--prompt", "x", "--show-tree", folder]
    assert _refused(capsys, monkeypatch, *args) == f"--show-tree {folder}: {reason}"


def test_a_show_tree_folder_is_made_with_its_parents_and_left_empty(tmp_path):
    folder = writable_dir("--show-tree", tmp_path / "a" / "b")
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_a_picture_that_fails_mid_run_names_show_tree(pair, tmp_path, capsys, monkeypatch):
    from sglang_ddtree.tree import show

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(show, "render_picture", full_disk)
    target, draft = pair
    trees = tmp_path / "trees"
    args = ["--target", target, "--draft", draft, "--prompt", "x", "--no-chat"]
    code = cli.main([str(a) for a in [*args, "--max-new-tokens", "3", "--show-tree", trees]])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        err == f"error: --show-tree {trees}: cannot write round_001.svg: No space left on device\n"
    )


def test_a_demo_cache_dir_that_cannot_be_written_is_named(tmp_path, capsys, monkeypatch):
    folder = _a_file(tmp_path) / "demo"
    err = _refused(capsys, monkeypatch, "--demo", "--cache-dir", folder)
    assert err.startswith(f"--cache-dir {folder}: cannot write the demo pair there: "), err


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda c: c.pop("vocab_size"), "its config.json has no 'vocab_size' field"),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "target architectures"),
    ],
)
def test_a_bad_target_config_names_target(pair, tmp_path, capsys, monkeypatch, edit, reason):
    target = _copy(pair[0], tmp_path / "target", edit)
    err = _refused(capsys, monkeypatch, "--target", target, "--draft", pair[1], "--prompt", "x")
    assert err.startswith(f"--target {target}: {reason}"), err


def test_a_config_that_is_not_json_names_its_option(pair, tmp_path, capsys, monkeypatch):
    draft = _copy(pair[1], tmp_path / "draft")
    (draft / "config.json").write_text("{not json")
    err = _refused(capsys, monkeypatch, "--target", pair[0], "--draft", draft, "--prompt", "x")
    assert err.startswith(f"--draft {draft}: its config.json is not valid JSON ("), err


def test_a_target_without_tokenizer_files_is_named(pair, tmp_path, capsys, monkeypatch):
    """transformers makes an empty tokenizer of such a folder; the prompt then encodes to
    nothing, and the error used to blame the prompt."""
    target = _copy(pair[0], tmp_path / "target", drop=("tokenizer.json", "tokenizer_config.json"))
    err = _refused(capsys, monkeypatch, "--target", target, "--draft", pair[1], "--prompt", "x")
    assert err.startswith(f"--target {target}: its tokenizer has "), err
    assert "holds no tokenizer files" in err


class _Tokenizer:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def get_vocab(self) -> dict:
        return {}


def test_a_prompt_id_outside_the_targets_vocabulary_is_named():
    from sglang_ddtree.reference.dflash import DFlashConfig

    draft = DFlashConfig.__new__(DFlashConfig)
    object.__setattr__(draft, "mask_token_id", 3)
    object.__setattr__(draft, "mask_token", "<mask>")
    pair = PairConfig(vocab=100, max_positions=None, draft=draft)
    dirs = Path("t"), Path("d")
    check_prompt_ids(pair, dirs, _Tokenizer(200), [5, 99], 4, "--prompt")
    with pytest.raises(ValueError, match=r"^--prompt-file p: its token id 150 is outside the "):
        check_prompt_ids(pair, dirs, _Tokenizer(200), [5, 150], 4, "--prompt-file p")


def test_the_table_counts_tokens_per_round_as_sglang_does():
    """64 tokens in 32 rounds whose accepted drafts + bonus sum to 65 (the prefill made the
    first token; max_new_tokens cut 2 from the last round): 2.00 tokens/round, as SGLang's
    spec_accept_length = completion_tokens / spec_verify_ct; the old "mean accept" was 2.03."""
    tree = GenerationResult(list(range(64)), [2] * 31 + [3], 32)
    plain = GenerationResult([7], [], 0)  # max_new_tokens 1: the prefill's token, no round
    assert tree.mean_accept_length == pytest.approx(65 / 32)
    assert tree.tokens_per_round == 2.0 and plain.tokens_per_round is None
    table = cli._summary([("DDTree", tree, 1.0), ("one", plain, 1.0)])
    head, tree_row, plain_row, note = table.splitlines()
    assert head.split() == ["tokens", "rounds", "tokens/round", "tokens/s"]
    assert tree_row.split() == ["DDTree", "64", "32", "2.00", "64.0"]
    assert plain_row.split() == ["one", "1", "0", "-", "1.0"]
    assert "tokens / target verify rounds" in note and "spec_accept_length" in note


def test_check_args_refuses_before_the_tokenizer_what_needs_no_file(tmp_path):
    """The options that need no file are checked first: no folder is read or made for them."""
    args = cli.build_parser().parse_args(
        ["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--prompt", "x"]
    )
    args.show_tree = str(tmp_path / "trees")
    args.temperature = float("nan")
    with pytest.raises(ValueError, match="^--temperature must be"):
        cli.check_args(argparse.Namespace(**vars(args)))
    assert not (tmp_path / "trees").exists()
