"""slurm/: the generated srun + torchrun + train.py command for 1 and 4 nodes (rendezvous on the first host, node
and GPU counts, config and overrides passed through intact, a run folder stable across requeues), the host-list
parser, clear errors; and slurm/train.sbatch itself, run with stand-in `srun` / `scontrol` executables: it parses,
launches exactly the command launch.py builds, requeues on USR1 and still returns srun's exit code."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm.launch import build_command, expand_nodelist, main, run_folder, spec_from

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "slurm" / "train.sbatch"
TRICKY = ["--training.dataset", "/data/my corpus/*.parquet", "--job.description", 'it\'s "quoted" $HOME; ls']


def _env(nodes: int, **extra) -> dict[str, str]:
    nodelist = "gpu017" if nodes == 1 else f"gpu[017-{16 + nodes:03d}]"
    return {
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NAME": "m2-370m",
        "SLURM_JOB_ID": "4242",
        "GPUS_PER_NODE": "8",
        "CONFIG_FILE": "configs/mamba2_370m.toml",
        "PATH": "/nonexistent",
        **extra,
    }  # no scontrol on PATH: the host-list parser answers


def _flag(cmd: list[str], name: str) -> str:
    (hit,) = [a for a in cmd if a.startswith(name + "=")]
    return hit.split("=", 1)[1]


def _train_args(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("train.py") + 1 :]


@pytest.mark.parametrize("nodes", [1, 4])
def test_command(nodes):
    spec, dry = spec_from(["--python", "python3", "--", *TRICKY], _env(nodes))
    cmd = build_command(spec)
    assert not dry and cmd[0] == "srun"
    srun = cmd[: cmd.index("python3")]
    assert _flag(srun, "--nodes") == _flag(srun, "--ntasks") == str(nodes) and "--ntasks-per-node=1" in srun
    torchrun = cmd[cmd.index("python3") : cmd.index("train.py")]
    assert torchrun[:3] == ["python3", "-m", "torch.distributed.run"]
    assert _flag(torchrun, "--nnodes") == str(nodes) and _flag(torchrun, "--nproc_per_node") == "8"
    assert _flag(torchrun, "--rdzv_backend") == "c10d"
    assert _flag(torchrun, "--rdzv_endpoint") == "gpu017:29500"  # the first host of the allocation
    assert _flag(torchrun, "--rdzv_id") == "4242"
    from torch.distributed.run import get_args_parser  # torchrun itself accepts every flag

    parsed = get_args_parser().parse_args(torchrun[3:] + cmd[cmd.index("train.py") :])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_endpoint) == (str(nodes), "8", "gpu017:29500")
    assert parsed.training_script == "train.py" and parsed.training_script_args == _train_args(cmd)
    assert _train_args(cmd) == [
        "--job.config_file",
        "configs/mamba2_370m.toml",
        "--job.dump_folder",
        "outputs/m2-370m",
        "--checkpoint.enable",
        "true",
        *TRICKY,
    ]
    assert shlex.split(shlex.join(cmd)) == cmd  # the printed form quotes spaces, quotes, $ and ; safely


def test_arguments_override_environment():
    spec, dry = spec_from(
        [
            "--dry_run",
            "--nodes",
            "2",
            "--gpus_per_node",
            "4",
            "--head_node",
            "10.0.0.5",
            "--port",
            "29600",
            "--config",
            "configs/debug.toml",
            "--cpus_per_task",
            "64",
            "--checkpoint_root",
            "/fast/ckpt",
            "--python",
            "py",
            "--training.steps",
            "7",
            "--",
            "--optimizer.lr",
            "1e-4",
        ],
        _env(4),
    )
    cmd = build_command(spec)
    assert dry and "--cpus-per-task=64" in cmd and _flag(cmd, "--nnodes") == "2"
    assert _flag(cmd, "--nproc_per_node") == "4" and _flag(cmd, "--rdzv_endpoint") == "10.0.0.5:29600"
    # options train.py understands, before or after `--`, pass through in order after ours
    assert _train_args(cmd) == [
        "--job.config_file",
        "configs/debug.toml",
        "--job.dump_folder",
        "outputs/m2-370m",
        "--checkpoint.enable",
        "true",
        "--checkpoint.folder",
        "/fast/ckpt/m2-370m",
        "--training.steps",
        "7",
        "--optimizer.lr",
        "1e-4",
    ]


def test_run_folder_stable_across_requeues():
    first = build_command(spec_from(["--python", "p"], _env(4, SLURM_RESTART_COUNT="0"))[0])
    requeued = build_command(spec_from(["--python", "p"], _env(4, SLURM_RESTART_COUNT="3"))[0])
    assert first == requeued
    # a resubmission under the same name (new job id) uses the same run folder; another name does not
    resubmitted = build_command(spec_from(["--python", "p"], _env(4, SLURM_JOB_ID="5000"))[0])
    assert _train_args(resubmitted) == _train_args(first)
    other = build_command(spec_from(["--python", "p"], _env(4, SLURM_JOB_NAME="m2-other"))[0])
    assert "outputs/m2-other" in other and run_folder("/o", "n") == "/o/n"


def test_expand_nodelist():
    assert expand_nodelist("gpu[001-003,7],login1") == ["gpu001", "gpu002", "gpu003", "gpu7", "login1"]
    assert expand_nodelist("a[9-11]-ib,b1") == ["a9-ib", "a10-ib", "a11-ib", "b1"]
    assert expand_nodelist("node5") == ["node5"]


@pytest.mark.parametrize(
    "argv,env_drop,env_set,msg",
    [
        ([], ["SLURM_NNODES"], {}, "missing --nodes"),
        ([], [], {"GPUS_PER_NODE": "0"}, "gpus_per_node=0 must be >= 1"),
        ([], [], {"SLURM_JOB_NAME": "a/b"}, "job name 'a/b'"),
        ([], ["SLURM_JOB_NODELIST"], {}, "pass --head_node"),
    ],
)
def test_errors(argv, env_drop, env_set, msg):
    env = {k: v for k, v in _env(2, **env_set).items() if k not in env_drop}
    with pytest.raises(ValueError, match=msg):
        spec_from(argv, env)
    with pytest.raises(SystemExit, match=msg):
        main(argv, env)


def test_sbatch_parses():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_DIR/srun_args"
echo "$NCCL_NVLS_ENABLE $TORCH_NCCL_ASYNC_ERROR_HANDLING" > "$FAKE_DIR/srun_env"
for _ in $(seq 200); do [ -z "${FAKE_SRUN_HOLD:-}" ] || [ -f "$FAKE_DIR/release" ] && break; sleep 0.05; done
exit "${FAKE_SRUN_RC:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo hostA; echo hostB; echo hostC; exit 0; fi
echo "$*" >> "$FAKE_DIR/scontrol_log"
"""


def _fake_cluster(tmp_path: Path, **extra) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_", "SLURM_"))}
    return dict(
        base,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_DIR=str(tmp_path),
        PYTHON=sys.executable,
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_NNODES="3",
        SLURM_JOB_NODELIST="host[A-C]",
        SLURM_JOB_ID="77",
        SLURM_JOB_NAME="sb-test",
        SLURM_GPUS_ON_NODE="4",
        SLURM_CPUS_ON_NODE="32",
        CONFIG_FILE="configs/debug.toml",
        OUTPUT_ROOT=str(tmp_path / "out"),
        **extra,
    )


def test_sbatch_launches_the_built_command(tmp_path):
    env = _fake_cluster(tmp_path, FAKE_SRUN_RC="0")
    r = subprocess.run(
        ["bash", str(SBATCH), *TRICKY], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = (tmp_path / "srun_args").read_bytes().decode().split("\0")[:-1]
    expected = build_command(spec_from(["--", *TRICKY], env)[0])  # the stand-in scontrol names hostA first
    assert ["srun", *got] == expected
    assert _flag(expected, "--rdzv_endpoint") == "hostA:29500" and "--cpus-per-task=32" in expected
    assert _flag(expected, "--nproc_per_node") == "4" and _train_args(expected)[-len(TRICKY) :] == TRICKY
    assert (tmp_path / "srun_env").read_text().split() == ["0", "1"]  # NVLS off, async error handling on
    assert (tmp_path / "out" / "sb-test").is_dir()


def test_sbatch_requeues_on_usr1(tmp_path):
    env = _fake_cluster(tmp_path, FAKE_SRUN_HOLD="1", FAKE_SRUN_RC="3")
    proc = subprocess.Popen(
        ["bash", str(SBATCH)], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 30
        while not (tmp_path / "srun_args").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "srun_args").exists(), "srun never started"
        os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 does: the batch shell only
        while not (tmp_path / "scontrol_log").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "scontrol_log").read_text().split() == ["requeue", "77"]
        assert proc.poll() is None  # the script keeps waiting for srun after the trap
        (tmp_path / "release").touch()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out  # srun's exit code
    assert "requeueing job 77" in out and "srun exited with 3" in out


def test_generated_torchrun_trains_and_requeue_resumes(tmp_path):
    """The torchrun part of a 1-node command, run here (CPU, 2 gloo ranks, rendezvous on localhost): it trains,
    and the same launch again (what a requeue does) resumes from the run folder's newest checkpoint."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    argv = [
        "--nodes",
        "1",
        "--gpus_per_node",
        "2",
        "--head_node",
        "localhost",
        "--port",
        port,
        "--job_name",
        "t",
        "--job_id",
        "9",
        "--config",
        "configs/debug.toml",
        "--output_root",
        str(tmp_path),
        "--python",
        sys.executable,
        "--",
        "--metrics.enable_tensorboard",
        "false",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--checkpoint.interval",
        "2",
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for steps in (2, 4):  # the first attempt "ends" after step 2's checkpoint
        cmd = build_command(spec_from([*argv, "--training.steps", str(steps)], {})[0])
        r = subprocess.run(
            cmd[cmd.index(sys.executable) :], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from step 2" in r.stdout
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoint").iterdir()) == ["step-2", "step-4"]
    assert list((tmp_path / "t" / "logs").glob("9_*/attempt_0/1/stdout.log"))  # every rank's output kept
