"""What checkpoint.checksums costs: DCP save + load of a state of a given size, with and without checksums.

    python benchmarks/checkpoint_checksum.py --gb 2 --folder /tmp/ckpt_bench      # one process, CPU tensors

Saves a dict of fp32 tensors (64 MiB each) with DCP's FileSystemWriter and with checkpoint/integrity.py's
ChecksummingWriter, loads each back (the checksummed one after verify_checksums), and prints the times, the
extra seconds, the CRC-32 throughput and an extrapolation to the 1.3B model's checkpoint (1.34e9 params:
fp32 weights + AdamW's two fp32 moments = 16.1 GB; the hashing is linear in bytes and split over ranks).
The load right after the save reads from the page cache, as the hashing at save time does: on a cold
network file system the reads themselves cost more and the hash's share is smaller.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint.integrity import ChecksummingWriter, file_crc32, verify_checksums  # noqa: E402

PARAMS_1_3B = 1.34e9
BYTES_1_3B = PARAMS_1_3B * 4 * 3  # fp32 weights + exp_avg + exp_avg_sq (the step counters are negligible)


def make_state(gb: float) -> dict:
    per = 16 << 20  # 64 MiB fp32 tensors
    n = max(1, round(gb * 1e9 / (per * 4)))
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(per, generator=g) for i in range(n)}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (fp32 tensors)")
    p.add_argument("--folder", default="/tmp/checkpoint_checksum_bench", help="scratch folder (deleted after)")
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs per variant")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = make_state(args.gb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    results = {}
    try:
        for name, writer_cls, verify in (("plain", FileSystemWriter, False), ("checksums", ChecksummingWriter, True)):
            best_save = best_load = float("inf")
            for r in range(args.repeats):
                folder = os.path.join(args.folder, f"{name}{r}")
                shutil.rmtree(folder, ignore_errors=True)
                best_save = min(best_save, timed(lambda: dcp.save(state, storage_writer=writer_cls(folder))))

                def load():
                    if verify:
                        assert verify_checksums(folder)
                    dcp.load(target, storage_reader=FileSystemReader(folder))

                best_load = min(best_load, timed(load))
                shutil.rmtree(folder, ignore_errors=True)
            results[name] = (best_save, best_load)
        os.makedirs(args.folder, exist_ok=True)
        blob = os.path.join(args.folder, "blob")
        with open(blob, "wb") as f:
            for t in list(state.values())[:8]:
                f.write(t.numpy().tobytes())
        file_crc32(blob)  # warm the page cache
        blob_bytes = os.path.getsize(blob)
        crc_s = min(timed(lambda: file_crc32(blob)) for _ in range(3))
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    gbps = blob_bytes / crc_s / 1e9
    (ps, pl), (cs, cl) = results["plain"], results["checksums"]
    print(f"state {nbytes / 1e9:.2f} GB ({len(state)} fp32 tensors), one process, torch {torch.__version__}")
    print(f"save: plain {ps:.2f} s, with checksums {cs:.2f} s (+{cs - ps:.2f} s, +{100 * (cs / ps - 1):.0f}%)")
    print(f"load: plain {pl:.2f} s, verified {cl:.2f} s (+{cl - pl:.2f} s, +{100 * (cl / pl - 1):.0f}%)")
    print(f"crc32 of a cached file: {gbps:.2f} GB/s on one core")
    for ranks in (1, 8):
        share = BYTES_1_3B / ranks
        print(
            f"1.3B checkpoint ({BYTES_1_3B / 1e9:.1f} GB) over {ranks} rank(s): about "
            f"{share / (gbps * 1e9):.1f} s of hashing per rank at save and again at load (extrapolated)"
        )


if __name__ == "__main__":
    main()
