"""SGLang plugin entry point (group `sglang.srt.plugins`): registers `--speculative-algorithm DDTREE`.

SGLang calls `register()` with no arguments in every process that loads plugins and only logs
what it raises, so a failure here would surface much later as "Unknown speculative algorithm
name: DDTREE". We therefore log the real cause at ERROR level with the fix, then re-raise.
Registration is idempotent: SGLang's registry refuses a second registration of a name.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    try:
        _register()
    except Exception as exc:
        logger.error("sglang_ddtree: DDTREE is NOT available: %s", exc)
        raise


def _register() -> None:
    from sglang_ddtree.adapter.compat import check_sglang_version

    check_sglang_version()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_ddtree.adapter.spec import ALGORITHM, DDTreeSpec, validate_server_args
    from sglang_ddtree.front_door.checks import register_request_hook

    if get_spec(ALGORITHM) is not None:
        return
    register_request_hook()
    SpeculativeAlgorithm.register(
        ALGORITHM,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=DDTreeSpec,
    )(_worker_factory)
    logger.info("sglang_ddtree: registered speculative algorithm %s", ALGORITHM)


def _worker_factory(server_args):
    """Runs in the scheduler process before memory pools, backends and CUDA graphs exist: parses
    this process's options once, reads SGLang's resolved (B, N, K) once, and hands both (as one
    Runtime) to the runtime hooks it installs and to the worker class it returns."""
    from sglang_ddtree.adapter import compat
    from sglang_ddtree.config import Options
    from sglang_ddtree.plugin.hooks import install_runtime_hooks
    from sglang_ddtree.round.runtime import Runtime
    from sglang_ddtree.round.worker import DDTreeWorker

    options = Options.from_env(**compat.option_modes(server_args))
    logger.info("sglang_ddtree: options: %s", options.describe())
    runtime = Runtime.create(options, compat.resolved_config())
    install_runtime_hooks(runtime)
    return DDTreeWorker.bound_to(runtime)
