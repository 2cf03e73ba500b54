"""mambatitan's trainer. Read top to bottom: config -> mesh -> model -> parallelisms -> optimizer -> data ->
checkpoint -> the loop (one batch: shard for CP, forward / backward per microbatch or through the pipeline
schedule, clip, step, log, save).

    python train.py --job.config_file configs/debug.toml                 # one process
    CONFIG_FILE=configs/debug.toml NGPU=4 ./run_train.sh --parallelism.data_parallel_shard_degree 4
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from checkpoint.integrity import ChecksumError
from checkpoint.manager import CheckpointManager, complete_steps
from checkpoint.run_record import ResumeMismatch, build_run_record
from components.metrics import MetricsLogger, memory_gib, model_flops_per_token, peak_flops
from components.optimizer import build_lr_scheduler, build_optimizer
from components.profiling import StepProfiler, validate_profiling
from components.run_lock import FolderInUseError, hold_run_folders
from components.signals import EXIT_CODE_TERMINATED, GracefulStop, die_with_launcher
from components.validation import PipelineEval, Validator
from configs.job_config import JobConfig
from configs.parser import ConfigError, load_config_or_exit
from data.loader import IGNORE_INDEX, build_loader
from data.tokenizer import build_tokenizer
from models import build_model_args, build_model_on_meta
from models.init import init_weights
from models.loss import cross_entropy_sum
from parallelisms import parallelize_part
from parallelisms.grad_norm import clip_grad_norm_
from parallelisms.mesh import ParallelDims, coords, group
from parallelisms.tied_weights import sum_tied_embedding_grads


def log(msg: str) -> None:
    print(f"[rank{int(os.environ.get('RANK', 0))}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# Set-up helpers (each one step of the recipe in main())
# ---------------------------------------------------------------------------------------------------------
def init_distributed(world_size: int) -> torch.device:
    """This process' device; a process group only when torchrun started several processes."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return device


def set_determinism(cfg: JobConfig, device: torch.device) -> None:
    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def main(argv: list[str] | None = None) -> None:
    # 1. Config: TOML + overrides, validated before any process group or compute.
    cfg = load_config_or_exit(argv)
    if cfg is None:
        return
    die_with_launcher()  # under torchrun: killed with the launcher, never left training on
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        pdims = ParallelDims.from_config(cfg.parallelism, world_size)
        model_args = build_model_args(cfg.model.flavor, cfg.model_overrides)
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        check_job(cfg, pdims, model_args, tokenizer)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        sys.exit(f"config error: {e}")
    if rank == 0:  # one run per folder: locked before anything is written there, held until this process exits
        try:
            hold_run_folders(cfg.job.dump_folder, cfg.checkpoint.folder if cfg.checkpoint.enable else None)
        except FolderInUseError as e:
            sys.exit(str(e))
    device = init_distributed(world_size)
    if rank == 0 and cfg.job.print_config:
        from configs.parser import to_dict

        log(f"config: {to_dict(cfg)}")

    # 2. DeviceMesh: pp x dp_replicate x dp_shard x cp (+ flattened dp, dp_shard_cp, dp_cp views).
    mesh = pdims.build_mesh(device.type)
    set_determinism(cfg, device)
    on_gpu = device.type == "cuda"
    compute_dtype = torch.bfloat16 if on_gpu and cfg.training.mixed_precision_param == "bfloat16" else torch.float32

    # 3. Model on the meta device; pipeline split; CP, activation checkpointing, compile, FSDP; then materialise
    #    and initialise (values depend only on the seed and the parameter names, never on the layout).
    model = build_model_on_meta(model_args)
    model.set_kernel_backend("reference" if cfg.model.kernels == "reference" else "auto")

    parallelize = functools.partial(parallelize_part, cfg=cfg, pdims=pdims, mesh=mesh, param_dtype=compute_dtype)

    loss_scale = {"global_tokens": 1.0}  # set per step, a device tensor (no host sync); the pipeline's loss_fn reads it
    # FSDP averages gradients over dp_cp ranks; each rank's loss is its share of the global token mean, so
    # multiplying by dp_cp turns that average into the exact sum.
    grad_scale = float(pdims.dp_cp)

    def pipeline_loss(logits_BSV, labels_BS):
        return cross_entropy_sum(logits_BSV, labels_BS) * (grad_scale / loss_scale["global_tokens"])

    if pdims.pp_enabled:
        from parallelisms.pipeline import num_microbatches, pipeline_model

        pp_schedule, model_parts, has_first_stage, has_last_stage = pipeline_model(
            model, mesh, pdims, cfg, device, pipeline_loss, parallelize)
        pp_microbatches = num_microbatches(cfg, pdims.dp)
    else:
        model_parts, has_first_stage, has_last_stage = [parallelize(model)], True, True
    for part in model_parts:
        part.to_empty(device=device)
        if not pdims.fsdp_enabled:  # FSDP keeps the tie through to_empty; plain modules lose it
            part.tie_weights()
        init_weights(part, seed=cfg.training.seed, init_std=model_args.initializer_range)
        part.train()
    n_params = sum(p.numel() for p in build_model_on_meta(model_args).parameters())
    flops_per_token, _ = model_flops_per_token(model_args, cfg.training.seq_len)

    # 4. Optimizer and LR schedule: one per model part (a pipeline rank may hold several stages), so that the
    #    checkpoint's optimizer state is keyed by parameter names whatever the split.
    optimizers = [build_optimizer([part], cfg.optimizer, device.type) for part in model_parts]
    lr_schedulers = [build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps) for opt in optimizers]

    # 5. Data: every dp rank reads its slice of the one global batch; cp / pp ranks of a dp rank share it.
    dp_rank, dp_degree = coords(mesh, "dp")
    cp_rank, _ = coords(mesh, "cp")
    with data_errors_exit():
        loader = build_loader(cfg, tokenizer, dp_rank, dp_degree, pin_memory=on_gpu)

    # 6. Checkpoint: resume from the newest complete step-N (or checkpoint.load_step / initial_load_path).
    #    A checkpoint trained with another model / tokenizer / data, or with corrupt files, stops here.
    checkpointer = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, model_parts, optimizers, lr_schedulers,
                                     loader, run_record=build_run_record(cfg, model_args, tokenizer))
    try:
        start_step = checkpointer.load()
    except (ResumeMismatch, ChecksumError) as e:
        sys.exit(f"checkpoint error: {e}")
    if start_step:
        log(f"resumed from step {start_step}")
    pipeline_eval = None
    if pdims.pp_enabled:  # validation's forward-only pass through the same schedule, its loss_fn left unscaled
        pipeline_eval = PipelineEval(pp_schedule, has_first_stage, has_last_stage,
                                     lambda: loss_scale.update(global_tokens=grad_scale))
    with data_errors_exit():
        validator = (Validator(cfg, model_parts, tokenizer, mesh, pdims, device, pipeline=pipeline_eval)
                     if cfg.validation.enable else None)
    metrics = MetricsLogger(cfg.job.dump_folder, rank == 0, cfg.metrics.save_jsonl, cfg.metrics.enable_tensorboard,
                            cfg.training.steps)
    if rank == 0:
        log(f"model {cfg.model.flavor}: {n_params / 1e6:.1f}M parameters, layers '{model_args.layer_types}', "
            f"world {world_size} = pp {pdims.pp} x dp_replicate {pdims.dp_replicate} x dp_shard {pdims.dp_shard} "
            f"x cp {pdims.cp} (ep {pdims.ep}), device {device}, compute {compute_dtype}")
    amp = (torch.autocast("cuda", dtype=compute_dtype) if on_gpu and compute_dtype != torch.float32
           and not pdims.fsdp_enabled else contextlib.nullcontext())
    dp_cp_group = group(mesh, "dp_cp")
    peak = peak_flops(device)
    params = [p for part in model_parts for p in part.parameters()]
    moe_layers = [m for part in model_parts for m in part.modules() if hasattr(m, "update_expert_bias")]
    pp_group = group(mesh, "pp") if pdims.pp_enabled else None

    profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, rank, device)
    flat_grads = None
    if pdims.ddp_enabled:  # after the checkpoint load, which needs .grad unset: every .grad becomes a view of one buffer
        from parallelisms.data_parallel import FlatGradients

        flat_grads = FlatGradients(params, group(mesh, "dp"))
    graphed = None
    if cfg.training.cuda_graph:  # one microbatch's forward + backward replayed as one CUDA graph
        from components.cuda_graph import GraphedMicrobatch

        graphed = GraphedMicrobatch(model_parts[0], compute_dtype, cfg.training.loss_chunk_tokens)

    # 7. The loop. From here on SIGTERM finishes the step, saves and exits (before it, it ends the process at
    #    once: there is nothing to save, and torchrun's shutdown of a failed start must not wait for us).
    stop = GracefulStop().install()
    t_last, tokens_since_log = time.perf_counter(), 0
    nonfinite_streak, stopping = 0, False  # steps in a row with a non-finite gradient norm; SIGTERM agreed on
    for step in range(start_step + 1, cfg.training.steps + 1):
        profiler.step(step)  # torch.profiler trace / CUDA memory snapshot of the steps [profiling] chooses
        batch = loader.next_batch()
        input_ids, labels, seq_idx = (batch[k].to(device, non_blocking=True)
                                      for k in ("input_ids", "labels", "seq_idx"))
        if not cfg.training.document_masking:
            seq_idx = None  # one stream per row; labels still never cross a document end
        if pdims.cp_enabled:
            # Tokens and labels are split along the sequence; seq_idx stays whole, since after the all-to-all
            # every layer sees the whole sequence for its slice of heads.
            from parallelisms.sequence_sharding import shard_sequence

            input_ids, labels = (shard_sequence(t, cp_rank, pdims.cp, cfg.parallelism.context_parallel_load_balance)
                                 for t in (input_ids, labels))
        global_tokens = (labels != IGNORE_INDEX).sum().float()
        if dp_cp_group is not None:
            dist.all_reduce(global_tokens, group=dp_cp_group)
        loss_scale["global_tokens"] = global_tokens

        if pdims.pp_enabled:
            for moe in moe_layers:
                moe.aux_loss_scale = 1.0 / pp_microbatches
            with amp:
                loss_sum = pipeline_step(pp_schedule, has_first_stage, has_last_stage, input_ids, labels, seq_idx,
                                         grad_scale, loss_scale["global_tokens"], device)
        else:
            loss_sum = microbatch_steps(model_parts[0], input_ids, labels, seq_idx, cfg.training.local_batch_size,
                                        grad_scale / loss_scale["global_tokens"], cfg.training.loss_chunk_tokens,
                                        amp, moe_layers, graphed)
        if flat_grads is not None:
            flat_grads.all_reduce()  # DDP: the one gradient reduction of the step
        sum_tied_embedding_grads(model_parts)  # PP + tied embeddings: the two stages' copies get one gradient
        grad_norm = clip_grad_norm_(params, cfg.training.max_norm, pp_group=pp_group)  # equal on every rank
        # The logged loss: mean over every token of the global batch (all ranks, all microbatches). A SIGTERM
        # rides on the same all-reduce, so that every rank agrees to stop after this same step.
        loss_and_stop = torch.stack([loss_sum.float(), loss_sum.new_full((), float(stop.requested))])
        if world_size > 1:
            dist.all_reduce(loss_and_stop)  # ranks without a loss (early pipeline stages) add zero
        loss, stop_votes, grad_norm_value = torch.stack(  # the step's one host sync
            [loss_and_stop[0] / global_tokens, loss_and_stop[1], grad_norm.float()]).tolist()
        # Both values are the same on every rank (all-reduced), so every rank takes the same branch.
        if not math.isfinite(loss):
            stop_before_optimizer_step(checkpointer, f"loss is {loss} at step {step}")
        skipped = not math.isfinite(grad_norm_value)
        nonfinite_streak = nonfinite_streak + 1 if skipped else 0
        if nonfinite_streak > cfg.training.skip_nonfinite_grads:
            stop_before_optimizer_step(
                checkpointer, f"the global gradient norm is {grad_norm_value} at step {step} (its loss {loss:.4f} is "
                f"finite)", hint="" if cfg.training.skip_nonfinite_grads else
                " To skip such steps instead, set --training.skip_nonfinite_grads N (N in a row at most).")
        if skipped:
            log(f"step {step}: the global gradient norm is {grad_norm_value}: step skipped, no optimizer step "
                f"({nonfinite_streak} in a row; at most training.skip_nonfinite_grads={cfg.training.skip_nonfinite_grads})")
        for opt in optimizers:
            if not skipped:
                opt.step()
            # a CUDA graph and the DDP buffer both hold on to the same .grad tensors
            opt.zero_grad(set_to_none=graphed is None and flat_grads is None)
        worst_expert_load = moe_step(moe_layers, dp_cp_group, pp_group, update=not skipped)
        lr = lr_schedulers[0].get_last_lr()[0]
        for sched in lr_schedulers:
            sched.step()
        val = validator.maybe_run(step, last_step=step == cfg.training.steps) if validator else {}

        tokens_since_log += input_ids.numel()
        stopping = stop_votes > 0 and step < cfg.training.steps
        if step % cfg.metrics.log_freq == 0 or step == cfg.training.steps or val or skipped or stopping:
            if on_gpu:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t_last
            # tokens/s per device: tokens this rank's data-parallel replica processed / pp stages sharing them
            tps = tokens_since_log / dt / pdims.pp
            record = {"loss": loss, "grad_norm": grad_norm_value, "lr": lr, "tokens_per_sec": tps,
                      "mfu": tps * flops_per_token / peak if peak else 0.0, "memory_gib": memory_gib(device), **val}
            if skipped:
                record["skipped"] = True
            if worst_expert_load is not None:  # busiest expert / mean, worst MoE layer (E / top_k at most)
                record["moe_max_load_ratio"] = worst_expert_load.item()
            metrics.log(step, record)
            t_last, tokens_since_log = time.perf_counter(), 0
        checkpointer.save(step, last_step=step == cfg.training.steps, force=stopping)
        if stopping:
            break

    profiler.close()
    checkpointer.close()
    metrics.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if stopping:  # SIGTERM: the step finished and (with checkpointing on) was saved
        saved = (f"saved as {checkpointer.step_dir(step)}; run the same command again to resume"
                 if checkpointer.enabled else "nothing saved (checkpoint.enable is false)")
        log(f"stopped by SIGTERM after step {step}: {saved}")
        sys.exit(EXIT_CODE_TERMINATED)


@contextlib.contextmanager
def data_errors_exit():
    """A dataset that cannot be read (empty, undecodable, wrong column) ends the run with its message, not a
    traceback; every rank opens the same data and exits with the same message."""
    try:
        yield
    except (ValueError, KeyError, TypeError, FileNotFoundError, UnicodeDecodeError) as e:
        sys.exit(f"data error: {e.args[0] if isinstance(e, KeyError) and e.args else e}")


def stop_before_optimizer_step(checkpointer: CheckpointManager, what: str, hint: str = "") -> None:
    """A non-finite loss or gradient norm: exit before the optimizer step, naming the checkpoint to resume from."""
    checkpointer.close()
    saved = complete_steps(checkpointer.folder) if os.path.isdir(checkpointer.folder) else []
    sys.exit(f"{what}: stopped before the optimizer step, nothing saved; the newest complete checkpoint is "
             f"{f'step-{saved[-1]}' if saved else 'none'} in {checkpointer.folder}. Lower optimizer.lr (or raise "
             f"lr_scheduler.warmup_steps) or check the data.{hint}")


def microbatch_steps(model, input_ids, labels, seq_idx, micro: int, loss_scale: torch.Tensor,
                     loss_chunk_tokens: int, amp, moe_layers: list, graphed=None) -> torch.Tensor:
    """Forward / backward of this rank's rows in microbatches of `micro` rows (gradient accumulation).

    Each microbatch's summed token loss is scaled by `loss_scale` (= dp_cp / global token count) before
    backward, so the accumulated, FSDP-averaged gradient is that of the global token mean. Returns the
    unscaled loss sum. `graphed` (training.cuda_graph) replays the same forward + backward as a CUDA graph.
    """
    loss_sum = torch.zeros((), device=input_ids.device)
    n_micro = input_ids.shape[0] // micro
    for moe in moe_layers:
        moe.aux_loss_scale = 1.0 / n_micro  # aux / z losses: mean over microbatches (and, by FSDP, ranks)
    for i in range(n_micro):
        rows = slice(i * micro, (i + 1) * micro)
        if graphed is not None:
            loss_sum += graphed(input_ids[rows], labels[rows], None if seq_idx is None else seq_idx[rows],
                                loss_scale)
            continue
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(i == n_micro - 1)  # reduce-scatter once, after the last microbatch
        with amp:  # the model returns the summed token loss of the microbatch
            mb_loss = model(input_ids[rows], seq_idx=None if seq_idx is None else seq_idx[rows], labels=labels[rows],
                            loss_chunk_tokens=loss_chunk_tokens)
        (mb_loss * loss_scale).backward()
        loss_sum += mb_loss.detach()
    return loss_sum


def pipeline_step(schedule, has_first: bool, has_last: bool, input_ids, labels, seq_idx, grad_scale: float,
                  global_tokens: torch.Tensor, device) -> torch.Tensor:
    """One optimizer step's forward / backward through the pipeline schedule; returns this rank's loss sum.

    Every rank passes seq_idx: the schedule splits each rank's keyword inputs into the same microbatches as
    the tokens, so every stage sees its own microbatch's document boundaries.
    """
    losses: list[torch.Tensor] | None = [] if has_last else None
    target = labels if has_last else None
    kwargs = {} if seq_idx is None else {"seq_idx": seq_idx}
    if has_first:
        schedule.step(input_ids, target=target, losses=losses, **kwargs)
    else:
        schedule.step(target=target, losses=losses, **kwargs)
    if not has_last:
        return torch.zeros((), device=device)
    # The loss_fn returned sum * grad_scale / global_tokens per microbatch; undo the scaling for logging.
    return torch.stack([l.detach().float() for l in losses]).sum() * (global_tokens / grad_scale)


def moe_step(moe_layers: list, dp_cp_group, pp_group, update: bool = True) -> torch.Tensor | None:
    """After the optimizer step: global expert loads, the auxiliary-loss-free bias update, load metrics.

    `update` False (a skipped step): the counts are dropped and the bias is left as it is.

    Each MoE layer counted the tokens routed to each expert on this rank; the sum over dp x cp is the global
    batch's load, identical on every rank, so the bias update keeps the replicas equal. Returns the busiest
    expert's load over the mean, worst over all MoE layers of the model (max over pipeline stages), as a device
    tensor: read on logging steps only, so it adds no host sync.
    """
    if not moe_layers:
        return None
    ratios = []
    for moe in moe_layers:
        if dp_cp_group is not None:
            dist.all_reduce(moe.tokens_per_expert, group=dp_cp_group)
        load = moe.tokens_per_expert.float()
        ratios.append(load.max() / load.mean().clamp(min=1))
        if update:
            moe.update_expert_bias()
        else:
            moe.tokens_per_expert.zero_()
    worst = torch.stack(ratios).max()
    if pp_group is not None:  # stages hold different layers: report the worst of the whole model on every rank
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp_group)
    return worst


def check_job(cfg: JobConfig, pdims: ParallelDims, model_args, tokenizer) -> None:
    """Combinations that would fail later, reported now with their fix."""
    t, errs = cfg.training, []
    if cfg.checkpoint.load_step >= 0 and not cfg.checkpoint.enable:
        errs.append(f"checkpoint.load_step={cfg.checkpoint.load_step} resumes only with checkpointing on; set "
                    "--checkpoint.enable true (or --checkpoint.initial_load_path DIR for weights alone)")
    if tokenizer.vocab_size > model_args.vocab_size:
        errs.append(f"the tokenizer's ids go up to {tokenizer.vocab_size - 1} but model.vocab_size="
                    f"{model_args.vocab_size}; set --model.vocab_size {tokenizer.vocab_size} (or larger)")
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * pdims.dp
    if gbs % pdims.dp:
        errs.append(f"training.global_batch_size={gbs} must divide by the data-parallel degree "
                    f"dp_replicate x dp_shard = {pdims.dp}")
    elif not pdims.pp_enabled and (gbs // pdims.dp) % t.local_batch_size:
        errs.append(f"training.global_batch_size / dp = {gbs // pdims.dp} rows per rank must divide by "
                    f"training.local_batch_size={t.local_batch_size} (gradient accumulation steps)")
    if pdims.cp_enabled:
        from parallelisms.context_parallel import validate_cp_mamba
        from parallelisms.sequence_sharding import validate_cp_shapes

        try:
            validate_cp_shapes(t.seq_len, pdims.cp, cfg.parallelism.context_parallel_load_balance)
            if "M" in model_args.layer_types:
                validate_cp_mamba(model_args.nheads, model_args.ngroups, pdims.cp)
        except ValueError as e:
            errs.append(str(e))
    if t.skip_nonfinite_grads < 0:
        errs.append(f"training.skip_nonfinite_grads={t.skip_nonfinite_grads} must be >= 0 (0 = stop at the first "
                    "non-finite gradient norm)")
    if cfg.parallelism.fsdp_blocks_per_unit < 1:
        errs.append(f"parallelism.fsdp_blocks_per_unit={cfg.parallelism.fsdp_blocks_per_unit} must be >= 1 "
                    "(1 = one FSDP unit per block)")
    if cfg.parallelism.fsdp_cpu_offload and not torch.cuda.is_available():
        errs.append("parallelism.fsdp_cpu_offload needs GPUs (without CUDA the parameters already live in CPU "
                    "memory); set it false")
    try:
        validate_profiling(cfg.profiling)
    except ValueError as e:
        errs.append(str(e))
    if pdims.pp_enabled and cfg.validation.enable and cfg.validation.local_batch_size * pdims.dp != gbs:
        errs.append(f"under pipeline parallel validation batches go through the training schedule, so "
                    f"validation.local_batch_size must equal the rows per data-parallel rank, {gbs // pdims.dp}")
    if t.cuda_graph:
        errs += cuda_graph_errors(cfg, pdims, model_args)
    if pdims.pp_enabled:
        from parallelisms.pipeline import validate_pipeline

        errs += validate_pipeline(cfg, pdims, model_args)
    if pdims.ep_enabled:
        from parallelisms.expert_parallel import validate_expert_parallel

        errs += validate_expert_parallel(model_args, pdims)
    if errs:
        raise ConfigError("invalid job:\n  - " + "\n  - ".join(errs))


def cuda_graph_errors(cfg: JobConfig, pdims: ParallelDims, model_args) -> list[str]:
    """What training.cuda_graph cannot capture (see components/cuda_graph.py), each with its fix."""
    errs = []
    if not torch.cuda.is_available():
        errs.append("training.cuda_graph needs a CUDA GPU; set it false on this machine")
    if pdims.world_size > 1 and not pdims.ddp_enabled:
        errs.append(f"training.cuda_graph runs on one GPU or under plain data parallel (only "
                    f"data_parallel_replicate_degree = NGPU); this job has {pdims.world_size} processes with FSDP, "
                    "PP or CP, whose hooks and collectives are not captured; set it false or change the layout")
    if cfg.compile.enable:
        errs.append("training.cuda_graph and compile.enable are exclusive; set one of them false")
    other = sorted(set(model_args.layer_types) - {"M", "-"})
    if other:
        errs.append(f"training.cuda_graph supports Mamba ('M') and MLP ('-') layers; this model has {other} "
                    "(attention builds document masks and MoE routes tokens by data-dependent counts); set it false")
    return errs


if __name__ == "__main__":
    main()
