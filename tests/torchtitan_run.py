"""Run torchtitan's (0.2.2) own Trainer with the "mamba2" spec and report its losses, for the integration tests
(tests/test_torchtitan.py on the CPU, tests/gpu/test_torchtitan_gpu.py on GPUs).

Without CUDA the run goes to the CPU with gloo. torchtitan assumes an accelerator: it reads `device_type` /
`device_module` ("cuda" / torch.cuda when none is found) into module globals, asks the device for memory statistics
and names, and passes device ids to barriers. `use_cpu_device` points those globals at the CPU, stands in a memory
monitor that reports zeros and skips the timeout-lowering barrier; everything else (config, spec lookup, model build
on meta, parallelize / pipelining functions, init_weights, the training loop, loss scaling, FSDP / PP, checkpoints)
is torchtitan's unchanged code.

    python -m tests.torchtitan_run --job.config_file integrations/torchtitan/mamba2_debug.toml --training.steps 4
    python -m torch.distributed.run --nproc_per_node 2 -m tests.torchtitan_run ... \\
        --parallelism.pipeline_parallel_degree 2

Every rank prints one line "METRICS <rank> <json list>": {"loss", "grad_norm"} as torchtitan logged them at every step
(under pipeline parallel only the ranks holding the last stage know the loss; the others log -1).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def use_cpu_device() -> None:
    """Point every loaded torchtitan module's device globals at the CPU (call after importing torchtitan.train)."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    class ZeroMemoryMonitor:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = ZeroMemoryMonitor
    dist_utils.set_pg_timeouts = lambda **kwargs: None  # a barrier with device_ids=[<cuda index>]
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan"):
            if getattr(module, "device_type", None) == "cuda":
                module.device_type = "cpu"
            if getattr(module, "device_module", None) is torch.cuda:
                module.device_module = torch.cpu


def run(argv: list[str]) -> list[dict[str, float]]:
    """Train with torchtitan's Trainer on this process' rank; returns the loss and grad norm logged at every step."""
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from tests.dist_utils import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # several ranks share the CPU cores
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    import integrations.torchtitan  # noqa: F401  (registers "mamba2")

    if not torch.cuda.is_available():
        use_cpu_device()
    init_logger()
    records: list[dict[str, float]] = []
    log = MetricsProcessor.log

    def recording_log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        records.append({"loss": float(global_avg_loss), "grad_norm": float(grad_norm)})
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    MetricsProcessor.log = recording_log
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return records


if __name__ == "__main__":
    step_records = run(sys.argv[1:])
    print(f"METRICS {os.environ['RANK']} {json.dumps(step_records)}", flush=True)
