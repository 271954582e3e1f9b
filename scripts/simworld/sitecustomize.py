"""Python imports `sitecustomize` at start-up in every process; with this folder first on
PYTHONPATH and DDTREE_SIMULATE=REGIME, the world's patches (server.py) are installed in each
(SGLang's spawned scheduler, where the rounds run, included). Without the variable it does
nothing. The folder is loaded as the package `simworld` from where it lies, so the server's
path needs nothing else. Any failure stops the process: Python prints an error in
sitecustomize and goes on, and the server would run without its world."""

import os


def _install() -> None:
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "simworld", os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    sys.modules["simworld"] = package = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package)
    from simworld import server

    server.install_from_env(os.environ)


if os.environ.get("DDTREE_SIMULATE"):
    try:
        _install()
    except Exception as exc:
        raise SystemExit(f"simworld: DDTREE_SIMULATE: {type(exc).__name__}: {exc}") from exc
