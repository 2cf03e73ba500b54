"""The torchtitan (0.2.2) integration on the CPU: the "mamba2" TrainSpec registers, builds and initialises the same
model as mambatitan, its loss, data and settings checks behave, and torchtitan's own Trainer trains it (one process;
FSDP and pipeline parallel over 2 gloo processes are the slow cases). Skipped when torchtitan is not installed
(pip install -e ".[torchtitan]", or the wheel). tests/gpu/test_torchtitan_gpu.py runs the trainer on GPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

import integrations.torchtitan as titan  # noqa: E402
from data.datasets import ListSource  # noqa: E402
from data.packing import DocumentPacker  # noqa: E402
from data.tokenizer import ByteTokenizer  # noqa: E402
from integrations.torchtitan.data import PackedRows, check_tokenizer_fits_flavor  # noqa: E402
from integrations.torchtitan.parallelize import parallelize_mamba2  # noqa: E402
from integrations.torchtitan.pipeline import pipeline_settings  # noqa: E402
from models import build_model_on_meta  # noqa: E402
from models.args import FLAVORS, build_model_args  # noqa: E402
from models.init import init_weights  # noqa: E402
from models.loss import cross_entropy_sum  # noqa: E402
from tests.dist_utils import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = "integrations/torchtitan/mamba2_debug.toml"
# A few fast steps of the debug flavor; fp32 everywhere so that layouts agree to rounding.
RUN_ARGS = [
    "--job.config_file",
    DEBUG_TOML,
    "--training.seq_len",
    "64",
    "--training.mixed_precision_param",
    "float32",
    "--lr_scheduler.warmup_steps",
    "1",
]


def test_spec_registers_every_flavor():
    spec = get_train_spec("mamba2")
    assert spec.model_cls is titan.TitanMamba2LM
    for name in FLAVORS:
        assert spec.model_args[name].d_model == build_model_args(name).d_model
    assert spec.model_args["debug"].tie_embeddings and not spec.model_args["debug_untied"].tie_embeddings
    titan.register()  # a second import / registration is harmless
    assert get_train_spec("mamba2") is spec


def _init_like_torchtitan(flavor: str, seed: int) -> torch.nn.Module:
    spec = get_train_spec("mamba2")
    args = spec.model_args[flavor]
    args.update_from_config(SimpleNamespace(debug=SimpleNamespace(seed=seed), model=SimpleNamespace(flavor=flavor)))
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


@pytest.mark.parametrize("flavor", ["debug", "hybrid_moe_debug"])
def test_init_weights_match_mambatitan(flavor):
    """torchtitan's build (meta, to_empty, init_weights(buffer_device)) gives mambatitan's weights, tie included."""
    got = _init_like_torchtitan(flavor, seed=3)
    ref = build_model_on_meta(build_model_args(flavor))
    ref.to_empty(device="cpu")
    ref.tie_weights()
    init_weights(ref, seed=3, init_std=ref.args.initializer_range)
    want = ref.state_dict()
    for name, value in got.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    if got.args.tie_embeddings:
        assert got.lm_head.weight is got.tok_embeddings.weight


def test_loss_matches_models_loss_and_torchtitan():
    logits_BSV = torch.randn(2, 5, 11)
    labels_BS = torch.randint(0, 11, (2, 5))
    labels_BS[0, 2] = labels_BS[1, 4] = IGNORE_INDEX
    loss_fn = get_train_spec("mamba2").build_loss_fn(SimpleNamespace(compile=SimpleNamespace(enable=False)))
    got = loss_fn(logits_BSV, labels_BS)
    torch.testing.assert_close(got, cross_entropy_sum(logits_BSV, labels_BS))
    torch.testing.assert_close(got, cross_entropy_loss(logits_BSV, labels_BS))


def _titan_settings(**parallelism):
    p = dict(
        module_fqns_per_model_part=None,
        pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1,
        pipeline_parallel_schedule_csv="",
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_layers_per_stage=None,
    )
    p.update(parallelism)
    return SimpleNamespace(
        parallelism=SimpleNamespace(**p),
        model=SimpleNamespace(flavor="debug", converters=[]),
        training=SimpleNamespace(enable_cpu_offload=False),
        activation_checkpoint=SimpleNamespace(mode="selective", selective_ac_option="op"),
    )


def test_unsupported_settings_are_refused_before_compute():
    dims = SimpleNamespace(tp=2, cp=1, ep=1, dp_replicate_enabled=False, fsdp_enabled=False)
    with torch.device("meta"):
        model = titan.TitanMamba2LM(get_train_spec("mamba2").model_args["debug"])
    with pytest.raises(ValueError) as e:
        parallelize_mamba2(model, dims, _titan_settings())
    assert "tensor_parallel_degree=2" in str(e.value) and "selective_ac_option='op'" in str(e.value)
    _, errs = pipeline_settings(
        _titan_settings(pipeline_parallel_last_stage_less_layers=2), get_train_spec("mamba2").model_args["debug"]
    )
    assert any("'debug_untied'" in e for e in errs) and any("last_stage_less_layers" in e for e in errs)


def test_tokenizer_must_fit_the_flavor():
    check_tokenizer_fits_flavor(258, "debug")  # the byte tokenizer and the debug vocabulary
    check_tokenizer_fits_flavor(50277, "130M")
    with pytest.raises(ValueError, match="flavor 'debug' embeds vocab_size=258"):
        check_tokenizer_fits_flavor(50277, "debug")
    with pytest.raises(ValueError, match="'debugmodel' is not a mamba2 flavor"):
        check_tokenizer_fits_flavor(258, "debugmodel")


def test_optimizer_step_balances_moe_experts():
    """The spec's optimizers run mambatitan's MoE bias update after each step (torchtitan's loop has no such step)."""
    from torchtitan.config import Optimizer as OptimizerConfig

    model = _init_like_torchtitan("hybrid_moe_debug", seed=0)
    no_mesh = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, pp_enabled=False)
    optimizers = get_train_spec("mamba2").build_optimizers_fn([model], OptimizerConfig(), no_mesh)
    moes = [m for m in model.modules() if hasattr(m, "expert_bias")]
    assert moes and all(not m.expert_bias.any() for m in moes)
    model(torch.randint(0, 258, (2, 32))).float().sum().backward()
    assert all(m.tokens_per_expert.sum() > 0 for m in moes)
    optimizers.step()
    assert all(m.expert_bias.any() and not m.tokens_per_expert.any() for m in moes)


def test_dataloader_workers_are_refused():
    cfg = SimpleNamespace(training=SimpleNamespace(dataloader=SimpleNamespace(num_workers=2)))
    with pytest.raises(ValueError, match="num_workers=2.*set it to 0"):
        get_train_spec("mamba2").build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=cfg)


def test_activation_checkpointing_wraps_every_nth_block():
    cfg = _titan_settings()
    cfg.activation_checkpoint.selective_ac_option = "2"
    cfg.compile = SimpleNamespace(enable=False)
    dims = SimpleNamespace(tp=1, cp=1, ep=1, dp_replicate_enabled=False, fsdp_enabled=False)
    with torch.device("meta"):
        model = titan.TitanMamba2LM(get_train_spec("mamba2").model_args["debug"])
    parallelize_mamba2(model, dims, cfg)
    wrapped = [name for name, block in model.layers.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == ["0", "2"]


def test_ranks_read_the_global_row_stream_and_resume():
    docs = ListSource([f"document {i} " * (i % 5 + 1) for i in range(40)])
    tok = ByteTokenizer()
    stream = DocumentPacker(docs, tok, 16)
    global_rows = [stream.next_row() for _ in range(8)]
    ranks = [iter(PackedRows(docs, tok, 16, r, 2, with_seq_idx=True)) for r in range(2)]
    for k, row in enumerate(global_rows):
        inputs, labels = next(ranks[k % 2])
        assert inputs["input"].tolist() == row["input_ids"].tolist() and labels.tolist() == row["labels"].tolist()
        assert inputs["seq_idx"].tolist() == row["seq_idx"].tolist()
    # Resume rank 1 from its saved position: the next row is global row 9.
    saved = PackedRows(docs, tok, 16, 1, 2, with_seq_idx=False)
    it = iter(saved)
    for _ in range(4):
        next(it)
    state = saved.state_dict()
    resumed = PackedRows(docs, tok, 16, 1, 2, with_seq_idx=False)
    resumed.load_state_dict(state)
    assert next(iter(resumed))[0]["input"].tolist() == next(it)[0]["input"].tolist()


def run_torchtitan(args: list[str], tmp_path: Path, nproc: int = 1) -> dict[int, dict[str, list[float]]]:
    """torchtitan's Trainer via tests/torchtitan_run.py (own processes: it sets process-wide state) ->
    {rank: {"loss": [per step], "grad_norm": [per step]}}."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    cmd += ["-m", "tests.torchtitan_run", *args, "--job.dump_folder", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    found = [line.split(" ", 2) for line in r.stdout.splitlines() if line.startswith("METRICS ")]
    by_rank = {int(rank): json.loads(records) for _, rank, records in found}
    return {
        rank: {key: [rec[key] for rec in records] for key in ("loss", "grad_norm")} for rank, records in by_rank.items()
    }


def test_torchtitan_trainer_trains_mamba2(tmp_path):
    losses = run_torchtitan(RUN_ARGS + ["--training.steps", "4", "--training.local_batch_size", "4"], tmp_path)[0][
        "loss"
    ]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_torchtitan_fsdp_matches_one_process(tmp_path):
    """FSDP over 2 gloo ranks (2 rows each) = one process (4 rows), losses and gradient norms: torchtitan divides by
    the global token count, so FSDP must sum the gradients (integrations/torchtitan/parallelize.py). The gradient
    norm is what shows it: clipping and AdamW hide a gradient scale from the losses."""
    steps = ["--training.steps", "3"]
    one = run_torchtitan(RUN_ARGS + steps + ["--training.local_batch_size", "4"], tmp_path / "one")[0]
    fsdp = run_torchtitan(RUN_ARGS + steps + ["--training.local_batch_size", "2"], tmp_path / "fsdp", nproc=2)
    for rank in (0, 1):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                torch.tensor(fsdp[rank][key]), torch.tensor(one[key]), rtol=1e-5, atol=0, msg=f"rank {rank} {key}"
            )


@pytest.mark.slow
def test_torchtitan_pipeline_trains(tmp_path):
    """PP over 2 gloo ranks (1F1B, 2 microbatches): the first step's loss is the one-process loss (same init, same
    data, mambatitan's stage split), and training goes on."""
    args = RUN_ARGS + ["--model.flavor", "debug_untied", "--training.local_batch_size", "4"]
    one = run_torchtitan(args + ["--training.steps", "1"], tmp_path / "one")[0]["loss"]
    pp = run_torchtitan(
        args + ["--training.steps", "4", "--parallelism.pipeline_parallel_degree", "2"], tmp_path / "pp", nproc=2
    )
    assert pp[0]["loss"] == [-1.0] * 4  # rank 0 holds the first stage only
    losses = pp[1]["loss"]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(one[0]), rtol=1e-5, atol=0)
    assert losses[-1] < losses[0], losses


def test_launcher_without_an_accelerator_says_so(monkeypatch):
    import torch._utils

    from integrations.torchtitan import train as launcher

    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: None)
    with pytest.raises(SystemExit, match="needs an accelerator .* python train.py"):
        launcher.main()


@pytest.mark.slow
def test_torchtitan_checkpoint_resumes_exactly(tmp_path):
    """torchtitan's checkpoint at step 2 (model, optimizer, lr schedule and PackedRows' data position) resumes to the
    same steps 3-4 as the uninterrupted run."""
    args = RUN_ARGS + [
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.no-last-save-model-only",
    ]
    straight = run_torchtitan(args, tmp_path)[0]
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    resumed = run_torchtitan(args, tmp_path)[0]
    for key in ("loss", "grad_norm"):
        assert resumed[key] == straight[key][2:], key
