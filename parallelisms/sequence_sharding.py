"""Sequence sharding for context parallel (CP): which tokens a CP rank holds, and the load-balanced order.

Outside the mixers every CP rank holds s/cp tokens of every sequence ([b, s, ...] -> [b, s/cp, ...]):
train.py and components/validation.py shard input_ids and labels with `shard_sequence` (seq_idx is NOT
sharded: each layer sees the whole sequence after its all-to-all, see parallelisms/context_parallel.py).

Load balance (for the attention layers of hybrids, whose causal work grows along the sequence): the sequence
is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r. The mixers' all-to-all delivers them in rank
order (cp=3, 1-based: 1 6 2 5 3 4); undo_load_balance restores 1 2 3 4 5 6 for the conv / SSM / attention
core, redo_load_balance goes back before the inverse all-to-all.

Pure tensor indexing: no collectives here.
"""

from __future__ import annotations

import torch

__all__ = ["load_balance_order", "undo_load_balance", "redo_load_balance", "validate_cp_shapes", "shard_sequence"]


def load_balance_order(cp: int) -> list[int]:
    """Chunk ids (0-based, of 2*cp chunks) in the order the ranks hold them: [0, 2cp-1, 1, 2cp-2, ...]."""
    order = []
    for r in range(cp):
        order += [r, 2 * cp - 1 - r]
    return order


def _permute_chunks(x: torch.Tensor, n_chunks: int, src_of_dst: list[int], seq_dim: int) -> torch.Tensor:
    seq_dim = seq_dim % x.dim()
    if x.shape[seq_dim] % n_chunks:
        raise ValueError(f"sequence length {x.shape[seq_dim]} (dim {seq_dim}) must divide by 2*cp={n_chunks}")
    # cat of views: one copy, no index tensor to ship to the device
    chunks = x.chunk(n_chunks, dim=seq_dim)
    return torch.cat([chunks[i] for i in src_of_dst], dim=seq_dim)


def undo_load_balance(x: torch.Tensor, cp: int, seq_dim: int = 1) -> torch.Tensor:
    """Balanced (rank) order -> natural order along seq_dim: cp=3 chunks 1 6 2 5 3 4 -> 1 2 3 4 5 6."""
    if cp == 1:
        return x
    order = load_balance_order(cp)  # position p holds chunk order[p]
    src_of_dst = [0] * (2 * cp)
    for p, c in enumerate(order):
        src_of_dst[c] = p
    return _permute_chunks(x, 2 * cp, src_of_dst, seq_dim)


def redo_load_balance(x: torch.Tensor, cp: int, seq_dim: int = 1) -> torch.Tensor:
    """Natural order -> balanced (rank) order along seq_dim: cp=3 chunks 1 2 3 4 5 6 -> 1 6 2 5 3 4."""
    if cp == 1:
        return x
    return _permute_chunks(x, 2 * cp, load_balance_order(cp), seq_dim)


def validate_cp_shapes(seq_len: int, cp: int, load_balance: bool) -> None:
    """Raise if training.seq_len cannot be sharded over cp (2*cp chunks when load-balanced)."""
    if cp < 1:
        raise ValueError(f"parallelism.context_parallel_degree={cp} must be >= 1")
    if load_balance and cp > 1:
        if seq_len % (2 * cp):
            fix_up = (seq_len // (2 * cp) + 1) * (2 * cp)
            raise ValueError(
                f"training.seq_len={seq_len} must divide by 2*cp={2 * cp} with "
                f"parallelism.context_parallel_load_balance=true; use e.g. training.seq_len={fix_up}, "
                f"another context_parallel_degree, or turn the load balance off"
            )
    elif seq_len % cp:
        fix_up = (seq_len // cp + 1) * cp
        raise ValueError(
            f"training.seq_len={seq_len} must divide by cp={cp} (parallelism.context_parallel_degree); "
            f"use e.g. training.seq_len={fix_up} or another context_parallel_degree"
        )


def shard_sequence(t: torch.Tensor, cp_rank: int, cp_size: int, load_balance: bool, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of a per-token tensor (input_ids, labels, embeddings ...), along seq_dim.

    [b, s, ...] -> [b, s/cp, ...]: the contiguous block cp_rank, or with load_balance the two chunks
    cp_rank and 2cp-1-cp_rank (of 2*cp) concatenated. Matches the layout context_parallel.all_to_all_seq_to_heads (+
    undo_load_balance) expects. seq_idx is NOT sharded: every rank keeps its rows' full [b, s] seq_idx.
    """
    if cp_size == 1:
        return t
    seq_dim = seq_dim % t.dim()
    s = t.shape[seq_dim]
    validate_cp_shapes(s, cp_size, load_balance)
    if not load_balance:
        n = s // cp_size
        return t.narrow(seq_dim, cp_rank * n, n)
    n = s // (2 * cp_size)
    first = t.narrow(seq_dim, cp_rank * n, n)
    second = t.narrow(seq_dim, (2 * cp_size - 1 - cp_rank) * n, n)
    return torch.cat([first, second], dim=seq_dim)
