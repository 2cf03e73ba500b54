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


def test_graph_reads_the_weight_copies_kept_current_in_place():
    """Under bf16 autocast the graphs read the weights' bf16 copies (optimizer.weight_copies; our AdamW updates a
    weight and its copy together, leaving the weight's version as it was). A weight changed by a torch op between
    replays (its version bumped) gets its copy remade in place before the next replay: the replayed loss is the eager
    loss of the changed weights, not of the stale copy. The "write" graph (a step's first microbatch) assigns the
    gradients: a second replay leaves the eager gradient, not twice it."""
    from components.cuda_graph import GraphedMicrobatch
    from models import Mamba2LM, ModelArgs
    from models.init import init_weights
    from models.kernels import weight_copies

    args = ModelArgs(d_model=256, n_layers=2, d_state=64, headdim=64, chunk_size=64, vocab_size=512)
    model = Mamba2LM(args).cuda()
    init_weights(model, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids, labels = (torch.randint(0, 512, (2, 256), device="cuda", generator=gen) for _ in range(2))
    scale = torch.ones((), device="cuda")

    def eager():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    weight_copies.enable(torch.bfloat16)
    try:
        want, want_grads = eager()
        graphed = GraphedMicrobatch(model, torch.bfloat16, 0, overwrite_grads=True)
        got = graphed(ids, labels, None, scale, first=True)
        assert graphed.copied, "the graph reads no weight copy"
        got = graphed(ids, labels, None, scale, first=True)  # written again, not added
        assert abs(got - want) <= 1e-6 * abs(want), (got.item(), want.item())
        differ = [n for n, p in model.named_parameters()
                  if (p.grad - want_grads[n]).norm() > 1e-3 * want_grads[n].norm()]  # fmt: skip
        assert not differ, f"gradients of a second 'write' replay differ from the eager ones: {differ}"
        with torch.no_grad():  # a torch op: the weight's version moves, its copy (read by the tied lm_head) is stale
            model.lm_head.weight.mul_(1.5)
        grads = [p.grad for p in model.parameters()]
        got = graphed(ids, labels, None, scale, first=True)
        assert all(p.grad is g for p, g in zip(model.parameters(), grads)), "a replay replaced a .grad tensor"
        changed, _ = eager()
        assert abs(changed - want) > 1e-3 * abs(want), (
            "the change did not reach the loss",
            changed.item(),
            want.item(),
        )
        assert abs(got - changed) <= 1e-6 * abs(changed), (got.item(), changed.item(), want.item())
    finally:
        weight_copies.enable(None)


def test_the_memory_a_graph_uses_at_replay_is_counted():
    """A graph's intermediates live in its memory pool as free blocks once the capture ends, so torch's
    memory_allocated stops counting them though every replay uses them: _pool_hidden_bytes finds them (a 256 MiB
    temporary here), and metrics.memory_gib adds what live GraphedMicrobatch graphs hold that way."""
    from components import cuda_graph
    from components.metrics import memory_gib

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            temporary = torch.ones(64 * 2**20, device="cuda")  # 256 MiB of float32
            total = temporary.sum()
            del temporary
    graph.replay()
    assert total.item() == 64 * 2**20
    hidden = cuda_graph._pool_hidden_bytes(graph.pool())
    assert hidden >= 256 * 2**20, hidden
    cuda_graph._POOL_HIDDEN_BYTES[-1] = hidden  # as a live GraphedMicrobatch registers its pool
    try:
        want = (torch.cuda.memory_allocated() + hidden) / 2**30
        assert memory_gib(torch.device("cuda")) >= want - 1e-6
    finally:
        del cuda_graph._POOL_HIDDEN_BYTES[-1]


def test_graph_with_bf16_linear_gradients_matches_eager(tmp_path):
    """training.grad_dtype bfloat16 (one microbatch a step, so the graph's backward WRITES the bf16 gradients, as
    eager autograd does): the replayed steps give the eager losses and norms, bf16 tolerance."""
    extra = ["--training.mixed_precision_param", "bfloat16", "--training.grad_dtype", "bfloat16",
             "--training.local_batch_size", "8"]  # fmt: skip
    eager = _train(extra, tmp_path / "eager")
    graphed = _train(extra + ["--training.cuda_graph", "true"], tmp_path / "graph")
    assert [r["step"] for r in graphed] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        bad = [(a["step"], a[key], b[key]) for a, b in zip(eager, graphed) if abs(a[key] - b[key]) > 1e-3 * abs(a[key])]
        assert not bad, f"bf16 gradients {key} (step, eager, graph): {bad}"
    assert graphed[-1]["loss"] < graphed[0]["loss"]
