"""DDTREE's Gated DeltaNet tree verify, state commit and conv1d inside SGLang (hybrid models:
Qwen3.5 / 3.6).

SGLang verifies a tree through a GDN layer node after node and stores every node's state
in the Mamba pool's `intermediate_ssm` so that the commit can copy the accepted one; at 27B and
N = 64 that is most of DDTREE's extra round time (docs/results.md). Hooks replace it while
DDTREE serves a tree (topk > 1):

- `target_verify` (around GDNKernelDispatcher.target_verify, once per GDN layer, inside the
  verify CUDA graph): `gdn.chunk_tree.chunk_tree_verify`, every node at once in the chunked
  form on tensor cores (N <= 256, in blocks of 64 nodes above 64; wider trees, and
  --enable-deterministic-inference, take `gdn.tree_verify.tree_verify`, one program per root
  path, whose tokens are batch-invariant).
  Each node's g, beta, k and v go to the request's scratch row, no state does.
- `commit` (around HybridLinearAttnBackend.update_mamba_state_after_mtp_verify, once per round):
  `commit_paths` replays the accepted path into the pool for all GDN layers in one launch (and
  into the radix-cache track slot where SGLang would snapshot one); the conv windows from
  the nodes' inputs the tree conv1d stored once (`conv_tree.commit_windows`, on the compact
  pool), else by SGLang's own scatter of the per-node windows, its state part skipped.
- `conv_update` (around gdn_backend.causal_conv1d_update): the tree verify's conv1d through
  `gdn/conv_tree.py`, every node in parallel.
- The compact scratch (state/gdn_pool.py) shrinks `intermediate_ssm` to the scratch that
  DDTREE's verify uses and sizes the Mamba pool for it (under --enable-unified-memory, whose
  pool SGLang allocates itself: SGLang's N states per request, the full scratch).

The accepted path comes from the same parent indices the verify used (the conv kernel fills
`retrieve_parent_token` from the tree), so the committed state is the verified one. SGLang's own
verify, commit and conv1d remain the reference the tests and scripts/bench_gdn_tree.py compare
with; a DDTREE server does not run them on a tree.
"""

from __future__ import annotations

import dataclasses
import logging

from sglang_ddtree.adapter import compat
from sglang_ddtree.config import DDTreeConfig, Options
from sglang_ddtree.state import gdn_pool

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GDNPath:
    """How DDTREE's tree verify runs the Gated DeltaNet layers (`path_of` the options)."""

    max_path: int  # nodes on the longest root path: the bonus token + B - 1 drafted tokens
    verify: str = "chunk"  # "chunk" (N <= 256) or "paths" (root paths; deterministic inference)
    # the compact scratch (state/gdn_pool.py): the tree conv1d stores each node's input
    # once and the commit builds the accepted window from them; full: SGLang's per-node windows
    # and its scatter
    compact: bool = True

    def chunked(self, nodes: int) -> bool:
        """Whether an N-node tree verify runs the chunked kernel (up to chunk_tree.MAX_NODES;
        wider trees: root paths)."""
        from sglang_ddtree.gdn.chunk_tree import MAX_NODES

        return self.verify == "chunk" and nodes <= MAX_NODES


def path_of(options: Options, block_size: int) -> GDNPath:
    """The GDN path `options` ask for; block_size: the DFlash block B."""
    return GDNPath(
        max_path=block_size,
        verify=options.gdn_verify,
        compact=options.compact_scratch,
    )


class Engaged:
    """The DDTREE paths one process's hooks have taken (`first_use`'s names; /server_info reports
    them), each logged the first time."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def first_use(self, what: str) -> None:
        if what not in self.names:
            self.names.add(what)
            logger.info("sglang_ddtree: first %s", what)

    def sorted(self) -> list[str]:
        return sorted(self.names)


@dataclasses.dataclass(eq=False)
class GDNState:
    """What the GDN hooks of one scheduler process share, made once by the worker factory: the
    GDN path, the engaged paths, and caches keyed by data pointers."""

    path: GDNPath
    engaged: Engaged = dataclasses.field(default_factory=Engaged)
    first_conv_state: int | None = None  # data_ptr of the first GDN layer's conv state
    filled: int | None = None  # data_ptr of the parent buffer the last filling call wrote
    no_states: tuple = (None, None)  # (the pool's caches, the same without states)

    def first_use(self, what: str) -> None:
        self.engaged.first_use(what)


def configure(opts: Options, cfg: DDTreeConfig) -> GDNState:
    """The GDN hooks' state for the worker factory's options and SGLang's resolved (B, N, K); logs
    the GDN path (tests/gpu checks the line), and says so when the chunked verify cannot apply
    (trees wider than it takes)."""
    path = path_of(opts, cfg.block_size)
    logger.info("sglang_ddtree: GDN path: %s", describe(path))
    if path.verify == "chunk" and not path.chunked(cfg.num_nodes):
        logger.warning(
            "sglang_ddtree: %d-node trees are wider than the chunked GDN verify takes: "
            "they use the root paths.",
            cfg.num_nodes,
        )
    return GDNState(path)


def describe(path: GDNPath) -> str:
    """The startup log's words for a GDN path (tests/gpu checks them per server)."""
    return (
        f"ddtree (verify: {path.verify}; commit: replay; tree conv1d: ddtree; scratch: "
        f"{'compact' if path.compact else 'full'})"
    )


def target_verify(state: GDNState, original, dispatcher, A_log, dt_bias, q, k, v, a, b, **kwargs):
    parents = kwargs.get("retrieve_parent_token")
    path = state.path
    if parents is None:  # a chain / warm-up batch
        _refuse_compact(kwargs.get("intermediate_states_buffer"))
        return original(dispatcher, A_log, dt_bias, q, k, v, a, b, **kwargs)
    from sglang_ddtree.gdn.chunk_tree import chunk_tree_verify
    from sglang_ddtree.gdn.tree_verify import as_scratch, tree_verify

    N = int(kwargs["cache_steps"])
    chunked = path.chunked(N)
    kernel = chunk_tree_verify if chunked else tree_verify
    state.first_use(
        "GDN tree verify through sglang_ddtree.gdn."
        + ("chunk_tree.chunk_tree_verify" if chunked else "tree_verify")
    )
    H, K = q.shape[-2:]
    HV, V = v.shape[-2:]
    T = v.numel() // (HV * V)
    bs = T // N
    try:
        args = (
            q.reshape(T, H, K),
            k.reshape(T, H, K),
            v.reshape(T, HV, V),
            a.reshape(T, HV),
            b.reshape(T, HV),
            A_log,
            dt_bias,
            kwargs["ssm_states"],
            kwargs["cache_indices"][:bs],
            _rows(parents, N),
            as_scratch(kwargs["intermediate_states_buffer"], 1),
            kwargs["intermediate_state_indices"][:bs],
        )
        o = kernel(*args, max_path=path.max_path)
    except ValueError as exc:  # a pool layout the kernel does not take: name the way out
        raise RuntimeError(
            f"DDTREE's Gated DeltaNet tree verify cannot run on this Mamba pool ({exc}); this "
            "model's GDN layout is not one DDTREE serves: serve it with DFLASH."
        ) from exc
    return o.reshape(v.shape)


def conv_update(
    state: GDNState, original, x, conv_state, weight, bias=None, activation=None, *rest, **kwargs
):
    """Around gdn_backend.causal_conv1d_update (SGLang's hook registry also rebinds every other
    module's import of that function): a tree verify's conv1d through `gdn.conv_tree.conv_tree`
    (same outputs, per-node windows and retrieve_parent_token as SGLang's kernel); every other
    call, as it came, to SGLang's."""
    tree = all(kwargs.get(k) is not None for k in _CONV_TREE_ARGS)
    path = state.path
    if not tree or rest or set(kwargs) - set(_CONV_TREE_ARGS):
        if tree and path.compact:
            # SGLang's kernel would write per-node windows where the commit reads the nodes'
            # inputs (and roll the conv state): a wrong state, silently
            raise RuntimeError(
                "A tree conv1d call DDTREE's conv does not cover (arguments "
                f"{sorted(set(kwargs) - set(_CONV_TREE_ARGS))}, {len(rest)} more positional) "
                "reached the compact GDN pool; serve with --enable-unified-memory (SGLang's "
                "per-node windows)."
            )
        return original(x, conv_state, weight, bias, activation, *rest, **kwargs)
    from sglang_ddtree.gdn.conv_tree import conv_tree

    state.first_use("tree conv1d through sglang_ddtree.gdn.conv_tree")
    # The parents kernel runs in the first GDN layer's call of a verify only: every layer sees
    # the same tree and SGLang's one retrieve_parent_token buffer. The first layer is the one
    # whose conv state (a per-layer slice of the pool, fixed once allocated) this process saw
    # first; any other layer fills the buffer too when it is not the one the first filled.
    # It rests on every forward running its first GDN layer's tree conv before the others'
    # (what SGLang does; pipeline parallelism and two-batch overlap, whose micro-batches
    # could share one parent buffer, are refused at start-up).
    parents = kwargs["retrieve_parent_token"]
    if state.first_conv_state is None:
        state.first_conv_state = conv_state.data_ptr()
    fill = conv_state.data_ptr() == state.first_conv_state or parents.data_ptr() != state.filled
    if fill:
        state.filled = parents.data_ptr()
    return conv_tree(
        x,
        conv_state,
        weight,
        bias,
        activation,
        fill_parents=fill,
        save_inputs=path.compact,
        **kwargs,
    )


_CONV_TREE_ARGS = (
    "conv_state_indices",
    "intermediate_conv_window",
    "intermediate_state_indices",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "retrieve_parent_token",
)


def commit(
    state: GDNState,
    original,
    backend,
    last_correct_step_indices,
    mamba_track_indices,
    mamba_steps_to_track,
    model,
    req_pool_indices=None,
):
    linear = backend.linear_attn_backend
    meta = linear.forward_metadata
    parents = getattr(meta, "retrieve_parent_token", None)
    caches = linear.req_to_token_pool.get_speculative_mamba2_params_all_layers()
    path = state.path
    if parents is None:  # a chain / warm-up batch
        _refuse_compact(caches.intermediate_ssm)
        return original(
            backend,
            last_correct_step_indices,
            mamba_track_indices,
            mamba_steps_to_track,
            model,
            req_pool_indices,
        )
    from sglang_ddtree.gdn.tree_verify import as_scratch, commit_paths

    state.first_use("GDN state commit through sglang_ddtree.gdn.tree_verify.commit_paths")
    bs = last_correct_step_indices.shape[0]
    state_idx = meta.mamba_cache_indices[:bs]  # physical slots already
    if mamba_track_indices is not None:  # the scheduler's (virtual) slots, as SGLang's commit
        mamba_track_indices = linear.req_to_token_pool.translate_mamba_indices(mamba_track_indices)
    # this round's width: SGLang's parent buffer is [bs, w] (eager and graph); the pool's rows
    # hold the widest tree ([layers, rows, N, dim, ...]), and a narrower round uses the front
    N = parents.shape[-1] if parents.dim() == 2 else caches.intermediate_conv_window[0].shape[2]
    rows, links = linear.verify_intermediate_state_indices[:bs], _rows(parents, N)
    track_node = mamba_steps_to_track if mamba_track_indices is not None else None
    commit_paths(
        caches.temporal,
        state_idx,
        as_scratch(caches.intermediate_ssm, 2),
        rows,
        links,
        last_correct_step_indices,
        max_path=path.max_path,
        track_idx=mamba_track_indices,
        track_node=track_node,
    )
    if path.compact:  # the accepted windows from the nodes' stored inputs
        steps = (state_idx, rows, links, last_correct_step_indices, mamba_track_indices, track_node)
        _commit_conv_windows(caches, steps)
        return
    # conv windows: SGLang's scatter, with an empty state pool so that it skips the states
    compat.scatter_mamba_states_after_mtp_verify()(
        _without_states(state, caches),
        state_idx,
        last_correct_step_indices,
        mamba_track_indices,
        mamba_steps_to_track,
    )


def _commit_conv_windows(caches, steps: tuple) -> None:
    """The compact scratch's conv windows of the accepted path, from the nodes' stored inputs;
    steps: (state slots, scratch rows, parent links, accepted steps, track slots, track node)."""
    from sglang_ddtree.gdn.conv_tree import commit_windows

    for conv, inputs in zip(caches.conv, caches.intermediate_conv_window, strict=True):
        commit_windows(conv, inputs, *steps)


def _refuse_compact(intermediate_ssm) -> None:
    """SGLang's own verify or commit would overrun a compact scratch: fail instead."""
    if gdn_pool.is_compact(intermediate_ssm):
        raise RuntimeError(
            "A Gated DeltaNet verify without a DDTREE tree reached a Mamba pool sized by "
            "DDTREE's compact scratch, which only DDTREE's tree verify can use; serve with "
            "--enable-unified-memory (SGLang's per-node states)."
        )


def _rows(parents, N: int):
    """parents as request rows of N (a view when SGLang's buffer already is one)."""
    return parents.reshape(-1, N).contiguous()


def _without_states(state: GDNState, caches):
    """The pool's caches with an empty `temporal` (SGLang's scatter then moves conv windows only);
    made once per pool."""
    if state.no_states[0] is not caches:
        state.no_states = (caches, dataclasses.replace(caches, temporal=caches.temporal[:, :0]))
    return state.no_states[1]
