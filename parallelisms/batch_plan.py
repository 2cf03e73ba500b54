"""How one optimizer step's global batch divides over data-parallel ranks and microbatches.

Computed once from the config and the mesh (configs/checks.py validates it before any compute) and handed down:
the loader (data/loader.py build_loader) reads `rows_per_dp_rank` rows per step for each of the `dp_degree`
data-parallel ranks, the training step runs `n_microbatches` forward / backward passes of `microbatch_rows` rows
(gradient accumulation, or the pipeline schedule's microbatches).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    global_rows: int  # sequences per optimizer step over all ranks (training.global_batch_size)
    rows_per_dp_rank: int  # each data-parallel rank's share; the cp / pp ranks of a dp rank share it
    dp_degree: int  # data-parallel ranks (dp_replicate x dp_shard)
    microbatch_rows: int  # rows per forward / backward: the pipeline microbatch under PP, else local_batch_size
    n_microbatches: int  # rows_per_dp_rank / microbatch_rows
    pipeline: bool  # whether microbatch_rows is parallelism.pipeline_parallel_microbatch_size

    @classmethod
    def from_config(cls, training, parallelism, pdims) -> "BatchPlan":
        """-1 sizes follow the others: global = local x dp; local = the whole rank's share (no accumulation)."""
        local = training.local_batch_size
        if training.global_batch_size != -1:
            global_rows = training.global_batch_size
        else:
            global_rows = local * pdims.dp if local > 0 else 0
        rows = global_rows // pdims.dp
        micro = parallelism.pipeline_parallel_microbatch_size if pdims.pp_enabled else (rows if local == -1 else local)
        return cls(global_rows, rows, pdims.dp, micro, rows // micro if micro > 0 else 0, pdims.pp_enabled)

    def errors(self) -> list[str]:
        """Each way the batch does not divide, naming the key and a value that would work (empty when fine)."""
        dp = self.dp_degree
        key = "parallelism.pipeline_parallel_microbatch_size" if self.pipeline else "training.local_batch_size"
        if self.global_rows < 1:
            return [
                "training.global_batch_size and training.local_batch_size are both -1 (or not positive); set "
                "training.global_batch_size to the sequences per optimizer step"
            ]
        if self.global_rows % dp:
            fits = max(dp, self.global_rows // dp * dp)
            return [
                f"training.global_batch_size={self.global_rows} must divide by the data-parallel degree "
                f"dp_replicate x dp_shard = {dp}; e.g. --training.global_batch_size {fits}"
            ]
        if self.microbatch_rows < 1:
            return [f"{key}={self.microbatch_rows} must be >= 1"]
        if self.rows_per_dp_rank % self.microbatch_rows:
            fits = max(d for d in range(1, self.microbatch_rows + 1) if self.rows_per_dp_rank % d == 0)
            what = "pipeline microbatches" if self.pipeline else "gradient accumulation steps"
            return [
                f"training.global_batch_size / dp = {self.rows_per_dp_rank} rows per data-parallel rank must "
                f"divide by {key}={self.microbatch_rows} ({what}); e.g. --{key} {fits}"
            ]
        return []
