"""Next-token sampling from logits: greedy, temperature, top-k, top-p (nucleus), with an optional seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits / temperature before softmax
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest most-likely set whose probability reaches top_p (1 = all)

    def validate(self) -> None:
        """Raise ValueError naming the bad field and its valid range."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = no top-k filter)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = no nucleus filter)")


def allowed_tokens(logits_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Boolean [B, V]: the tokens top-k and top-p leave for sampling (after temperature); never empty.

    top-k keeps exactly k tokens (ties broken by index order, as torch.topk); top-p then keeps the most likely
    tokens, in order, until the kept probability reaches top_p (the most likely token is always kept).
    """
    logits_BV = logits_BV.float() / params.temperature if params.temperature > 0 else logits_BV.float()
    keep_BV = torch.ones_like(logits_BV, dtype=torch.bool)
    V = logits_BV.shape[-1]
    if 0 < params.top_k < V:
        keep_BV = torch.zeros_like(keep_BV).scatter_(-1, logits_BV.topk(params.top_k, dim=-1).indices, True)
    if params.top_p < 1:
        probs_BV = logits_BV.masked_fill(~keep_BV, float("-inf")).softmax(-1)
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        mass_before_BV = sorted_BV.cumsum(-1) - sorted_BV  # probability of the tokens ranked above each one
        keep_sorted_BV = mass_before_BV < params.top_p
        keep_sorted_BV[:, 0] = True
        keep_BV = keep_BV & torch.zeros_like(keep_BV).scatter_(-1, order_BV, keep_sorted_BV)
    return keep_BV


def sample_next_tokens(
    logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] -> int64 token ids [B]. The same generator state and logits give the same tokens."""
    params.validate()
    if logits_BV.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got {list(logits_BV.shape)}")
    if params.temperature == 0:
        return logits_BV.argmax(dim=-1)
    keep_BV = allowed_tokens(logits_BV, params)
    probs_BV = (logits_BV.float() / params.temperature).masked_fill(~keep_BV, float("-inf")).softmax(-1)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


__all__ = ["SamplingParams", "allowed_tokens", "sample_next_tokens"]
