"""Pipeline parallelism: split the LM into stages by FQN and drive them with a torch.distributed.pipelining schedule.

Each pipeline rank deep-copies the (meta-device) model once per stage it owns and deletes what the stage does not
own: layers leave the `layers` ModuleDict (the kept ones keep their global names "0".."n-1", so state dicts and
checkpoints are the same under every layout), and tok_embeddings / norm_f / lm_head become None off the first /
last stage. Between stages hidden + residual travel as one plain tensor (`parallelism.pipeline_parallel_pack`).
Tied embeddings: the last stage keeps a copy of the embedding as its head's weight, kept equal to the first
stage's by summing their gradients every step (parallelisms/tied_weights.py; the trainer calls
`sum_tied_embedding_grads` between the backward and the clipping).

Splits (`stage_layer_ranges`), in order of precedence:
    parallelism.pipeline_parallel_split_points = [6, 12, 18]   explicit: first layer of every stage but the first
    model.layer_pattern = "MM*-|MME-|..."                    explicit: '|' marks the stage boundaries
    otherwise an even split of the cost, where the embedding and the head each count as
    parallelism.pipeline_parallel_first_last_stage_weight layers (so those stages get fewer layers), and the last
    stage's LM head + loss as parallelism.pipeline_parallel_head_weight layers more (-1: estimated from the FLOPs).
Stages per rank: 1 for single-stage schedules (GPipe, 1F1B); 2 for the multi-stage ones (Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble) unless pipeline_parallel_layers_per_stage, split points or the
pattern say otherwise. Loop schedules give rank r the stages r, r+pp, r+2pp, ...; V schedules (ZBVZeroBubble,
DualPipeV) give rank r the stages r and 2*pp-1-r.

Document boundaries: the trainer passes seq_idx [b, s] as a keyword argument of schedule.step on every rank; the
schedule splits keyword tensors along the batch dimension exactly as it splits the tokens, so each stage's forward
receives its own microbatch's seq_idx (tests/test_pipeline.py proves it for every enabled schedule).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.torch_version import TorchVersion

from parallelisms.tied_weights import build_tied_embedding_group, mark_tied_copy

logger = logging.getLogger(__name__)

# Names as torch.distributed.pipelining.schedules.get_schedule_class spells them.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble",)
# Backward split into an input-gradient and a later weight-gradient step (torch's _backward.stage_backward_weight).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES


# ---------------------------------------------------------------------------------------------- pure split logic
def canonical_schedule(name: str) -> str:
    """The schedule's canonical spelling (case-insensitive match); ValueError listing the valid names."""
    for s in SCHEDULES:
        if s.lower() == str(name).lower():
            return s
    raise ValueError(f"parallelism.pipeline_parallel_schedule={name!r} is unknown; choose one of {list(SCHEDULES)}")


def split_layers(
    n_layers: int, num_stages: int, first_last_weight: float = 0.0, head_weight: float = 0.0
) -> list[range]:
    """Contiguous layer ranges, one per stage, balancing cost = layers (+ first_last_weight on the first stage for
    the embedding and on the last for the head, + head_weight more on the last: the LM head's matmuls and the loss
    cost several layers' worth at a 50k vocabulary). Every stage gets at least one layer.

    Boundary s (layers in stages 0..s) is the one whose cumulative cost is nearest (s+1)/S of the total, so with
    weight 0 this is the plain even split. Ties go to the later stages: under 1F1B an earlier stage holds more
    microbatches' activations at once, so it is the one to keep lighter.
    """
    if num_stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {num_stages}")
    if num_stages > n_layers:
        raise ValueError(
            f"{num_stages} pipeline stages but only {n_layers} layers: every stage needs a layer; "
            f"lower the stage count or add layers"
        )
    if first_last_weight < 0:
        raise ValueError(f"parallelism.pipeline_parallel_first_last_stage_weight={first_last_weight} must be >= 0")
    if head_weight < 0:
        raise ValueError(
            f"parallelism.pipeline_parallel_head_weight={head_weight} must be >= 0 (or -1 for the estimate)"
        )
    w = first_last_weight if num_stages > 1 else 0.0
    total = n_layers + 2 * w + (head_weight if num_stages > 1 else 0.0)
    bounds, prev = [], 0
    for s in range(num_stages - 1):
        ideal = (s + 1) * total / num_stages - w  # layers before the cut whose cost is (s+1)/S of the total
        cut = math.ceil(ideal - 0.5 - 1e-9)  # nearest integer, halves rounded down
        cut = min(max(cut, prev + 1), n_layers - (num_stages - 1 - s))
        bounds.append(cut)
        prev = cut
    edges = [0, *bounds, n_layers]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def ranges_from_split_points(n_layers: int, split_points: list[int]) -> list[range]:
    """[6, 12, 18] with 24 layers -> [0:6, 6:12, 12:18, 18:24]; ValueError unless strictly increasing in (0, n)."""
    pts = [int(p) for p in split_points]
    if any(p <= 0 or p >= n_layers for p in pts):
        raise ValueError(
            f"parallelism.pipeline_parallel_split_points={pts} must lie in [1, {n_layers - 1}] "
            f"(the first layer index of every stage but the first, {n_layers} layers)"
        )
    if any(b <= a for a, b in itertools.pairwise(pts)):
        raise ValueError(f"parallelism.pipeline_parallel_split_points={pts} must be strictly increasing")
    edges = [0, *pts, n_layers]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def ranges_from_pattern(layer_pattern: str) -> list[range]:
    """'MM*|-ME|M' -> [0:3, 3:6, 6:7]; ValueError for an empty stage."""
    sizes = [len(s) for s in layer_pattern.split("|")]
    if any(n == 0 for n in sizes):
        raise ValueError(
            f"model.layer_pattern={layer_pattern!r} has an empty pipeline stage (two '|' in a row or "
            f"a '|' at an end); every stage needs a layer"
        )
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def stage_layer_ranges(
    n_layers: int,
    layer_pattern: str,
    pp: int,
    schedule: str,
    layers_per_stage: int = -1,
    split_points: list[int] | None = None,
    first_last_weight: float = 0.0,
    head_weight: float = 0.0,
) -> list[range]:
    """The layers of every pipeline stage (all ranks, stage order), or ValueError naming the key to fix."""
    schedule = canonical_schedule(schedule)
    multi = schedule in MULTI_STAGE_SCHEDULES
    explicit = None
    if split_points:
        if "|" in layer_pattern:
            raise ValueError(
                "both parallelism.pipeline_parallel_split_points and '|' in model.layer_pattern set the "
                "stage split; keep one of them"
            )
        explicit = ranges_from_split_points(n_layers, split_points)
        source = "parallelism.pipeline_parallel_split_points"
    elif "|" in layer_pattern:
        explicit, source = ranges_from_pattern(layer_pattern), "the '|' in model.layer_pattern"
    if layers_per_stage > 0:
        num_stages = math.ceil(n_layers / layers_per_stage)
        how = f"parallelism.pipeline_parallel_layers_per_stage={layers_per_stage} ({n_layers} layers)"
    else:
        num_stages = pp * (2 if multi else 1) if explicit is None else len(explicit)
        how = f"pipeline_parallel_schedule={schedule}" if explicit is None else source
    if explicit is not None and len(explicit) != num_stages:
        raise ValueError(f"{source} makes {len(explicit)} stages but {how} asks for {num_stages}; make them agree")
    per_rank = f"{num_stages} stages from {how}"
    if not multi and num_stages != pp:
        raise ValueError(
            f"{per_rank}, but the single-stage schedule {schedule} runs exactly one stage per rank "
            f"(pipeline_parallel_degree={pp}); use {pp} stages or a multi-stage schedule "
            f"({', '.join(MULTI_STAGE_SCHEDULES)})"
        )
    if multi and num_stages % pp:
        raise ValueError(f"{per_rank} do not divide over pipeline_parallel_degree={pp}; use a multiple of {pp}")
    if schedule in V_SCHEDULES and num_stages != 2 * pp:
        raise ValueError(f"{per_rank}, but {schedule} needs exactly 2 stages per rank ({2 * pp} stages)")
    if num_stages > n_layers:
        raise ValueError(
            f"{per_rank} but the model has only {n_layers} layers; every stage needs a layer "
            f"(lower pipeline_parallel_degree / stages per rank or add layers)"
        )
    return explicit if explicit is not None else split_layers(n_layers, num_stages, first_last_weight, head_weight)


def _head_weight(cfg, model_args) -> float:
    """The job's pipeline_parallel_head_weight in layers (0 where the settings have none: torchtitan's trainer)."""
    setting = getattr(cfg.parallelism, "pipeline_parallel_head_weight", 0.0)
    return head_weight_in_layers(model_args, cfg.training.seq_len, setting) if setting == -1 else setting


def head_weight_in_layers(model_args, seq_len: int, setting: float) -> float:
    """parallelism.pipeline_parallel_head_weight as layers: the setting itself when >= 0; -1 estimates it as the LM
    head's training FLOPs per token (6 x d_model x vocab) over a layer's average (the model's FLOPs without the head,
    over its layers; components/metrics.py counts them): ~3.7 at the 1.3B, 4096 tokens."""
    if setting != -1:
        return setting
    from components.metrics import model_flops_per_token  # lazy: metrics imports the model package

    total, _ = model_flops_per_token(model_args, seq_len)
    head = 6.0 * model_args.d_model * model_args.padded_vocab_size
    return head / ((total - head) / model_args.n_layers)


def stage_ids_for_rank(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """The stages pp rank `pp_rank` runs: loop style r, r+pp, ...; V style r and 2*pp-1-r."""
    if canonical_schedule(schedule) in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


# --------------------------------------------------------------------------------------------- validation
def validate_pipeline(cfg, pdims, model_args, n_microbatches: int) -> list[str]:
    """Every problem of the pipeline settings, each naming the key and the fix (empty when fine); no compute.
    `n_microbatches` comes from the BatchPlan (parallelisms/batch_plan.py), which checks that the batch divides."""
    p, errs = cfg.parallelism, []
    if model_args.tie_embeddings and p.fsdp_cpu_offload:
        errs.append(
            "model.tie_embeddings=true under pipeline parallel sums the tied weight's gradients between the "
            "first and the last stage over the GPU backend, which cannot reach parallelism.fsdp_cpu_offload's "
            "CPU gradients; set fsdp_cpu_offload false or --model.tie_embeddings false"
        )
    try:
        schedule = canonical_schedule(p.pipeline_parallel_schedule)
    except ValueError as e:
        return errs + [str(e)]
    err = split_backward_error(schedule, torch.cuda.is_available(), torch.__version__)
    if err:
        errs.append(err)
    num_stages = None
    try:
        num_stages = len(
            stage_layer_ranges(
                model_args.n_layers,
                model_args.layer_pattern,
                pdims.pp,
                schedule,
                p.pipeline_parallel_layers_per_stage,
                p.pipeline_parallel_split_points,
                p.pipeline_parallel_first_last_stage_weight,
                _head_weight(cfg, model_args),
            )
        )
    except ValueError as e:
        errs.append(str(e))
    if num_stages is not None and n_microbatches >= 1:
        if schedule in ("1F1B",) and n_microbatches < num_stages:
            errs.append(
                f"{schedule} needs at least as many microbatches as stages: {n_microbatches} microbatches "
                f"(training.global_batch_size / dp / parallelism.pipeline_parallel_microbatch_size) < "
                f"{num_stages} stages; raise the batch or lower the microbatch size"
            )
        if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            rounds = max(1, n_microbatches // pdims.pp)
            if n_microbatches % rounds:
                errs.append(
                    f"{schedule} needs the microbatch count ({n_microbatches}) to be a multiple of "
                    f"{rounds} = microbatches // pipeline_parallel_degree; use a multiple of "
                    f"pipeline_parallel_degree={pdims.pp} microbatches"
                )
    return errs


def split_backward_error(schedule: str, on_gpu: bool, torch_version: str) -> str | None:
    """Zero-bubble schedules on GPUs need torch >= 2.13: before it, the weight-gradient step adds up the gradients
    of a node's several outputs and feeds the sum into its first output. mamba_ssm's fused add + RMSNorm is such a
    node (normed hidden and residual), so the norm weights got wrong gradients (measured on 2 H200s, torch 2.11,
    debug model, fp32 deterministic: ZBVZeroBubble drifted from one GPU by 3e-5 at step 2 and 1.3e-4 at step 5,
    where 1F1B stayed within 2e-7). The CPU path has no such node (the references are plain torch ops)."""
    if schedule in SPLIT_BACKWARD_SCHEDULES and on_gpu and TorchVersion(torch_version) < (2, 13):
        return (
            f"parallelism.pipeline_parallel_schedule={schedule} on GPUs needs torch >= 2.13 (this is "
            f"{torch_version}, whose zero-bubble weight step gives mamba_ssm's fused add+norm wrong gradients); "
            "use 1F1B, Interleaved1F1B or GPipe, or upgrade torch"
        )
    return None


# -------------------------------------------------------------------------------------------- building stages
def build_stage_module(model: nn.Module, layers: range, is_first: bool, is_last: bool, pack: str) -> nn.Module:
    """A deep copy of `model` that keeps only `layers` (under their global names) and the ends it owns.

    With tied embeddings the last stage keeps tok_embeddings too, as the owner of its head's (shared) weight, but
    does not embed (embeds_tokens = False): parallelisms/tied_weights.py keeps that copy equal to the first stage's.
    """
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if int(name) not in layers:
            del part.layers[name]
    if not is_first:
        if is_last and model.args.tie_embeddings:
            part.embeds_tokens = False
        else:
            part.tok_embeddings = None
    if not is_last:
        part.norm_f = None
        part.lm_head = None
    part.pack_format = pack
    part.loss_shape = (1,)  # given labels, the last stage outputs its loss sum: one per microbatch to concatenate
    return part


def _leave_no_trace_of_metadata_inference(stage) -> None:
    """At the first step torch runs every stage once more to learn the inter-stage shapes (torch 2.11 / 2.12:
    `_shape_inference`, a no-grad forward on zeros; torch 2.13: `_forward_metadata_inference`, a forward on the
    first microbatch, uninitialised inputs for later stages). Parameters get no gradient from it, but buffers that a
    forward updates (the MoE load counters) would count it: put them back afterwards."""
    module = stage.submod
    for name in ("_forward_metadata_inference", "_shape_inference"):
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        def restoring(*args, _inner=inner, **kwargs):
            saved = [(b, b.detach().clone()) for b in module.buffers() if b.device.type != "meta"]
            try:
                return _inner(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for b, value in saved:
                        b.copy_(value)

        setattr(stage, name, restoring)


def _no_p2p_warmup_to_self(stage) -> None:
    """torch 2.11 / 2.12 warm up the pipeline's communicators at the first step by a dummy send from every stage
    to its neighbours' ranks, including a neighbour on the SAME rank (ZBVZeroBubble's V puts stages 1 and 2 of
    pp 2 on rank 1): a send to oneself, which gloo refuses ("Pair is not connected") and which broke the
    schedule on GPUs too. Stages on one rank exchange tensors directly, so those ops are dropped. torch 2.13
    builds its warm-up differently; the filter then finds nothing to drop."""
    inner = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if inner is None:
        return
    me = dist.get_rank(stage.group)

    def without_self(_inner=inner):
        return [op for op in _inner() if getattr(op, "group_peer", None) != me]

    stage._get_init_p2p_neighbors_ops = without_self


def keep_graph_for_weight_grads(stage_backward_input: Callable) -> Callable:
    """Wrap torch's `stage_backward_input` (zero-bubble schedules: input gradients now, weight gradients later) so
    that the autograd nodes the later weight step starts from stay alive until then.

    torch 2.11 / 2.12 detach the stage outputs after the input step, which frees the output side of the graph; an
    intermediate node that belongs to a custom autograd.Function (mamba_ssm's fused scan on GPUs, this repo's
    all-to-alls) is then gone, and the weight step fails with "Attribute '_input_metadata' is invalid for this
    instance of _C._FunctionBase". Each param group returned keeps a view node of every stage output (a built-in
    node that holds the output's graph, not its data) and drops it with the group after the weight step; the cost
    is that the output side's saved activations also live until that step."""

    def keeping(stage_outputs_or_loss, *args, **kwargs):
        with torch.enable_grad():
            roots = [
                t.view_as(t).grad_fn
                for t in stage_outputs_or_loss
                if isinstance(t, torch.Tensor) and t.grad_fn is not None
            ]
        dinputs, param_groups = stage_backward_input(stage_outputs_or_loss, *args, **kwargs)
        for group in param_groups:
            group["graph_roots"] = roots
        return dinputs, param_groups

    keeping.keeps_graph = True
    return keeping


def _keep_graph_for_weight_grads_before_torch_2_13() -> None:
    import torch.distributed.pipelining.stage as stage_module  # lazy: imports torch._dynamo (see pipeline_model)

    if TorchVersion(torch.__version__) >= (2, 13) or getattr(stage_module.stage_backward_input, "keeps_graph", False):
        return
    stage_module.stage_backward_input = keep_graph_for_weight_grads(stage_module.stage_backward_input)


def pipeline_model(
    model: nn.Module,
    world_mesh,
    pdims,
    cfg,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parallelize: Callable[[nn.Module], nn.Module],
    n_microbatches: int,
):
    """Split `model` (on the meta device) into this pp rank's stages and build the schedule.

    Returns (schedule, model_parts, has_first_stage, has_last_stage). The parts are still on the meta device when
    `parallelize` returned them: the caller materialises (to_empty) and initialises them in place; the stages keep
    references to the same modules and infer the inter-stage shapes at the first step, so they need no real
    tensors now. loss_fn(last stage's output, labels_BS) must return the already-scaled loss (scale_grads=False):
    the output is the logits, or the summed token loss when the stages are given `labels` as a keyword input (the
    trainer does: components/step_loss.py). The
    settings are validated beforehand (validate_pipeline, from configs/checks.py).
    """
    # torch.distributed.pipelining imports torch._dynamo (~1 s): only pipeline-parallel runs pay for it.
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    p = cfg.parallelism
    schedule_name = canonical_schedule(p.pipeline_parallel_schedule)
    ranges = stage_layer_ranges(
        model.args.n_layers,
        model.args.layer_pattern,
        pdims.pp,
        schedule_name,
        p.pipeline_parallel_layers_per_stage,
        p.pipeline_parallel_split_points,
        p.pipeline_parallel_first_last_stage_weight,
        _head_weight(cfg, model.args),
    )
    num_stages = len(ranges)
    logger.info(
        f"pipeline: {schedule_name}, {num_stages} stages over pp {pdims.pp}, layers per stage "
        f"{[len(r) for r in ranges]}"
    )
    pp_mesh = world_mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    stage_ids = stage_ids_for_rank(pp_rank, pdims.pp, num_stages, schedule_name)

    tied_group = None
    if model.args.tie_embeddings:  # collective: every rank builds the groups of the two ranks holding copies
        last_stage_rank = next(
            r for r in range(pdims.pp) if num_stages - 1 in stage_ids_for_rank(r, pdims.pp, num_stages, schedule_name)
        )
        tied_group = build_tied_embedding_group(world_mesh, pdims.pp, sorted({0, last_stage_rank}))

    stages, parts = [], []
    for sid in stage_ids:
        part = build_stage_module(model, ranges[sid], sid == 0, sid == num_stages - 1, p.pipeline_parallel_pack)
        part = parallelize(part)
        if model.args.tie_embeddings and sid in (0, num_stages - 1):
            mark_tied_copy(part, tied_group)
        parts.append(part)
        stage = PipelineStage(part, sid, num_stages, device, group=pp_mesh.get_group())
        _leave_no_trace_of_metadata_inference(stage)
        _no_p2p_warmup_to_self(stage)
        stages.append(stage)

    if schedule_name in SPLIT_BACKWARD_SCHEDULES:
        _keep_graph_for_weight_grads_before_torch_2_13()
    cls = get_schedule_class(schedule_name)
    stage_or_stages = stages[0] if schedule_name in SINGLE_STAGE_SCHEDULES else stages
    schedule = cls(stage_or_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule, parts, 0 in stage_ids, num_stages - 1 in stage_ids
