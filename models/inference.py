"""Recurrent decoding state: what each layer keeps between tokens, and the left-padding rule for batches.

One InferenceCache serves one batch of prompts from prefill to the last decoded token:

- Mamba-2 layers keep a MambaLayerCache: the last d_conv inputs of the causal conv ([B, conv_dim, d_conv],
  oldest first, mamba_ssm's layout) and the SSM state ([B, nheads, headdim, d_state], float32 whatever the
  model dtype: it accumulates over the whole sequence).
- Attention layers keep a KVCache: keys (after rotary) and values, pre-allocated [B, max_seqlen, kv_heads,
  head_dim] in the model dtype.
- MLP and MoE layers are per token and keep nothing.

Prompts of different lengths are LEFT-padded to one length S: row b's real tokens fill columns
[first_real[b], S), and every decoded token goes to the same column (`seqlen`) in all rows. The prefill marks
the padding as its own document (seq_idx 0, the prompt 1), so the model's document rules keep the padding out:
the conv and the SSM state restart at the first real token, attention is block-diagonal by document; the decode
steps mask key columns < first_real. Rotary positions are columns (the parallel forward's rule), so a padded
row's positions are shifted by its padding: attention scores depend only on relative positions, hence a padded
row gives its unpadded result (up to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class MambaLayerCache:
    conv_state_BCW: torch.Tensor  # the last d_conv conv inputs (x, B, C before the conv), oldest first
    ssm_state_BHPN: torch.Tensor  # float32


@dataclass
class KVCache:
    k_BLHD: torch.Tensor  # keys after rotary, column = position in the (left-padded) row
    v_BLHD: torch.Tensor


@dataclass
class InferenceCache:
    """Per-layer decoding state of a batch (layers keyed by the model's layer names; stateless layers absent).

    seqlen: columns filled so far (prompt + decoded); the next token is written at column `seqlen`.
    first_real_B: int64 [B], the first real (non-padding) column of each row; None when no row is padded.
    """

    batch_size: int
    max_seqlen: int
    layers: dict[str, MambaLayerCache | KVCache] = field(default_factory=dict)
    seqlen: int = 0
    first_real_B: torch.Tensor | None = None

    def reset(self) -> None:
        """Make the cache reusable for a new batch of the same size (the states are overwritten by prefill)."""
        self.seqlen, self.first_real_B = 0, None


def left_padding_seq_idx(prompt_lengths_B: torch.Tensor, seqlen: int) -> torch.Tensor | None:
    """int32 [B, seqlen]: 0 on each row's left padding, 1 on its prompt; None when no row is padded."""
    first_real_B = seqlen - prompt_lengths_B.to(torch.int64)
    if not bool((first_real_B > 0).any()):
        return None
    cols_S = torch.arange(seqlen, device=prompt_lengths_B.device)
    return (cols_S[None, :] >= first_real_B[:, None]).to(torch.int32)


def last_conv_inputs(xBC_BSC: torch.Tensor, seq_idx_BS: torch.Tensor | None, width: int) -> torch.Tensor:
    """The conv state after the last token: [B, C, width], the last `width` inputs, oldest first.

    Inputs before the row start, or of an earlier document than the last token's, are zeros: exactly the taps
    the parallel conv leaves out (so a prompt shorter than width - 1 starts from a clean window).
    """
    s = xBC_BSC.shape[1]
    window_BWC = F.pad(xBC_BSC[:, max(s - width, 0) :], (0, 0, max(width - s, 0), 0))
    if seq_idx_BS is not None:
        ids_BW = F.pad(seq_idx_BS[:, max(s - width, 0) :], (max(width - s, 0), 0), value=-1)
        window_BWC = window_BWC * (ids_BW == seq_idx_BS[:, -1:])[:, :, None].to(window_BWC.dtype)
    return window_BWC.transpose(1, 2)


__all__ = ["MambaLayerCache", "KVCache", "InferenceCache", "left_padding_seq_idx", "last_conv_inputs"]
