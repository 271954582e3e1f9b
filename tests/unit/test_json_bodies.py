"""front_door/json_bodies.py: a body over the size bound gets a 413; a JSON body that is not an
object gets a 400 on the OpenAI endpoints (SGLang answered `[1, 2, 3]` with a 500, as fuzzing on
the GPU found); a Vertex body whose parameters break SGLang's own /generate contract gets a 400;
every other body reaches the app byte for byte, and the hook adds the middleware to the HTTP
server's app on DDTREE servers only."""

from __future__ import annotations

import json
import sys
import types

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from sglang_ddtree.adapter import compat
from sglang_ddtree.front_door import (
    checks,
    json_bodies,  # noqa: E402
)


def _app() -> Starlette:
    async def echo(request):
        body = await request.body()
        return JSONResponse({"got": body.decode(), "parsed": type(json.loads(body)).__name__})

    routes = [Route(p, echo, methods=["POST"]) for p in ("/v1/chat/completions", "/generate")]
    app = Starlette(routes=routes)
    assert json_bodies.add_to(app)
    assert not json_bodies.add_to(app)  # once
    return app


@pytest.mark.parametrize("body", [b"[1, 2, 3]", b"  \n 5", b'"text"', b"null", b"true"])
def test_a_body_that_is_not_an_object_gets_a_400(body):
    r = TestClient(_app()).post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["code"] == 400 and "must be a JSON object" in r.json()["message"]


def test_objects_and_other_paths_reach_the_app_unchanged():
    client = TestClient(_app())
    body = b'  {"model": "x", "messages": [{"role": "user", "content": "hi"}]}'
    r = client.post("/v1/chat/completions", content=body)
    assert r.status_code == 200 and r.json() == {"got": body.decode(), "parsed": "dict"}
    # the same array elsewhere is not this middleware's to judge
    r = client.post("/generate", content=b"[1, 2]")
    assert r.status_code == 200 and r.json()["parsed"] == "list"


def test_it_sits_inside_the_apps_own_middlewares_and_under_a_root_path():
    """Innermost: SGLang's decompression and CORS middlewares (added before it) run first, so a
    compressed body is judged after decompression and the 400 carries the CORS headers; a root
    path (uvicorn puts it in front of the path) does not hide the endpoint."""
    from starlette.middleware.cors import CORSMiddleware

    class Unzip:  # stands in for SGLang's RequestDecompressionMiddleware: "(" + body -> body
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def unzipped():
                message = await receive()
                if message.get("type") == "http.request":
                    message = {**message, "body": message.get("body", b"").removeprefix(b"(")}
                return message

            return await self.app(scope, unzipped, send)

    async def echo(request):
        return JSONResponse({"got": (await request.body()).decode()})

    app = Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"])])
    app.add_middleware(Unzip)
    app.add_middleware(CORSMiddleware, allow_origins=["*"])
    assert json_bodies.add_to(app)
    client = TestClient(app)
    cors = {"origin": "http://example.com"}
    r = client.post("/v1/chat/completions", content=b'({"a": 1}', headers=cors)
    assert r.status_code == 200 and r.json() == {"got": '{"a": 1}'}
    r = client.post("/v1/chat/completions", content=b"([1]", headers=cors)
    assert r.status_code == 400 and r.headers["access-control-allow-origin"] == "*"
    rooted = TestClient(_app(), root_path="/api")
    assert rooted.post("/v1/chat/completions", content=b"[1]").status_code == 400
    started = _plain_app()
    TestClient(started).post("/v1/chat/completions", content=b"{}")
    with pytest.raises(RuntimeError, match="has started"):
        json_bodies.add_to(started)


def _plain_app() -> Starlette:
    async def ok(request):
        return JSONResponse({})

    return Starlette(routes=[Route("/v1/chat/completions", ok, methods=["POST"])])


def test_a_body_in_chunks_is_replayed_whole():
    def chunks():  # a streamed request body: one ASGI message per part
        yield from (b"", b"  ", b'{"a"', b": 1}")

    r = TestClient(_app()).post("/v1/chat/completions", content=chunks())
    assert r.status_code == 200 and r.json()["got"] == '  {"a": 1}'


def test_the_hook_guards_ddtree_http_servers_only(monkeypatch):
    from sglang_ddtree.front_door import admin

    calls = []
    monkeypatch.setattr(json_bodies, "add_to", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.setattr(admin, "add_to", lambda app, **kw: calls.append(("admin", kw)))
    dflash = types.SimpleNamespace(speculative_algorithm="DFLASH")
    ddtree = types.SimpleNamespace(speculative_algorithm="DDTREE")
    monkeypatch.delitem(sys.modules, compat.HTTP_SERVER_MODULE, raising=False)
    assert checks._guard_json_bodies(None, "manager", ddtree, "port args") is None
    assert calls == []  # no HTTP server in this process (the offline engine): nothing
    http = types.SimpleNamespace(app="app", generate_contract_error="contract")
    monkeypatch.setitem(sys.modules, compat.HTTP_SERVER_MODULE, http)
    assert checks._guard_json_bodies(None, "manager", dflash, "port args") is None and calls == []
    assert checks._guard_json_bodies(None, "manager", ddtree, "port args") is None
    assert calls == [
        ("admin", {"admin_key": None}),
        ("app", {"vertex": None, "contract": "contract"}),
    ]


def test_an_app_that_has_started_is_left_as_it_is(monkeypatch, caplog):
    app = _plain_app()
    TestClient(app).post("/v1/chat/completions", content=b"{}")  # builds the middleware stack
    monkeypatch.setitem(sys.modules, compat.HTTP_SERVER_MODULE, types.SimpleNamespace(app=app))
    ddtree = types.SimpleNamespace(speculative_algorithm="DDTREE")
    assert checks._guard_json_bodies(None, "manager", ddtree) is None
    assert "no request-body checks" in caplog.text


def test_the_hook_targets_sglangs_tokenizer_manager():
    """TokenizerManager.__init__(self, server_args, port_args, ...) in SGLang's source (read, not
    imported: its module needs uvloop, which the CPU stack leaves out)."""
    import ast
    import importlib.util

    module, cls, method = compat.TOKENIZER_MANAGER_INIT.rsplit(".", 2)
    spec = importlib.util.find_spec(module)
    if spec is None:
        pytest.skip("sglang is not installed")
    tree = ast.parse(open(spec.origin).read())
    init = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == cls
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == method
    )
    assert [a.arg for a in init.args.args][:3] == ["self", "server_args", "port_args"]
    http = importlib.util.find_spec(compat.HTTP_SERVER_MODULE)
    assert f"\n{compat.HTTP_APP} = FastAPI(" in open(http.origin).read()


def test_a_body_over_the_bound_gets_a_413_declared_or_not():
    """Every POST and PUT path; a declared length is refused before a byte is read."""
    app = _app()
    app.user_middleware[-1].kwargs["limit"] = 1000
    client = TestClient(app)
    r = client.post("/generate", content=b'{"text": "' + b"x" * 1000 + b'"}')
    assert r.status_code == 413 and "over DDTREE's limit of 1000" in r.json()["message"]

    def chunks():  # no content-length: counted as it comes
        yield from (b'{"text": "', b"x" * 600, b"x" * 600, b'"}')

    r = client.post("/v1/chat/completions", content=chunks())
    assert r.status_code == 413 and "bytes or more, over" in r.json()["message"]
    body = b'{"text": "' + b"x" * 900 + b'"}'
    assert client.post("/generate", content=body).json()["got"] == body.decode()
    assert json_bodies.MAX_BODY_BYTES == 64 << 20


def _vertex_app():
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    async def vertex_generate(request):
        return JSONResponse({"got": (await request.body()).decode()})

    app = Starlette(routes=[Route("/vertex_generate", vertex_generate, methods=["POST"])])
    assert compat.vertex_route(app) == "/vertex_generate"
    assert compat.vertex_route(_plain_app()) is None
    json_bodies.add_to(app, vertex=compat.vertex_route(app), contract=generate_contract_error)
    return TestClient(app)


@pytest.mark.parametrize(
    "parameters,words",
    [
        ({"return_logprob": True, "top_logprobs_num": 2.0}, "floating point `2.0`"),
        ({"return_logprob": True, "logprob_start_len": 1.0}, "floating point `1.0`"),
        ({"return_routed_experts": True, "routed_experts_start_len": "x"}, 'string "x"'),
        (
            {"sampling_params": {"is_normalized": True, "temperature": 0}},
            "unknown field `is_normalized`",
        ),
    ],
)
def test_a_vertex_body_gets_sglangs_generate_contract(parameters, words):
    """SGLang builds the Vertex request from `parameters` untyped: each of these reached the
    scheduler and raised there (a float k in torch.topk, a string compared with an int, ...)."""
    pytest.importorskip("sglang")
    client = _vertex_app()
    r = client.post(
        "/vertex_generate", json={"instances": [{"text": "hi"}], "parameters": parameters}
    )
    assert r.status_code == 400 and words in r.json()["message"], r.json()
    assert "Vertex request's parameters" in r.json()["message"]


def test_a_good_vertex_body_and_one_sglang_answers_itself_reach_the_app():
    pytest.importorskip("sglang")
    client = _vertex_app()
    for body in (
        {
            "instances": [{"text": "hi"}, {"text": "yo"}],
            "parameters": {
                "top_logprobs_num": 2,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8},
            },
        },
        {"instances": "not a list"},
        {"instances": []},
    ):
        r = client.post("/vertex_generate", json=body)
        assert r.status_code == 200 and json.loads(r.json()["got"]) == body
    assert json_bodies.vertex_as_generate(
        b'{"instances": [{"input_ids": [1]}, {"input_ids": [2]}], "parameters": {"stream": true}}'
    ) == {"input_ids": [[1], [2]], "stream": True}


def test_the_body_bound_is_the_readmes():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"a request body over {json_bodies.MAX_BODY_BYTES >> 20} MiB" in readme


def test_a_body_with_a_byte_order_mark_or_in_utf_16_is_sglangs_to_parse():
    """json.loads (Starlette's) takes a UTF-8 body after a byte order mark, and UTF-16 ones: the
    shape check reads past the mark and leaves wide encodings alone."""
    client = TestClient(_app())
    body = b'\xef\xbb\xbf  {"a": 1}'
    assert client.post("/v1/chat/completions", content=body).status_code == 200
    assert client.post("/v1/chat/completions", content=b"\xef\xbb\xbf[1]").status_code == 400

    async def parse(request):
        return JSONResponse({"parsed": type(json.loads(await request.body())).__name__})

    app = Starlette(routes=[Route("/v1/chat/completions", parse, methods=["POST"])])
    json_bodies.add_to(app)
    wide = '{"a": 1}'.encode("utf-16")
    assert TestClient(app).post("/v1/chat/completions", content=wide).json() == {"parsed": "dict"}
