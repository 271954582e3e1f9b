"""The endpoints that change a DDTREE server's state, and the secrets its info endpoint shows.

SGLang 0.5.23 marks ~45 endpoints admin-level (`sglang.srt.utils.auth`: every one
ADMIN_OPTIONAL): flushing caches, loading weights and adapters, profiling to a path the body
names, pausing, slowing and aborting generation, logging, memory release, internal state. With
no key configured they are open to every client; with --api-key alone, to every holder of the
API key; only --admin-api-key closes them to the rest. And `/server_info` (NORMAL level: open
whenever --api-key is unset) returns the resolved server arguments, api_key and admin_api_key
among them, in clear, and the launch command with them.

`AdminGate`, an ASGI middleware on a DDTREE server's app:
- **Closed by default.** An endpoint SGLang marks admin-level answers 403 unless the server was
  started with --admin-api-key, and then 401 unless `Authorization: Bearer <that key>` comes
  with it (SGLang's own middleware checks the same where it is installed).
- **DDTREE's invariants.** Whatever the key: /set_internal_state takes only the settings that
  leave DDTREE exact (REFUSED_STATE: the accept thresholds at 1.0, nothing else); the LoRA,
  PD-role and elastic-EP endpoints, which change what DDTREE does not serve, are refused.
- **Bad values change nothing.** The bodies whose bad values SGLang applies in part or raises on
  in another process get a 400 naming the field, the value and the limit first (VALIDATORS).
- **No secrets.** `/server_info` and `/get_server_info` answer with every key, password, secret
  and token field, and their values in the launch command, replaced by REDACTED.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
from collections.abc import Callable

from sglang_ddtree.front_door.json_bodies import refuse
from sglang_ddtree.front_door.values import show

REDACTED = "<redacted>"
INFO_PATHS = ("/server_info", "/get_server_info")
MAX_ADMIN_BODY = 1 << 20  # the bodies judged here are a few fields
MAX_FORWARD_SLEEP = 10.0  # /slow_down's seconds per forward (SGLang's watchdog ends at 300)
# DDTREE keeps the target distribution exactly: SGLang's accept thresholds stay at 1.0
EXACT_SETTINGS = ("speculative_accept_threshold_single", "speculative_accept_threshold_acc")
# SGLang posts /freeze_gc to itself after its warm-up (with no key when none is set): served to
# a client on the server's own host
LOCAL_WITHOUT_KEY = ("/freeze_gc",)
REFUSED = {
    "/load_lora_adapter": "LoRA adapters are not served with DDTREE (lora_path is refused)",
    "/load_lora_adapter_from_tensors": "LoRA adapters are not served with DDTREE",
    "/unload_lora_adapter": "LoRA adapters are not served with DDTREE",
    "/pd_role_switch": "DDTREE does not support PD disaggregation",
    "/scale_elastic_ep": "DDTREE does not support elastic expert parallelism",
}


def _set_internal_state(body: dict) -> str | None:
    args = body.get("server_args")
    if not isinstance(args, dict):
        return f"server_args must be an object of settings, got {show(args)}"
    for key, value in args.items():
        if key not in EXACT_SETTINGS:
            return (
                f"server_args.{key} cannot be changed on a DDTREE server at run time (its widths, "
                "verify scratch and state pool are sized at start-up); of SGLang's run-time "
                f"settings it takes only {' and '.join(EXACT_SETTINGS)} at 1.0"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value != 1.0:
            return (
                f"server_args.{key}={show(value)}: DDTREE keeps the target distribution "
                "exactly, so it stays at 1.0"
            )
    return None


_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


def _configure_logging(body: dict) -> str | None:
    """SGLang applies the request-logging fields before it sets log_level (an unknown level
    raises there: a 500 after the change) and stores log_requests_level unchecked (a level past
    3 raises on every later change)."""
    checks = {
        "log_requests": (lambda v: isinstance(v, bool), "true or false"),
        "log_requests_level": (lambda v: v in (0, 1, 2, 3) and type(v) is int, "0, 1, 2 or 3"),
        "log_requests_format": (lambda v: v in ("text", "json"), "'text' or 'json'"),
        "log_level": (lambda v: isinstance(v, str) and v.upper() in _LEVELS, "a level name"),
        "dump_requests_threshold": (lambda v: type(v) is int and v >= 1, "an integer >= 1"),
        "dump_requests_folder": (lambda v: isinstance(v, str), "a path"),
        "crash_dump_folder": (lambda v: isinstance(v, str), "a path"),
        "dump_requests_exclude_meta_keys": (
            lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
            "a list of strings",
        ),
    }
    for name, value in body.items():
        if name in checks and value is not None and not checks[name][0](value):
            return f"{name}={show(value)} must be {checks[name][1]}"
    return None


def _slow_down(body: dict) -> str | None:
    value = body.get("forward_sleep_time")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"forward_sleep_time must be a number of seconds, got {show(value)}"
    if value > MAX_FORWARD_SLEEP:
        return (
            f"forward_sleep_time={value} is above DDTREE's limit of {MAX_FORWARD_SLEEP} s per "
            "forward (the scheduler sleeps that long every batch; past --watchdog-timeout it "
            "ends the server, and /health fails long before)"
        )
    return None


def _abort_request(body: dict) -> str | None:
    rid, every = body.get("rid"), body.get("abort_all")
    if every is True:
        return None
    if not isinstance(rid, str) or not rid:
        return (
            f"rid={show(rid)}: give the id of the request to abort (SGLang aborts every request "
            "whose id begins with it, and ignores an empty one), or abort_all: true"
        )
    return None


VALIDATORS: dict[str, Callable[[dict], str | None]] = {
    "/set_internal_state": _set_internal_state,
    "/configure_logging": _configure_logging,
    "/slow_down": _slow_down,
    "/abort_request": _abort_request,
}
_SECRET = re.compile(r"(api_key|password|secret|token|watermark_key\w*)$")
_SECRET_FLAG = re.compile(
    r"(--[\w-]*(?:api-key|password|secret|token|watermark-key[\w-]*))(=|\s+)('[^']*'|\"[^\"]*\"|\S+)"
)


def redact(value):
    """A JSON value with every secret field's value (a string) and the secrets in a launch
    command replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: _redacted(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def _redacted(key, value):
    if isinstance(key, str) and _SECRET.search(key) and isinstance(value, str) and value:
        return REDACTED
    if key == "launch_command" and isinstance(value, str):
        return _SECRET_FLAG.sub(rf"\1\2{REDACTED}", value)
    return redact(value)


class AdminGate:
    """ASGI middleware (module docstring). `owner`: the app whose routes carry SGLang's
    auth-level marks; `admin_key`: --admin-api-key (None: every admin endpoint is refused)."""

    def __init__(self, app, owner=None, admin_key: str | None = None) -> None:
        self.app, self.owner, self.admin_key = app, owner, admin_key or None
        self._admin_routes = None  # read from the owner's routes at the first request

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        route = self._admin_route(scope)
        if route is not None:
            refusal = self._refusal(scope, route)
            if refusal is not None:
                return await refuse(send, *refusal)
            if route in VALIDATORS:
                return await self._judged(scope, receive, send, VALIDATORS[route])
        if _route_path(scope) in INFO_PATHS:
            return await self.app(scope, receive, _redacting(send))
        return await self.app(scope, receive, send)

    def _admin_route(self, scope) -> str | None:
        """The admin-level route `scope` reaches (its path template), or None."""
        if self._admin_routes is None:
            self._admin_routes = admin_routes(self.owner)
        from starlette.routing import Match

        for route in self._admin_routes:
            if route.matches(scope)[0] is Match.FULL:
                return route.path
        return None

    def _refusal(self, scope, route: str) -> tuple[int, str] | None:
        if self.admin_key is None:
            host = (scope.get("client") or ("",))[0]
            if route in LOCAL_WITHOUT_KEY and host in ("127.0.0.1", "::1", "localhost"):
                return None
            return 403, (
                f"{route} changes the server's state, and a DDTREE server refuses it unless "
                "started with --admin-api-key (then send Authorization: Bearer <that key>)"
            )
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.encode(), self.admin_key.encode()
        ):
            return 401, f"{route} needs Authorization: Bearer <the server's --admin-api-key>"
        if route in REFUSED:
            return 400, f"{route} is not served by DDTREE: {REFUSED[route]}"
        return None

    async def _judged(self, scope, receive, send, validator):
        seen, size = [], 0
        while True:
            message = await receive()
            seen.append(message)
            if message.get("type") != "http.request":
                break
            size += len(message.get("body", b""))
            if size > MAX_ADMIN_BODY:
                return await refuse(send, 413, f"an admin body over {MAX_ADMIN_BODY} bytes")
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in seen if m.get("type") == "http.request")
        try:
            parsed = json.loads(body) if body.strip() else None
        except (ValueError, RecursionError):
            parsed = None  # SGLang's own parse answers it
        fault = validator(parsed) if isinstance(parsed, dict) else None
        if fault is not None:
            return await refuse(send, 400, f"{_route_path(scope)}: {fault}")

        async def replay():
            return seen.pop(0) if seen else await receive()

        return await self.app(scope, replay, send)


def admin_routes(app) -> list:
    """The routes of `app` whose endpoint SGLang marks admin-level (an AuthLevel other than
    NORMAL on the function: sglang.srt.utils.auth.auth_level)."""
    from sglang.srt.utils.auth import AuthLevel

    found = []
    for route in getattr(getattr(app, "router", None), "routes", None) or []:
        marks = vars(getattr(route, "endpoint", None) or (lambda: None)).values()
        if any(isinstance(m, AuthLevel) and m is not AuthLevel.NORMAL for m in marks):
            found.append(route)
    return found


def _redacting(send):
    """`send` for an info endpoint: its JSON body is held, redacted and sent whole."""
    held: dict = {}

    async def redacting(message):
        if message["type"] == "http.response.start":
            held["start"], held["body"] = message, b""
            return None
        if message["type"] != "http.response.body" or "start" not in held:
            return await send(message)
        held["body"] += message.get("body", b"")
        if message.get("more_body", False):
            return None
        body = held["body"]
        try:
            body = json.dumps(redact(json.loads(body))).encode()
        except (ValueError, RecursionError):
            logging.getLogger(__name__).warning("sglang_ddtree: an info body that is not JSON")
        start = held.pop("start")
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        return await send({"type": "http.response.body", "body": body})

    return redacting


def _route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def add_to(app, admin_key: str | None) -> bool:
    """Put the gate on a FastAPI / Starlette app that has not started (once), innermost of the
    app's middlewares so far (the body guard goes inside it). Whether it was added."""
    from starlette.middleware import Middleware

    if any(getattr(m, "cls", None) is AdminGate for m in app.user_middleware):
        return False
    if app.middleware_stack is not None:
        raise RuntimeError("the HTTP app has started; its middleware is fixed")
    app.user_middleware.append(Middleware(AdminGate, owner=app, admin_key=admin_key))
    return True
