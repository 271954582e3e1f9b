"""A DraftTree in SGLang's EAGLE tree-verify layout (pure torch: no SGLang import, CPU-testable).

FULL_MASK custom mask (FlashInfer): for request b with committed length S_b, N rows (one per node)
of S_b + N bools, row-major; requests concatenated. Columns [0, S_b) are the committed prefix
(all visible), columns S_b + j are tree node j. Total size = N * sum(S) + bs * N * N.
Row i of request b therefore starts at  N * sum_{c<b} S_c + b * N * N + i * (S_b + N).
"""

from __future__ import annotations

import torch


def full_mask_size(num_nodes: int, batch_size: int, seq_lens_sum: int) -> int:
    return num_nodes * seq_lens_sum + batch_size * num_nodes * num_nodes


def write_full_mask(
    visibility: torch.Tensor,  # [bs, N, N] bool: [b, i, j] = node j is i or an ancestor of i
    seq_lens: torch.Tensor,  # [bs] int: committed length per request (root's position)
    out: torch.Tensor,  # [>= full_mask_size] bool, written in place
) -> torch.Tensor:
    """Fill `out` with the FULL_MASK layout; host-sync free (sizes come from shapes only)."""
    bs, N, _ = visibility.shape
    seq = seq_lens.to(torch.int64)
    prefix = torch.cumsum(seq, 0) - seq  # [bs] committed tokens of earlier requests
    block_start = N * prefix + torch.arange(bs, device=seq.device) * N * N  # [bs]
    row = torch.arange(N, device=seq.device)
    row_start = block_start[:, None] + row[None, :] * (seq[:, None] + N)  # [bs, N]
    tree_cols = row_start[:, :, None] + seq[:, None, None] + row[None, None, :]  # [bs, N, N]
    out.fill_(True)
    out[tree_cols.reshape(-1)] = visibility.reshape(-1)
    return out


def retrieve_index(batch_size: int, num_nodes: int, device: torch.device) -> torch.Tensor:
    """[bs, N] int64 flat node index b * N + i (EAGLE's retrieve_index)."""
    return torch.arange(batch_size * num_nodes, device=device).view(batch_size, num_nodes)


def node_positions(depth: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[bs * N] int64 absolute positions: the root sits at the committed length."""
    return (seq_lens.to(torch.int64)[:, None] + depth).reshape(-1)
