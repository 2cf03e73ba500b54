"""Token cross-entropy as a SUM over labelled tokens (the trainer divides by the global token count).

`chunked_cross_entropy_sum` never materialises the full [tokens, vocab] logits: each chunk's logits are
computed, reduced and freed, and recomputed in backward (activation checkpointing per chunk). With a 50k
vocabulary that removes several GB of fp32 logits at 16k tokens per rank, for one extra lm_head matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Labels equal to this don't count: document ends and padding. data/packing.py gives them the same value
# (its own constant, so that data/ and its preprocessing workers need neither torch nor models/;
# tests/test_import_boundaries.py checks the two agree).
IGNORE_INDEX = -100


def cross_entropy_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Summed token loss in fp32; labels of IGNORE_INDEX (document ends, padding) don't count."""
    return F.cross_entropy(
        logits_BSV.flatten(0, 1).float(), labels_BS.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _chunk_loss(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h_ND, weight_VD).float(), labels_N, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    h_BSD: torch.Tensor, weight_VD: torch.Tensor, labels_BS: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """sum_t CE(h_t @ W^T, label_t) computed over chunks of `chunk_tokens` tokens ([B, S, D] -> scalar)."""
    h_ND, labels_N = h_BSD.flatten(0, 1), labels_BS.flatten(0, 1)
    total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
    for start in range(0, h_ND.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss, h_ND[rows], weight_VD, labels_N[rows], use_reentrant=False)
    return total
