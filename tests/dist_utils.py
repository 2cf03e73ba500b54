"""Run a function in N CPU processes joined by a gloo process group (for unit tests of collectives).

    def body(rank, world_size, x):            # runs in every process, after init_process_group
        ...
        return something_picklable             # collected per rank
    results = run_distributed(body, 4, x)      # list indexed by rank; an exception in any rank re-raises here

For whole-trainer parity runs use tests/parity.py (it launches train.py through torchrun).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class FakeGroup:
    """A process group's size() and rank() alone: for code that only reads them (no collective runs)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; the queue's own pickler would share their storage through a
        # file descriptor that dies with this process, racing the parent's unpickling.
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            try:  # after a first error, give the other ranks a moment to report theirs (often the root cause)
                rank, status, payload = queue.get(timeout=10 if errors else timeout)
            except queue_module.Empty:
                break
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
            else:
                results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
