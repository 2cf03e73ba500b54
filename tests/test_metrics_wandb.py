"""metrics.enable_wandb: the W&B run MetricsLogger starts and what it logs, against a stand-in wandb module
(the real one is optional and needs no network offline), and the config-time error when wandb is missing."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from components.metrics import MetricsLogger
from configs.parser import ConfigError, load_config


class _StandInRun:
    def __init__(self, calls: list):
        self.calls = calls

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", dict(data), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


class _ScalarRecorder:
    """In place of the TensorBoard SummaryWriter: what it was given."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def close(self):
        pass


@pytest.fixture
def stand_in_wandb(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _StandInRun(calls)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    return calls


def _config(tmp_path, *overrides: str):
    return load_config(
        [
            "--job.config_file",
            "configs/debug.toml",
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--metrics.enable_wandb",
            "true",
            *overrides,
        ]
    )


def test_rank0_logs_to_wandb_offline_what_tensorboard_gets(tmp_path, stand_in_wandb):
    cfg = _config(tmp_path)
    logger = MetricsLogger.from_config(cfg, is_rank0=True)
    ((name, kwargs),) = stand_in_wandb
    assert name == "init"
    assert kwargs == {
        "project": "mambatitan",
        "name": "run",
        "mode": "offline",
        "dir": str(tmp_path / "run"),
        "config": dataclasses.asdict(cfg),
    }
    logger.tb.close()
    logger.tb = _ScalarRecorder()
    base = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 10.0, "mfu": 0.0, "memory_gib": 0.5}
    logger.log(1, base)
    logger.log(2, {**base, "grad_norm": float("inf"), "skipped": True, "val_loss": 2.7, "note": "not a number"})
    logger.close()

    logged = [c for c in stand_in_wandb if c[0] == "log"]
    assert [step for _, _, step in logged] == [1, 2]
    assert logged[1][1] == {**base, "grad_norm": float("inf"), "skipped": True, "val_loss": 2.7}
    as_scalars = sorted((k, float(v), step) for _, data, step in logged for k, v in data.items())
    assert as_scalars == sorted((k, float(v), step) for k, v, step in logger.tb.scalars)
    assert stand_in_wandb[-1] == ("finish",)


def test_other_ranks_start_no_wandb_run(tmp_path, stand_in_wandb):
    logger = MetricsLogger.from_config(_config(tmp_path), is_rank0=False)
    logger.log(1, {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 10.0, "mfu": 0.0, "memory_gib": 0.5})
    logger.close()
    assert stand_in_wandb == []


@pytest.mark.parametrize(
    "setting, env, expected",
    [
        ("auto", {}, "offline"),
        ("auto", {"WANDB_API_KEY": "k"}, "online"),
        ("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),
        ("offline", {"WANDB_API_KEY": "k"}, "offline"),
        ("online", {}, "online"),
    ],
)
def test_wandb_mode(tmp_path, stand_in_wandb, monkeypatch, setting, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = _config(
        tmp_path,
        "--metrics.wandb_mode",
        setting,
        "--metrics.wandb_project",
        "p",
        "--metrics.wandb_run_name",
        "r",
        "--metrics.enable_tensorboard",
        "false",
    )
    MetricsLogger.from_config(cfg, is_rank0=True).close()
    kwargs = stand_in_wandb[0][1]
    assert (kwargs["mode"], kwargs["project"], kwargs["name"]) == (expected, "p", "r")


def test_enabling_wandb_without_the_package_fails_at_config_time(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, installed or not
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb needs the wandb package.*pip install wandb"):
        _config(tmp_path)
    metrics_cfg = _config(tmp_path, "--metrics.enable_wandb", "false").metrics  # off: wandb is never looked for
    metrics_cfg.enable_wandb = True  # a logger built without the config check still names the fix
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(str(tmp_path / "run"), True, False, False, 1, wandb_cfg=metrics_cfg)
