"""All-reduce / all-gather / reduce-scatter time and bus bandwidth between the GPUs of one host (explains FSDP / CP
scaling).

torchrun --nproc_per_node 4 benchmarks/nccl_bandwidth.py
"""

import os
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    for mib in (0.25, 1, 8, 64, 256):
        numel = int(mib * 2**20) // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        big = torch.empty(numel * world, dtype=torch.bfloat16, device="cuda")
        for name, op, factor in (
            ("all_reduce", lambda: dist.all_reduce(x), 2 * (world - 1) / world),
            ("all_gather", lambda: dist.all_gather_into_tensor(big, x), world - 1),
            ("reduce_scatter", lambda: dist.reduce_scatter_tensor(x, big), world - 1),
        ):
            for _ in range(5):
                op()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                op()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 20
            if rank == 0:
                print(
                    f"{name:14s} {mib:6.2f} MiB/rank: {dt * 1e3:7.3f} ms, bus bandwidth "
                    f"{numel * 2 * factor / dt / 1e9:7.1f} GB/s"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
