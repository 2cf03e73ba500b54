"""The DeviceMesh: pp, dp_replicate, dp_shard, cp (outermost first), and the flattened views the trainer uses.

    world = pp * dp_replicate * dp_shard * cp
    "dp"          = dp_replicate x dp_shard         data loading: each dp rank reads a disjoint slice of the batch
    "dp_shard_cp" = dp_shard x cp                   FSDP shards parameters over it
    "dp_cp"       = dp_replicate x dp_shard x cp    the loss and gradients are averaged over it
EP borrows its ranks from dp_shard x cp (ep divides dp_shard * cp), as torchtitan does: see `ep_mesh`.
All four dimensions always exist (size 1 included) so code never branches on which are present.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from configs.job_config import Parallelism
from configs.parser import ConfigError


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, p: Parallelism, world_size: int) -> "ParallelDims":
        """Resolve -1 and check every product before any process group or compute exists."""
        fixed = p.pipeline_parallel_degree * p.data_parallel_replicate_degree * p.context_parallel_degree
        dp_shard = p.data_parallel_shard_degree
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"world size {world_size} is not divisible by pipeline_parallel_degree x "
                    f"data_parallel_replicate_degree x context_parallel_degree = {fixed}; change those degrees or NGPU"
                )
            dp_shard = world_size // fixed
        dims = cls(
            p.pipeline_parallel_degree,
            p.data_parallel_replicate_degree,
            dp_shard,
            p.context_parallel_degree,
            p.expert_parallel_degree,
            world_size,
        )
        if dims.pp * dims.dp_replicate * dims.dp_shard * dims.cp != world_size:
            raise ConfigError(
                f"parallelism degrees pp={dims.pp} x dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} "
                f"x cp={dims.cp} = {dims.pp * dims.dp_replicate * dims.dp_shard * dims.cp} != world size "
                f"{world_size}; set parallelism.data_parallel_shard_degree -1 or match NGPU"
            )
        if (dims.dp_shard * dims.cp) % dims.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree={dims.ep} must divide data_parallel_shard_degree x "
                f"context_parallel_degree = {dims.dp_shard * dims.cp} (EP borrows those ranks)"
            )
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def ddp_enabled(self) -> bool:
        """dp_replicate is the only parallelism: plain data parallel (parallelisms/data_parallel.py), as in
        torchtitan. Under PP, dp_replicate stays FSDP's replica dimension (HSDP with shard 1)."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1 and self.pp == 1

    @property
    def fsdp_enabled(self) -> bool:
        return (self.dp_shard * self.cp > 1 or self.dp_replicate > 1) and not self.ddp_enabled

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The 4-D world mesh with its flattened views; None for a single process."""
        if self.world_size == 1:
            return None
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp"),
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self._device_type = device_type
        return mesh

    @cached_property
    def ep_mesh(self) -> DeviceMesh:
        """(pp, dp_replicate, efsdp, ep): dp_shard x cp re-cut so that ep is innermost.

        Experts are split over "ep" and FSDP-sharded over ("dp_replicate", "efsdp") replicas; the rank order is
        the world mesh's, so an ep group is ep consecutive ranks of one dp_shard x cp group.
        """
        efsdp = self.dp_shard * self.cp // self.ep
        return init_device_mesh(
            self._device_type,
            (self.pp, self.dp_replicate, efsdp, self.ep),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"),
        )


def coords(mesh: DeviceMesh | None, dim: str) -> tuple[int, int]:
    """(rank within `dim`, size of `dim`); (0, 1) without a mesh."""
    if mesh is None:
        return 0, 1
    sub = mesh[dim]
    return sub.get_local_rank(), sub.size()


def group(mesh: DeviceMesh | None, dim: str):
    return None if mesh is None else mesh[dim].get_group()
