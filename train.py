"""mambatitan's trainer. Read top to bottom: config -> mesh -> model -> parallelisms -> optimizer -> data ->
checkpoint -> the loop (one batch: shard for CP, forward / backward per microbatch or through the pipeline
schedule, clip, step, log, save).

    python train.py --job.config_file configs/debug.toml                 # one process
    CONFIG_FILE=configs/debug.toml NGPU=4 ./run_train.sh --parallelism.data_parallel_shard_degree 4
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from checkpoint.integrity import ChecksumError
from checkpoint.manager import CheckpointManager, complete_steps, resolve_checkpoint_folder
from checkpoint.run_record import ResumeMismatch, build_run_record
from components.cuda_graph import GraphedMicrobatch
from components.distributed import destroy_distributed, init_distributed, set_determinism
from components.garbage_collection import StepGarbageCollection
from components.gradient_dtype import set_linear_weight_grad_dtype
from components.log import setup_logging
from components.metrics import MetricsLogger, model_flops_per_token, peak_flops
from components.moe_balance import MoEBalancer
from components.optimizer import build_lr_scheduler, build_optimizer, skips_on_device, take_optimizer_steps
from components.profiling import StepProfiler
from components.run_lock import FolderInUseError, hold_run_folders
from components.signals import EXIT_CODE_TERMINATED, GracefulStop, die_with_launcher
from components.step_loss import StepLoss
from components.step_outcome import NonFiniteStep, StepOutcome, StepOutcomes, StepReport, nonfinite
from components.validation import PipelineEval, Validator
from configs.checks import resolve_job
from configs.parser import ConfigError, load_config_or_exit, to_dict
from data.loader import build_loader
from models import build_model_on_meta
from parallelisms.data_parallel import FlatGradients
from parallelisms.distributed_optimizer import ShardedDataParallel
from parallelisms.grad_norm import global_grad_norm
from parallelisms.mesh import coords, group
from parallelisms.parallelize import build_model_parts
from parallelisms.sequence_sharding import shard_sequence
from parallelisms.tied_weights import sum_tied_embedding_grads

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    t_run_start = time.perf_counter()
    setup_logging()  # `[rankN] time message` lines; INFO on rank 0 and the LOG_RANK ranks (components/log.py)
    if sys.__stderr__ is not None:  # a fatal signal (SIGSEGV, SIGABRT: a C++ abort) prints every thread's Python stack
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    # 1. Config: TOML + overrides, resolved and validated once (configs/checks.py), before any process group.
    cfg = load_config_or_exit(argv)
    if cfg is None:
        return
    die_with_launcher()  # under torchrun: killed with the launcher, never left training on
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        job = resolve_job(cfg, world_size)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    pdims, model_args, tokenizer, batch_plan = job.pdims, job.model_args, job.tokenizer, job.batch
    if rank == 0:  # one run per folder: locked before anything is written there, held until this process exits
        try:
            hold_run_folders(cfg.job.dump_folder, cfg.checkpoint.folder if cfg.checkpoint.enable else None)
        except FolderInUseError as e:
            sys.exit(str(e))
    finished = already_finished(cfg)
    if finished:  # every rank reads the same folder and returns here, before any process group or model
        if rank == 0:
            logger.info(finished)
        return
    if rank == 0:
        write_resolved_config(cfg)
    device = init_distributed(world_size)
    if rank == 0 and cfg.job.print_config:
        logger.info(f"config: {to_dict(cfg)}")

    # 2. DeviceMesh: pp x dp_replicate x dp_shard x cp (+ flattened dp, dp_shard_cp, dp_cp views).
    mesh = pdims.build_mesh(device.type)
    set_determinism(cfg.training.seed, cfg.training.deterministic, device)
    on_gpu = device.type == "cuda"
    compute_dtype = torch.bfloat16 if on_gpu and cfg.training.mixed_precision_param == "bfloat16" else torch.float32
    dp_cp_group = group(mesh, "dp_cp")
    pp_group = group(mesh, "pp") if pdims.pp_enabled else None
    step_loss = StepLoss(pdims.dp_cp, dp_cp_group)  # the global token mean, for both paths and validation

    # 3. Model: split (pipeline), CP, EP, activation checkpointing, compile, FSDP; materialised and initialised
    #    (values depend only on the seed and the parameter names, never on the layout).
    model = build_model_parts(
        cfg,
        pdims,
        mesh,
        model_args,
        device,
        compute_dtype,
        n_microbatches=batch_plan.n_microbatches,
        pipeline_loss_fn=step_loss.pipeline_loss_fn,
    )
    model_parts = model.parts
    n_params = sum(p.numel() for p in build_model_on_meta(model_args).parameters())
    flops_per_token, _ = model_flops_per_token(model_args, cfg.training.seq_len)
    moe = MoEBalancer(model_parts, "E" in model_args.layer_types, dp_cp_group, pp_group)
    moe.set_microbatches(batch_plan.n_microbatches)

    # 4. Optimizer and LR schedule: one per model part (a pipeline rank may hold several stages), so that the
    #    checkpoint's optimizer state is keyed by parameter names whatever the split.
    # Autocast runs the products in compute_dtype where the weights stay float32 (one GPU, DDP; FSDP2 casts itself).
    autocast_dtype = compute_dtype if on_gpu and compute_dtype != torch.float32 and not pdims.fsdp_enabled else None
    # Under autocast our AdamW can keep the weights' copies in its dtype (optimizer.weight_copies; a captured CUDA
    # graph reads them too). The distributed optimizer updates each rank's rows of the weights, whose other rows
    # arrive by an all-gather, so it keeps none.
    distributed_optimizer = pdims.ddp_enabled and cfg.parallelism.distributed_optimizer
    copies_dtype = autocast_dtype if not distributed_optimizer else None
    optimizers = [build_optimizer([part], cfg.optimizer, device.type, copies_dtype) for part in model_parts]
    # parallelism.distributed_optimizer: the weights re-homed in padded storage, the moments sharded over the dp ranks
    # (parallelisms/distributed_optimizer.py); before the checkpoint load, which fills them.
    sharded_dp = ShardedDataParallel(list(model_parts[0].parameters()), mesh["dp"]) if distributed_optimizer else None
    if sharded_dp is not None:
        sharded_dp.shard_optimizer_state(optimizers[0])
    lr_schedulers = [build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps) for opt in optimizers]

    # 5. Data: every dp rank reads its slice of the one global batch; cp / pp ranks of a dp rank share it.
    dp_rank, _ = coords(mesh, "dp")
    cp_rank, _ = coords(mesh, "cp")
    with data_errors_exit():
        loader = build_loader(cfg, tokenizer, batch_plan, dp_rank, pin_memory=on_gpu)

    # 6. Checkpoint: resume from the newest complete step-N (or checkpoint.load_step / initial_load_path).
    #    A checkpoint trained with another model / tokenizer / data, or with corrupt files, stops here.
    checkpointer = CheckpointManager(
        cfg.checkpoint,
        cfg.job.dump_folder,
        model_parts,
        optimizers,
        lr_schedulers,
        loader,
        run_record=build_run_record(cfg, model_args, tokenizer),
    )
    try:
        start_step = checkpointer.load()
    except (ResumeMismatch, ChecksumError) as e:
        sys.exit(f"checkpoint error: {e}")
    if start_step:
        logger.info(f"resumed from step {start_step}")
    # The linear weights' gradient dtype: float32, or bf16 as autocast leaves them (training.grad_dtype). After the
    # load: DCP's optimizer-state load gives every parameter a float32 zero gradient to build the state.
    set_linear_weight_grad_dtype(model_parts, cfg.training.grad_dtype)
    pipeline_eval = (
        PipelineEval(model.schedule, model.has_first_stage, model.has_last_stage, step_loss)
        if pdims.pp_enabled
        else None
    )  # validation's forward-only pass through the same schedule
    with data_errors_exit():
        validator = (
            Validator(cfg, model_parts, tokenizer, mesh, pdims, batch_plan, device, pipeline=pipeline_eval)
            if cfg.validation.enable
            else None
        )
    metrics = MetricsLogger.from_config(cfg, rank == 0)  # metrics.jsonl, TensorBoard, optional W&B
    if rank == 0:
        logger.info(
            f"model {cfg.model.flavor}: {n_params / 1e6:.1f}M parameters, layers '{model_args.layer_types}', "
            f"world {world_size} = pp {pdims.pp} x dp_replicate {pdims.dp_replicate} x dp_shard {pdims.dp_shard} "
            f"x cp {pdims.cp} (ep {pdims.ep}), device {device}, compute {compute_dtype}"
        )
    amp = torch.autocast("cuda", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    params = [p for part in model_parts for p in part.parameters()]
    profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, rank, device)
    # DDP: after the checkpoint load, which needs .grad unset: every .grad becomes a view of one buffer (of padded
    # storage under the distributed optimizer).
    flat_grads = FlatGradients(params, group(mesh, "dp")) if pdims.ddp_enabled and sharded_dp is None else None
    if sharded_dp is not None:
        sharded_dp.make_gradient_views()
    # training.cuda_graph: one microbatch's forward + backward replayed as one CUDA graph.
    # On one GPU a step's first microbatch writes the gradients (no zeroing, no adding); DDP's buffer views and
    # FSDP's sharded gradients are added into.
    graphed = (
        GraphedMicrobatch(model_parts[0], autocast_dtype, cfg.training.loss_chunk_tokens,
                          overwrite_grads=flat_grads is None and sharded_dp is None and not pdims.fsdp_enabled)
        if cfg.training.cuda_graph
        else None
    )  # fmt: skip

    # 7. The loop. From here on SIGTERM finishes the step, saves and exits (before it, it ends the process at
    #    once: there is nothing to save, and torchrun's shutdown of a failed start must not wait for us).
    stop = GracefulStop().install()
    collector = StepGarbageCollection(cfg.training.gc_freq)  # Python's GC between steps only, on every rank at once
    # A step's loss, grad norm and stop votes are read by the host one step late (components/step_outcome.py), and
    # fused AdamW skips a non-finite step on the device: the host never waits for the GPU between steps.
    skip_on_device = all(skips_on_device(opt) for opt in optimizers)
    outcomes = StepOutcomes(device)
    report = StepReport(metrics, cfg.metrics.log_freq, cfg.training.steps, cfg.training.skip_nonfinite_grads,
                        pdims.pp, flops_per_token, peak_flops(device), device)  # fmt: skip
    stopping = False  # SIGTERM, agreed on by every rank
    for step in range(start_step + 1, cfg.training.steps + 1):
        is_last = step == cfg.training.steps
        profiler.step(step)  # torch.profiler trace / CUDA memory snapshot of the steps [profiling] chooses
        collector.step(step)
        batch = loader.next_batch()
        input_ids, labels, seq_idx = (
            batch[k].to(device, non_blocking=True) for k in ("input_ids", "labels", "seq_idx")
        )
        if not cfg.training.document_masking:
            seq_idx = None  # one stream per row; labels still never cross a document end
        if pdims.cp_enabled:
            # Tokens and labels are split along the sequence; seq_idx stays whole, since after the all-to-all
            # every layer sees the whole sequence for its slice of heads.
            input_ids, labels = (
                shard_sequence(t, cp_rank, pdims.cp, cfg.parallelism.context_parallel_load_balance)
                for t in (input_ids, labels)
            )
        step_loss.begin_step(labels)

        if pdims.pp_enabled:
            with amp:
                loss_sum = pipeline_step(model, input_ids, labels, seq_idx, step_loss, device)
        else:
            loss_sum = microbatch_steps(
                model_parts[0],
                input_ids,
                labels,
                seq_idx,
                batch_plan.microbatch_rows,
                step_loss.backward_scale,
                cfg.training.loss_chunk_tokens,
                amp,
                graphed,
            )
        if flat_grads is not None:
            flat_grads.all_reduce()  # DDP: the one gradient reduction of the step
        if model.replicated_grads is not None:
            model.replicated_grads.all_reduce()  # FSDP: the small parameters every rank holds whole (fsdp.py)
        if sharded_dp is not None:
            sharded_dp.reduce_scatter_gradients()  # the distributed optimizer: this rank's rows of the mean gradient
        sum_tied_embedding_grads(model_parts)  # PP + tied embeddings: the two stages' copies get one gradient
        # equal on every rank
        grad_norm = sharded_dp.grad_norm() if sharded_dp is not None else global_grad_norm(params, pp_group)
        # The logged loss: mean over every token of the global batch (all ranks, all microbatches). A SIGTERM
        # rides on the same all-reduce, so that every rank agrees to stop after the same step.
        loss_and_stop = torch.stack([loss_sum.float(), loss_sum.new_full((), float(stop.requested))])
        if world_size > 1:
            dist.all_reduce(loss_and_stop)  # ranks without a loss (early pipeline stages) add zero
        loss = step_loss.mean(loss_and_stop[0])
        skip = nonfinite(loss, grad_norm)  # 1.0: a non-finite loss or gradient norm, the same on every rank
        if not skip_on_device:  # foreach / for-loop AdamW: the host decides (a sync), before any update
            skip = bool(skip.item())
        take_optimizer_steps(optimizers, params, grad_norm, cfg.training.max_norm, skip)  # clipped, or skipped
        if sharded_dp is not None:
            sharded_dp.all_gather_weights()  # every rank's updated rows -> the whole weights on every rank
        if graphed is None or not graphed.overwrite_grads:  # else the next step's first replay writes them all
            for opt in optimizers:
                # a CUDA graph and the DDP buffers all hold on to the same .grad tensors
                opt.zero_grad(set_to_none=graphed is None and flat_grads is None and sharded_dp is None)
        worst_expert_load = moe.after_step(skip=skip)
        lr = lr_schedulers[0].get_last_lr()[0]
        for sched in lr_schedulers:
            sched.step()
        val = validator.maybe_run(step, last_step=is_last) if validator else {}
        outcomes.push(step, loss, grad_norm, loss_and_stop[1], worst_expert_load, lr=lr, tokens=input_ids.numel(),
                      val=val)  # fmt: skip

        # The host reads the previous step's outcome now that this one is queued; this one's at once where it must
        # know it before going on (see components/step_outcome.py). Every rank reads the same values.
        read_now = not skip_on_device or bool(val) or is_last or checkpointer.due(step, is_last)
        stopping = read_outcomes(outcomes.take(step if read_now else step - 1), report, checkpointer)
        if stopping:  # the stop was read from an earlier step: this step is the one saved, so it is read too
            read_outcomes(outcomes.take(step), report, checkpointer)
        checkpointer.save(step, last_step=is_last, force=stopping)
        if stopping:
            break

    profiler.close()
    collector.close()
    checkpointer.close()
    metrics.close()
    if graphed is not None:
        graphed.release()  # a graph holding FSDP's collectives must go before the process group
    destroy_distributed()
    last_step = step if start_step < cfg.training.steps else start_step
    if rank == 0:
        tokens = (last_step - start_step) * batch_plan.global_rows * cfg.training.seq_len
        logger.info(
            metrics.summary(
                start_step + 1, last_step, tokens, time.perf_counter() - t_run_start, outputs(cfg, checkpointer)
            )
        )
    if stopping:  # SIGTERM: the step finished and (with checkpointing on) was saved
        saved = (
            f"saved as {checkpointer.step_dir(step)}; run the same command again to resume"
            if checkpointer.enabled
            else "nothing saved (checkpoint.enable is false)"
        )
        logger.info(f"stopped by SIGTERM after step {step}: {saved}")
        sys.exit(EXIT_CODE_TERMINATED)


def already_finished(cfg) -> str | None:
    """A job rerun after it finished: the newest checkpoint is at (or past) training.steps. Returns the line to log,
    else None. Only with checkpointing on and automatic resume (load_step -1): an explicit load_step is a choice."""
    c = cfg.checkpoint
    if not c.enable or c.load_step >= 0:
        return None
    folder = resolve_checkpoint_folder(c.folder, cfg.job.dump_folder)
    saved = complete_steps(folder)
    if not saved or saved[-1] < cfg.training.steps:
        return None
    return (
        f"already finished at step {saved[-1]} (training.steps={cfg.training.steps}; outputs in "
        f"{cfg.job.dump_folder}, checkpoints in {folder}); raise --training.steps to continue"
    )


def write_resolved_config(cfg) -> str:
    """Rank 0: <dump_folder>/config.json, the whole resolved config of this run (TOML + overrides, defaults filled
    in), rewritten at every start so that it describes the latest run in the folder."""
    path = os.path.join(cfg.job.dump_folder, "config.json")
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_dict(cfg), f, indent=2)
        f.write("\n")
    logger.info(f"resolved config written to {path}")
    return path


def outputs(cfg, checkpointer: CheckpointManager) -> str:
    """Where a run's outputs are, for the end-of-run line."""
    files = [
        name
        for name in ("metrics.jsonl", "config.json", "tb")
        if os.path.exists(os.path.join(cfg.job.dump_folder, name))
    ]
    saved = complete_steps(checkpointer.folder) if checkpointer.enabled else []
    ckpt = f"; newest checkpoint {checkpointer.step_dir(saved[-1])}" if saved else ""
    return f"{cfg.job.dump_folder} ({', '.join(files) or 'no files'}){ckpt}"


@contextlib.contextmanager
def data_errors_exit():
    """A dataset that cannot be read (empty, undecodable, wrong column) ends the run with its message, not a
    traceback; every rank opens the same data and exits with the same message."""
    try:
        yield
    except (ValueError, KeyError, TypeError, FileNotFoundError, UnicodeDecodeError) as e:
        sys.exit(f"data error: {e.args[0] if isinstance(e, KeyError) and e.args else e}")


def read_outcomes(done: list[StepOutcome], report: StepReport, checkpointer: CheckpointManager) -> bool:
    """Report steps' outcomes in step order; exit on a non-finite one beyond the budget. Returns whether any of them
    asks the run to stop (SIGTERM) after the current step."""
    stop = False
    for outcome in done:
        problem = report(outcome)
        if problem is not None:
            stop_on_nonfinite(checkpointer, problem)
        stop = stop or report.stop_requested(outcome)
    return stop


def stop_on_nonfinite(checkpointer: CheckpointManager, problem: NonFiniteStep) -> None:
    """A non-finite loss, or too many non-finite gradient norms in a row: exit without saving, naming the checkpoint
    to resume from. The step's optimizer update was not taken (skipped on the device, or never called)."""
    checkpointer.close()
    saved = complete_steps(checkpointer.folder) if os.path.isdir(checkpointer.folder) else []
    sys.exit(
        f"{problem.what}: stopped without its optimizer update, nothing saved; the newest complete checkpoint is "
        f"{f'step-{saved[-1]}' if saved else 'none'} in {checkpointer.folder}. Lower optimizer.lr (or raise "
        f"lr_scheduler.warmup_steps) or check the data.{problem.hint}"
    )


def microbatch_steps(
    model,
    input_ids,
    labels,
    seq_idx,
    micro: int,
    backward_scale: torch.Tensor,
    loss_chunk_tokens: int,
    amp,
    graphed=None,
) -> torch.Tensor:
    """Forward / backward of this rank's rows in microbatches of `micro` rows (gradient accumulation).

    Each microbatch's summed token loss is multiplied by `backward_scale` (components/step_loss.py) before
    backward, so the accumulated, FSDP-averaged gradient is that of the global token mean. Returns the
    unscaled loss sum. `graphed` (training.cuda_graph) replays the same forward + backward as a CUDA graph.
    """
    loss_sum = torch.zeros((), device=input_ids.device)
    n_micro = input_ids.shape[0] // micro
    for i in range(n_micro):
        rows = slice(i * micro, (i + 1) * micro)
        if graphed is not None:
            loss_sum += graphed(
                input_ids[rows], labels[rows], None if seq_idx is None else seq_idx[rows], backward_scale, first=i == 0
            )
            continue
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP: reduce-scatter once, after the last microbatch
            model.set_requires_gradient_sync(i == n_micro - 1)
        with amp:  # the model returns the summed token loss of the microbatch
            mb_loss = model(
                input_ids[rows],
                seq_idx=None if seq_idx is None else seq_idx[rows],
                labels=labels[rows],
                loss_chunk_tokens=loss_chunk_tokens,
            )
        (mb_loss * backward_scale).backward()
        loss_sum += mb_loss.detach()
    return loss_sum


def pipeline_step(model, input_ids, labels, seq_idx, step_loss: StepLoss, device) -> torch.Tensor:
    """One optimizer step's forward / backward through the pipeline schedule; returns this rank's loss sum.

    Every rank passes seq_idx and labels: the schedule splits each rank's keyword inputs into the same microbatches as
    the tokens, so every stage sees its own microbatch's document boundaries, and the last stage computes its
    microbatch's summed token loss itself (the model's loss path: the fused loss on CUDA) for the schedule's loss_fn
    to scale (StepLoss.pipeline_loss_fn). Other stages ignore the labels.
    """
    losses: list[torch.Tensor] | None = [] if model.has_last_stage else None
    target = labels if model.has_last_stage else None
    kwargs = {"labels": labels} if seq_idx is None else {"seq_idx": seq_idx, "labels": labels}
    if model.has_first_stage:
        model.schedule.step(input_ids, target=target, losses=losses, **kwargs)
    else:
        model.schedule.step(target=target, losses=losses, **kwargs)
    if not model.has_last_stage:
        return torch.zeros((), device=device)
    return step_loss.pipeline_loss_sum(losses)


if __name__ == "__main__":
    main()
    # A finished run leaves the interpreter without its teardown: every file is closed and every process group
    # destroyed by now, and the teardown's C++ static destructors have aborted finished runs ("terminate called
    # without an active exception", exit -6 after the end-of-run line: sessions 8, 9, 25 and 2026-11-28's FSDP2
    # 370M run), which torchrun and SLURM then report as failed jobs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
