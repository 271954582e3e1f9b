"""What a DDTREE server's HTTP app checks of a request body before SGLang reads it: its size, an
OpenAI body's shape, and a Vertex body's fields.

- **Size.** SGLang reads every body whole and tokenizes its text in the front end before any
  length check, so a body of gigabytes would fill the front end's memory. A POST or PUT body
  over `MAX_BODY_BYTES` gets a 413 (a declared length at once; an undeclared one once that many
  bytes have come).
- **An OpenAI body that is JSON but not an object** gets a 400. SGLang's chat request model runs
  a `mode="before"` validator (`ChatCompletionRequest.set_json_schema`) that calls `.get` on the
  raw body, so a body such as `[1, 2, 3]` raised AttributeError inside FastAPI's validation and
  the client got a 500 (found by fuzzing). The validator is compiled into pydantic's schema when
  the class is made, so no hook reaches it.
- **A Vertex AI body** (`/vertex_generate`, or the route AIP_PREDICT_ROUTE names) gets SGLang's
  own `/generate` contract check. SGLang builds its request from the body's `parameters` with no
  type check at all (neither pydantic's nor the contract's, which `/generate` runs), so a float
  where the scheduler takes an integer, or a list where it takes a string, reached the scheduler
  and ended the server. The check runs on the `/generate` body SGLang's handler builds from the
  Vertex one; a violation is a 400 naming it.

One ASGI middleware, put innermost on the app (inside SGLang's decompression and CORS
middlewares): it holds a body's messages while it counts them (and joins them once where it judges
the body), then replays them to the app as they came.
"""

from __future__ import annotations

import json
from collections.abc import Callable

# the endpoints whose request models expect an object (SGLang's OpenAI routes, and
# /invocations, which takes the chat request too)
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/invocations")
MAX_BODY_BYTES = 64 << 20  # 64 MiB: 262,144 tokens are about 1 MiB of text, 2 of input_ids
VERTEX_INPUTS = ("text", "input_ids", "input_embeds")  # SGLang's handler takes the first present
_SPACE = b" \t\r\n"
_UTF8_BOM = b"\xef\xbb\xbf"  # json.loads takes a body after it, and UTF-16 and UTF-32 ones


class JsonBodies:
    """ASGI middleware: a POST or PUT body over `limit` bytes gets a 413; on `paths` one that
    begins with anything but `{` (after white space) a 400; on `vertex` (the Vertex route, None:
    none) one whose `/generate` form `contract` faults (a message, or None) a 400. Each in
    SGLang's error shape; every other body reaches the app byte for byte."""

    def __init__(
        self,
        app,
        paths: tuple[str, ...] = OPENAI_PATHS,
        vertex: str | None = None,
        contract: Callable[[dict], str | None] | None = None,
        limit: int = MAX_BODY_BYTES,
    ) -> None:
        self.app, self.paths, self.vertex = app, paths, vertex
        self.contract, self.limit = contract, limit

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await refuse(send, 413, self._too_large(int(declared)))
        seen, size = [], 0  # the messages as they came, replayed; the body joined only to judge
        while True:
            message = await receive()
            seen.append(message)
            if message.get("type") != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await refuse(send, 413, self._too_large(size))
            if not message.get("more_body", False):
                break
        path = _path(scope)
        if path in self.paths or path == self.vertex:
            body = b"".join(m.get("body", b"") for m in seen if m.get("type") == "http.request")
            refusal = self._judge(path, body)
            if refusal is not None:
                return await refuse(send, 400, refusal)

        async def replay():
            return seen.pop(0) if seen else await receive()

        return await self.app(scope, replay, send)

    def _too_large(self, size: int) -> str:
        return f"the request body is {size} bytes or more, over DDTREE's limit of {self.limit}"

    def _judge(self, path: str, body: bytes) -> str | None:
        first = body.removeprefix(_UTF8_BOM).lstrip(_SPACE)[:1]
        wide = body[:4].count(b"\x00") > 0 or body[:2] in (b"\xff\xfe", b"\xfe\xff")
        if path in self.paths and first and first != b"{" and not wide:  # UTF-16/32: SGLang's
            return f"the request body must be a JSON object ({{...}}); it begins with {first!r}"
        if path == self.vertex and self.contract is not None:
            generate = vertex_as_generate(body)
            fault = None if generate is None else self.contract(generate)
            if fault is not None:
                return f"the Vertex request's parameters, as a /generate body: {fault}"
        return None


def vertex_as_generate(body: bytes) -> dict | None:
    """The /generate body SGLang's Vertex handler builds from a Vertex one (the first input
    field the first instance has, from every instance; their images; then the parameters), or
    None where the body is not a Vertex request SGLang's own validation takes (its answer)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    instances, parameters = request.get("instances"), request.get("parameters") or {}
    if not isinstance(instances, list) or not instances or not isinstance(parameters, dict):
        return None
    if not all(isinstance(instance, dict) for instance in instances):
        return None
    generate = {}
    for key in VERTEX_INPUTS:
        if instances[0].get(key):
            generate[key] = [instance.get(key) for instance in instances]
            break
    images = [i["image_data"] for i in instances if i.get("image_data") is not None]
    if images:
        generate["image_data"] = images
    return {**generate, **parameters}


def _path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):  # uvicorn's path holds the root path (--root-path)
        path = path[len(root) :]
    return path


ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    403: "Forbidden",
    413: "RequestTooLarge",
}


async def refuse(send, status: int, message: str) -> None:
    """Answer the request at once with an OpenAI-shaped error of `status` (ERROR_TYPES)."""
    body = json.dumps(
        {
            "object": "error",
            "message": message,
            "type": ERROR_TYPES[status],
            "param": None,
            "code": status,
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def add_to(
    app, vertex: str | None = None, contract: Callable[[dict], str | None] | None = None
) -> bool:
    """Put the middleware on a FastAPI / Starlette app that has not started (once), innermost:
    inside SGLang's own middlewares, so that it reads a body after their decompression and its
    refusals get their CORS headers (Starlette's add_middleware would put it outermost). Whether
    it was added; RuntimeError for an app that has started."""
    from starlette.middleware import Middleware

    if any(getattr(m, "cls", None) is JsonBodies for m in app.user_middleware):
        return False
    if app.middleware_stack is not None:
        raise RuntimeError("the HTTP app has started; its middleware is fixed")
    app.user_middleware.append(Middleware(JsonBodies, vertex=vertex, contract=contract))
    return True
