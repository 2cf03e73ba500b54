"""The job configuration: one dataclass per TOML section, every field with a default and a doc.

Names follow torchtitan 0.2 where torchtitan has the same knob. `configs/parser.py` turns a TOML file
plus `--section.key value` overrides into a `JobConfig` and validates it before any compute.

The [model] section takes, beyond the fields of `Model` below, any field of `models.args.ModelArgs`
(d_model, n_layers, layer_pattern, ...): those override the chosen flavor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def doc(default: Any, text: str, choices: tuple | None = None):
    """A dataclass field with a default, a help text (shown by --help) and optional allowed values."""
    meta = {"doc": text}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = doc("", "The TOML job file this run was started from.")
    dump_folder: str = doc(
        "./outputs",
        "Run folder: metrics.jsonl, tb/ and (by default) checkpoints go here. "
        "One run at a time: rank 0 locks <dump_folder>/.lock until its process exits, and a "
        "second run into the folder stops at once, naming the first.",
    )
    description: str = doc("", "Free text, printed at start.")
    print_config: bool = doc(False, "Print the resolved configuration at start (rank 0).")


@dataclass
class Model:
    name: str = doc("mamba2", "Model family.", choices=("mamba2",))
    flavor: str = doc("debug", "Named size preset (models/args.py FLAVORS); [model] keys override its fields.")
    tokenizer_path: str = doc(
        "", "Empty: the built-in byte tokenizer (no files). Else a HF `tokenizers` tokenizer.json file or its folder."
    )
    kernels: str = doc(
        "auto",
        "auto: on CUDA our own Triton SSD kernels and fused mixer (models/kernels/ssd_triton; 0.84-0.87x "
        "mamba_ssm's GPU time, docs/performance.md) with causal_conv1d / mamba_ssm for the conv and the norms; "
        "on CPU the pure-PyTorch references; "
        "triton: as auto, but an error where our kernels cannot run; "
        "mamba_ssm: the mamba_ssm / causal_conv1d kernels for everything (auto before 2026-11-23), or an error; "
        "reference: the references everywhere (slow, for debugging).",
        choices=("auto", "triton", "mamba_ssm", "reference"),
    )


@dataclass
class Training:
    dataset: str = doc(
        "default",
        "default: the embedded offline corpus; a local file / folder / glob (.txt, .jsonl, .json, .parquet); "
        "or a HF hub dataset name (streamed, needs `datasets` and network).",
    )
    dataset_path: str = doc("", "For a HF hub dataset: optional data_dir / local copy passed to load_dataset.")
    dataset_config: str = doc("", "For a HF hub dataset: the config (subset) name.")
    dataset_split: str = doc("train", "Split of a HF hub dataset.")
    dataset_text_field: str = doc("text", "Field holding the document text in jsonl / parquet / HF rows.")
    datasets: list = doc(
        [],
        "A weighted mixture of token-shard folders (made by `python -m data.preprocess`), replacing "
        "training.dataset: in TOML one [[training.datasets]] table per dataset with `path` and `weight`; on the "
        'command line "path:weight,path:weight". Weights are relative shares of the training rows (tokens), '
        "realised by a fixed interleave pattern (data/mixture.py); each dataset repeats on its own epochs.",
    )
    shuffle: bool = doc(
        True,
        "Token-shard datasets (a folder from data.preprocess, or training.datasets): visit the documents of "
        "each epoch in a permutation seeded by (training.seed, dataset index, epoch); false: file order. Text "
        "datasets packed on the fly are read in file order unless training.shuffle_buffer is set.",
    )
    shuffle_buffer: int = doc(
        0,
        "Text datasets packed on the fly (local files or a streamed HF dataset): pass the documents through a "
        "shuffle buffer of this many documents, seeded by (training.seed, epoch); resuming re-reads (without "
        "tokenizing) the epoch's documents up to the position. 0: file order.",
    )
    prefetch_batches: int = doc(
        2,
        "Training batches built ahead in a background thread (checkpoints keep the position of the batches "
        "trained on, not of the prefetched ones); 0 builds each batch when the step asks for it.",
    )
    global_batch_size: int = doc(
        -1, "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree."
    )
    local_batch_size: int = doc(
        8,
        "Sequences per forward/backward on one data-parallel rank (the microbatch; global_batch_size / dp / "
        "local_batch_size steps of gradient accumulation); -1 = the rank's whole share (no accumulation).",
    )
    seq_len: int = doc(256, "Tokens per sequence (packed from several documents).")
    steps: int = doc(100, "Optimizer steps to train.")
    document_masking: bool = doc(
        True,
        "Documents packed into a row are independent: seq_idx resets the conv and SSM state and masks attention "
        "at each document start. false: the row is one stream (Megatron's default; faster kernels).",
    )
    loss_chunk_tokens: int = doc(
        0,
        "lm_head + cross-entropy over chunks of this many tokens so the full [tokens, vocab] logits never exist; "
        "0 = one pass. With model.kernels auto / triton on CUDA the loss is fused (gradients made in its forward, "
        "no float32 logits) and this only bounds its logits buffer; otherwise chunks are recomputed in backward. "
        "Pipeline stages compute the loss in one pass (the fused loss on CUDA).",
    )
    max_norm: float = doc(
        1.0, "Gradient clipping by global L2 norm over all shards (finite, >= 0); 0 disables clipping."
    )
    skip_nonfinite_grads: int = doc(
        0,
        "A step whose global gradient norm is NaN / inf (with a finite loss) stops the run before the optimizer "
        "step, like a non-finite loss, unless this is > 0: then up to this many such steps in a row are skipped "
        "(gradients dropped, no optimizer step; the step's batch is consumed and the LR schedule advances), and "
        "the next one stops the run.",
    )
    mixed_precision_param: str = doc(
        "bfloat16",
        "Compute dtype on GPU (autocast / FSDP param dtype). CPU always trains in float32.",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = doc(
        "float32",
        "dtype of FSDP / HSDP's gradient reduction over the data-parallel ranks (reduce-scatter, and all-reduce "
        "across replicas): float32 sums every rank's gradient exactly to float32; bfloat16 moves half the bytes "
        "(Megatron's --grad-reduce-in-bf16) at the price of each contribution rounded to bf16. Plain data parallel's "
        "flat-buffer all-reduce and single-process runs always reduce in the gradients' float32.",
        choices=("float32", "bfloat16"),
    )
    grad_dtype: str = doc(
        "float32",
        "dtype of the blocks' linear weights' gradients (in_proj, out_proj; attention and MLP): float32 from the "
        "products (more precise than torch autocast's), or bfloat16, the value autocast gives a float32 weight "
        "(mamba_ssm's own loop trains with it), which halves the bytes the gradient norm and AdamW read (1.3B on an "
        "H100: docs/performance.md). bfloat16 needs one process, one microbatch per step, optimizer.implementation "
        "auto / fused / triton (components/gradient_dtype.py); training.cuda_graph captures it.",
        choices=("float32", "bfloat16"),
    )
    seed: int = doc(42, "Seed for weight init and data order; initial weights do not depend on the layout.")
    deterministic: bool = doc(False, "Deterministic algorithms (and no TF32); slower on GPU.")
    cuda_graph: bool = doc(
        False,
        "Capture each microbatch's forward + backward once as a CUDA graph and replay it (no per-kernel "
        "launch cost; pays when the host, not the GPU, limits the step: on an H100 the 370M at 8 x 2048 runs "
        "129.5k against 110.2k tokens/s eager, the 1.3B at 4 x 4096 the same as eager, at the same memory). One GPU, "
        "plain data parallel, or FSDP2 / HSDP (their all-gathers and reduce-scatters captured in the graph; no "
        "fsdp_cpu_offload); not PP or CP; Mamba / MLP layers, no compile.",
    )
    gc_freq: int = doc(
        50,
        "Python's garbage collector runs only between steps (generation 0 every step, generation 1 every "
        "gc_freq steps), never inside one: an automatic collection mid-step stalls that rank's kernel launches, "
        "and under data / pipeline parallel every other rank waits for it at the next collective. 0: Python's "
        "automatic collection.",
    )


@dataclass
class Optimizer:
    name: str = doc("AdamW", "Optimizer.", choices=("AdamW",))
    lr: float = doc(8e-4, "Peak learning rate (finite, > 0).")
    beta1: float = doc(0.9, "Adam beta1, in [0, 1).")
    beta2: float = doc(0.95, "Adam beta2, in [0, 1).")
    eps: float = doc(1e-8, "Adam epsilon (finite, > 0).")
    weight_decay: float = doc(
        0.1, "Decoupled weight decay (finite, >= 0; not applied to biases, norms, A_log, D, dt_bias)."
    )
    implementation: str = doc(
        "auto",
        "auto: triton on CUDA (when triton imports), else fused. fused: torch's fused AdamW (only a fused update "
        "skips a non-finite step and clips on the device, so the host never waits for the gradient norm; foreach / "
        "for-loop read it on the host every step). triton (CUDA): fused AdamW's update, state and checkpoints in one "
        "Triton launch per parameter group (components/adamw_triton.py; 17.6 against 20.3 ms per 1.3B step, H100).",
        choices=("auto", "fused", "triton", "foreach", "for-loop"),
    )
    weight_copies: bool = doc(
        True,
        "With the triton implementation under bf16 autocast (one GPU, DDP without the distributed optimizer; also "
        "read by a training.cuda_graph): the optimizer also writes each float32 "
        "weight's bf16 copy as it updates it, and the products read the copy instead of casting the weight "
        "(models/kernels/weight_copies.py; 1.3B on an H100: 147 cast kernels, ~3.9 ms of a step, gone; +2 bytes per "
        "weight held for the run). False: cast at every use, as torch's autocast does.",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = doc(
        10, "Linear warmup: step i (0-based) of the first warmup_steps uses lr * (i+1) / (warmup_steps+1)."
    )
    decay_ratio: float = doc(
        -1.0,
        "Fraction of steps spent decaying at the end (warmup-stable-decay); -1 = decay over every step after warmup.",
    )
    decay_type: str = doc("cosine", "Shape of the decay.", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = doc(0.1, "The decay ends at lr * min_lr_factor, in [0, 1].")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = doc(
        1, "HSDP replicas (dp_replicate); the only degree > 1 (no shard / CP / PP): plain data parallel (DDP)."
    )
    data_parallel_shard_degree: int = doc(-1, "FSDP shard degree (dp_shard); -1 = whatever the others leave.")
    distributed_optimizer: bool = doc(
        False,
        "With plain data parallel (data_parallel_replicate_degree = NGPU and no other parallelism): the moments of "
        "AdamW sharded over the ranks, the gradients reduce-scattered and the weights all-gathered once per step "
        "(Megatron's distributed optimizer, ZeRO-2: parallelisms/distributed_optimizer.py). Nothing distributed runs "
        "inside forward / backward, so it composes with training.cuda_graph. For models whose weights and gradients "
        "fit whole on each GPU (<= ~1B); needs the fused AdamW (optimizer.implementation auto, fused or triton).",
    )
    fsdp_reshard_after_forward: str = doc(
        "default",
        "default: reshard except the last unit, and not at all under pipeline parallel or for a part whose gathered "
        "parameters take <= 2 GiB in param_dtype (parallelisms/fsdp.py: SMALL_PART_BYTES); always; never.",
        choices=("default", "always", "never"),
    )
    fsdp_cpu_offload: bool = doc(False, "Keep sharded parameters and optimizer state in CPU memory.")
    fsdp_blocks_per_unit: int = doc(
        0,
        "Consecutive blocks sharded as one FSDP unit: fewer, larger collectives and fewer hooks (less host time "
        "per step, which limits small models) for more gathered parameters in memory at once. -1: no unit of their "
        "own, the blocks are in the root's unit with the embedding and head (one pre-forward and one post-backward "
        "pass per step; torch 2.11 runs a grouped unit's post-backward once per block). 0 (auto): -1 when the part's "
        "gathered parameters take <= 2 GiB in param_dtype (the 370M on 2 H200s, in one process: 180 ms per step "
        "against 194 with its blocks one unit of their own; one GPU 167), else as many blocks as make about 100M "
        "parameters (the 1.3B's 26M-parameter blocks: 4 per unit, measured best on 2 H200s; blocks of 100M and "
        "more: 1).",
    )
    fsdp_replicate_params_below: int = doc(
        100_000,
        "Parameters of fewer elements (norm weights, the conv's weight and bias, dt_bias, A_log, D; never an "
        "nn.Linear's or nn.Embedding's, nor a routed expert's) are left out of FSDP: every rank holds them whole in "
        "float32 (as one GPU's autocast does), their gradients averaged over the dp_cp ranks by one all-reduce per "
        "step (DeepSpeed ZeRO-3's persistence threshold). FSDP2's host time grows with its number of parameters: "
        "337 of the 370M's 434 parameters, 0.2% of its elements. 0: FSDP shards every parameter. Ignored under "
        "fsdp_cpu_offload.",
    )
    context_parallel_degree: int = doc(1, "All-to-all context parallel degree (cp).")
    context_parallel_load_balance: bool = doc(
        False, "Shard the sequence as 2*cp chunks, rank r holding chunks r and 2cp-1-r (balances attention)."
    )
    context_parallel_overlap: bool = doc(
        True,
        "Mamba layers under CP: in_proj's all-to-all runs while the z half of in_proj is multiplied (and in the "
        "backward the inverse all-to-all while z's gradients are); false: each all-to-all is waited for at once "
        "(the same values; for measuring what the overlap gains: a product beside an all-to-all can slow both).",
    )
    pipeline_parallel_degree: int = doc(1, "Pipeline stages over ranks (pp).")
    pipeline_parallel_schedule: str = doc(
        "1F1B",
        "Pipeline schedule name from torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B, "
        "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble). The zero-bubble ones need torch >= 2.13 on GPUs.",
    )
    pipeline_parallel_microbatch_size: int = doc(1, "Sequences per pipeline microbatch.")
    pipeline_parallel_layers_per_stage: int = doc(
        -1, "Layers per virtual stage; -1 = one stage per rank (or two for interleaved schedules)."
    )
    pipeline_parallel_split_points: list = doc(
        [], "Explicit split: the first layer index of every stage but the first, e.g. [6, 12, 18]."
    )
    pipeline_parallel_first_last_stage_weight: float = doc(
        0.0,
        "The embedding / head stages count as this many layers more when splitting evenly (so they get fewer). 0: the "
        "embedding costs about nothing; the head has pipeline_parallel_head_weight (1 before 2026-11-28).",
    )
    pipeline_parallel_head_weight: float = doc(
        -1.0,
        "The last stage's LM head + loss count as this many layers more when splitting evenly; -1 = estimated from "
        "the FLOPs (6 x d_model x vocab against a layer's: ~3.7 at 1.3B with a 50k vocabulary). With -1 and the "
        "embedding at 0, PP2 at 1.3B gave 0.90 (1F1B, 26 / 22 layers) and 0.91 (Interleaved1F1B, 13 / 13 / 13 / 9) of "
        "one GPU against 0.87 / 0.85 with the old even split (docs/performance.md, 2 x H200, 2026-11-28).",
    )
    pipeline_parallel_pack: str = doc(
        "sum",
        "How hidden + residual travel between stages: stack (2 x [b,s,d]) or sum ([b,s,d], half the bytes).",
        choices=("stack", "sum"),
    )
    expert_parallel_degree: int = doc(1, "Expert parallel degree (ep); must divide dp_shard * cp.")


@dataclass
class Checkpoint:
    enable: bool = doc(False, "Save DCP checkpoints and resume from the latest complete one.")
    folder: str = doc("checkpoint", "Relative to job.dump_folder unless absolute; holds step-N/ folders.")
    interval: int = doc(500, "Save every this many steps (and at the last step).")
    keep_latest_k: int = doc(
        0,
        "Keep only the newest k complete step-N checkpoints (abandoned-step-N folders are "
        "never counted nor deleted); 0 keeps all.",
    )
    async_mode: str = doc(
        "disabled", "disabled or async (async_save; overlaps the write with training).", choices=("disabled", "async")
    )
    load_step: int = doc(
        -1,
        "Resume from step-N; -1 = the latest complete checkpoint, if any. A step older than "
        "the newest starts a new branch: the newer step-M folders become abandoned-step-M.",
    )
    initial_load_path: str = doc(
        "", "A DCP folder of model weights (e.g. from checkpoint.convert) to start from at step 0."
    )
    last_save_model_only: bool = doc(False, "At the last step, save only the model weights (an export).")
    export_dtype: str = doc("float32", "Dtype of a model-only export.", choices=("float32", "bfloat16"))
    checksums: bool = doc(
        True,
        "Write checksums.json (every file's size + CRC-32) into each step-N when saving, and verify it before "
        "loading (the work spread over ranks; about 3 GB/s per rank, see README 'Checkpoints'). A mismatch is an "
        "error naming the file; false skips both.",
    )
    allow_changed_data: bool = doc(
        False,
        "Resume although the checkpoint's run_record.json names other data: training.dataset, dataset_path, "
        "dataset_config, dataset_split, dataset_text_field, seq_len, document_masking or seed (logged as a warning). "
        "false: such a resume is an error listing the differences.",
    )
    allow_changed_tokenizer: bool = doc(
        False,
        "Resume although the checkpoint was trained with another tokenizer (vocabulary / special ids; logged "
        "as a warning). false: an error. A changed model is never loadable; optimizer.*, lr_scheduler.* and "
        "training.steps changes always apply from the first resumed step (logged).",
    )


@dataclass
class Metrics:
    log_freq: int = doc(1, "Log every this many steps.")
    enable_tensorboard: bool = doc(True, "TensorBoard events under <dump_folder>/tb.")
    save_jsonl: bool = doc(True, "Append one JSON object per logged step to <dump_folder>/metrics.jsonl.")
    enable_wandb: bool = doc(
        False,
        "Also log the TensorBoard scalars to Weights & Biases (rank 0; files under <dump_folder>/wandb). "
        "Needs `pip install wandb` (not a requirement: the run stops at config time if it is missing).",
    )
    wandb_project: str = doc("mambatitan", "With enable_wandb: the W&B project.")
    wandb_run_name: str = doc("", "With enable_wandb: the W&B run name; empty = the dump folder's name.")
    wandb_mode: str = doc(
        "auto",
        "With enable_wandb: offline writes <dump_folder>/wandb only (upload later with `wandb sync`); "
        "online streams to the server; auto = $WANDB_MODE if set, else online when $WANDB_API_KEY is set, else "
        "offline.",
        choices=("auto", "online", "offline"),
    )


@dataclass
class ActivationCheckpoint:
    mode: str = doc(
        "none",
        "none, full (every layer), or selective (every n-th layer, see selective_ac_option).",
        choices=("none", "full", "selective"),
    )
    selective_ac_option: str = doc("2", "With mode=selective: checkpoint every n-th layer, given as a number.")


@dataclass
class Compile:
    enable: bool = doc(False, "torch.compile each block.")


@dataclass
class Validation:
    enable: bool = doc(False, "Evaluate on a held-out dataset during training.")
    dataset: str = doc("default", "Same forms as training.dataset; default = the embedded corpus' held-out part.")
    dataset_split: str = doc("validation", "Split of a HF hub dataset.")
    freq: int = doc(50, "Validate every this many steps.")
    steps: int = doc(10, "Batches per validation (-1 = the whole dataset).")
    local_batch_size: int = doc(8, "Sequences per validation batch on one data-parallel rank.")


@dataclass
class Profiling:
    enable_profiling: bool = doc(
        False, "torch.profiler traces (Chrome / Perfetto JSON, one per rank) of the chosen steps."
    )
    save_traces_folder: str = doc(
        "profile_trace", "Relative to job.dump_folder (unless absolute): iteration_<step>/rank<r>_trace.json."
    )
    profile_freq: int = doc(100, "Profile every this many steps (steps divisible by it), unless profile_steps is set.")
    profile_steps: list = doc(
        [], "Explicit steps to profile / snapshot, e.g. [5, 6]; takes precedence over profile_freq."
    )
    enable_memory_snapshot: bool = doc(
        False,
        "CUDA only: record allocator history and dump a snapshot after each chosen step (and on OOM); "
        "view it at https://pytorch.org/memory_viz.",
    )
    save_memory_snapshot_folder: str = doc(
        "memory_snapshot",
        "Relative to job.dump_folder (unless absolute): iteration_<step>/rank<r>_memory_snapshot.pickle.",
    )
    memory_snapshot_max_entries: int = doc(100000, "Allocator events kept in the history ring buffer.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    # [model] keys that override the flavor's ModelArgs (filled by the parser).
    model_overrides: dict = field(default_factory=dict)
