"""The one validation pass: everything about a job that can be known before any process group or compute.

`resolve_job(cfg, world_size)` builds what the config implies (layout, model args, tokenizer, batch plan), checks
every combination that would fail later, and raises one ConfigError listing each problem with its fix. train.py,
evaluate.py and generation call it; nothing downstream checks the same thing again.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from components.profiling import validate_profiling
from configs.job_config import JobConfig
from configs.parser import ConfigError, load_config_or_exit
from data.tokenizer import build_tokenizer
from models import build_model_args
from models.args import ModelArgs
from parallelisms.batch_plan import BatchPlan
from parallelisms.context_parallel import validate_cp_mamba
from parallelisms.expert_parallel import validate_expert_parallel
from parallelisms.mesh import ParallelDims
from parallelisms.pipeline import validate_pipeline
from parallelisms.sequence_sharding import validate_cp_shapes


@dataclass
class ResolvedJob:
    """What the config resolves to, computed once and passed down."""

    pdims: ParallelDims
    model_args: ModelArgs
    tokenizer: object
    batch: BatchPlan


def resolve_job(cfg: JobConfig, world_size: int, training: bool = True) -> ResolvedJob:
    """Layout, model, tokenizer and batch plan of the job, or a ConfigError naming every problem and its fix.
    training False (evaluate.py): the checks that only concern a training run are left out."""
    try:
        pdims = ParallelDims.from_config(cfg.parallelism, world_size)
        model_args = build_model_args(cfg.model.flavor, cfg.model_overrides)
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    batch = BatchPlan.from_config(cfg.training, cfg.parallelism, pdims)
    errs = job_errors(cfg, pdims, model_args, tokenizer, batch, training)
    if errs:
        raise ConfigError("invalid job:\n  - " + "\n  - ".join(errs))
    return ResolvedJob(pdims, model_args, tokenizer, batch)


def job_errors(
    cfg: JobConfig, pdims: ParallelDims, model_args: ModelArgs, tokenizer, batch: BatchPlan, training: bool = True
) -> list[str]:
    """Combinations that would fail later, each with its fix (empty when the job is fine)."""
    t, errs = cfg.training, []
    if training and cfg.checkpoint.load_step >= 0 and not cfg.checkpoint.enable:
        errs.append(
            f"checkpoint.load_step={cfg.checkpoint.load_step} resumes only with checkpointing on; set "
            "--checkpoint.enable true (or --checkpoint.initial_load_path DIR for weights alone)"
        )
    if tokenizer.vocab_size > model_args.vocab_size:
        errs.append(
            f"the tokenizer's ids go up to {tokenizer.vocab_size - 1} but model.vocab_size="
            f"{model_args.vocab_size}; set --model.vocab_size {tokenizer.vocab_size} (or larger)"
        )
    if training:  # evaluate.py reads validation batches; the training batch and loop do not concern it
        errs += batch.errors()
    if pdims.cp_enabled:
        try:
            validate_cp_shapes(t.seq_len, pdims.cp, cfg.parallelism.context_parallel_load_balance)
            if "M" in model_args.layer_types:
                validate_cp_mamba(model_args.nheads, model_args.ngroups, pdims.cp)
        except ValueError as e:
            errs.append(str(e))
    if training and t.skip_nonfinite_grads < 0:
        errs.append(
            f"training.skip_nonfinite_grads={t.skip_nonfinite_grads} must be >= 0 (0 = stop at the first "
            "non-finite gradient norm)"
        )
    if cfg.parallelism.fsdp_blocks_per_unit < -1:
        errs.append(
            f"parallelism.fsdp_blocks_per_unit={cfg.parallelism.fsdp_blocks_per_unit} must be >= -1 "
            "(1 = one FSDP unit per block, 0 = auto, -1 = the blocks in the root's unit)"
        )
    if cfg.parallelism.fsdp_replicate_params_below < 0:
        errs.append(
            f"parallelism.fsdp_replicate_params_below={cfg.parallelism.fsdp_replicate_params_below} must be >= 0 "
            "(0 = FSDP shards every parameter)"
        )
    if cfg.parallelism.distributed_optimizer:
        errs += distributed_optimizer_errors(cfg, pdims)
    if cfg.parallelism.fsdp_cpu_offload and not torch.cuda.is_available():
        errs.append(
            "parallelism.fsdp_cpu_offload needs GPUs (without CUDA the parameters already live in CPU "
            "memory); set it false"
        )
    try:
        validate_profiling(cfg.profiling)
    except ValueError as e:
        errs.append(str(e))
    if pdims.pp_enabled and cfg.validation.enable and cfg.validation.local_batch_size != batch.rows_per_dp_rank:
        errs.append(
            f"under pipeline parallel validation batches go through the training schedule, so "
            f"validation.local_batch_size must equal the rows per data-parallel rank, {batch.rows_per_dp_rank}"
        )
    if training and t.cuda_graph:
        errs += cuda_graph_errors(cfg, pdims, model_args)
    if training and t.grad_dtype != "float32":
        errs += grad_dtype_errors(cfg, pdims, batch)
    if pdims.pp_enabled:
        errs += validate_pipeline(cfg, pdims, model_args, batch.n_microbatches)
    if pdims.ep_enabled:
        errs += validate_expert_parallel(model_args, pdims)
    return errs


def distributed_optimizer_errors(cfg: JobConfig, pdims: ParallelDims) -> list[str]:
    """What parallelism.distributed_optimizer needs (parallelisms/distributed_optimizer.py), each with its fix."""
    errs = []
    if pdims.world_size > 1 and not pdims.ddp_enabled:
        errs.append(
            f"parallelism.distributed_optimizer shards plain data parallel's optimizer (data_parallel_replicate_degree "
            f"= NGPU, no other parallelism); this job is pp {pdims.pp} x dp_replicate {pdims.dp_replicate} x dp_shard "
            f"{pdims.dp_shard} x cp {pdims.cp}: set --parallelism.data_parallel_replicate_degree {pdims.world_size} "
            "--parallelism.data_parallel_shard_degree 1 (and no PP / CP / EP), or distributed_optimizer false (FSDP "
            "already shards the optimizer)"
        )
    if cfg.optimizer.implementation not in ("auto", "fused", "triton"):
        errs.append(
            f"parallelism.distributed_optimizer needs the fused AdamW (it clips the gradient shards inside its "
            f"kernel); optimizer.implementation is {cfg.optimizer.implementation!r}: use auto, fused or triton"
        )
    return errs


def cuda_graph_errors(cfg: JobConfig, pdims: ParallelDims, model_args: ModelArgs) -> list[str]:
    """What training.cuda_graph cannot capture (see components/cuda_graph.py), each with its fix."""
    errs = []
    if not torch.cuda.is_available():
        errs.append("training.cuda_graph needs a CUDA GPU; set it false on this machine")
    if pdims.pp_enabled or pdims.cp_enabled:
        errs.append(
            f"training.cuda_graph runs on one GPU, under plain data parallel or under FSDP2 / HSDP; this job has "
            f"pipeline_parallel_degree {pdims.pp} and context_parallel_degree {pdims.cp}, whose schedules and "
            "all-to-alls are not captured; set it false or use data parallel only"
        )
    if pdims.fsdp_enabled and cfg.parallelism.fsdp_cpu_offload:
        errs.append(
            "training.cuda_graph cannot capture parallelism.fsdp_cpu_offload (host copies of every weight and "
            "gradient); set one of them false"
        )
    if cfg.compile.enable:
        errs.append("training.cuda_graph and compile.enable are exclusive; set one of them false")
    other = sorted(set(model_args.layer_types) - {"M", "-"})
    if other:
        errs.append(
            f"training.cuda_graph supports Mamba ('M') and MLP ('-') layers; this model has {other} "
            "(attention builds document masks and MoE routes tokens by data-dependent counts); set it false"
        )
    return errs


def grad_dtype_errors(cfg: JobConfig, pdims: ParallelDims, batch: BatchPlan) -> list[str]:
    """What training.grad_dtype bfloat16 needs (components/gradient_dtype.py), each with its fix."""
    t, errs = cfg.training, []
    fix = "or set --training.grad_dtype float32"
    if not hasattr(torch.Tensor, "grad_dtype"):
        errs.append(f"training.grad_dtype {t.grad_dtype} needs torch's per-tensor grad_dtype (torch >= 2.10); "
                    f"this torch {torch.__version__} has none: upgrade torch {fix}")  # fmt: skip
    if pdims.world_size > 1:
        errs.append(
            f"training.grad_dtype {t.grad_dtype} runs in one process (its gradients are neither reduced nor sharded "
            f"over ranks); this job has {pdims.world_size}: train on one GPU {fix} (FSDP / HSDP reduce in bf16 "
            "with --training.mixed_precision_reduce bfloat16)"
        )
    if batch.n_microbatches > 1:
        errs.append(
            f"training.grad_dtype {t.grad_dtype} with {batch.n_microbatches} microbatches per step would add every "
            f"microbatch's gradient in {t.grad_dtype}: set --training.local_batch_size -1 (one microbatch) {fix}"
        )
    if cfg.optimizer.implementation not in ("auto", "fused", "triton"):
        errs.append(
            f"training.grad_dtype {t.grad_dtype} needs a fused AdamW, which clips and upcasts the gradients inside "
            f"its kernel; optimizer.implementation is {cfg.optimizer.implementation!r}: use auto, fused or triton {fix}"
        )
    return errs


def main(argv: list[str] | None = None) -> None:
    """`python -m configs.checks --world_size N <train.py arguments>`: validate the job for N processes and exit
    (0: fine; 2: the errors, printed once). run_train.sh runs it before torchrun starts any worker, so a config
    error reads as one message instead of one per rank plus the launcher's traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = 1
    if "--world_size" in argv:
        i = argv.index("--world_size")
        world_size = int(argv[i + 1])
        del argv[i : i + 2]
    cfg = load_config_or_exit(argv)
    if cfg is None:
        return
    try:
        resolve_job(cfg, world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
