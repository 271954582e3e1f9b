"""The admin gate (front_door/admin.py) on SGLang 0.5.23's own HTTP routes (its app's routes on a
fresh app, its handlers calling a recording tokenizer manager; no model): with no
--admin-api-key every endpoint SGLang marks admin-level answers 403 and reaches no handler (SGLang
alone serves them to anyone); with the key, a wrong bearer is a 401, DDTREE's invariants hold
whatever the key, bad values are a 400 that changes nothing, and /server_info shows no secret."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang")
pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from sglang_ddtree.front_door import admin  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
KEY = "admin-secret"
BEARER = {"Authorization": f"Bearer {KEY}"}


class Manager:
    """Stands in for SGLang's TokenizerManager behind the routes: records every method a
    handler calls, which answers as a successful control call does."""

    def __init__(self, server_args=None):
        self.calls, self.server_args, self.startup_time = [], server_args, {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append(name)

            async def done():
                if name == "get_internal_state":
                    return [{"avg_spec_accept_length": 3.5}]
                return types.SimpleNamespace(success=True, message="", updated=True)

            return done()

        return call


@pytest.fixture(scope="module")
def http():
    import sglang.srt.entrypoints.http_server as http

    return http


@pytest.fixture()
def manager(http):
    before = http.get_global_state()
    manager = Manager()
    http.set_global_state(http._GlobalState(manager, None, {}))
    yield manager
    http.set_global_state(before)


def _client(http, gate=True, key=None, client=("testclient", 50000)) -> TestClient:
    app = FastAPI()
    app.router.routes.extend(http.app.router.routes)  # SGLang's routes, marks and handlers
    if gate:
        assert admin.add_to(app, admin_key=key) and not admin.add_to(app, admin_key=key)
    return TestClient(app, client=client)


def _admin_calls(http):
    """(method, path) of one call to every admin-level route of SGLang's app."""
    calls = []
    for route in admin.admin_routes(http.app):
        method = sorted(route.methods - {"HEAD"})[0]
        calls.append((method, route.path.replace("{method}", "start")))
    return sorted(set(calls))


def test_sglang_marks_its_admin_endpoints_and_serves_them_to_anyone(http, manager):
    """SGLang's own behaviour without a key: every admin-level route reaches its handler (the
    recording manager is called) for a client that sends no key at all."""
    calls = _admin_calls(http)
    paths = {p for _, p in calls}
    assert len(paths) >= 40
    for path in ("/flush_cache", "/pause_generation", "/set_internal_state", "/abort_request"):
        assert path in paths
    for path in ("/configure_logging", "/slow_down", "/start_profile", "/update_weights_from_disk"):
        assert path in paths
    assert {"/generate", "/health", "/server_info", "/v1/chat/completions"}.isdisjoint(paths)
    client = _client(http, gate=False)
    for method, path, body in (
        ("POST", "/flush_cache", None),
        ("POST", "/pause_generation", {"mode": "in_place"}),
        ("POST", "/configure_logging", {"log_requests": True}),
        ("POST", "/slow_down", {"forward_sleep_time": 1e9}),
        ("POST", "/abort_request", {"abort_all": True}),
    ):
        manager.calls.clear()
        r = client.request(method, path, json=body)
        assert manager.calls, (path, r.status_code, r.text)


def test_every_admin_endpoint_is_a_403_without_the_key_and_reaches_nothing(http, manager):
    client = _client(http)
    for method, path in _admin_calls(http):
        manager.calls.clear()
        r = client.request(method, path, json={})
        assert r.status_code == 403, (path, r.status_code)
        assert "--admin-api-key" in r.json()["message"] and path in r.json()["message"]
        assert manager.calls == [], path
    # everything else is not the gate's
    r = client.get("/health_generate")
    assert r.status_code != 403
    assert client.options("/flush_cache").status_code != 403  # CORS preflight


def test_with_the_key_a_wrong_bearer_is_a_401_and_the_right_one_is_served(http, manager):
    client = _client(http, key=KEY)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        manager.calls.clear()
        r = client.post("/flush_cache", headers=headers)
        assert r.status_code == 401 and manager.calls == [], headers
    r = client.post("/flush_cache", headers=BEARER)
    assert r.status_code == 200 and manager.calls == ["flush_cache"]


def test_sglangs_post_warm_up_freeze_gc_is_served_on_its_own_host(http, manager):
    """SGLang posts /freeze_gc to itself after its warm-up, with no key when none is set."""
    local = _client(http, client=("127.0.0.1", 50000))
    assert local.post("/freeze_gc").status_code == 200 and manager.calls == ["freeze_gc"]
    assert local.post("/flush_cache").status_code == 403
    assert _client(http).post("/freeze_gc").status_code == 403  # from elsewhere


@pytest.mark.parametrize(
    "path,body,words",
    [
        (
            "/set_internal_state",
            {"server_args": {"speculative_accept_threshold_single": 0.5}},
            "stays at 1.0",
        ),
        (
            "/set_internal_state",
            {"server_args": {"max_running_requests": 4}},
            "server_args.max_running_requests cannot be changed on a DDTREE server",
        ),
        (
            "/set_internal_state",
            {"server_args": {"pp_max_micro_batch_size": 2}},
            "pp_max_micro_batch_size cannot be changed",
        ),
        ("/set_internal_state", {"server_args": [1]}, "server_args must be an object"),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}, "LoRA adapters"),
        ("/unload_lora_adapter", {"lora_name": "a"}, "not served by DDTREE"),
        ("/pd_role_switch", {"new_role": "decode"}, "PD disaggregation"),
    ],
)
def test_ddtrees_invariants_hold_whatever_the_key(http, manager, path, body, words):
    r = _client(http, key=KEY).post(path, json=body, headers=BEARER)
    assert r.status_code == 400 and words in r.json()["message"], r.json()
    assert manager.calls == []


def test_an_exact_setting_passes_to_sglang(http, manager):
    body = {"server_args": {"speculative_accept_threshold_acc": 1.0}}
    r = _client(http, key=KEY).post("/set_internal_state", json=body, headers=BEARER)
    assert r.status_code == 200 and manager.calls == ["set_internal_state"]


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("/configure_logging", {"log_requests": True, "log_requests_level": 7}, "0, 1, 2 or 3"),
        ("/configure_logging", {"log_requests": True, "log_level": "loud"}, "a level name"),
        ("/configure_logging", {"log_requests_format": "xml"}, "'text' or 'json'"),
        ("/configure_logging", {"dump_requests_threshold": 0}, "an integer >= 1"),
        ("/configure_logging", {"log_requests": "yes"}, "true or false"),
        ("/slow_down", {"forward_sleep_time": 1e9}, "DDTREE's limit of 10.0 s"),
        ("/abort_request", {"rid": ""}, "give the id of the request to abort"),
        ("/abort_request", {}, "or abort_all: true"),
    ],
)
def test_a_bad_value_is_a_400_that_changes_nothing(http, manager, path, body, words):
    r = _client(http, key=KEY).post(path, json=body, headers=BEARER)
    assert r.status_code == 400 and words in r.json()["message"], r.json()
    assert path in r.json()["message"] and manager.calls == []


def test_good_values_reach_sglang(http, manager):
    client = _client(http, key=KEY)
    for path, body, called in (
        (
            "/configure_logging",
            {"log_requests": True, "log_requests_level": 3},
            "configure_logging",
        ),
        ("/configure_logging", {"log_level": "debug"}, "configure_logging"),
        ("/slow_down", {"forward_sleep_time": 0.5}, "slow_down"),
        ("/abort_request", {"rid": "job-1"}, "abort_request"),
        ("/abort_request", {"abort_all": True}, "abort_request"),
    ):
        manager.calls.clear()
        r = client.post(path, json=body, headers=BEARER)
        assert r.status_code == 200 and manager.calls == [called], (path, r.text)


def test_sglangs_configure_logging_applies_part_of_a_bad_body_then_raises():
    """The reason for the /configure_logging check: SGLang's own handler (compiled from its
    source) stores the request-logging fields, then raises on the level: a 500 after a change."""
    from sglang.srt.managers.io_struct import ConfigureLoggingReq
    from sglang.srt.utils.request_logger import RequestLogger

    from tests.front_end import tokenizer_manager_method

    configure = tokenizer_manager_method("configure_logging")
    for body in (
        {"log_requests": True, "log_level": "loud"},
        {"log_requests": True, "log_requests_level": 7},
    ):
        manager = types.SimpleNamespace(request_logger=RequestLogger(False, 2, "text", None))
        with pytest.raises(ValueError):
            configure(manager, ConfigureLoggingReq(**body))
        assert manager.request_logger.log_requests is True  # changed before the refusal


def test_server_info_shows_no_secret(http, manager):
    """SGLang's /server_info (open whenever --api-key is unset) returns api_key and
    admin_api_key in clear, and the launch command with them."""
    from sglang.srt.server_args import ServerArgs

    from sglang_ddtree import DEMO_PAIR_DIR

    args = ServerArgs(
        model_path=str(DEMO_PAIR_DIR / "target"),
        device="cpu",
        disable_radix_cache=True,
        api_key="api-secret",
        admin_api_key=KEY,
    )
    args.resolve_once()
    args._launch_command = f"sglang serve --api-key api-secret --admin-api-key={KEY} --port 1"
    manager.server_args = args
    plain = _client(http, gate=False).get("/server_info")
    assert plain.status_code == 200 and KEY in plain.text and "api-secret" in plain.text
    for path in admin.INFO_PATHS:
        r = _client(http, key=KEY).get(path)
        assert r.status_code == 200 and KEY not in r.text and "api-secret" not in r.text
        info = r.json()
        assert info["api_key"] == info["admin_api_key"] == admin.REDACTED
        assert info["launch_command"] == (
            "sglang serve --api-key <redacted> --admin-api-key=<redacted> --port 1"
        )
        assert info["internal_states"] == [{"avg_spec_accept_length": 3.5}]
        assert info["model_path"] == plain.json()["model_path"] == args.model_path


def test_redact_finds_secrets_by_name_and_keeps_the_rest():
    value = {
        "api_key": "a",
        "admin_api_key": None,  # nothing to hide
        "ssl_keyfile_password": "p",
        "watermark_key_b": "w",
        "hf_token": "t",
        "max_total_num_tokens": 5,
        "tokenizer_path": "/t",
        "nested": [{"client_secret": "s", "launch_command": "x --hf-token 't 1' --tokens 3"}],
    }
    assert admin.redact(value) == {
        "api_key": admin.REDACTED,
        "admin_api_key": None,
        "ssl_keyfile_password": admin.REDACTED,
        "watermark_key_b": admin.REDACTED,
        "hf_token": admin.REDACTED,
        "max_total_num_tokens": 5,
        "tokenizer_path": "/t",
        "nested": [
            {
                "client_secret": admin.REDACTED,
                "launch_command": "x --hf-token <redacted> --tokens 3",
            }
        ],
    }


def test_the_hook_closes_a_ddtree_servers_admin_endpoints_only(monkeypatch):
    """checks._guard_json_bodies adds the gate (outside the body guard) with the server's
    --admin-api-key on DDTREE servers, and nothing on others."""
    import sys

    from sglang_ddtree.adapter import compat
    from sglang_ddtree.front_door import checks, json_bodies

    app = FastAPI()
    monkeypatch.setitem(sys.modules, compat.HTTP_SERVER_MODULE, types.SimpleNamespace(app=app))
    dflash = types.SimpleNamespace(speculative_algorithm="DFLASH", admin_api_key=None)
    checks._guard_json_bodies(None, "manager", dflash)
    assert app.user_middleware == []
    ddtree = types.SimpleNamespace(speculative_algorithm="DDTREE", admin_api_key=KEY)
    checks._guard_json_bodies(None, "manager", ddtree)
    gate, body = app.user_middleware
    assert gate.cls is admin.AdminGate and gate.kwargs == {"owner": app, "admin_key": KEY}
    assert body.cls is json_bodies.JsonBodies
