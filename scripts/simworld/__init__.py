"""The simulated world, benchmark tooling (docs/simulation.md): a synthetic drafter and target in
which drafts are accepted the way a real drafter's are, for end-to-end benchmarks at real shapes
with dummy weights. Not part of the package, and no switch of a server: a benchmark puts this
folder first on a server's PYTHONPATH with DDTREE_SIMULATE=REGIME (`server_env`), and Python's
start-up imports its `sitecustomize`, which installs the world's patches in every process of
that server (SGLang's spawned scheduler, where the rounds run, included).

  world.py          the world: World, the regimes, `parse`, the reference engine's runners
  server.py         the patches in a server: DDTREE's draft head and verify, DFLASH's start-up
                    and chain accept (`install`)
  sitecustomize.py  DDTREE_SIMULATE set: `server.install` of the world it names

The benchmark scripts import it as `simworld` (scripts/ is their first path entry); this module
itself imports nothing heavy, so a script may read VARIABLE and `server_env` without torch.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "DDTREE_SIMULATE"  # the world's name, read by sitecustomize.py in the server
FOLDER = Path(__file__).resolve().parent  # what goes on the server's PYTHONPATH


def server_env(env: dict[str, str], regime: str, environ=os.environ) -> dict[str, str]:
    """A server's environment `env` with the world `regime` (world.parse's value): this folder
    first on PYTHONPATH (before `env`'s, then `environ`'s) and VARIABLE set. Python imports one
    `sitecustomize` only, the first on the path: a server with another folder that holds one
    (the host sampler's, the test servers' debugging aids) cannot have the world too."""
    inherited = env.get("PYTHONPATH", environ.get("PYTHONPATH", ""))
    taken = [p for p in inherited.split(os.pathsep) if p and Path(p, "sitecustomize.py").is_file()]
    if taken:
        raise ValueError(
            f"{VARIABLE} needs {FOLDER} first on PYTHONPATH for its sitecustomize, but "
            f"{taken[0]} already has one (Python imports only the first): run the world "
            "without that folder's tooling."
        )
    path = os.pathsep.join(p for p in (str(FOLDER), inherited) if p)
    return {**env, "PYTHONPATH": path, VARIABLE: regime}
