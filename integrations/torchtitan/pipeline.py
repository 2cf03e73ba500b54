"""torchtitan's pipelining_fn for Mamba-2: mambatitan's stage split (parallelisms/pipeline.py: layers keep their
global names, the packed hidden + residual travels between stages) with torchtitan's schedule builder.

torchtitan's own `pipeline_llm` cannot split this model: it keeps modules by the names "norm" / "output" and would
drop `norm_f` / `lm_head` and the residual stream. Stage boundaries come from torchtitan's
`parallelism.pipeline_parallel_layers_per_stage`, '|' in the flavor's layer_pattern, or an even split weighting the
embedding / head stages by `pipeline_parallel_first_stage_less_layers` (= `..._last_stage_less_layers`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule

from parallelisms.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    _keep_graph_for_weight_grads_before_torch_2_13,
    _leave_no_trace_of_metadata_inference,
    _no_p2p_warmup_to_self,
    build_stage_module,
    canonical_schedule,
    stage_ids_for_rank,
    stage_layer_ranges,
    validate_pipeline,
)


def pipeline_settings(job_config, model_args) -> tuple[SimpleNamespace, list[str]]:
    """torchtitan's pipeline settings as parallelisms/pipeline.py's Parallelism fields, and the problems with
    them (each naming torchtitan's key and the fix)."""
    p, errs = job_config.parallelism, []
    if p.module_fqns_per_model_part is not None:
        errs.append(
            "parallelism.module_fqns_per_model_part is not supported for mamba2; split with "
            "parallelism.pipeline_parallel_layers_per_stage or '|' in the flavor's layer_pattern"
        )
    if p.pipeline_parallel_first_stage_less_layers != p.pipeline_parallel_last_stage_less_layers:
        errs.append(
            "mamba2 weights the first and the last stage alike: set parallelism."
            "pipeline_parallel_first_stage_less_layers and ..._last_stage_less_layers to the same value"
        )
    if p.pipeline_parallel_schedule_csv:
        errs.append("parallelism.pipeline_parallel_schedule_csv is not supported for mamba2; name a schedule")
    if model_args.tie_embeddings:
        errs.append(
            f"flavor {job_config.model.flavor!r} ties the head to the embedding, whose two pipeline copies "
            "need a gradient sum that torchtitan's trainer does not do; use the flavor "
            f"'{job_config.model.flavor}_untied'"
        )
    settings = SimpleNamespace(
        pipeline_parallel_schedule=p.pipeline_parallel_schedule,
        pipeline_parallel_layers_per_stage=p.pipeline_parallel_layers_per_stage or -1,
        pipeline_parallel_split_points=[],
        pipeline_parallel_first_last_stage_weight=float(p.pipeline_parallel_first_stage_less_layers),
        fsdp_cpu_offload=job_config.training.enable_cpu_offload,
    )
    return settings, errs


def pipeline_mamba2(
    model: nn.Module, parallel_dims, job_config, device: torch.device, model_args, parallelize_fn, loss_fn
):
    """Split `model` (meta device) into this pp rank's stages, parallelise each with `parallelize_fn`, and build
    torchtitan's schedule. Returns (schedule, model_parts, has_first_stage, has_last_stage) as torchtitan expects;
    the parts stay on the meta device (torchtitan materialises and initialises them)."""
    settings, errs = pipeline_settings(job_config, model_args)
    pp = parallel_dims.pp
    n_microbatches = job_config.training.local_batch_size // job_config.parallelism.pipeline_parallel_microbatch_size
    errs += validate_pipeline(SimpleNamespace(parallelism=settings), SimpleNamespace(pp=pp), model_args, n_microbatches)
    if errs:
        raise ValueError("mamba2 pipeline parallel under torchtitan:\n  - " + "\n  - ".join(errs))

    schedule_name = canonical_schedule(settings.pipeline_parallel_schedule)
    ranges = stage_layer_ranges(
        model_args.n_layers,
        model_args.layer_pattern,
        pp,
        schedule_name,
        settings.pipeline_parallel_layers_per_stage,
        None,
        settings.pipeline_parallel_first_last_stage_weight,
    )
    pp_mesh = parallel_dims.get_mesh("pp")
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp, len(ranges), schedule_name)
    stages, parts = [], []
    for sid in stage_ids:
        part = build_stage_module(model, ranges[sid], sid == 0, sid == len(ranges) - 1, model.pack_format)
        part = parallelize_fn(part, parallel_dims, job_config)
        stage = PipelineStage(part, sid, len(ranges), device, group=pp_mesh.get_group())
        _leave_no_trace_of_metadata_inference(stage)
        _no_p2p_warmup_to_self(stage)
        stages.append(stage)
        parts.append(part)
    if schedule_name in SPLIT_BACKWARD_SCHEDULES:
        _keep_graph_for_weight_grads_before_torch_2_13()
    schedule = build_pipeline_schedule(job_config, stages, loss_fn)
    return schedule, parts, 0 in stage_ids, len(ranges) - 1 in stage_ids
