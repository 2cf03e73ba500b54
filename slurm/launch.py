"""Build (and run) the multi-node launch: one srun task per node, each a torchrun that starts GPUS_PER_NODE ranks.

    python3 slurm/launch.py --config configs/mamba2_1.3b.toml -- --training.steps 20000    # inside an allocation
    python3 slurm/launch.py --dry_run --nodes 4 --gpus_per_node 8 --head_node gpu001 --job_name m2 --job_id 7 \
        --config configs/mamba2_1.3b.toml -- --training.steps 20000                        # print it, anywhere

slurm/train.sbatch calls it. Every value comes from an argument or, failing that, from the Slurm environment
(SLURM_NNODES, SLURM_JOB_NODELIST, SLURM_JOB_NAME, SLURM_JOB_ID, SLURM_CPUS_ON_NODE) or the sbatch script's
variables (CONFIG_FILE, GPUS_PER_NODE, OUTPUT_ROOT, CHECKPOINT_ROOT, MASTER_PORT, HEAD_NODE). Everything after `--`
goes to train.py unchanged (after ours, so it can override them).

What the command guarantees:
- rendezvous: torchrun's c10d backend on the first host of the allocation (`scontrol show hostnames`), port
  MASTER_PORT (29500); rdzv_id = the job id, which Slurm keeps across requeues. The node ranks are assigned by
  the rendezvous, so the same command runs on every node.
- a run folder per job NAME, not per job id or attempt: <OUTPUT_ROOT>/<job name>. A requeued or resubmitted job
  of the same name finds its checkpoints there and train.py resumes from the newest complete one.
- checkpoint.enable true (periodic saves are what a preempted job resumes from); checkpoints under the run folder,
  or under <CHECKPOINT_ROOT>/<job name> when CHECKPOINT_ROOT is set (e.g. a faster file system).
- every rank's stdout / stderr in <run folder>/logs (torchrun --log-dir); the console (the sbatch log) shows each
  node's local rank 0, prefixed by srun's node label.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_PORT = 29500


@dataclass
class LaunchSpec:
    nodes: int
    gpus_per_node: int
    head_node: str
    config_file: str
    job_name: str
    job_id: str
    output_root: str = "outputs"
    checkpoint_root: str = ""
    port: int = DEFAULT_PORT
    cpus_per_task: int = 0  # 0: let srun decide
    python: str = "python3"
    overrides: list[str] = field(default_factory=list)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names, e.g. 'gpu[001-003,7],login1' -> gpu001 gpu002 gpu003 gpu7 login1.

    The fallback for machines without `scontrol`; covers the forms Slurm writes (one bracket group per name)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def first_host(nodelist: str, search_path: str | None = None) -> str:
    """The allocation's first host name: `scontrol show hostnames` where Slurm is installed (looked up in
    search_path, default $PATH), else our parser."""
    scontrol = shutil.which("scontrol", path=search_path)
    if scontrol:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        hosts = out.stdout.split()
    else:
        hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names no host; pass --head_node")
    return hosts[0]


def run_folder(output_root: str, job_name: str) -> str:
    """One folder per job name: stable across requeues (same name, same id) and resubmissions (same name)."""
    return os.path.join(output_root, job_name)


def build_command(spec: LaunchSpec) -> list[str]:
    """The srun + torchrun + train.py argument list (no shell in between: arguments arrive exactly as given)."""
    dump = run_folder(spec.output_root, spec.job_name)
    srun = [
        "srun",
        f"--nodes={spec.nodes}",
        f"--ntasks={spec.nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--label",
    ]
    if spec.cpus_per_task:
        # one task per node starts all its GPUs' ranks: it needs the node's cores, not srun's default of one
        srun.append(f"--cpus-per-task={spec.cpus_per_task}")
    torchrun = [
        spec.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.nodes}",
        f"--nproc_per_node={spec.gpus_per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={spec.head_node}:{spec.port}",
        f"--rdzv_id={spec.job_id}",
        "--max_restarts=0",  # a failed rank fails the job; Slurm's requeue (not torchrun) restarts it
        f"--log_dir={os.path.join(dump, 'logs')}",
        "--tee=3",
        "--local-ranks-filter=0",
    ]
    train = [
        "train.py",
        "--job.config_file",
        spec.config_file,
        "--job.dump_folder",
        dump,
        "--checkpoint.enable",
        "true",
    ]
    if spec.checkpoint_root:
        train += ["--checkpoint.folder", os.path.join(spec.checkpoint_root, spec.job_name)]
    return srun + torchrun + train + list(spec.overrides)


def _int(value, name: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{name}={n} must be >= 1")
    return n


def spec_from(argv: list[str], env: Mapping[str, str]) -> tuple[LaunchSpec, bool]:
    """Arguments first, then the environment; returns the spec and whether this is a dry run."""
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--nodes", default=env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"))
    ap.add_argument("--gpus_per_node", default=env.get("GPUS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE"))
    ap.add_argument(
        "--head_node",
        default=env.get("HEAD_NODE", ""),
        help="rendezvous host (default: the first host of SLURM_JOB_NODELIST)",
    )
    ap.add_argument("--config", default=env.get("CONFIG_FILE"), help="the TOML job file")
    ap.add_argument("--job_name", default=env.get("SLURM_JOB_NAME"))
    ap.add_argument("--job_id", default=env.get("SLURM_JOB_ID"))
    ap.add_argument("--output_root", default=env.get("OUTPUT_ROOT", "outputs"))
    ap.add_argument("--checkpoint_root", default=env.get("CHECKPOINT_ROOT", ""))
    ap.add_argument("--port", default=env.get("MASTER_PORT", str(DEFAULT_PORT)))
    ap.add_argument("--cpus_per_task", default=env.get("SLURM_CPUS_ON_NODE", "0"))
    ap.add_argument("--python", default=env.get("PYTHON") or sys.executable)
    ap.add_argument("--dry_run", action="store_true", help="print the command instead of running it")
    a, unknown = ap.parse_known_args(argv)
    overrides = unknown + overrides  # train.py options given before `--` pass through too
    missing = [
        f"--{k} (or {v})"
        for k, v in (
            ("nodes", "SLURM_NNODES"),
            ("gpus_per_node", "GPUS_PER_NODE"),
            ("config", "CONFIG_FILE"),
            ("job_name", "SLURM_JOB_NAME"),
            ("job_id", "SLURM_JOB_ID"),
        )
        if not getattr(a, k)
    ]
    if missing:
        raise ValueError("missing " + ", ".join(missing) + "; inside an allocation Slurm sets the SLURM_* ones")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", a.job_name):
        raise ValueError(f"job name {a.job_name!r} names the run folder: use letters, digits, '.', '_' and '-'")
    head = a.head_node
    if not head:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError("no rendezvous host: pass --head_node (or run inside an allocation: SLURM_JOB_NODELIST)")
        head = first_host(nodelist, env.get("PATH"))
    cpus = int(a.cpus_per_task) if str(a.cpus_per_task).isdigit() else 0
    spec = LaunchSpec(
        nodes=_int(a.nodes, "nodes"),
        gpus_per_node=_int(a.gpus_per_node, "gpus_per_node"),
        head_node=head,
        config_file=a.config,
        job_name=a.job_name,
        job_id=str(a.job_id),
        output_root=a.output_root,
        checkpoint_root=a.checkpoint_root,
        port=_int(a.port, "port"),
        cpus_per_task=cpus,
        python=a.python,
        overrides=overrides,
    )
    return spec, a.dry_run


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> None:
    try:
        spec, dry_run = spec_from(list(sys.argv[1:] if argv is None else argv), os.environ if env is None else env)
    except ValueError as e:
        sys.exit(f"slurm/launch.py: {e}")
    if not os.path.isfile(spec.config_file) and not dry_run:
        sys.exit(f"slurm/launch.py: config {spec.config_file} not found; run from the repository root")
    cmd = build_command(spec)
    print(shlex.join(cmd), flush=True)
    if dry_run:
        return
    os.makedirs(run_folder(spec.output_root, spec.job_name), exist_ok=True)
    os.execvp(cmd[0], cmd)  # srun replaces this process: the sbatch script's `wait` and signals reach it


if __name__ == "__main__":
    main()
