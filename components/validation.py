"""Validation: token-mean loss and perplexity of the model on held-out batches, the same batches every time.

    validator = Validator(cfg, model_parts, tokenizer, mesh, pdims, batch, device) if cfg.validation.enable else None
    ...
    val = validator.maybe_run(step, last_step=step == cfg.training.steps) if validator else {}   # {} unless due

The loss is the mean over every labelled token of every validation batch of every data-parallel rank (the
training loss' definition), so it does not depend on the layout: sums and token counts are all-reduced over
dp_cp, like train.py's loss. evaluate.py runs the same Validator on a checkpoint.
Under pipeline parallel the batch goes through the schedule's forward-only `eval` pass (`pipeline=`); only the
last stage has losses, so its sums are all-reduced over the whole world (other stages add zero).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch
import torch.distributed as dist

from data.loader import IGNORE_INDEX, build_loader
from parallelisms.batch_plan import BatchPlan
from parallelisms.fsdp import reshard_gathered
from parallelisms.mesh import coords, group
from parallelisms.sequence_sharding import shard_sequence

logger = logging.getLogger(__name__)


class PipelineEval:
    """What validation needs of the training pipeline: the schedule, this rank's ends, and the step's loss object,
    whose `unscaled()` makes the schedule's loss_fn return plain token-loss sums (components/step_loss.py)."""

    def __init__(self, schedule, has_first: bool, has_last: bool, step_loss):
        self.schedule, self.has_first, self.has_last = schedule, has_first, has_last
        self.step_loss = step_loss

    def loss_sum(self, input_ids, labels, seq_idx) -> torch.Tensor:
        """Forward-only pass of the whole batch through the pipeline; the summed token loss on the last stage."""
        losses = [] if self.has_last else None
        kwargs = {"labels": labels} if seq_idx is None else {"seq_idx": seq_idx, "labels": labels}  # as pipeline_step
        args = (input_ids,) if self.has_first else ()
        with self.step_loss.unscaled():
            self.schedule.eval(*args, target=labels if self.has_last else None, losses=losses, **kwargs)
        if not self.has_last:
            return torch.zeros((), dtype=torch.float64, device=labels.device)
        return torch.stack([loss.detach().double() for loss in losses]).sum()


class Validator:
    def __init__(
        self,
        cfg,
        model_parts: list[torch.nn.Module],
        tokenizer,
        mesh,
        pdims,
        batch: BatchPlan,
        device: torch.device,
        pipeline: PipelineEval | None = None,
    ):
        if pdims is not None and pdims.pp_enabled and pipeline is None:
            raise ValueError("validation under pipeline parallel needs the training schedule (pipeline=PipelineEval)")
        self.pipeline = pipeline
        v = cfg.validation
        if v.steps == 0 or v.steps < -1:
            raise ValueError(f"validation.steps={v.steps} must be >= 1, or -1 for the whole dataset")
        if v.freq < 1:
            raise ValueError(f"validation.freq={v.freq} must be >= 1")
        self.cfg, self.model_parts, self.device, self.pdims = cfg, list(model_parts), device, pdims
        self.steps, self.freq = v.steps, v.freq
        dp_rank, _ = coords(mesh, "dp")
        self.cp_rank, self.cp = coords(mesh, "cp")
        self.dp_cp_group = group(mesh, "dp_cp")
        self.loader = build_loader(cfg, tokenizer, batch, dp_rank, split="validation", pin_memory=device.type == "cuda")
        fsdp = pdims is not None and pdims.fsdp_enabled
        bf16 = device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
        # Same precision as the training forward: FSDP's param dtype, else autocast on the GPU.
        self._amp = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 and not fsdp else contextlib.nullcontext
        )
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
                input_ids, labels, seq_idx = (
                    batch[k].to(self.device, non_blocking=True) for k in ("input_ids", "labels", "seq_idx")
                )
                if self.cp > 1:
                    lb = self.cfg.parallelism.context_parallel_load_balance
                    input_ids, labels = (shard_sequence(t, self.cp_rank, self.cp, lb) for t in (input_ids, labels))
                if not self.cfg.training.document_masking:
                    seq_idx = None  # score as training sees the rows: one stream each
                if self.pipeline is not None:
                    with self._amp():
                        sums[0] += self.pipeline.loss_sum(input_ids, labels, seq_idx)
                    if self.pipeline.has_last:  # count each token once: on the stage that has its loss
                        sums[1] += (labels != IGNORE_INDEX).sum()
                else:
                    with self._amp():  # the training loss's path (the fused loss on CUDA: no float32 logits)
                        loss_sum = model(
                            input_ids,
                            seq_idx=seq_idx,
                            labels=labels,
                            loss_chunk_tokens=self.cfg.training.loss_chunk_tokens,
                        )
                    sums[0] += loss_sum.double()
                    sums[1] += (labels != IGNORE_INDEX).sum()
                n += 1
        finally:
            for part, mode in zip(self.model_parts, modes):
                part.train(mode)
            reshard_gathered(self.model_parts)  # FSDP: the next forward gathers the weights again (fsdp.py)
        if self.pipeline is not None:
            dist.all_reduce(sums)  # [2] per rank -> [2] summed over the world (non-last stages hold zeros)
        elif self.dp_cp_group is not None:
            dist.all_reduce(sums, group=self.dp_cp_group)  # [2] per rank -> [2] summed over dp_cp
        loss_sum, tokens = sums.tolist()
        if tokens == 0:
            raise ValueError(
                f"validation saw no labelled tokens in {n} batches: is validation.dataset "
                f"({self.cfg.validation.dataset!r}) empty?"
            )
        loss = loss_sum / tokens
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(tokens)}
        if self.is_rank0:
            logger.info(
                f"validation step {step:>6} | val_loss {loss:.4f} | val_ppl {out['val_ppl']:.3f} | "
                f"{int(tokens)} tokens in {n} batches"
            )
        return out
