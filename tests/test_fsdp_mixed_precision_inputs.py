"""FSDP2 under bf16 parameters (parallelisms/fsdp.py): the blocks receive the float32 residual stream
(model.residual_in_fp32) as one GPU's autocast run does, not rounded to bf16 at each FSDP unit's entry."""

from __future__ import annotations

import torch

from configs.job_config import Parallelism
from parallelisms.mesh import ParallelDims
from tests.dist_utils import run_distributed


def _block_input_dtypes(rank, world_size):
    from models import build_model_args, build_model_on_meta
    from models.init import init_weights
    from parallelisms.fsdp import apply_fsdp

    dims = ParallelDims.from_config(Parallelism(data_parallel_shard_degree=world_size), world_size)
    args = build_model_args("debug", {"n_layers": 4, "d_model": 32, "headdim": 16, "d_state": 8, "chunk_size": 8})
    model = build_model_on_meta(args)
    apply_fsdp(model, dims.build_mesh("cpu"), Parallelism(fsdp_blocks_per_unit=2), torch.bfloat16, pdims=dims)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    seen = []
    for layer in model.layers.values():  # after FSDP's own pre-hooks (prepended): the inputs the block computes on
        layer.register_forward_pre_hook(lambda _m, a: seen.append([None if t is None else str(t.dtype) for t in a[:2]]))
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = model(tokens, labels=tokens)
    loss.float().backward()
    return seen


def test_blocks_keep_the_float32_residual_under_bf16_fsdp():
    for seen in run_distributed(_block_input_dtypes, 2):
        # block 0: the bf16 embedding, no residual yet; then the bf16 mixer output and the float32 residual, in
        # every block, including the first block of the second unit (block 2)
        assert seen == [["torch.bfloat16", None]] + [["torch.bfloat16", "torch.float32"]] * 3, seen


def test_small_parts_keep_their_gathered_parameters_by_default():
    """fsdp_reshard_after_forward "default": a part whose gathered parameters fit SMALL_PART_BYTES (the 370M) keeps
    them from forward to backward; the 1.3B reshards every unit but the last; always / never override both."""
    from models import build_model_args, build_model_on_meta
    from parallelisms.fsdp import SMALL_PART_BYTES, gathered_bytes, unit_reshards

    small = {f: gathered_bytes(build_model_on_meta(build_model_args(f)), torch.bfloat16) <= SMALL_PART_BYTES
             for f in ("370M", "1.3B")}  # fmt: skip
    assert small == {"370M": True, "1.3B": False}
    assert [unit_reshards("default", i, 4, False, small["370M"]) for i in range(4)] == [False] * 4
    assert [unit_reshards("default", i, 4, False, small["1.3B"]) for i in range(4)] == [True, True, True, False]
    assert [unit_reshards("default", i, 4, True, False) for i in range(4)] == [False] * 4  # pipeline parallel
    assert unit_reshards("always", 3, 4, True, True) and not unit_reshards("never", 0, 4, False, False)
