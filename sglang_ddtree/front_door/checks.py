"""The front door of a DDTREE server: what the tokenizer manager and the HTTP app check before
SGLang schedules a request. Three hooks, registered at plugin load in the server's main process
(`register_request_hook`) and applied there by SGLang's load_plugins():

| target                                  | what it checks                                       |
|-----------------------------------------|------------------------------------------------------|
| TokenizerManager._validate_one_request  | every per-request limit (request_limits.py), token   |
|                                         | ids in the vocabulary, the sampling options DDTREE   |
|                                         | serves exactly                                       |
| TokenizerManager.generate_request       | n and the number of prompts, the per-prompt fields'  |
|                                         | shape (batch_shape.py), the request ids              |
|                                         | (identity.py) and a long text's tokens off the event |
|                                         | loop (long_text.py), before SGLang makes a request   |
|                                         | of each                                              |
| TokenizerManager.__init__               | the HTTP app's bodies (json_bodies.py) and admin     |
|                                         | endpoints (admin.py)                                 |

A refusal is a ValueError, which SGLang answers with a 400 naming the field, the value and the
limit. Every check is a no-op on a server that does not serve DDTREE.
"""

from __future__ import annotations

import functools
import logging
import sys

from sglang_ddtree.adapter import compat
from sglang_ddtree.adapter.spec import serves_ddtree
from sglang_ddtree.config import Options
from sglang_ddtree.front_door import (
    admin,
    batch_shape,
    identity,
    json_bodies,
    long_text,
    request_limits,
)
from sglang_ddtree.round import penalties

logger = logging.getLogger(__name__)


def _check_token_ids(tokenizer_manager, ids) -> None:
    """A prompt's token ids lie in [0, vocab): SGLang defines that check
    (_validate_input_ids_in_vocab) but never calls it, and the embedding lookup of an id
    outside takes the scheduler down (a fuzzed request did this to DDTREE and DFLASH alike)."""
    if not ids:
        return
    vocab = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    low, high = min(ids), max(ids)
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        raise ValueError(
            f"input_ids holds token id {bad}, outside the vocabulary [0, "
            f"{vocab if vocab is not None else 'vocab'})."
        )


def register_request_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(compat.TOKENIZER_REQUEST_VALIDATOR, RequestCheck(), HookType.BEFORE)
    HookRegistry.register(compat.TOKENIZER_GENERATE_REQUEST, _bounded_call, HookType.AROUND)
    HookRegistry.register(compat.TOKENIZER_MANAGER_INIT, _guard_json_bodies, HookType.AFTER)


async def _bounded_call(original, manager, obj, *args, **kwargs):
    """AROUND TokenizerManager.generate_request (an async generator): on a DDTREE server, a
    call's n and prompts are bounded (request_limits.check_batch), its per-prompt fields' shape
    checked (batch_shape.check_shape), its request ids (identity.check_ids, against the
    manager's in-flight ids) and a long text's tokens counted in a thread
    (long_text.check_text_lengths) before SGLang splits it into one request per prompt and sample,
    which it does first; the refusal is a ValueError at the first item, as SGLang's own checks
    there raise. The original's items pass through, and it is closed with this generator (a
    client that goes away aborts its requests)."""
    if serves_ddtree(getattr(manager, "server_args", None)) and hasattr(obj, "sampling_params"):
        request_limits.check_batch(obj)
        batch_shape.check_shape(obj)
        if not _own_health_check(obj, args[0] if args else kwargs.get("request")):
            single, prompts = batch_shape.call_shape(obj)
            in_flight = getattr(manager, "rid_to_state", None) or ()
            identity.check_ids(getattr(obj, "rid", None), single, prompts, in_flight)
        if not getattr(manager, "allow_auto_truncate", False):
            _, context = compat.front_end_sizes(manager)
            tokenizer = getattr(manager, "tokenizer", None)
            await long_text.check_text_lengths(tokenizer, getattr(obj, "text", None), context)
    items = original(manager, obj, *args, **kwargs)
    try:
        async for item in items:
            yield item
    finally:
        await items.aclose()


HEALTH_PATHS = ("/health", "/health_generate")


def _own_health_check(obj, request) -> bool:
    """Whether the call is SGLang's own health check (its /health handler names the request
    HEALTH_CHECK_<uuid hex>; a client cannot give a body there). The path may carry a
    --root-path in front."""
    path = getattr(getattr(request, "url", None), "path", None)
    rid = getattr(obj, "rid", None)
    own = isinstance(rid, str) and rid.startswith(identity.RESERVED)
    return own and isinstance(path, str) and path.endswith(HEALTH_PATHS)


def _guard_json_bodies(result, manager, server_args, *args, **kwargs):
    """AFTER TokenizerManager.__init__: on a DDTREE server whose process has SGLang's HTTP server
    (imported, its app not started yet), the app's admin endpoints are closed unless
    --admin-api-key is set and its info endpoint's secrets redacted (admin.py), and its request
    bodies are checked before SGLang reads them (json_bodies.py: their size, an OpenAI body's
    shape, a Vertex body's fields by SGLang's own /generate contract). Nothing is imported here:
    the offline engine and other processes are left alone."""
    http = sys.modules.get(compat.HTTP_SERVER_MODULE)
    if http is None or not serves_ddtree(server_args):
        return None
    app = getattr(http, compat.HTTP_APP, None)
    guards = {
        "admin-endpoint": lambda: admin.add_to(
            app, admin_key=getattr(server_args, "admin_api_key", None)
        ),
        "request-body": lambda: json_bodies.add_to(
            app,
            vertex=compat.vertex_route(app),
            contract=getattr(http, compat.GENERATE_CONTRACT, None),
        ),
    }
    for name, add in guards.items():  # the admin gate first: outside the body guard
        try:
            add()
        except (AttributeError, RuntimeError) as exc:  # an app already started, or none
            logger.warning("sglang_ddtree: no %s checks on the HTTP app: %s", name, exc)
    return None


class RequestCheck:
    """BEFORE TokenizerManager._validate_one_request: raise ValueError (HTTP 400) for what a
    DDTREE server cannot serve. One per front-end process, made at plugin registration; its
    options are parsed once, on the first DDTREE request (validate_server_args has parsed and
    checked the same switches in this process at start-up, with the error naming the fix)."""

    @functools.cached_property
    def options(self) -> Options:
        return Options.from_env()

    def __call__(self, tokenizer_manager, obj, *args, **kwargs):
        server_args = getattr(tokenizer_manager, "server_args", None)
        if not serves_ddtree(server_args):
            return None
        ids = args[0] if args else None
        sizes = request_limits.Sizes(
            *compat.front_end_sizes(tokenizer_manager),
            labels=compat.allowed_custom_labels(server_args),
            regex_length=compat.stop_regex_length,
        )
        request_limits.check_request(obj, ids, sizes)
        _check_token_ids(tokenizer_manager, ids)
        sampling = getattr(obj, "sampling_params", None) or {}
        if isinstance(sampling, dict):
            _check_sampling(sampling, server_args, self.options.penalties)
        return None


def _check_sampling(sampling: dict, server_args, per_node: bool) -> None:
    """A request's sampling parameters; per_node: SGLANG_DDTREE_PENALTIES=1, every option of
    LOSSY_SAMPLING_OPTIONS served, each node by its own path (round/penalties.py)."""
    max_new_tokens = sampling.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_new_tokens}.")
    samples = sampling.get("n")
    if isinstance(samples, int) and not 1 <= samples <= request_limits.MAX_SAMPLES:
        # SGLang expands n into n requests with no bound (n=5000: 5,000 requests)
        raise ValueError(
            f"n={samples}: between 1 and {request_limits.MAX_SAMPLES} samples per request "
            "(OpenAI's bound); send several requests for more."
        )
    min_p = sampling.get("min_p")
    if min_p and getattr(server_args, "enable_deterministic_inference", False):
        # SGLang's deterministic sampler (pytorch backend, seeded) asserts on min_p
        raise ValueError(
            f"min_p={min_p} cannot be served with --enable-deterministic-inference "
            "(SGLang's seeded sampler does not take it); leave it at 0."
        )
    for name, neutral in LOSSY_SAMPLING_OPTIONS.items():
        value = sampling.get(name)
        if value is not None and value != neutral and not per_node:
            raise ValueError(
                f"DDTREE cannot apply {name}={value} exactly inside a draft tree (the output "
                f"distribution would differ from the target's); leave it at {neutral} "
                "(this server was started with SGLANG_DDTREE_PENALTIES=0; SGLANG_DDTREE_PENALTIES=1, "
                "the default, applies it per node)."
            )


# Options SGLang's tree verify applies only approximately (penalties, and min_new_tokens's EOS
# block, are one vector for the whole tree: a node at depth d has d more tokens behind it) or not
# at all (min_p): refused unless round/penalties.py applies them per node. (logit_bias is
# the same at every node, and SGLang's tree verify adds it to every node: exact.)
LOSSY_SAMPLING_OPTIONS = {"min_p": 0.0, **penalties.PENALTIES}
