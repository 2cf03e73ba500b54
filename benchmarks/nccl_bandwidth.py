"""All-gather / all-reduce bus bandwidth between the GPUs of one host (explains FSDP / CP scaling).

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
    for mib in (8, 64, 256):
        numel = mib * 2**20 // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(numel * world, dtype=torch.bfloat16, device="cuda")
        for name, op in (("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(out, x))):
            for _ in range(3):
                op()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                op()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 10
            factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1)
            if rank == 0:
                print(f"{name:10s} {mib:4d} MiB/rank: {dt * 1e3:7.2f} ms, bus bandwidth {numel * 2 * factor / dt / 1e9:7.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
