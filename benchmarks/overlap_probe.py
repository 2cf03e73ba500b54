"""Does an all-to-all run under a cuBLAS product, or only beside it? NCCL's against a copy-engine peer copy (2 GPUs).

Context parallel's exposed time is its all-to-alls (docs/multi_gpu_sessions.md, session 30). Running one beside a
product (out_proj's weight gradient, ~0.4 ms at the 1.3B's 32k shape) did not shorten the step: NCCL moves data with a
kernel on SMs, and Hopper's cuBLAS products run persistent kernels that hold every SM. A peer copy through a
symmetric-memory buffer goes through the copy engines instead (what PyTorch's async tensor parallel uses). This times,
on two GPUs of one host, each alone and each beside the product, median of --repeats:

    product           [T, D]^T-shaped bf16 product, T = --tokens (out_proj's weight gradient: [D, T] @ [T, I])
    nccl              all_to_all_single of --mib MiB per rank
    nccl + product    the all-to-all launched first on NCCL's stream, the product then on the compute stream
    copy              cp 2's all-to-all as one peer copy each way (half of the buffer into the other rank's
                      symmetric buffer, copy_ on a side stream) and a barrier
    copy + product    the same beside the product

"overlap" = (alone + alone) / together: 2.0 when the transfer is hidden entirely, 1.0 when the two run one after the
other.

    bash .gpu/setup.sh && NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        torchrun --nproc_per_node 2 benchmarks/overlap_probe.py [--tokens 16384 --mib 128]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="T of the product (16k: 1.3B, 32k tokens, cp 2)")
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--d_inner", type=int, default=4096)
    ap.add_argument("--mib", type=float, default=128.0, help="all-to-all buffer per rank (y at 32k, cp 2: 128 MiB)")
    ap.add_argument("--repeats", type=int, default=20)
    return ap.parse_args(argv)


def timed(fn, repeats: int) -> float:
    """Median ms of fn() over `repeats`, each between events on the current stream (fn joins its side streams)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    a = parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"overlap_probe.py runs on 2 GPUs (cp 2's all-to-all as one copy each way); got {world}")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    import torch.distributed._symmetric_memory as symm_mem

    dout = torch.randn(a.tokens, a.d_model, dtype=torch.bfloat16, device="cuda")
    normed = torch.randn(a.tokens, a.d_inner, dtype=torch.bfloat16, device="cuda")
    numel = int(a.mib * 2**20) // 2 // world * world
    send = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    recv = torch.empty_like(send)
    half = numel // world
    group_name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous on some versions
        symm_mem.enable_symm_mem_for_group(group_name)
    buf = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, group_name)
    peer = 1 - rank
    remote = handle.get_buffer(peer, (numel,), torch.bfloat16)
    side = torch.cuda.Stream()

    def product():
        torch.mm(dout.t(), normed)

    def nccl():
        dist.all_to_all_single(recv, send)

    def nccl_product():
        work = dist.all_to_all_single(recv, send, async_op=True)
        product()
        work.wait()

    def copy(with_product: bool = False):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # block `peer` of our send goes to the peer's buffer at our slot; our own block stays (one local copy)
            remote[rank * half : (rank + 1) * half].copy_(send[peer * half : (peer + 1) * half])
            buf[rank * half : (rank + 1) * half].copy_(send[rank * half : (rank + 1) * half])
            handle.barrier(channel=0)  # both ranks' writes have landed
        if with_product:
            product()
        torch.cuda.current_stream().wait_stream(side)

    rows = {}
    for name, fn in [
        ("product", product),
        ("nccl", nccl),
        ("nccl + product", nccl_product),
        ("copy", copy),
        ("copy + product", lambda: copy(True)),
    ]:
        rows[name] = timed(fn, a.repeats)
    # the copy path delivers what all_to_all_single does
    nccl()
    copy()
    torch.cuda.synchronize()
    same = torch.equal(buf, recv)
    if rank == 0:
        gb = numel * 2 / world / 1e9  # bytes each rank sends to the other
        shapes = f"[{a.d_model} x {a.tokens}] @ [{a.tokens} x {a.d_inner}]"
        print(f"product {shapes} bf16; all-to-all {a.mib:g} MiB per rank")
        for name, ms in rows.items():
            extra = f"  {gb / ms * 1e3:.0f} GB/s to the peer" if name in ("nccl", "copy") else ""
            print(f"  {name:15s} {ms:7.3f} ms{extra}")
        for kind in ("nccl", "copy"):
            together = rows[f"{kind} + product"]
            print(f"  overlap {kind:5s} {(rows[kind] + rows['product']) / together:.2f} (2.0 hidden, 1.0 serial)")
        print(f"  copy path equals all_to_all_single: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
