"""A DDTREE server's request path in miniature, on the CPU: SGLang's own request classes and checks
in the order the HTTP server runs them, with DDTREE's front-end hook, for /generate,
/v1/chat/completions and /v1/completions; `answer(path, body)` gives the HTTP status the server
would answer before anything reaches the scheduler (200: the request would be scheduled), and
/vertex_generate and the body size bound as DDTREE's middleware (json_bodies.py) answers them,
and SGLang's admin endpoints as DDTREE's admin gate (admin.py) answers a client without a key.

The path, SGLang 0.5.23 (http_server.py, serving_chat.py, serving_completions.py,
tokenizer_manager.py):
- the body parsed into the endpoint's request model (GenerateReqInput, ChatCompletionRequest,
  CompletionRequest); a validation error is a 400 (SGLang's RequestValidationError handler);
- OpenAI requests converted as SGLang converts them (`to_sampling_params` / the completions
  server's `_build_sampling_params`, top_logprobs into top_logprobs_num); the chat template is
  left out (the prompt's text is the messages' contents);
- DDTREE's hook around `generate_request` (n and the prompts of a call, the per-prompt fields'
  shape, the request ids against `in_flight`), then `normalize_batch_and_arguments` and SGLang's
  `_init_req_state` (every prompt's sub-request, the duplicate-id check), then per request of
  the batch (and sample of n): DDTREE's `RequestCheck`, SGLang's `_validate_one_request` and
  `SamplingParams(...).normalize(tokenizer).verify(vocab)`.
A ValueError anywhere is a 400 (a streamed /generate: HTTP 200 with an error event, which
SGLang sends; `answer` reports it as 400 with streamed=True); any other exception is what the
server would answer with a 500.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import threading
import types

import pydantic

STREAMED_ERROR = "streamed error event"
VERTEX = "/vertex_generate"


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int  # 200, 400, or 500
    message: str
    streamed: bool = False  # a streamed /generate refusal: HTTP 200 carrying an error event


class FrontEnd:
    """The request path of a DDTREE server on the model at `model_dir` (its tokenizer, the
    vocabulary of its config) with a context of `context` tokens."""

    def __init__(self, model_dir, context: int, algorithm: str = "DDTREE") -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        vocab = getattr(config, "vocab_size", None) or config.text_config.vocab_size
        # the runtime context SGLang's checks read (the server's features), published for each
        # answer and reset after it (tests.fixtures' model context publishes its own)
        from sglang.srt.server_args import ServerArgs

        self._server_args = ServerArgs(
            model_path=str(model_dir),
            device="cpu",
            disable_radix_cache=True,
            enable_custom_logit_processor=True,
        )
        self._server_args.resolve_once()
        self._lock = threading.Lock()  # one answer at a time: the context is process-wide
        self.manager = types.SimpleNamespace(
            server_args=types.SimpleNamespace(
                speculative_algorithm=algorithm,
                enable_custom_logit_processor=True,
                return_hidden_states_mode=None,
            ),
            model_config=types.SimpleNamespace(
                vocab_size=vocab, joint_head_config=None, pointer_head=None
            ),
            context_len=context,
            num_reserved_tokens=0,
            allow_auto_truncate=False,
            validate_total_tokens=True,
            tokenizer=self.tokenizer,
            rid_to_state={},  # SGLang's: the in-flight requests' states, by id
            enable_trace=False,
            disaggregation_mode="null",
        )
        # ids of requests held in flight (a test's streamed request), in rid_to_state for
        # every answer while held
        self.in_flight: set[str] = set()

    @property
    def vocab(self) -> int:
        return self.manager.model_config.vocab_size

    def answer(self, path: str, body: bytes | dict) -> Answer:
        from sglang_ddtree.front_door import json_bodies

        if isinstance(body, bytes | str) and len(body) > json_bodies.MAX_BODY_BYTES:
            return Answer(413, "the request body is over DDTREE's limit")  # its middleware's
        try:
            raw = json.loads(body) if isinstance(body, bytes | str) else body
        except json.JSONDecodeError as exc:
            return Answer(400, f"JSON decode error: {exc}")
        if not isinstance(raw, dict):
            return Answer(400, "the body must be a JSON object")
        if path.split("?")[0] in admin_paths():  # DDTREE's admin gate, no --admin-api-key
            if self.manager.server_args.speculative_algorithm != "DDTREE":
                return Answer(200, "")  # SGLang serves them to any client
            return Answer(403, f"{path} is refused unless started with --admin-api-key")
        if path == VERTEX:
            return self._vertex(raw)
        streamed = path == "/generate" and bool(raw.get("stream"))
        try:
            with self._published():
                self._run(path, raw)
        except pydantic.ValidationError as exc:
            return Answer(400, str(exc)[:300])
        except ValueError as exc:
            return Answer(400, str(exc), streamed)
        except Exception as exc:  # what the server answers with a 500
            return Answer(500, f"{type(exc).__name__}: {exc}")
        return Answer(200, "")

    def _vertex(self, raw: dict) -> Answer:
        """The Vertex route: DDTREE's middleware checks the /generate body SGLang's handler
        builds against SGLang's /generate contract; SGLang then builds the request untyped."""
        from sglang.srt.entrypoints.api_contract import generate_contract_error

        from sglang_ddtree.front_door import json_bodies

        generate = json_bodies.vertex_as_generate(json.dumps(raw).encode())
        if generate is None:
            return Answer(400, "not a Vertex request")  # SGLang's own validation
        fault = generate_contract_error(generate)
        if fault is not None and self.manager.server_args.speculative_algorithm == "DDTREE":
            return Answer(400, fault)
        from sglang.srt.managers.io_struct import GenerateReqInput

        try:
            with self._published():
                self._run("/generate", GenerateReqInput(**generate))
        except ValueError as exc:
            return Answer(400, str(exc))
        except Exception as exc:  # what the server answers with a 500
            return Answer(500, f"{type(exc).__name__}: {exc}")
        return Answer(200, "")

    @contextlib.contextmanager
    def _published(self):
        from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

        with self._lock:
            publish(self._server_args, role="test", ranks=SpawnRanks(world_rank=0))
            try:
                yield
            finally:
                reset_context()

    def _run(self, path: str, raw) -> None:
        """raw: a parsed body, or (the Vertex route) the request SGLang built from one."""
        from sglang_ddtree.front_door import checks

        obj = (
            raw
            if not isinstance(raw, dict)
            else {
                "/generate": self._generate,
                "/v1/chat/completions": self._chat,
                "/v1/completions": self._completion,
            }[path](raw)
        )

        async def generate_request(manager, obj):  # TokenizerManager.generate_request's start
            obj.normalize_batch_and_arguments()
            tokenizer_manager_method("_init_req_state")(manager, obj)  # obj[i] of every prompt
            items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
            for item in items:
                self._one(item)
            yield None

        self.manager.rid_to_state = dict.fromkeys(set(self.in_flight))

        async def call():  # through DDTREE's hook around it, as the server calls it
            async for _ in checks._bounded_call(generate_request, self.manager, obj):
                pass

        asyncio.run(call())

    def _one(self, item) -> None:
        from sglang.srt.sampling.sampling_params import SamplingParams

        from sglang_ddtree.front_door import checks

        ids = item.input_ids
        if ids is None:
            ids = self.tokenizer(item.text)["input_ids"]
        checks.RequestCheck()(self.manager, item, ids)
        for name in (
            "_validate_one_request",
            "_validate_token_ids_logprob",
            "_validate_joint_schema_request",
        ):
            method = tokenizer_manager_method(name)
            setattr(self.manager, name, types.MethodType(method, self.manager))
        self.manager._validate_one_request(item, list(ids))  # SGLang's, compiled once
        params = SamplingParams(**item.sampling_params)
        params.normalize(self.tokenizer)
        params.verify(self.vocab)

    @staticmethod
    def _generate(raw: dict):
        from sglang.srt.managers.io_struct import GenerateReqInput

        return pydantic.TypeAdapter(GenerateReqInput).validate_python(raw)

    @staticmethod
    def _chat(raw: dict):
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = ChatCompletionRequest.model_validate(raw)
        if not request.messages:
            raise ValueError("Messages cannot be empty.")
        sampling = request.to_sampling_params(stop=request.stop, model_generation_config={})
        text = " ".join(str(m.content) for m in request.messages)
        return GenerateReqInput(
            text=text,
            sampling_params=sampling,
            return_logprob=request.logprobs,
            logprob_start_len=-1,
            top_logprobs_num=request.top_logprobs or 0,
            stream=request.stream,
            custom_logit_processor=request.custom_logit_processor,
            return_hidden_states=request.return_hidden_states,
            **_openai_fields(request),
        )

    @staticmethod
    def _completion(raw: dict):
        from sglang.srt.entrypoints.openai.protocol import CompletionRequest
        from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = CompletionRequest.model_validate(raw)
        sampling = OpenAIServingCompletion._build_sampling_params(None, request)
        prompt = request.prompt
        ids = isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
        return GenerateReqInput(
            **({"input_ids": prompt} if ids else {"text": prompt}),
            sampling_params=sampling,
            return_logprob=request.logprobs is not None,
            top_logprobs_num=request.logprobs or 0,
            logprob_start_len=-1,
            stream=request.stream,
            custom_logit_processor=request.custom_logit_processor,
            return_hidden_states=request.return_hidden_states,
            **_openai_fields(request),
        )


def _openai_fields(request) -> dict:
    """The fields SGLang's chat and completions servers pass on as they come (serving_chat.py,
    serving_completions.py): the request id and the per-prompt ones."""
    names = ("rid", "extra_key", "cache_salt", "bootstrap_host", "bootstrap_port", "bootstrap_room")
    return {name: getattr(request, name, None) for name in names}


@functools.cache
def admin_paths() -> frozenset[str]:
    """The paths of SGLang's app that its routes mark admin-level (front_door/admin.py)."""
    import sglang.srt.entrypoints.http_server as http

    from sglang_ddtree.front_door import admin

    return frozenset(route.path for route in admin.admin_routes(http.app))


TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"


@functools.cache
def tokenizer_manager_method(name: str):
    """TokenizerManager.<name> compiled from SGLang's source with the names it uses imported as
    its module imports them, and the module's own classes it names (ReqState) compiled beside it
    (the module itself needs uvloop, which the CPU stack leaves out)."""
    import __future__

    spec = importlib.util.find_spec(TOKENIZER_MANAGER)
    tree = ast.parse(open(spec.origin).read())
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name: (node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.asname or a.name: (a.name, None) for a in node.names}
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    fn = next(f for f in classes["TokenizerManager"].body if getattr(f, "name", None) == name)
    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    own = [classes[u] for u in sorted(used & set(classes)) if u != "TokenizerManager"]
    used |= {n.id for c in own for n in ast.walk(c) if isinstance(n, ast.Name)}
    namespace = {"logger": logging.getLogger(TOKENIZER_MANAGER)}
    for u in used & set(imported):
        module, attr = imported[u]
        loaded = importlib.import_module(module)
        namespace[u] = loaded if attr is None else getattr(loaded, attr)
    code = ast.Module(body=[*own, fn], type_ignores=[])
    flags = __future__.annotations.compiler_flag  # the module's own future import
    exec(compile(code, spec.origin, "exec", flags=flags, dont_inherit=True), namespace)
    return namespace[name]
