"""Weighted mixtures of packed row streams: row k of the mixture is row k_d of dataset d, by arithmetic.

Rows, not documents, are what the weights share out (Megatron's blended-dataset semantics): every row is
seq_len tokens of ONE dataset, so the weights are the fractions of training tokens each dataset supplies,
exactly, whatever its document lengths. (Document counts then follow the token shares divided by each
dataset's mean document length.)

The mixture repeats one pattern of BLOCK rows. In it dataset d owns count_d = its weight x BLOCK rows
(largest-remainder rounding, so the counts sum to BLOCK), spread by smooth weighted round-robin (each slot goes
to the dataset furthest behind its share), so every prefix of the pattern is within about one row per dataset
of the exact shares. Row k: block b, slot t = divmod(k, BLOCK); d = pattern[t]; k_d = b * count_d + (the
number of earlier slots of d in the pattern). No state but k: resumable exactly, the same for every layout.
"""

from __future__ import annotations

import numpy as np

BLOCK = 10_000


def mixture_counts(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Rows of each dataset per block: weights normalized, x block, largest-remainder rounded."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"training.datasets weights {list(weights)}: each must be a finite number > 0")
    exact = w / w.sum() * block
    counts = np.floor(exact).astype(np.int64)
    remainder_order = np.argsort(-(exact - counts), kind="stable")
    counts[remainder_order[: block - counts.sum()]] += 1
    if np.any(counts == 0):
        small = [float(weights[i]) for i in np.flatnonzero(counts == 0)]
        raise ValueError(
            f"training.datasets weights {small} are below 1/{block} of the total: such a dataset "
            f"would get no row; raise them to at least {w.sum() / block:.3g}, or drop those datasets"
        )
    return counts


def mixture_pattern(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each slot, index of the slot among its dataset's slots) over one block."""
    block = int(counts.sum())
    current = np.zeros(len(counts), dtype=np.int64)
    seen = np.zeros(len(counts), dtype=np.int64)
    pattern = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    for t in range(block):  # smooth weighted round-robin (ties: the lower dataset index)
        current += counts
        d = int(np.argmax(current))
        current[d] -= block
        pattern[t], rank[t] = d, seen[d]
        seen[d] += 1
    return pattern, rank


class MixtureRows:
    """row(k) of a weighted mixture of row streams (objects with row(k)), e.g. data.shards.PackedRows."""

    def __init__(self, streams: list, weights: list[float], block: int = BLOCK):
        if len(streams) != len(weights):
            raise ValueError(f"{len(streams)} datasets but {len(weights)} weights")
        self.streams, self.weights = streams, list(weights)
        self.counts = mixture_counts(weights, block)
        self.block = block
        self.pattern, self.rank = mixture_pattern(self.counts)

    def source_of(self, k: int) -> tuple[int, int]:
        """(dataset index, row index within that dataset) of mixture row k."""
        b, t = divmod(k, self.block)
        d = int(self.pattern[t])
        return d, b * int(self.counts[d]) + int(self.rank[t])

    def row(self, k: int):
        d, k_d = self.source_of(k)
        return self.streams[d].row(k_d)


def parse_mixture(entries: list) -> list[tuple[str, float]]:
    """training.datasets -> [(path, weight)]. Entries are TOML tables {path = "...", weight = 0.7} (from
    [[training.datasets]]) or, on the command line, "path:weight" strings. Raises ValueError naming the entry."""
    out = []
    for i, entry in enumerate(entries):
        key = f"training.datasets[{i}]"
        if isinstance(entry, str) and ":" in entry:
            path, _, weight = entry.rpartition(":")
        elif isinstance(entry, dict) and set(entry) <= {"path", "weight"} and "path" in entry:
            path, weight = entry["path"], entry.get("weight", 1.0)
        else:
            raise ValueError(
                f"{key}={entry!r}: give a table with `path` and `weight` ([[training.datasets]] "
                'path = "shards/web" weight = 0.7) or, on the command line, "path:weight"'
            )
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: weight {weight!r} is not a number") from None
        if not isinstance(path, str) or not path:
            raise ValueError(f"{key}: path {path!r} must name a token-shard folder")
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"{key}: weight {weight} must be a finite number > 0 (weights are relative shares)")
        out.append((path, weight))
    return out
