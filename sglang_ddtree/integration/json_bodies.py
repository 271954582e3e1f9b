"""A 400 for an OpenAI request whose body is JSON but not an object (found by fuzzing).

SGLang 0.5.17's chat request model runs a `mode="before"` validator
(`ChatCompletionRequest.set_json_schema`) that calls `.get` on the raw body, so a body such as
`[1, 2, 3]` raises AttributeError inside FastAPI's validation and the client gets a 500 with a
traceback in the log. The validator is compiled into pydantic's schema when the class is made,
so no hook reaches it; instead DDTREE's servers put a small ASGI middleware in front of the
OpenAI endpoints that looks at the body's first byte that is not white space and answers 400 when
it cannot open a JSON object. Every other request passes untouched, its body replayed as it came.
"""

from __future__ import annotations

import json

# the endpoints whose request models expect an object (SGLang 0.5.17's OpenAI routes, and
# /invocations, which takes the chat request too)
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/invocations")
_SPACE = b" \t\r\n"


class JsonObjectBodies:
    """ASGI middleware: a POST to OPENAI_PATHS whose body begins with anything but `{` (after
    white space) gets a 400 in SGLang's error shape; an empty body goes on to SGLang's own check."""

    def __init__(self, app, paths: tuple[str, ...] = OPENAI_PATHS) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope, receive, send):
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # uvicorn's path holds the root path (--root-path)
            path = path[len(root) :]
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in self.paths:
            return await self.app(scope, receive, send)
        seen, first = [], b""
        while True:  # until the first byte that is not white space, or the end of the body
            message = await receive()
            seen.append(message)
            if message.get("type") != "http.request":
                break
            first = message.get("body", b"").lstrip(_SPACE)[:1]
            if first or not message.get("more_body", False):
                break
        if first and first != b"{":
            return await _bad_request(send, first)

        async def replay():
            return seen.pop(0) if seen else await receive()

        return await self.app(scope, replay, send)


async def _bad_request(send, first: bytes) -> None:
    message = f"the request body must be a JSON object ({{...}}); it begins with {first!r}"
    body = json.dumps({"object": "error", "message": message, "type": "BadRequestError",
                       "param": None, "code": 400}).encode()  # fmt: skip
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def add_to(app) -> bool:
    """Put the middleware on a FastAPI / Starlette app that has not started (once), innermost:
    inside SGLang's own middlewares, so that it reads a body after their decompression and its
    400 gets their CORS headers (Starlette's add_middleware would put it outermost). Whether it
    was added; RuntimeError for an app that has started."""
    from starlette.middleware import Middleware

    if any(getattr(m, "cls", None) is JsonObjectBodies for m in app.user_middleware):
        return False
    if app.middleware_stack is not None:
        raise RuntimeError("the HTTP app has started; its middleware is fixed")
    app.user_middleware.append(Middleware(JsonObjectBodies))
    return True
