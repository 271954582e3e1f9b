"""Python imports `sitecustomize` at start-up in every process; with this folder first on
PYTHONPATH and a DDTREE_GDN_* variable set (ddtree_gdn_debug.py), the GDN debugging aids are
installed in each (SGLang's spawned scheduler, where the verify runs, included). Without one it
does nothing."""

import os

if any(os.environ.get(name) for name in ("DDTREE_GDN_CHECK", "DDTREE_GDN_PERTURB")):
    import ddtree_gdn_debug

    ddtree_gdn_debug.install(ddtree_gdn_debug.Settings.from_env(os.environ))
