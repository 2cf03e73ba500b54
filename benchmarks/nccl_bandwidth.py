"""All-reduce / all-gather / reduce-scatter / all-to-all time and bus bandwidth between the GPUs of one host (explains
FSDP / CP scaling; 144 MiB is the 1.3B's CP all-to-all at 32k tokens on 2 GPUs).

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
    for mib in (0.25, 1, 8, 64, 144, 256):
        numel = int(mib * 2**20) // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        big = torch.empty(numel * world, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        for name, op, factor in (
            ("all_reduce", lambda: dist.all_reduce(x), 2 * (world - 1) / world),
            ("all_gather", lambda: dist.all_gather_into_tensor(big, x), world - 1),
            ("reduce_scatter", lambda: dist.reduce_scatter_tensor(x, big), world - 1),
            # context parallel's collective: each rank sends 1/world of x to every rank (nccl-tests' bus bandwidth)
            ("all_to_all", lambda: dist.all_to_all_single(y, x), (world - 1) / world),
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
