"""One microbatch's forward + backward captured once as a CUDA graph and replayed for every microbatch.

Why: a Mamba-2 layer launches ~80 kernels per forward + backward (in_proj, conv, five SSD Triton kernels, gated
norm, out_proj, add + norm, and their backwards). On one H200 the 130M model at 4 x 2048 tokens keeps the GPU
busy for only 18% of a step; the rest is the host launching kernels (Python, Triton launchers), measured with
benchmarks/trace_summary.py (docs/performance.md). A replayed graph launches all of them with one call.

    graphed = GraphedMicrobatch(model, autocast_dtype, loss_chunk_tokens)     # nothing captured yet
    loss_sum = graphed(input_ids_BS, labels_BS, seq_idx_BS, loss_scale)       # capture on first call, then replay
    ...
    graphed.release()                                                         # before the process group goes

What a replay does equals the eager code: loss = model(...) (summed token loss), (loss * loss_scale).backward(),
gradients ADDED to the parameters' .grad, or on one GPU (overwrite_grads) WRITTEN there by a step's first microbatch,
as eager autograd writes into a .grad of None: a second graph, captured for that microbatch with the gradients
unset, whose backward assigns each one (the 1.3B on an H100: no zeroing of 5.2 GB of float32 gradients and no
read-add-write of them every step). Hence:
- every shape is fixed at capture (the microbatch's [rows, seq_len]); a different shape is an error;
- .grad tensors are the graph's outputs and must stay the same tensors: never set them to None; where they are
  added into, zero them with `optimizer.zero_grad(set_to_none=False)` (train.py does so; with overwrite_grads it
  does not zero at all);
- nothing in the forward may synchronise with the host or choose shapes from data. That holds for Mamba-2 and
  MLP layers; attention (document masks built from seq_idx) and MoE (data-dependent token counts) do not
  qualify, and train.py refuses them, with PP / CP, FSDP's CPU offload and compile, before any compute.
Plain data parallel works: its one gradient all-reduce runs after the replays (parallelisms/data_parallel.py).
FSDP2 works too, with its collectives inside the graph (HSDP's replica all-reduce is captured the same way;
tests/gpu/test_cuda_graph_gpu.py checks both against one GPU): the capture runs FSDP's hooks once, so the graph
holds the all-gathers of the weights (read from the sharded parameters, which the optimizer updates in place), the
forward and backward on the gathered weights, and the reduce-scatters that add each gradient's shard into the
sharded parameter's .grad (a DTensor whose local tensor stays the same; one reduce-scatter per microbatch, where
eager FSDP defers it to the last); the parameters FSDP leaves whole (parallelism.fsdp_replicate_params_below) get
their gradients as on one GPU, all-reduced after the replays. FSDP's Python bookkeeping runs only at capture,
which is what removes its host cost. A graph holding NCCL work must be released before the process group is
destroyed (`release()`; otherwise NCCL's teardown waits forever).
Capture runs a few warm-up passes first on a side stream (Triton autotuning, cuBLAS workspaces, .grad
allocation); their gradients are discarded, so the first step's gradients are exactly the eager ones.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from models.kernels import weight_copies

# Bytes each live graph's memory pool holds for its replays beyond what its live outputs occupy: the blocks its
# captured intermediates (activations, temporaries) use at every replay, which torch.cuda.memory_allocated stops
# counting once the capture ends (they are free blocks of a private pool). Keyed by id(GraphedMicrobatch).
_POOL_HIDDEN_BYTES: dict[int, int] = {}


def graph_pool_hidden_bytes() -> int:
    """Device bytes that live graphs use at replay and torch.cuda.memory_allocated does not count (see above):
    components/metrics.py adds them to the reported memory, else a graph run's figure would leave out its
    activations after the first step (session 50: a 1.3B graph run reported 48.9 GiB, the eager one 53.9)."""
    return sum(_POOL_HIDDEN_BYTES.values())


def _pool_hidden_bytes(pool) -> int:
    """Reserved minus allocated bytes of the graph memory pool `pool` (the allocator's segments of that pool)."""
    segments = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", ())) == tuple(pool)]
    return sum(seg["total_size"] - seg["allocated_size"] for seg in segments)


class GraphedMicrobatch:
    """Replays forward + backward of `model` for one microbatch of a fixed shape; see the module docstring."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None, loss_chunk_tokens: int, warmup: int = 3,
                 overwrite_grads: bool = False):  # fmt: skip
        """autocast_dtype: the dtype autocast runs the products in over float32 weights (one GPU, DDP), None for
        none (float32 training, or FSDP2, whose mixed precision casts the gathered weights itself).
        overwrite_grads (one GPU; not DDP's buffer views or FSDP's sharded gradients, which must be added into): a
        step's first microbatch replays a graph whose backward WRITES the gradients, as eager autograd does into
        a .grad of None, and only later microbatches replay one that adds into them; no zeroing between steps."""
        self.model, self.autocast_dtype, self.loss_chunk_tokens, self.warmup = (
            model,
            autocast_dtype,
            loss_chunk_tokens,
            warmup,
        )
        self.overwrite_grads = overwrite_grads
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Never traced by dynamo. Applied here, not as a decorator: the decorator imports torch._dynamo (~1 s)
        # when this module is imported, which every training process does.
        self._call_outside_compile = torch.compiler.disable(self._replay)
        # "write" (overwrite_grads: a step's first microbatch) and "add" graphs, each with its loss output; one
        # memory pool for both (they never run at the same time).
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.static_losses: dict[str, torch.Tensor] = {}
        self.static: dict[str, torch.Tensor | None] = {}
        self.copied: list[torch.Tensor] = []

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # The weight-cast cache would hold casts made during capture outside the graph's memory pool.
        return torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)

    def release(self) -> None:
        """Frees the graphs and their memory pool. Needed before the process group is destroyed when the graph holds
        collectives (FSDP2): NCCL's teardown otherwise waits on the captured work for ever (2 x H200, 2026-11-28)."""
        for graph in self.graphs.values():
            graph.reset()
        _POOL_HIDDEN_BYTES.pop(id(self), None)
        self.graphs, self.static_losses, self.static, self.copied = {}, {}, {}, []

    def _forward_backward(self) -> torch.Tensor:
        s = self.static
        with self._autocast():
            loss = self.model(
                s["input_ids"], seq_idx=s["seq_idx"], labels=s["labels"], loss_chunk_tokens=self.loss_chunk_tokens
            )
        (loss * s["loss_scale"]).backward()
        return loss.detach()

    def _copy_in(self, input_ids, labels, seq_idx, loss_scale) -> None:
        s = self.static
        if tuple(input_ids.shape) != tuple(s["input_ids"].shape) or (seq_idx is None) != (s["seq_idx"] is None):
            raise RuntimeError(
                f"training.cuda_graph: the graph was captured for microbatches of shape "
                f"{tuple(s['input_ids'].shape)} (seq_idx {'absent' if s['seq_idx'] is None else 'given'}), got "
                f"{tuple(input_ids.shape)} (seq_idx {'absent' if seq_idx is None else 'given'}); keep "
                "training.local_batch_size and training.seq_len fixed, or set training.cuda_graph false"
            )
        s["input_ids"].copy_(input_ids, non_blocking=True)
        s["labels"].copy_(labels, non_blocking=True)
        if seq_idx is not None:
            s["seq_idx"].copy_(seq_idx, non_blocking=True)
        s["loss_scale"].copy_(loss_scale)

    def _capture(self, kind: str, input_ids, labels, seq_idx, loss_scale) -> None:
        """Captures the "write" or "add" graph (see __init__) after a few eager warm-up passes."""
        if not self.static:
            self.static = {
                "input_ids": input_ids.clone(),
                "labels": labels.clone(),
                "seq_idx": None if seq_idx is None else seq_idx.clone(),
                "loss_scale": torch.as_tensor(loss_scale, dtype=torch.float32, device=input_ids.device).clone(),
            }
        self._copy_in(input_ids, labels, seq_idx, loss_scale)
        # The "add" graph's warm-up passes add into the gradients of the microbatches before it: kept aside here.
        stash = [None if p.grad is None else p.grad.clone() for p in self.params] if kind == "add" else []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._forward_backward()
        torch.cuda.current_stream().wait_stream(side)
        for p in self.params:
            if kind == "write":  # the backward assigns each gradient (in the graph's pool, at a fixed address)
                p.grad = None
            elif p.grad is None:  # the graph must ADD into an existing .grad, not allocate a new one
                p.grad = torch.zeros_like(p)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        # thread_local: CUDA calls of other threads (the loader's pinning, async checkpoint saves) may go on.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.static_losses[kind] = self._forward_backward()
        self.graphs[kind] = graph
        _POOL_HIDDEN_BYTES[id(self)] = _pool_hidden_bytes(graph.pool())
        if kind == "add":
            for p, saved in zip(self.params, stash):  # drop the warm-up passes' gradients
                if saved is None:
                    p.grad.zero_()
                else:
                    p.grad.copy_(saved)
        # The weights' 16-bit copies the graphs read (models/kernels/weight_copies.py: current ones are read under
        # capture, none is made there); _replay keeps them current.
        current = weight_copies.current_copies(self.params)
        self.copied = [p for p, copy in zip(self.params, current) if copy is not None]

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, seq_idx: torch.Tensor | None,
                 loss_scale: torch.Tensor, first: bool = False) -> torch.Tensor:  # fmt: skip
        """The microbatch's summed token loss (a new tensor); its scaled gradients are added to .grad, or written
        there when `first` (the step's first microbatch) under overwrite_grads."""
        return self._call_outside_compile(input_ids, labels, seq_idx, loss_scale, first)

    def _replay(self, input_ids, labels, seq_idx, loss_scale, first: bool) -> torch.Tensor:
        kind = "write" if first and self.overwrite_grads else "add"
        if kind not in self.graphs:
            self._capture(kind, input_ids, labels, seq_idx, loss_scale)
        self._copy_in(input_ids, labels, seq_idx, loss_scale)
        # Our AdamW updates the copies with the weights; a weight changed by anything else (a torch op) gets its
        # copy remade in place here, at the address the graph reads.
        dtype = weight_copies.copies_dtype()
        for p in self.copied:
            weight_copies.copy_of(p, dtype)
        self.graphs[kind].replay()
        return self.static_losses[kind].clone()
