"""Config parsing: overrides, types, and errors that name the key and the fix."""

import subprocess
import sys

import pytest

from configs.parser import ConfigError, help_text, load_config


def test_toml_then_overrides_in_both_forms():
    cfg = load_config(
        [
            "--job.config_file",
            "configs/debug.toml",
            "--training.steps",
            "7",
            "--checkpoint.enable=true",
            "--model.d_model=64",
            "--optimizer.lr",
            "1e-3",
        ]
    )
    assert cfg.training.steps == 7 and cfg.checkpoint.enable is True and cfg.optimizer.lr == 1e-3
    assert cfg.model_overrides["d_model"] == 64 and cfg.job.config_file == "configs/debug.toml"
    assert cfg.training.seq_len == 256  # from the TOML


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--training.stepz", "3"], "training.stepz"),
        (["--trainin.steps", "3"], "[trainin]"),
        (["--training.steps", "three"], "--training.steps: 'three' is not a valid int"),
        (["--checkpoint.enable", "maybe"], "checkpoint.enable"),
        (["--model.headdim", "7"], "model.headdim=7 must divide"),
        (["--model.flavor", "9B"], "model.flavor='9B' is unknown"),
        (["--model.ssd_keep_conv_layers", "-2"], "model.ssd_keep_conv_layers=-2: give a number of layers >= 0"),
        (["--lr_scheduler.decay_type", "step"], "lr_scheduler.decay_type='step' is not allowed"),
        (["--training.seq_len", "0"], "training.seq_len=0 must be >= 1"),
        (["--training.max_norm", "nan"], "training.max_norm=nan must be a finite number >= 0 (0 disables clipping)"),
        (["--training.max_norm", "-1"], "training.max_norm=-1.0 must be a finite number >= 0"),
        (["--optimizer.lr", "-3e-4"], "optimizer.lr=-0.0003 must be a finite number > 0"),
        (["--optimizer.lr", "nan"], "optimizer.lr=nan must be a finite number > 0"),
        (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay=-0.1 must be a finite number >= 0"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2=1.0 must be in [0, 1)"),
        (["--optimizer.eps", "0"], "optimizer.eps=0.0 must be a finite number > 0"),
        (["--lr_scheduler.min_lr_factor", "inf"], "lr_scheduler.min_lr_factor=inf must be in [0, 1]"),
        (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps=-1 must be >= 0"),
        (["--training.gc_freq", "-1"], "training.gc_freq=-1 must be >= 0"),
        (["--job.config_file", "configs/nope.toml"], "no such file"),
        (["--training.steps"], "needs a value"),
        (["steps=3"], "unexpected argument"),
    ],
)
def test_errors_name_the_key(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert needle in str(e.value)


def test_unknown_key_in_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nstepss = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key training.stepss \(did you mean training.steps"):
        load_config(["--job.config_file", str(bad)])


def test_help_lists_every_key():
    text = help_text()
    for key in (
        "--parallelism.data_parallel_shard_degree",
        "--checkpoint.load_step",
        "--model.layer_pattern",
        "--training.global_batch_size",
        "--lr_scheduler.decay_ratio",
        "--compile.enable",
    ):
        assert key in text


def test_cpu_offload_without_gpu_is_refused(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "configs/debug.toml",
            "--parallelism.fsdp_cpu_offload",
            "true",
            "--job.dump_folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(__import__("os").environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode != 0 and "parallelism.fsdp_cpu_offload needs GPUs" in r.stderr


def test_train_py_fails_before_compute_with_the_fix(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "configs/debug.toml",
            "--training.global_batch_size",
            "12",
            "--training.local_batch_size",
            "8",
            "--job.dump_folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "training.local_batch_size=8" in r.stderr and "global_batch_size" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_run_train_sh_prints_a_config_error_once_before_any_worker(tmp_path):
    import os

    env = dict(os.environ, CONFIG_FILE="configs/debug.toml", NGPU="2", LOG_RANK="0,1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        ["./run_train.sh", "--training.global_batch_size", "7", "--job.dump_folder", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2 and out.count("config error: invalid job") == 1, out[-3000:]
    assert "e.g. --training.global_batch_size 6" in out
    assert "Traceback" not in out and "ChildFailedError" not in out and not (tmp_path / "run").exists()


def test_cuda_graph_refuses_what_it_cannot_capture():
    """Every reason is named before compute; the same checks pass for a one-GPU Mamba job (CUDA aside)."""
    from configs.checks import cuda_graph_errors
    from configs.parser import load_config
    from models import build_model_args
    from parallelisms.mesh import ParallelDims

    def errors(argv, world):
        cfg = load_config(["--job.config_file", "configs/debug.toml", "--training.cuda_graph", "true", *argv])
        return cuda_graph_errors(
            cfg,
            ParallelDims.from_config(cfg.parallelism, world),
            build_model_args(cfg.model.flavor, cfg.model_overrides),
        )

    cuda = ["training.cuda_graph needs a CUDA GPU"] if not __import__("torch").cuda.is_available() else []
    assert [e.split(";")[0] for e in errors([], 1)] == cuda
    msgs = " | ".join(errors(["--compile.enable", "true", "--model.flavor", "hybrid_moe_debug"], 2))
    assert "compile.enable are exclusive" in msgs and "['*', 'E']" in msgs
    layout = [e.split(";")[0] for e in errors([], 2)]  # FSDP2 over 2 processes: captured
    assert layout == cuda
    assert layout == [e.split(";")[0] for e in errors(["--parallelism.data_parallel_replicate_degree", "2"], 2)]
    pp = " | ".join(errors(["--parallelism.pipeline_parallel_degree", "2"], 2))
    cp = " | ".join(errors(["--parallelism.context_parallel_degree", "2"], 2))
    assert "pipeline_parallel_degree 2" in pp and "context_parallel_degree 2" in cp and "not captured" in cp
    offload = " | ".join(errors(["--parallelism.fsdp_cpu_offload", "true"], 2))
    assert "cannot capture parallelism.fsdp_cpu_offload" in offload


def test_distributed_optimizer_names_the_layout_and_optimizer_it_needs():
    """parallelism.distributed_optimizer shards plain data parallel's optimizer with the fused AdamW: any other
    layout or optimizer implementation is refused before compute, with the flags that fix it."""
    from configs.checks import distributed_optimizer_errors
    from configs.parser import load_config
    from parallelisms.mesh import ParallelDims

    def errors(argv, world):
        cfg = load_config(
            ["--job.config_file", "configs/debug.toml", "--parallelism.distributed_optimizer", "true", *argv]
        )
        return distributed_optimizer_errors(cfg, ParallelDims.from_config(cfg.parallelism, world))

    ddp2 = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    assert errors(ddp2, 2) == [] and errors([], 1) == []  # one process: nothing to shard, nothing to refuse
    (fsdp,) = errors([], 2)
    assert "dp_shard 2" in fsdp and "--parallelism.data_parallel_replicate_degree 2" in fsdp
    (impl,) = errors([*ddp2, "--optimizer.implementation", "foreach"], 2)
    assert "'foreach'" in impl and "auto, fused or triton" in impl


def test_grad_dtype_bfloat16_names_what_it_needs():
    """training.grad_dtype bfloat16 (components/gradient_dtype.py): one process, one microbatch, a fused AdamW (the
    CUDA graph captures it: tests/gpu/test_cuda_graph_gpu.py); each other case is refused before compute with its
    fix, and the debug job passes."""
    from configs.checks import grad_dtype_errors
    from configs.parser import load_config
    from parallelisms.batch_plan import BatchPlan
    from parallelisms.mesh import ParallelDims

    def errors(argv, world=1):
        cfg = load_config(["--job.config_file", "configs/debug.toml", "--training.grad_dtype", "bfloat16", *argv])
        pdims = ParallelDims.from_config(cfg.parallelism, world)
        return grad_dtype_errors(cfg, pdims, BatchPlan.from_config(cfg.training, cfg.parallelism, pdims))

    assert errors([]) == []
    (world,) = errors([], 2)
    assert "one process" in world and "this job has 2" in world and "--training.grad_dtype float32" in world
    (accum,) = errors(["--training.global_batch_size", "8", "--training.local_batch_size", "2"])
    assert "4 microbatches" in accum and "--training.local_batch_size -1" in accum
    (impl,) = errors(["--optimizer.implementation", "foreach"])
    assert "'foreach'" in impl and "auto, fused or triton" in impl
    assert errors(["--training.cuda_graph", "true"]) == []
    with pytest.raises(ConfigError, match="grad_dtype=.float16. is not allowed"):
        load_config(["--job.config_file", "configs/debug.toml", "--training.grad_dtype", "float16"])
