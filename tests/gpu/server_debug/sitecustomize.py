"""Python imports `sitecustomize` at start-up in every process; with this folder first on
PYTHONPATH, the debugging aids a variable asks for are installed in each (SGLang's spawned
scheduler, where the rounds run, included): DDTREE_SYNC_CHECK=1 the sync check
(ddtree_sync_check.py), a DDTREE_GDN_* variable the GDN aids (ddtree_gdn_debug.py). Without one
it does nothing."""

import os

if os.environ.get("DDTREE_SYNC_CHECK") == "1":
    import ddtree_sync_check

    ddtree_sync_check.install()

if any(
    os.environ.get("DDTREE_GDN_" + name) for name in ("CHECK", "PERTURB", "VERIFY", "PRECISION")
):
    import ddtree_gdn_debug

    ddtree_gdn_debug.install(ddtree_gdn_debug.Settings.from_env(os.environ))
