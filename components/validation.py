"""Validation: token-mean loss and perplexity of the model on held-out batches, the same batches every time.

    validator = Validator(cfg, model_parts, tokenizer, mesh, pdims, device) if cfg.validation.enable else None
    ...
    val = validator.maybe_run(step, last_step=step == cfg.training.steps) if validator else {}   # {} unless due

The loss is the mean over every labelled token of every validation batch of every data-parallel rank (the
training loss' definition), so it does not depend on the layout: sums and token counts are all-reduced over
dp_cp, like train.py's loss. evaluate.py runs the same Validator on a checkpoint.
Pipeline parallel is not supported yet (only the last stage has logits; it needs the schedule's eval pass).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data.loader import IGNORE_INDEX, build_loader
from parallelisms.mesh import coords, group


def token_loss_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy over labelled tokens (IGNORE_INDEX labels don't count), as in training."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(0, 1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class Validator:
    def __init__(self, cfg, model_parts: list[torch.nn.Module], tokenizer, mesh, pdims, device: torch.device):
        if pdims is not None and pdims.pp_enabled:
            raise NotImplementedError(
                "validation under pipeline parallel is not implemented (only the last stage has logits); set "
                "--validation.enable false, or evaluate a checkpoint with evaluate.py without pipeline parallel")
        v = cfg.validation
        if v.steps == 0 or v.steps < -1:
            raise ValueError(f"validation.steps={v.steps} must be >= 1, or -1 for the whole dataset")
        if v.freq < 1:
            raise ValueError(f"validation.freq={v.freq} must be >= 1")
        self.cfg, self.model_parts, self.device, self.pdims = cfg, list(model_parts), device, pdims
        self.steps, self.freq = v.steps, v.freq
        dp_rank, dp_degree = coords(mesh, "dp")
        self.cp_rank, self.cp = coords(mesh, "cp")
        self.dp_cp_group = group(mesh, "dp_cp")
        self.loader = build_loader(cfg, tokenizer, dp_rank, dp_degree, split="validation",
                                   pin_memory=device.type == "cuda")
        fsdp = pdims is not None and pdims.fsdp_enabled
        bf16 = device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
        # Same precision as the training forward: FSDP's param dtype, else autocast on the GPU.
        self._amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 and not fsdp else contextlib.nullcontext
        self.is_rank0 = os.environ.get("RANK", "0") == "0"

    def should_run(self, step: int, last_step: bool = False) -> bool:
        return step % self.freq == 0 or last_step

    def maybe_run(self, step: int, last_step: bool = False) -> dict:
        """run(step) every validation.freq steps (and at the last step); {} otherwise."""
        return self.run(step) if self.should_run(step, last_step) else {}

    @torch.no_grad()
    def run(self, step: int = 0) -> dict:
        """{"val_loss", "val_ppl", "val_tokens"} over validation.steps batches (all of them for -1).

        Collective over dp_cp (every rank calls it at the same step).
        """
        self.loader.reset()  # every evaluation sees the same batches
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        model = self.model_parts[0]
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, labelled tokens)
        n = 0
        try:
            while self.steps == -1 or n < self.steps:
                try:
                    batch = self.loader.next_batch()
                except StopIteration:
                    break
                input_ids, labels, seq_idx = (batch[k].to(self.device, non_blocking=True)
                                              for k in ("input_ids", "labels", "seq_idx"))
                if self.cp > 1:
                    from parallelisms.context_parallel import shard_sequence

                    lb = self.cfg.parallelism.context_parallel_load_balance
                    input_ids, labels = (shard_sequence(t, self.cp_rank, self.cp, lb) for t in (input_ids, labels))
                if not self.cfg.training.document_masking:
                    seq_idx = None  # score as training sees the rows: one stream each
                with self._amp():
                    logits = model(input_ids, seq_idx=seq_idx)
                sums[0] += token_loss_sum(logits, labels).double()
                sums[1] += (labels != IGNORE_INDEX).sum()
                n += 1
                del logits
        finally:
            for part, mode in zip(self.model_parts, modes):
                part.train(mode)
        if self.dp_cp_group is not None:
            dist.all_reduce(sums, group=self.dp_cp_group)  # [2] per rank -> [2] summed over dp_cp
        loss_sum, tokens = sums.tolist()
        if tokens == 0:
            raise ValueError(f"validation saw no labelled tokens in {n} batches: is validation.dataset "
                             f"({self.cfg.validation.dataset!r}) empty?")
        loss = loss_sum / tokens
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(tokens)}
        if self.is_rank0:
            print(f"validation step {step:>6} | val_loss {loss:.4f} | val_ppl {out['val_ppl']:.3f} | "
                  f"{int(tokens)} tokens in {n} batches", flush=True)
        return out
