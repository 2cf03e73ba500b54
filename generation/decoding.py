"""Batched generation: left-pad the prompts, prefill them in parallel, then decode one token per step.

generate(model, prompts, max_new_tokens, ...) -> one list of new token ids per prompt. A row stops at its
first EOS (included in its output) while the other rows go on; the loop ends when every row has stopped or
max_new_tokens are out. Rows never influence each other (see models.inference for the padding rule), so a
prompt gets the same tokens alone or in a batch, up to float rounding and, when sampling, the generator's
draws (one shared generator: a row's draws depend on the batch it is in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from generation.sampling import SamplingParams, sample_next_tokens


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None):
    """-> (token ids int64 [B, longest], prompt lengths int64 [B]): each prompt right-aligned after pad_id."""
    lengths = [len(p) for p in prompts]
    ids_BS = torch.full((len(prompts), max(lengths)), pad_id, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids_BS[row, ids_BS.shape[1] - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.int64)
    return ids_BS.to(device), torch.tensor(lengths, dtype=torch.int64, device=device)


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    if len(prompts) == 0:
        raise ValueError("generate: no prompts given; pass a list of token-id lists")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"generate: prompt {row} is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(
                f"generate: prompt {row} has token ids {bad[:5]} outside [0, {vocab_size}) "
                "(the model's vocab_size); was it tokenized with another tokenizer?"
            )


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),  # noqa: B008 - frozen dataclass: a shared default is safe
    eos_id: int | None = None,
    seed: int | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """Sample up to max_new_tokens after each prompt (a Mamba2LM in eval mode, the whole model on one device).

    seed: a torch.Generator on the model's device seeded with it draws the samples (None: torch's global RNG).
    pad_id: any valid id; padding never reaches a prompt's result. Only ids < args.vocab_size are sampled
    (the embedding's padded rows are never chosen).
    """
    sampling.validate()
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    vocab_size = model.args.vocab_size
    _check_prompts(prompts, vocab_size)
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"generate: pad_id={pad_id} must be a token id in [0, {vocab_size})")
    device = next(model.parameters()).device  # (a pipeline stage without an embedding is refused at allocation)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    ids_BS, lengths_B = left_pad(prompts, pad_id, device)
    # The last sampled token is never fed back, hence the - 1.
    cache = model.allocate_inference_cache(len(prompts), ids_BS.shape[1] + max_new_tokens - 1)
    logits_BV = model.prefill(ids_BS, cache, lengths_B)
    outputs: list[list[int]] = [[] for _ in prompts]
    done_B = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        next_B = sample_next_tokens(logits_BV[:, :vocab_size], sampling, generator)
        next_B = next_B.masked_fill(done_B, pad_id)  # stopped rows are fed padding; their outputs are dropped
        for row, (token, stopped) in enumerate(zip(next_B.tolist(), done_B.tolist())):
            if not stopped:
                outputs[row].append(token)
        if eos_id is not None:
            done_B |= next_B == eos_id
        if bool(done_B.all()) or step == max_new_tokens - 1:
            break
        logits_BV = model.decode_step(next_B, cache)
    return outputs


__all__ = ["generate", "left_pad"]
