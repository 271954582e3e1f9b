"""Gated DeltaNet over a draft tree: every node continues from its parent's state.

An attention mask cannot keep branches apart inside a recurrent layer. Here each node's causal
conv window is gathered from its own root-to-node chain (self + kernel-1 ancestors, continuing
into the committed conv window above the root), and each node's delta-rule recurrence starts
from its parent's post-state (the root from the committed state). The result for every node is
what the layer would compute if that node's path were appended to the committed sequence and run
token by token; the plain reference for that is the model's own sequential decode, which the
tests compare against.

State layout follows transformers' `LinearAttentionLayer` cache (Qwen3.5 / Qwen3.6), one batch
row of its state 0 (transformers 5.19 keeps `conv_states[0]` [B, C, kernel] and
`recurrent_states[0]` [B, Hv, Dk, Dv]):
  conv state       [C, kernel]       the last `kernel` pre-conv inputs (in_proj_qkv output),
                                     oldest first; C = 2 * key_dim + value_dim
  recurrent state  [Hv, Dk, Dv]      the delta-rule memory of every value head
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class GDNTreeOutput(NamedTuple):
    out: torch.Tensor  # [N, hidden]: the layer's output for every node
    conv_states: torch.Tensor  # [N, C, kernel]: conv window after each node (its post-state)
    recurrent_states: torch.Tensor  # [N, Hv, Dk, Dv]: delta-rule state after each node


def conv_window_index(parents: list[int], kernel: int) -> torch.Tensor:
    """Rows into cat(committed window [kernel], node inputs [N]) that each node's conv sees.

    parents [N] (-1 at the root, else parent < child) -> [N, kernel] int64, oldest first:
    row i = (..., grandparent, parent, self). Slot j < kernel is the committed window's column j
    (kernel - 1 = newest committed input); slot kernel + m is node m's input.
    """
    rows = []
    for node in range(len(parents)):
        row, committed_slot = [], kernel - 1
        for _ in range(kernel):
            if node >= 0:
                row.append(kernel + node)
                node = parents[node]
            else:
                row.append(committed_slot)
                committed_slot -= 1
        rows.append(row[::-1])
    return torch.tensor(rows, dtype=torch.int64)


def depth_levels(parents: list[int]) -> list[torch.Tensor]:
    """Node indices grouped by depth: levels[d] [n_d] int64, root level first."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    buckets: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for i, d in enumerate(depth):
        buckets[d].append(i)
    return [torch.tensor(b, dtype=torch.int64) for b in buckets]


def _tree_conv(
    module: nn.Module, mixed: torch.Tensor, conv_state0: torch.Tensor, window_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv along each node's ancestor chain.

    mixed [N, C] node inputs, conv_state0 [C, kernel] committed window
    -> (activated conv output [N, C], node windows = conv post-states [N, C, kernel]).
    """
    source = torch.cat([conv_state0.transpose(0, 1).to(mixed.dtype), mixed], dim=0)  # [k+N, C]
    windows = source[window_index.to(mixed.device)].transpose(1, 2)  # [N, C, k]
    weight = module.conv1d.weight.squeeze(1)  # [C, k]
    out = (windows.to(weight.dtype) * weight).sum(-1)  # [N, C]
    if module.conv1d.bias is not None:
        out = out + module.conv1d.bias
    return F.silu(out).to(mixed.dtype), windows.to(conv_state0.dtype)


def recurrent_kernel(module: nn.Module) -> Callable:
    """The single-token delta-rule kernel the layer's own cached decode step calls.

    transformers 5.19 calls a function of the layer's modeling module,
    `torch_recurrent_gated_delta_rule` (FLA's fused kernel when installed, else the torch loop),
    not a method of the layer; using the same one keeps the tree's states bit-comparable with
    sequential decoding.
    """
    return sys.modules[type(module).__module__].torch_recurrent_gated_delta_rule


def _delta_rule_tree(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    levels: list[torch.Tensor],
    state0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delta-rule step per node, a whole depth level at a time, each from its parent's state.

    q, k [N, Hv, Dk], v [N, Hv, Dv], g, beta [N, Hv], state0 [Hv, Dk, Dv]
    -> (core output [N, Hv, Dv], post-states [N, Hv, Dk, Dv] in state0's dtype).
    """
    n, hv, dv = v.shape
    kernel = recurrent_kernel(module)
    core = v.new_empty(n, hv, dv)  # [N, Hv, Dv]
    states = state0.new_empty(n, *state0.shape)  # [N, Hv, Dk, Dv]
    for level, nodes in enumerate(levels):
        nodes = nodes.to(q.device)
        if level == 0:
            init = state0[None].expand(len(nodes), *state0.shape)
        else:
            init = states[parents[nodes]]
        # the module's own single-token kernel (torch reference on CPU, FLA's when installed)
        out, post = kernel(
            q[nodes, None],
            k[nodes, None],
            v[nodes, None],
            g=g[nodes, None],
            beta=beta[nodes, None],
            initial_state=init.contiguous(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        core[nodes] = out[:, 0].to(core.dtype)
        # round like the cache would between two sequential decode steps
        states[nodes] = post.to(states.dtype)
    return core, states


def gdn_tree_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    parents: torch.Tensor,
    conv_state0: torch.Tensor,
    recurrent_state0: torch.Tensor,
) -> GDNTreeOutput:
    """A `Qwen3_5GatedDeltaNet` layer over a tree, with the module's own weights.

    hidden [N, hidden] (already input-normed), parents [N] int64 (-1 at the root, topological),
    conv_state0 [C, kernel] and recurrent_state0 [Hv, Dk, Dv]: the committed states.
    """
    n = hidden.shape[0]
    parent_list = parents.tolist()  # planning: tree shape on the host
    window_index = conv_window_index(parent_list, module.conv_kernel_size)  # [N, k]
    levels = depth_levels(parent_list)

    mixed = module.in_proj_qkv(hidden)  # [N, C]
    z = module.in_proj_z(hidden).reshape(n, -1, module.head_v_dim)  # [N, Hv, Dv]
    b = module.in_proj_b(hidden)  # [N, Hv]
    a = module.in_proj_a(hidden)  # [N, Hv]

    conv_out, conv_states = _tree_conv(module, mixed, conv_state0, window_index)
    q, k, v = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(n, -1, module.head_k_dim)  # [N, Hk, Dk]
    k = k.reshape(n, -1, module.head_k_dim)  # [N, Hk, Dk]
    v = v.reshape(n, -1, module.head_v_dim)  # [N, Hv, Dv]
    beta = b.sigmoid()  # [N, Hv]
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # [N, Hv]
    group = module.num_v_heads // module.num_k_heads
    if group > 1:
        q = q.repeat_interleave(group, dim=1)  # [N, Hv, Dk]
        k = k.repeat_interleave(group, dim=1)

    core, recurrent_states = _delta_rule_tree(
        module, q, k, v, g, beta, parents, levels, recurrent_state0
    )
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out = module.out_proj(core.reshape(n, -1))  # [N, hidden]
    return GDNTreeOutput(out, conv_states, recurrent_states)
