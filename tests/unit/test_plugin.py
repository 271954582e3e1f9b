"""The SGLang plugin on CPU: registration, version gate, the spec class against 0.5.23's scheduler
calls, flag validation and defaults, runtime hooks. Needs sglang 0.5.23's Python code installed
(--no-deps); no GPU."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import types

import pytest

pytest.importorskip("sglang.srt.speculative.spec_info")

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_ddtree import plugin  # noqa: E402
from sglang_ddtree.adapter import (
    compat,  # noqa: E402
    spec,  # noqa: E402
)
from sglang_ddtree.config import DDTreeConfigError  # noqa: E402
from sglang_ddtree.front_door import checks
from sglang_ddtree.plugin import hooks  # noqa: E402


@pytest.fixture(scope="module")
def registered():
    plugin.register()
    return SpeculativeAlgorithm.from_string("DDTREE")


def test_register_is_idempotent_and_resolves(registered):
    plugin.register()  # a second call (another load_plugins) must not raise
    assert isinstance(registered, spec.DDTreeSpec)
    assert SpeculativeAlgorithm.from_string("ddtree") is registered
    assert registered.is_dflash_family() and not registered.is_dflash()
    assert registered.supports_target_verify_for_draft()
    assert registered.supports_overlap


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert {ep.name: ep.value for ep in eps}.get("ddtree") == "sglang_ddtree.plugin:register"


def test_sglang_load_plugins_registers_ddtree():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert isinstance(SpeculativeAlgorithm.from_string("DDTREE"), spec.DDTreeSpec)


def test_spec_class_has_every_method_the_scheduler_calls(registered):
    """Every instance method of the SpeculativeAlgorithm enum (what scheduler code calls on any
    algorithm) exists on DDTreeSpec with a compatible signature; CustomSpecAlgo alone lacks some."""
    for name, member in vars(SpeculativeAlgorithm).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        ours = getattr(registered, name, None)
        assert callable(ours), f"DDTreeSpec lacks {name}()"
        enum_params = list(inspect.signature(member).parameters)[1:]
        our_params = list(inspect.signature(ours).parameters)
        assert our_params[: len(enum_params)] == enum_params, name
    assert registered.carries_draft_hidden_states() is False
    assert registered.need_topk() is False


def test_verify_widths(registered, monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(
        rc, "get_spec", lambda: types.SimpleNamespace(speculative_dflash_block_size=16)
    )
    assert registered.get_num_tokens_per_req_for_target_verify(48, is_draft_worker=True) == 16
    assert registered.get_num_tokens_per_req_for_target_verify(48, is_draft_worker=False) == 48


def test_version_gate():
    assert compat.check_sglang_version("0.5.23") == "0.5.23"
    with pytest.raises(compat.UnsupportedSGLangVersion, match="0.5.23"):
        compat.check_sglang_version("0.5.17")


def test_registration_failure_is_loud(monkeypatch, caplog):
    def refuse(version=None):
        raise compat.UnsupportedSGLangVersion("sglang 9.9 is not supported")

    monkeypatch.setattr(compat, "check_sglang_version", refuse)
    with caplog.at_level(logging.ERROR), pytest.raises(compat.UnsupportedSGLangVersion):
        plugin.register()
    assert "DDTREE is NOT available" in caplog.text and "9.9" in caplog.text


# ------------------------------------------------------------------------------ flags


@pytest.fixture
def draft_dir(tmp_path):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_target_layers": 4,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2]},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _server_args(draft_dir, **overrides):
    """A stand-in with every real ServerArgs field at its default (so typos fail loudly)."""
    import msgspec
    from sglang.srt.server_args import ServerArgs

    values = {}
    for f in msgspec.structs.fields(ServerArgs):  # ServerArgs is a msgspec Struct
        if f.default is not msgspec.NODEFAULT:
            values[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            values[f.name] = f.default_factory()
        else:
            values[f.name] = None
    values.update(
        model_path="target",
        device="cuda",
        attention_backend="flashinfer",
        speculative_algorithm="DDTREE",
        speculative_draft_model_path=str(draft_dir),
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_defaults_when_only_the_draft_is_given(draft_dir):
    sa = _server_args(draft_dir)
    spec.validate_server_args(sa)
    cfg = spec.apply_server_args(sa)
    assert (cfg.block_size, cfg.num_nodes, cfg.topk) == (16, 32, 8)
    assert sa.speculative_num_draft_tokens == 32 and sa.speculative_eagle_topk == 8
    assert sa.speculative_dflash_block_size == 16 and sa.speculative_num_steps == 1
    assert sa.speculative_draft_attention_backend == "flashinfer"
    assert sa.max_running_requests == 16


def test_explicit_flags_are_kept(draft_dir):
    sa = _server_args(
        draft_dir, speculative_num_draft_tokens=64, speculative_eagle_topk=4, max_running_requests=8
    )
    spec.validate_server_args(sa)
    cfg = spec.apply_server_args(sa)
    assert (cfg.num_nodes, cfg.topk, cfg.budget) == (64, 4, 63)
    assert sa.max_running_requests == 8


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(speculative_draft_model_path=None), "--speculative-draft-model-path"),
        (dict(attention_backend="fa3"), "--attention-backend flashinfer"),
        (dict(decode_attention_backend="triton"), "--attention-backend flashinfer"),
        (dict(device="cpu"), "CUDA"),
        (dict(page_size=16), "--page-size 1"),
        (dict(speculative_use_rejection_sampling=True), "--speculative-use-rejection-sampling"),
        (dict(speculative_accept_threshold_single=0.5), "speculative-accept-threshold-single"),
        (dict(speculative_accept_threshold_acc=0.9), "speculative-accept-threshold-acc"),
        (dict(tokenizer_worker_num=2), "--tokenizer-worker-num 1"),
        (dict(enable_dp_attention=True), "--enable-dp-attention"),
        (dict(pp_size=2), "--pp-size 1"),
        (dict(tp_size=2), "--tp-size 1"),
        (dict(enable_linear_replayssm_spec=True), "replayssm"),
        (dict(speculative_adaptive=True), "--speculative-adaptive"),
        (dict(speculative_draft_window_size=256), "--speculative-draft-window-size"),
        (dict(speculative_eagle_topk=1), "--speculative-eagle-topk >= 2, got 1"),
        (
            dict(speculative_eagle_topk=65),
            "--speculative-eagle-topk 65 exceeds the largest supported (64)",
        ),
        (dict(speculative_num_draft_tokens=8), "N=8 < B=16"),
        (dict(speculative_num_draft_tokens=4096), "exceeds"),
        (dict(speculative_dflash_block_size=8), "block_size 16"),
        (dict(speculative_num_draft_tokens="many"), "must be an integer"),
        (
            dict(enable_two_batch_overlap=True),
            "DDTREE does not support --enable-two-batch-overlap (SGLang splits a verify batch",
        ),
        (dict(enable_pdmux=True), "--enable-pdmux; set SGLANG_DDTREE_WIDTH=fixed"),
    ],
)
def test_unsupported_flags_name_the_flag_and_fix(draft_dir, overrides, words):
    with pytest.raises(DDTreeConfigError) as err:
        spec.validate_server_args(_server_args(draft_dir, **overrides))
    assert words in str(err.value)


def _draft_variant(draft_dir, name: str, block_size: int = 8, arch="DFlash2DraftModel", **dflash):
    """draft_dir's config with these changes, in a folder of its own (SGLang caches a config
    by its path): by default a DFlash2 draft, SGLang's DFlash2 architecture with a candidate
    selector of rank 8 over K = 4 candidates, block 8."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg.update(architectures=[arch], block_size=block_size)
    cfg["dflash_config"].update({"selector_rank": 8, "selector_top_k": 4, **dflash})
    out = draft_dir / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("topk", [None, 4])
def test_a_dflash2_draft_fixes_k_at_its_selector_top_k(draft_dir, topk):
    """K is the checkpoint's selector_top_k: unset, the flag takes it; set, it must equal it.
    The budget may fill the tree's capacity at that K and B - 1 levels (4 + 16 + ... + 4**7)."""
    dflash2 = _draft_variant(draft_dir, "dflash2")
    sa = _server_args(dflash2, speculative_eagle_topk=topk)
    spec.validate_server_args(sa)
    cfg = spec.apply_server_args(sa)
    assert (cfg.block_size, cfg.num_nodes, cfg.topk) == (8, 16, 4)
    assert sa.speculative_eagle_topk == 4
    draft = compat.draft_checkpoint(sa)
    assert (draft.dflash2, draft.architecture, draft.selector_rank) == (
        True,
        "DFlash2DraftModel",
        8,
    )
    widest = _server_args(dflash2, speculative_num_draft_tokens=1024)  # capacity 21844
    assert spec.resolve_config(widest).num_nodes == 1024
    alias = _draft_variant(draft_dir, "beam", arch="DFlash2BeamDraftModel")
    assert compat.draft_checkpoint(_server_args(alias)).dflash2


def test_a_dflash2_draft_refuses_another_k_or_a_budget_past_its_trees(draft_dir):
    """One line each, naming the flag, its value and the checkpoint's K."""
    dflash2 = _draft_variant(draft_dir, "dflash2")
    with pytest.raises(DDTreeConfigError) as err:
        spec.validate_server_args(_server_args(dflash2, speculative_eagle_topk=8))
    assert str(err.value) == (
        "--speculative-eagle-topk 8 differs from the DFlash2 draft checkpoint's selector_top_k "
        "4 (the candidates its selector scores per position); drop the flag or pass "
        "--speculative-eagle-topk 4."
    )
    shallow = _draft_variant(draft_dir, "shallow", block_size=3, selector_top_k=2)
    spec.validate_server_args(_server_args(shallow, speculative_num_draft_tokens=7))
    with pytest.raises(DDTreeConfigError) as err:  # two levels: at most 2 + 4 draft nodes
        spec.validate_server_args(_server_args(shallow, speculative_num_draft_tokens=8))
    assert str(err.value) == (
        "--speculative-num-draft-tokens 8 asks for 7 draft nodes, but a tree of depth <= 2 over "
        "the DFlash2 draft checkpoint's selector_top_k 2 candidates holds at most 6; pass "
        "--speculative-num-draft-tokens <= 7."
    )
    assert "\n" not in str(err.value)


def test_a_dflash2_architecture_without_a_selector_or_with_k_1_is_refused(draft_dir):
    bare = _draft_variant(draft_dir, "bare", selector_rank=0, selector_top_k=0)
    with pytest.raises(DDTreeConfigError, match="DFlash2DraftModel but its dflash_config has no"):
        spec.validate_server_args(_server_args(bare))
    one = _draft_variant(draft_dir, "one", selector_top_k=1)
    with pytest.raises(DDTreeConfigError, match="selector_top_k is 1; DDTREE needs 2 <= K <= 64"):
        spec.validate_server_args(_server_args(one))


def test_a_dflash_draft_with_selector_keys_is_served_as_dflash(draft_dir):
    """SGLang builds a DFlashDraftModel (no selector) for that architecture whatever its
    dflash_config says: DDTREE's K is then the flag's, as for any DFlash draft."""
    plain = _draft_variant(draft_dir, "plain", block_size=16, arch="DFlashDraftModel")
    sa = _server_args(plain, speculative_eagle_topk=6)
    assert not compat.draft_checkpoint(sa).dflash2
    assert spec.resolve_config(sa).topk == 6


def test_width_switches_are_checked_against_the_flags_at_startup(draft_dir, monkeypatch):
    """SGLANG_DDTREE_WIDTHS outside [B, N] fails before any model loads, naming both flags;
    with fixed widths the automatic-width refusals do not apply."""
    monkeypatch.setenv("SGLANG_DDTREE_WIDTHS", "8,16")
    with pytest.raises(DDTreeConfigError, match=r"\[B, N\] = \[16, 32\].*--speculative-num"):
        spec.validate_server_args(_server_args(draft_dir))
    monkeypatch.setenv("SGLANG_DDTREE_WIDTHS", "16")
    spec.validate_server_args(_server_args(draft_dir))
    monkeypatch.delenv("SGLANG_DDTREE_WIDTHS")
    monkeypatch.setenv("SGLANG_DDTREE_WIDTH", "fixed")
    spec.validate_server_args(_server_args(draft_dir, enable_pdmux=True))
    # two-batch overlap splits a verify batch field by field, not DDTREE's tree: at any width
    with pytest.raises(DDTreeConfigError, match="does not support --enable-two-batch-overlap"):
        spec.validate_server_args(_server_args(draft_dir, enable_two_batch_overlap=True))
    spec.validate_server_args(_server_args(draft_dir))


def test_serve_command_flags_parse_into_the_fields_we_read(draft_dir):
    """The README's serve command parses with SGLang's own CLI into what the validator reads."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--model-path",
            "Qwen/Qwen3.6-27B",
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            str(draft_dir),
            "--attention-backend",
            "flashinfer",
            "--speculative-num-draft-tokens",
            "48",
            "--speculative-eagle-topk",
            "6",
        ]
    )
    sa = _server_args(draft_dir, **{k: v for k, v in vars(ns).items() if v is not None})
    spec.validate_server_args(sa)
    cfg = spec.apply_server_args(sa)
    assert (cfg.block_size, cfg.num_nodes, cfg.topk) == (16, 48, 6)


# ------------------------------------------------------------------------------ hooks


def _tokenizer_manager(algorithm):
    return types.SimpleNamespace(server_args=types.SimpleNamespace(speculative_algorithm=algorithm))


def _request(**sampling):
    return types.SimpleNamespace(
        return_logprob=sampling.pop("logprob", False), sampling_params=sampling
    )


@pytest.mark.parametrize(
    "request_kwargs, words",
    [
        (dict(max_new_tokens=0), "at least 1, got 0"),
        (dict(max_new_tokens=8, min_p=0.1), "min_p=0.1"),
        (dict(max_new_tokens=8, repetition_penalty=1.2), "repetition_penalty=1.2"),
        (dict(max_new_tokens=8, frequency_penalty=0.5), "frequency_penalty=0.5"),
        (dict(max_new_tokens=8, min_new_tokens=4), "min_new_tokens=4"),
        (dict(max_new_tokens=8, n=5000), "n=5000: between 1 and 128 samples"),
        (dict(max_new_tokens=8, n=0), "n=0: between 1 and 128"),
    ],
)
def test_front_end_rejects_what_ddtree_cannot_serve_exactly(request_kwargs, words, monkeypatch):
    """With penalties switched off (served by default), each refusal names its option; the
    other refusals hold whatever the switch."""
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "0")
    with pytest.raises(ValueError, match=words):
        checks.RequestCheck()(_tokenizer_manager("DDTREE"), _request(**request_kwargs), [1])


def test_up_to_128_samples_per_request_pass_and_token_ids_outside_the_vocabulary_do_not():
    assert (
        checks.RequestCheck()(_tokenizer_manager("DDTREE"), _request(max_new_tokens=8, n=128), [1])
        is None
    )
    with pytest.raises(ValueError, match="token id -7, outside"):  # embedding row -7: a crash
        checks.RequestCheck()(_tokenizer_manager("DDTREE"), _request(max_new_tokens=8), [1, -7, 3])
    manager = _tokenizer_manager("DDTREE")
    manager.model_config = types.SimpleNamespace(vocab_size=100)
    with pytest.raises(ValueError, match=r"token id 100, outside the vocabulary \[0, 100\)"):
        checks.RequestCheck()(manager, _request(max_new_tokens=8), [1, 100])
    assert checks.RequestCheck()(manager, _request(max_new_tokens=8), [0, 99]) is None
    assert checks.RequestCheck()(_tokenizer_manager("DFLASH"), _request(n=5000), [-1]) is None


def test_logprobs_and_penalties_are_served_by_default(monkeypatch):
    """Logprob requests always pass the front end; penalty requests too unless
    SGLANG_DDTREE_PENALTIES=0 (its default is 1 since its GPU tests passed)."""
    monkeypatch.delenv("SGLANG_DDTREE_PENALTIES", raising=False)
    asked = _request(
        logprob=True, max_new_tokens=8, frequency_penalty=0.5, min_new_tokens=2, min_p=0.1
    )
    assert checks.RequestCheck()(_tokenizer_manager("DDTREE"), asked, [1]) is None


def test_logprobs_are_served_with_penalties_switched_off(monkeypatch):
    """Logprob requests go through (to SGLang's spec-v2 logprobs) whatever the switches; the
    other refusals stay."""
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "0")
    asked = _request(logprob=True, max_new_tokens=8)
    assert checks.RequestCheck()(_tokenizer_manager("DDTREE"), asked, [1]) is None
    with pytest.raises(ValueError, match="min_p=0.1"):
        checks.RequestCheck()(
            _tokenizer_manager("DDTREE"), _request(logprob=True, max_new_tokens=8, min_p=0.1), [1]
        )


def test_the_package_parses_its_switches_and_refuses_the_retired(monkeypatch):
    """The SGLANG_DDTREE_* names Options.from_env reads are the five a user sets (config.SWITCHES)
    and the retired ones it refuses; a sixth switch fails here. Every such name the package's
    source mentions is one of those."""
    import os
    import pathlib
    import re

    from sglang_ddtree import config

    class Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

    read: set[str] = set()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DDTREE_")}
    monkeypatch.setattr(config.os, "environ", Recording(environ))
    config.Options.from_env()
    config.Options.from_env(unified_memory=True, deterministic=True, tensor_parallel=True)
    retired = set(config.RETIRED_SWITCHES) | set(config.DEBUG_SWITCHES)
    parsed = {name for name in read if name.startswith("SGLANG_DDTREE_")} - retired
    assert len(config.SWITCHES) == 5 and parsed == set(config.SWITCHES)
    source = pathlib.Path(config.__file__).parent
    named = {
        m
        for f in source.rglob("*.py")
        for m in re.findall(r"SGLANG_DDTREE_[A-Z_]*[A-Z]", f.read_text())
    }
    assert named <= set(config.SWITCHES) | retired, named - set(config.SWITCHES) - retired


@pytest.mark.parametrize(
    "name",
    [
        "SGLANG_DDTREE_TREE_BUILDER",
        "SGLANG_DDTREE_SYNC_CHECK",
        "SGLANG_DDTREE_GDN_VERIFY",
        "SGLANG_DDTREE_GDN_PRECISION",
        "SGLANG_DDTREE_CONV",
        "SGLANG_DDTREE_GDN_SCRATCH",
        "SGLANG_DDTREE_LOGPROBS",
        "SGLANG_DDTREE_MASK_PACK",
        "SGLANG_DDTREE_ACCEPT_PATH",
    ],
)
def test_a_retired_switch_is_refused_by_name(monkeypatch, name):
    """A server does not start with a retired switch set, whatever its value (silently ignoring
    it would mislead); the message names it and what replaced it."""
    from sglang_ddtree import config

    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=f"{name} is no longer a switch: .+ Unset {name}"):
        config.Options.from_env()


def test_penalties_are_refused_when_switched_off(monkeypatch):
    """SGLANG_DDTREE_PENALTIES=1 lets frequency / presence / repetition penalties,
    min_new_tokens and min_p through (round/penalties.py applies them per node); the other
    refusals stay; without it each refusal names the switch."""
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "1")
    asked = _request(
        max_new_tokens=8,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        repetition_penalty=1.3,
        min_new_tokens=4,
        min_p=0.1,
    )
    assert checks.RequestCheck()(_tokenizer_manager("DDTREE"), asked, [1]) is None
    with pytest.raises(ValueError, match="at least 1"):
        checks.RequestCheck()(
            _tokenizer_manager("DDTREE"), _request(max_new_tokens=0, min_p=0.1), [1]
        )
    deterministic = types.SimpleNamespace(
        server_args=types.SimpleNamespace(
            speculative_algorithm="DDTREE", enable_deterministic_inference=True
        )
    )
    with pytest.raises(ValueError, match="min_p=0.1 cannot be served with --enable-determ"):
        checks.RequestCheck()(deterministic, _request(max_new_tokens=8, min_p=0.1), [1])
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "0")
    for name in ("frequency_penalty", "min_p"):
        with pytest.raises(ValueError, match=f"{name}=.*SGLANG_DDTREE_PENALTIES=1"):
            checks.RequestCheck()(
                _tokenizer_manager("DDTREE"), _request(max_new_tokens=8, **{name: 0.1}), [1]
            )


def test_front_end_accepts_plain_requests_and_other_algorithms():
    ok = _request(
        max_new_tokens=8,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        min_new_tokens=0,
    )
    assert checks.RequestCheck()(_tokenizer_manager("DDTREE"), ok, [1]) is None
    bad = _request(logprob=True, max_new_tokens=0)
    assert checks.RequestCheck()(_tokenizer_manager("DFLASH"), bad, [1]) is None


def test_dummy_inputs_have_the_right_width_and_fields(registered, monkeypatch):
    import torch

    cfg = spec.DDTreeConfig(block_size=16, num_nodes=32, topk=4)  # the worker factory's
    mask = torch.ones(8, dtype=torch.bool)
    draft = hooks._dummy_verify_input(cfg, None, registered, mask, 16, True)
    assert draft.draft_token_num == 16 and draft.custom_mask is None
    target = hooks._dummy_verify_input(cfg, None, registered, mask, 32, False)
    assert target.draft_token_num == 32 and target.custom_mask is mask
    assert target.retrieve_next_token is None  # GDN reads the attribute: it must exist
    assert target.max_tree_depth == 16 and target.topk == 4
    sentinel = object()
    other = hooks._dummy_verify_input(cfg, lambda *a: sentinel, SpeculativeAlgorithm.EAGLE, 0, 0, 0)
    assert other is sentinel
    # the hook takes SGLang's create_dummy_verify_input's parameters
    from sglang.srt.speculative import spec_info as spec_info_mod

    theirs = list(inspect.signature(spec_info_mod.create_dummy_verify_input).parameters)
    assert list(inspect.signature(hooks._dummy_verify_input).parameters)[2:] == theirs


def test_worker_module_imports_against_installed_sglang():
    """Every SGLang symbol the worker uses exists in the installed release."""
    from sglang_ddtree.round import worker

    assert issubclass(worker.DDTreeWorker, worker.DFlashWorkerV2)


def test_the_worker_factory_hands_one_runtime_to_the_hooks_and_the_worker(monkeypatch):
    """The scheduler process parses its options once (the worker factory), reads SGLang's
    resolved (B, N, K) once, and hands both as one Runtime to the hooks it installs and to the
    worker SGLang constructs with its own four arguments."""
    from sglang_ddtree.round import worker as worker_mod

    installed = []
    monkeypatch.setattr(hooks, "install_runtime_hooks", installed.append)
    cfg = spec.DDTreeConfig(block_size=16, num_nodes=32, topk=8)
    monkeypatch.setattr(compat, "resolved_config", lambda: cfg)
    monkeypatch.setenv("SGLANG_DDTREE_PENALTIES", "0")
    worker_cls = plugin._worker_factory(types.SimpleNamespace())
    (runtime,) = installed
    assert runtime.cfg is cfg and runtime.options.penalties is False
    assert runtime.gdn.path.max_path == 16 and runtime.penalties is None
    assert issubclass(worker_cls, worker_mod.DDTreeWorker)
    assert worker_cls.__name__ == "DDTreeWorker"
    seen = []
    monkeypatch.setattr(worker_mod.DDTreeWorker, "__init__", lambda self, *a: seen.append(a))
    worker_cls("server_args", 0, 1234, "target")
    assert seen == [("server_args", 0, 1234, "target", runtime)]


def test_the_runtime_hooks_are_installed_once_per_process(monkeypatch):
    """A second install would leave the first runtime's hooks in SGLang's functions: refused."""
    import collections
    import functools

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_ddtree.config import Options
    from sglang_ddtree.round.runtime import Runtime
    from sglang_ddtree.state import gdn

    runtime = Runtime.create(Options(), spec.DDTreeConfig(block_size=16, num_nodes=32, topk=8))
    earlier = functools.partial(gdn.target_verify, runtime.gdn)
    monkeypatch.setattr(
        HookRegistry,
        "_hooks",
        collections.defaultdict(
            list, {compat.GDN_TARGET_VERIFY: [(HookType.AROUND, earlier, None)]}
        ),
    )
    assert compat.hook_registered(compat.GDN_TARGET_VERIFY, gdn.target_verify)
    with pytest.raises(RuntimeError, match="already installed in this process"):
        hooks.install_runtime_hooks(runtime)


def test_the_rounds_ranges_exist_while_a_torch_profiler_runs_and_cost_nothing_otherwise():
    """The worker's `ddtree.*` ranges (scripts/bench_round.py reads them from SGLang's
    /start_profile traces) are recorded under torch's profiler, started as SGLang starts it,
    and are no range at all without one."""
    import contextlib

    import torch

    from sglang_ddtree.round.round import profiled

    assert isinstance(profiled("ddtree.verify_input"), contextlib.nullcontext)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    prof.start()
    try:
        with profiled("ddtree.verify_input"):
            torch.ones(3).sum()
    finally:
        prof.stop()
    assert "ddtree.verify_input" in {e.name for e in prof.events()}
    assert isinstance(profiled("ddtree.verify_input"), contextlib.nullcontext)


def test_verify_input_carries_the_tree_in_eagle_layout():
    import torch
    from sglang.srt.speculative.spec_info import SpecInputType

    from sglang_ddtree.config import DDTreeConfig
    from sglang_ddtree.round.verify_input import make_verify_input
    from sglang_ddtree.tree import build_tree, topk_logprobs_from_logits
    from sglang_ddtree.tree import verify_layout as tree_layout

    cfg = DDTreeConfig(block_size=5, num_nodes=9, topk=3)
    ids, lps = topk_logprobs_from_logits(torch.randn(2, 4, 30), cfg.topk)
    tree = build_tree(torch.tensor([7, 8]), ids, lps, cfg.budget)
    seq_lens = torch.tensor([5, 11])
    v = make_verify_input(
        cfg,
        tree.tokens,
        tree.depth,
        tree.first_child,
        tree.next_sibling,
        tree.visibility,
        seq_lens,
        seq_lens_sum=40,  # an over-estimate is allowed
    )
    assert v.spec_input_type == SpecInputType.EAGLE_VERIFY and v.is_verify_input()
    assert v.draft_token_num == v.num_tokens_per_req == 9 and v.max_tree_depth == 5
    assert torch.equal(v.draft_token, tree.tokens.reshape(-1))
    assert torch.equal(v.positions.view(2, 9), seq_lens[:, None] + tree.depth)
    assert torch.equal(v.retrieve_next_token, tree.first_child)
    assert torch.equal(v.retrieve_next_sibling, tree.next_sibling)
    expected = torch.empty(tree_layout.full_mask_size(9, 2, 40), dtype=torch.bool)
    tree_layout.write_full_mask(tree.visibility, seq_lens, expected)
    assert torch.equal(v.custom_mask, expected)


def test_worker_drops_only_dflashs_width_mismatch_warning():
    """DDTREE's verify width N differs from the draft's block B by design: DFlashWorkerV2's
    "block size mismatch" warning is dropped while it initialises, nothing else."""
    import logging

    from sglang_ddtree.round.worker import _DropWidthMismatch

    def record(msg):
        return logging.LogRecord("x", logging.WARNING, __file__, 1, msg, (64, 16), None)

    drop = _DropWidthMismatch()
    mismatch = "DFLASH block size mismatch: using speculative_num_draft_tokens=%s but draft config block_size=%s."
    assert not drop.filter(record(mismatch))
    assert drop.filter(record("Initialized DFLASH draft runner. block_size=%s %s"))


def test_the_prefill_is_dflashs_and_serves_logprobs(monkeypatch):
    """A prefill batch goes to DFlashWorkerV2's own prefill as it came: SGLang serves a logprob
    request's first token itself (its target forward sees return_logprob), with no refusal of
    its own to work around."""
    from sglang_ddtree.round import worker as worker_mod

    class Reached(Exception):
        pass

    class Target:
        def forward_batch_generation(self, batch, *args, **kwargs):
            raise Reached(batch.return_logprob, args, kwargs)

    w = worker_mod.DDTreeWorker.__new__(worker_mod.DDTreeWorker)
    w._target_worker = Target()
    w.selector = w.lilicorr = None
    w._warned_sampling_fallback = True
    batch = types.SimpleNamespace(
        return_logprob=True,
        sampling_info=None,
        is_extend_in_batch=True,
        forward_mode=types.SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False),
        reqs=[],
        extend_lens=[1],
        prefix_lens=[0],
    )
    monkeypatch.setattr(
        worker_mod.DFlashWorkerV2,
        "_wait_for_fused_hicache_load",
        lambda self, b: None,
        raising=False,
    )
    with pytest.raises(Reached) as reached:
        w.forward_batch_generation(batch)
    assert reached.value.args[0] is True  # the target forward saw return_logprob
    assert "capture_hidden_mode" in reached.value.args[2]  # DFLASH's prefill call


def _resolve(target: str):
    import importlib

    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def test_the_request_hooks_are_registered(monkeypatch):
    """The front-end hooks: the request check and the JSON-body guard (SGLang's chat endpoint
    gives each streamed token its own top logprobs itself)."""
    registered = []
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(
        HookRegistry, "register", lambda target, fn, kind: registered.append((target, fn))
    )
    checks.register_request_hook()
    (validator, check), call, guard = registered
    assert validator == compat.TOKENIZER_REQUEST_VALIDATOR
    assert isinstance(check, checks.RequestCheck)
    assert call == (compat.TOKENIZER_GENERATE_REQUEST, checks._bounded_call)
    assert guard == (compat.TOKENIZER_MANAGER_INIT, checks._guard_json_bodies)


def test_a_calls_size_is_bounded_before_sglang_splits_it_and_its_items_pass_through():
    """checks._bounded_call through SGLang's own AROUND wrapper on an async generator method, as
    TokenizerManager.generate_request is: a DDTREE call with n past 128 is refused at its first
    item, before the original runs; a good call's items pass through; closing the call early
    closes the original (its finally runs: SGLang aborts a request whose client left); other
    algorithms' calls are not checked."""
    import asyncio

    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    ran = []

    async def generate_request(manager, obj, request=None):
        ran.append("start")
        try:
            for i in range(3):
                yield i
        finally:
            ran.append("closed")

    wrapped = _wrap_fn(generate_request, checks._bounded_call, HookType.AROUND)
    ddtree = types.SimpleNamespace(
        server_args=types.SimpleNamespace(speculative_algorithm="DDTREE")
    )
    dflash = types.SimpleNamespace(
        server_args=types.SimpleNamespace(speculative_algorithm="DFLASH")
    )

    def call(manager, n):
        obj = types.SimpleNamespace(text="hi", input_ids=None, sampling_params={"n": n})
        return wrapped(manager, obj, None)

    async def first(gen):
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()

    async def every(gen):
        return [item async for item in gen]

    with pytest.raises(ValueError, match=r"n=129 is outside DDTREE's limit \[1, 128\]"):
        asyncio.run(first(call(ddtree, 129)))
    assert ran == []
    assert asyncio.run(every(call(ddtree, 128))) == [0, 1, 2]
    assert asyncio.run(first(call(ddtree, 2))) == 0
    assert ran == ["start", "closed", "start", "closed"]
    assert asyncio.run(every(call(dflash, 10**6))) == [0, 1, 2]


def _row_context(monkeypatch, algorithm, nodes: int, page_size: int = 1) -> None:
    """The runtime context SGLang's get_req_to_token_extra_context_len and DDTREE's headroom
    read: the algorithm, N and the allocation page."""
    import sglang.srt.mem_cache.allocation_sizing as sizing
    import sglang.srt.runtime_context as rc

    spec_bag = types.SimpleNamespace(
        speculative_algorithm=algorithm,
        speculative_num_draft_tokens=nodes,
        max_speculative_num_draft_tokens=nodes,
    )
    monkeypatch.setattr(rc, "get_spec", lambda: spec_bag)
    monkeypatch.setattr(sizing, "get_spec", lambda: spec_bag)
    monkeypatch.setattr(sizing, "get_alloc_page_size", lambda: page_size)
    monkeypatch.setattr(sizing, "max_speculative_num_draft_tokens", lambda: nodes)
    monkeypatch.setattr(sizing, "get_alloc_reserve_per_decode", lambda: 2 * nodes)


def test_request_rows_hold_the_decode_reserve_at_the_context_limit(registered, monkeypatch):
    """4 prompts at the context limit on a DDTREE server once left 57-72 KV slots allocated and
    the scheduler stopped on its idle leak check. DFlash v2 reserves committed + 2N slots per
    running request, SGLang's rows hold context + 4 + N: past the row's end the slots go into
    the next row and are never freed. DDTREE's rows hold the reserve at the largest committed
    length a running request has (context - 1); other algorithms keep SGLang's width."""
    import pkgutil

    from sglang.srt.mem_cache import allocation_sizing
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    # the reserve as SGLang computes it (a release that changes it fails here)
    source = inspect.getsource(DFlashDraftInputV2.prepare_for_decode)
    assert "reserve = 2 * block_size" in source
    assert "block_size = int(get_spec().speculative_num_draft_tokens)" in source
    original = allocation_sizing.get_req_to_token_extra_context_len
    assert pkgutil.resolve_name(compat.REQ_TO_TOKEN_HEADROOM) is original  # what the hook wraps
    assert hooks.HOOKS[compat.REQ_TO_TOKEN_HEADROOM] is hooks._row_headroom
    context = 2048
    for nodes, page in ((32, 1), (31, 1), (64, 1), (32, 16)):
        _row_context(monkeypatch, "DDTREE", nodes, page)
        sglang_rows = original()
        rows = hooks._row_headroom(original)
        reserve_end = (context - 1) + 2 * nodes  # a running request's last reserve
        if page > 1:  # SGLang page-aligns the reserve
            reserve_end = -(-reserve_end // page) * page
        assert context + rows >= reserve_end, (nodes, page, rows)
        assert rows >= sglang_rows
    _row_context(monkeypatch, "DDTREE", 32)
    assert original() == 36  # SGLang's own: too narrow by 27 slots
    for other in ("DFLASH", "EAGLE", None):
        _row_context(monkeypatch, other, 16)
        assert hooks._row_headroom(original) == original()


def test_unified_memory_rows_get_the_same_headroom(registered, monkeypatch):
    """--enable-unified-memory: SGLang's configurator passes the rows' headroom (4 + N) to
    init_unified_mamba_pools itself; DDTREE's is raised to the decode reserve's there too."""
    import pkgutil

    from sglang.srt.mem_cache import unified_memory_pool

    assert pkgutil.resolve_name(compat.UNIFIED_MAMBA_POOLS) is (
        unified_memory_pool.init_unified_mamba_pools
    )
    assert hooks.HOOKS[compat.UNIFIED_MAMBA_POOLS] is hooks._unified_row_headroom
    params = inspect.signature(unified_memory_pool.init_unified_mamba_pools).parameters
    assert params["extra_max_context_len"].kind is inspect.Parameter.KEYWORD_ONLY

    def sized(**kwargs):
        return kwargs["extra_max_context_len"]

    for algorithm, expected in (("DDTREE", 4 + 2 * 32), ("DFLASH", 36)):
        _row_context(monkeypatch, algorithm, 32)
        assert hooks._unified_row_headroom(sized, extra_max_context_len=36) == expected
