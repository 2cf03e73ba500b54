"""TOML job file + `--section.key value` overrides -> a validated JobConfig, before any compute.

python train.py --job.config_file configs/debug.toml --training.steps 40 --checkpoint.enable=true
python train.py --help            # every key, its type, default and doc
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from components.metrics import wandb_errors
from configs.job_config import JobConfig
from data.mixture import mixture_counts, parse_mixture
from models.args import FLAVORS, MODEL_ARG_NAMES, ModelArgs, build_model_args


class ConfigError(ValueError):
    """A bad job configuration; the message names the key and the fix."""


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig) if f.name != "model_overrides"}


def _field_map(cls: type) -> dict[str, tuple[type, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _known_keys(section: str) -> dict[str, tuple[type, dataclasses.Field]]:
    keys = _field_map(_sections()[section])
    if section == "model":
        keys.update(_field_map(ModelArgs))
    return keys


def _convert(value: Any, typ: type, key: str) -> Any:
    """Coerce a TOML value or a command-line string to the field's type, or fail naming the key."""
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
        if typ is list:
            if isinstance(value, str):
                value = [v for v in value.strip("[]").replace(" ", "").split(",") if v]
                return [int(v) if v.lstrip("-").isdigit() else v for v in value]
            if not isinstance(value, list):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"--{key}: {value!r} is not a valid {typ.__name__}") from None
    return value


def parse_cli(argv: list[str]) -> dict[str, str]:
    """['--a.b', 'v', '--c.d=w'] -> {'a.b': 'v', 'c.d': 'w'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value (booleans: {arg} true / false)")
            k, v = arg[2:], argv[i + 1]
            i += 2
        out[k] = v
    return out


def _apply(cfg: JobConfig, key: str, raw: Any, origin: str) -> None:
    if "." not in key:
        raise ConfigError(f"{origin}: '{key}' is not of the form section.key; see --help")
    section, name = key.split(".", 1)
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section [{section}]; sections are {', '.join(sections)}")
    known = _known_keys(section)
    if name not in known:
        close = [k for k in known if k.startswith(name[:4])][:3]
        hint = f" (did you mean {', '.join(section + '.' + c for c in close)}?)" if close else ""
        raise ConfigError(f"{origin}: unknown key {section}.{name}{hint}; `python train.py --help` lists every key")
    typ, fld = known[name]
    value = _convert(raw, typ, f"{section}.{name}")
    choices = fld.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not allowed; choose one of {list(choices)}")
    if section == "model" and name in MODEL_ARG_NAMES:
        cfg.model_overrides[name] = value
    else:
        setattr(getattr(cfg, section), name, value)


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Read --job.config_file (if given), then apply the other overrides in order; validate."""
    cli = parse_cli(list(sys.argv[1:] if argv is None else argv))
    cfg = JobConfig()
    path = cli.pop("job.config_file", None)
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"--job.config_file {path}: no such file (configs/ holds the job files)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
            for name, value in table.items():
                _apply(cfg, f"{section}.{name}", value, path)
        cfg.job.config_file = path
    for key, value in cli.items():
        _apply(cfg, key, value, "command line")
    validate(cfg)
    return cfg


def load_config_or_exit(argv: list[str] | None = None, usage: str = "", prog: str = "train.py") -> JobConfig | None:
    """The command-line entry of train.py / evaluate.py: --help prints `usage` and every key (returns None);
    no --job.config_file prints how to pass one and exits 2 (never a run of the built-in defaults); a bad config
    exits with its message before anything else happens."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print((usage + "\n" if usage else "") + help_text())
        return None
    if not any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in argv):
        print(no_config_usage(prog), file=sys.stderr)
        sys.exit(2)
    try:
        return load_config(argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group (the mesh checks the world-size products)."""
    errs: list[str] = []
    if cfg.model.flavor not in FLAVORS:
        errs.append(f"model.flavor={cfg.model.flavor!r} is unknown; choose one of {sorted(FLAVORS)}")
    else:
        errs += build_model_args(cfg.model.flavor, cfg.model_overrides).validate()
    t = cfg.training
    for key, v in (
        ("training.steps", t.steps),
        ("training.seq_len", t.seq_len),
        ("metrics.log_freq", cfg.metrics.log_freq),
        ("checkpoint.interval", cfg.checkpoint.interval),
    ):
        if v < 1:
            errs.append(f"{key}={v} must be >= 1")
    if t.local_batch_size != -1 and t.local_batch_size < 1:
        errs.append(f"training.local_batch_size={t.local_batch_size} must be >= 1, or -1 (= the rows per rank)")
    if t.global_batch_size == -1 and t.local_batch_size == -1:
        errs.append("training.global_batch_size and training.local_batch_size are both -1; set one of them")
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        errs.append(f"training.global_batch_size={t.global_batch_size} must be >= 1, or -1 (= local x DP degree)")
    errs += _data_errors(t)
    if cfg.lr_scheduler.warmup_steps < 0:
        errs.append(f"lr_scheduler.warmup_steps={cfg.lr_scheduler.warmup_steps} must be >= 0")
    if t.gc_freq < 0:
        errs.append(
            f"training.gc_freq={t.gc_freq} must be >= 0 (N: collect between steps every N steps; 0: Python's "
            "automatic collection)"
        )
    errs += _number_errors(cfg)
    if not (cfg.lr_scheduler.decay_ratio == -1 or 0.0 <= cfg.lr_scheduler.decay_ratio <= 1.0):
        errs.append(f"lr_scheduler.decay_ratio={cfg.lr_scheduler.decay_ratio} must be in [0, 1] or -1")
    if cfg.checkpoint.keep_latest_k < 0:
        errs.append("checkpoint.keep_latest_k must be >= 0 (0 keeps all)")
    if cfg.activation_checkpoint.mode == "selective" and not cfg.activation_checkpoint.selective_ac_option.isdigit():
        errs.append(
            "activation_checkpoint.selective_ac_option must be a positive integer (checkpoint every n-th layer)"
        )
    p = cfg.parallelism
    for key in (
        "data_parallel_replicate_degree",
        "context_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
        "pipeline_parallel_microbatch_size",
    ):
        if getattr(p, key) < 1:
            errs.append(f"parallelism.{key}={getattr(p, key)} must be >= 1")
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        errs.append("parallelism.data_parallel_shard_degree must be >= 1, or -1 (the rest of the world)")
    errs += wandb_errors(cfg.metrics)
    if errs:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))


def _data_errors(t) -> list[str]:
    """training.datasets entries and weights, prefetch depth, shuffle buffer (the folders themselves are opened by
    the loader)."""
    errs = []
    if t.prefetch_batches < 0:
        errs.append(f"training.prefetch_batches={t.prefetch_batches} must be >= 0 (0 = no prefetching)")
    if t.shuffle_buffer < 0:
        errs.append(f"training.shuffle_buffer={t.shuffle_buffer} must be >= 0 (0 = file order)")
    if t.datasets:
        if t.dataset != "default":
            errs.append(
                f"training.dataset='{t.dataset}' and training.datasets are both set: the mixture replaces "
                "the single dataset; keep one (a one-entry training.datasets is a single shard folder)"
            )
        try:
            mixture_counts([w for _, w in parse_mixture(t.datasets)])
        except ValueError as e:
            errs.append(str(e))
    return errs


def _number_errors(cfg: JobConfig) -> list[str]:
    """Float keys outside the range where they mean something (NaN fails every range)."""
    o, sched = cfg.optimizer, cfg.lr_scheduler

    def positive(v):
        return math.isfinite(v) and v > 0

    def non_negative(v):
        return math.isfinite(v) and v >= 0

    checks = (
        ("optimizer.lr", o.lr, positive, "a finite number > 0"),
        ("optimizer.eps", o.eps, positive, "a finite number > 0"),
        ("optimizer.weight_decay", o.weight_decay, non_negative, "a finite number >= 0 (0 = no decay)"),
        ("optimizer.beta1", o.beta1, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("optimizer.beta2", o.beta2, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("training.max_norm", cfg.training.max_norm, non_negative, "a finite number >= 0 (0 disables clipping)"),
        ("lr_scheduler.min_lr_factor", sched.min_lr_factor, lambda v: 0 <= v <= 1, "in [0, 1]"),
    )
    return [f"{key}={v} must be {valid}" for key, v, ok, valid in checks if not ok(v)]


def no_config_usage(prog: str = "train.py") -> str:
    """What to type when no --job.config_file was given: the form, an example, the job files in configs/."""
    configs = os.path.dirname(os.path.abspath(__file__))
    jobs = sorted(name for name in os.listdir(configs) if name.endswith(".toml"))
    return (
        f"usage: python {prog} --job.config_file FILE [--section.key value | --section.key=value ...]\n"
        f"no --job.config_file given: every run starts from a job file, e.g.\n"
        f"    python {prog} --job.config_file configs/debug.toml        # a tiny Mamba-2, seconds on a CPU\n"
        f"job files in configs/: {', '.join(jobs)}\n"
        f"`python {prog} --help` lists every key."
    )


def help_text() -> str:
    lines = ["usage: python train.py --job.config_file FILE [--section.key value | --section.key=value ...]", ""]
    for section, cls in _sections().items():
        lines.append(f"[{section}]")
        keys = _field_map(cls)
        if section == "model":
            keys.update(_field_map(ModelArgs))
        for name, (typ, fld) in keys.items():
            default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
            choices = fld.metadata.get("choices")
            extra = f" {{{'|'.join(map(str, choices))}}}" if choices else ""
            lines.append(f"  --{section}.{name} ({typ.__name__}, default {default!r}){extra}")
            lines.append(f"      {fld.metadata.get('doc', '')}")
        lines.append("")
    lines.append("[model] keys below `kernels` override the chosen flavor (models/args.py FLAVORS).")
    return "\n".join(lines)


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
