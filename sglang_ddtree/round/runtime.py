"""What one scheduler process's DDTREE worker and runtime hooks share, made once by the worker
factory (plugin._worker_factory) and handed to both: no module holds it.

`Runtime` carries the options parsed once for this process, SGLang's resolved (B, N, K), the GDN
hooks' state (path, data-pointer caches, the DDTREE paths taken), and what the worker makes once
its pools and graphs exist: the penalty table and the automatic-width policy. Each hook in
hooks.HOOKS takes it (or the part it needs) as its first argument, bound by `hooks.bound_hooks`
when the hooks are installed.
"""

from __future__ import annotations

import dataclasses

from sglang_ddtree.config import DDTreeConfig, Options
from sglang_ddtree.round.penalties import PenaltyTable
from sglang_ddtree.round.widths import WidthPolicy
from sglang_ddtree.state import gdn


@dataclasses.dataclass(eq=False)
class Runtime:
    options: Options  # this process's switches, parsed once (config.Options.from_env)
    cfg: DDTreeConfig  # B, N, K as SGLang resolved them (compat.resolved_config)
    gdn: gdn.GDNState  # the GDN hooks' path and caches
    penalties: PenaltyTable | None = None  # the worker's (alloc_memory_pool), for eagle_sample
    widths: WidthPolicy | None = None  # the worker's automatic widths (rank 0's), for report()

    @classmethod
    def create(cls, options: Options, cfg: DDTreeConfig) -> Runtime:
        return cls(options=options, cfg=cfg, gdn=gdn.configure(options, cfg))

    @property
    def engaged(self) -> gdn.Engaged:
        """The DDTREE paths this process's hooks have taken so far (first_use's names)."""
        return self.gdn.engaged

    def report(self) -> dict:
        """The resolved DDTREE options, GDN path, the DDTREE paths the hooks have taken so far
        (e.g. "tree conv1d through sglang_ddtree.gdn.conv_tree") and, with automatic widths, the
        decode rounds verified at each width since start-up: /server_info's values."""
        out = {
            "options": dataclasses.asdict(self.options),
            "gdn_path": gdn.describe(self.gdn.path),
            "engaged": self.engaged.sorted(),
        }
        if self.widths is not None:
            out["widths_chosen"] = {str(w): n for w, n in sorted(self.widths.chosen.items())}
        return out
