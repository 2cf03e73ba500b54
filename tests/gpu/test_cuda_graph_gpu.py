"""training.cuda_graph on one GPU, under DDP and under FSDP2: the replayed forward + backward gives the eager losses
and gradient norms.

Packed multi-document rows (seq_idx reaches the kernels), two microbatches per step (the graph ADDS into .grad),
the chunked loss (its backward recomputes logits inside the graph), 6 optimizer steps so that the replay sees
updated weights. Same kernels in the same order: fp32 agrees to 1e-5 relative, bf16 to 1e-3 (autocast's weight
cache is off under capture, which changes nothing numerically; Triton autotuning may pick other configs in a
new process, so the two runs share one Triton autotuning cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.launch import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARGS = [
    "--job.config_file",
    "configs/debug.toml",
    "--training.steps",
    "6",
    "--training.seq_len",
    "512",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "4",
    "--training.loss_chunk_tokens",
    "1024",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "false",
    "--metrics.enable_tensorboard",
    "false",
]


def _train(args: list[str], folder: Path, nproc: int = 1) -> list[dict]:
    # one autotuning cache per test: eager and graph runs then use the same kernel configurations
    return train([*ARGS, *args], folder, nproc, autotune_cache=folder.parent / "triton")


@pytest.mark.parametrize("precision, rtol", [("float32", 1e-5), ("bfloat16", 1e-3)])
def test_graph_replay_matches_eager(tmp_path, precision, rtol):
    extra = ["--training.mixed_precision_param", precision]
    if precision == "float32":  # mamba_ssm's backward kernels then avoid atomic adds (run-to-run identical sums)
        extra += ["--training.deterministic", "true"]
    eager = _train(extra, tmp_path / "eager")
    graphed = _train(extra + ["--training.cuda_graph", "true"], tmp_path / "graph")
    assert [r["step"] for r in graphed] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        bad = [(a["step"], a[key], b[key]) for a, b in zip(eager, graphed) if abs(a[key] - b[key]) > rtol * abs(a[key])]
        assert not bad, f"{precision} {key} (step, eager, graph): {bad}"
    assert graphed[-1]["loss"] < graphed[0]["loss"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_graph_under_plain_data_parallel_matches_one_gpu(tmp_path):
    """DDP2 (data_parallel_replicate_degree 2): each rank replays its graph, then one all-reduce; fp32."""
    fp32 = ["--training.mixed_precision_param", "float32", "--training.deterministic", "true"]
    one = _train(fp32, tmp_path / "one")
    ddp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    got = _train(fp32 + ddp + ["--training.cuda_graph", "true"], tmp_path / "ddp2", nproc=2)
    bad = [(a["step"], a["loss"], b["loss"]) for a, b in zip(one, got) if abs(a["loss"] - b["loss"]) > 1e-4 * a["loss"]]
    assert len(got) == 6 and not bad, f"loss (step, 1 GPU, DDP2 + graph): {bad}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_graph_under_the_distributed_optimizer_matches_one_gpu(tmp_path):
    """DDP2 with parallelism.distributed_optimizer: each rank replays its graph into the padded gradient storage, the
    gradients are reduce-scattered, each rank updates its rows (our AdamW on the shards), the weights all-gathered
    in place (the graph reads them there); fp32, against one GPU."""
    fp32 = ["--training.mixed_precision_param", "float32", "--training.deterministic", "true"]
    one = _train(fp32, tmp_path / "one")
    dist_opt = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.distributed_optimizer",
        "true",
    ]
    got = _train(fp32 + dist_opt + ["--training.cuda_graph", "true"], tmp_path / "distopt2", nproc=2)
    bad = [(a["step"], a["loss"], b["loss"]) for a, b in zip(one, got) if abs(a["loss"] - b["loss"]) > 1e-4 * a["loss"]]
    assert len(got) == 6 and not bad, f"loss (step, 1 GPU, distributed optimizer + graph): {bad}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("units, global_rows", [("0", "8"), ("1", "16")])
def test_graph_under_fsdp2_matches_one_gpu(tmp_path, units, global_rows):
    """FSDP2 over 2 GPUs with its all-gathers and reduce-scatters captured in the graph: the blocks in the root's unit
    (the auto layout of a small model) or a unit per block (FSDP's prefetches captured too) with two microbatches per
    rank (each replay adds its reduce-scattered shard into .grad); the small parameters whole on every rank, their
    gradients all-reduced after the replays. fp32 against one GPU on the same global batch, and the validation losses
    of steps 3 and 6 on the same global validation batches (the second needs FSDP's units resharded after the first:
    graph steps run none of FSDP's Python); the run must also exit (a graph holding NCCL work is released before the
    process group, else the teardown hangs)."""
    fp32 = ["--training.mixed_precision_param", "float32", "--training.deterministic", "true"]
    rows = ["--training.global_batch_size", global_rows]
    val = ["--validation.enable", "true", "--validation.freq", "3", "--validation.steps", "2"]
    one = _train(fp32 + rows + val + ["--validation.local_batch_size", "4"], tmp_path / "one")
    fsdp = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.fsdp_blocks_per_unit", units]
    got = _train(fp32 + rows + val + ["--validation.local_batch_size", "2"] + fsdp + ["--training.cuda_graph", "true"],
                 tmp_path / "fsdp2", nproc=2)  # fmt: skip
    bad = [(a["step"], a["loss"], b["loss"]) for a, b in zip(one, got) if abs(a["loss"] - b["loss"]) > 1e-4 * a["loss"]]
    assert len(got) == 6 and not bad, f"loss (step, 1 GPU, FSDP2 + graph): {bad}"
    val_one, val_got = ({r["step"]: r["val_loss"] for r in rs if "val_loss" in r} for rs in (one, got))
    assert sorted(val_got) == sorted(val_one) == [3, 6], (val_one, val_got)
    bad = [(s, val_one[s], val_got[s]) for s in val_one if abs(val_one[s] - val_got[s]) > 1e-4 * val_one[s]]
    assert not bad, f"val_loss (step, 1 GPU, FSDP2 + graph): {bad}"


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_graph_under_hsdp_2x2_matches_one_gpu(tmp_path):
    """HSDP 2 x 2 (FSDP over 2 GPUs, replicated twice) with the graph: the captured backward reduce-scatters within a
    shard group and all-reduces the shards across the replicas; the small parameters' gradients are all-reduced over
    all four ranks after the replays. Two microbatches per rank, fp32, against one GPU on the same global batch."""
    fp32 = ["--training.mixed_precision_param", "float32", "--training.deterministic", "true"]
    rows = ["--training.global_batch_size", "32"]
    one = _train(fp32 + rows, tmp_path / "one")
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    got = _train(fp32 + rows + hsdp + ["--training.cuda_graph", "true"], tmp_path / "hsdp", nproc=4)
    bad = [(a["step"], a["loss"], b["loss"]) for a, b in zip(one, got) if abs(a["loss"] - b["loss"]) > 1e-4 * a["loss"]]
    assert len(got) == 6 and not bad, f"loss (step, 1 GPU, HSDP 2x2 + graph): {bad}"
