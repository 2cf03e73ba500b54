"""CheckpointManager / export: exact restore, atomic folders, retention, layouts (FSDP2 / one process / stages)."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from checkpoint import CheckpointManager, complete_steps, load_model_weights
from checkpoint.export import main as export_main
from configs.job_config import Checkpoint
from tests.dist_utils import run_distributed

D = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Toy(nn.Module):
    """Layers in a ModuleDict keyed "0".."n-1" (stages delete entries, FQNs stay), plus an optional head."""

    def __init__(self, n_layers: int = 4, keep: set[int] | None = None, head: bool = True, d: int = D):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(d, d) for i in range(n_layers)})
        self.head = nn.Linear(d, 1) if head else None
        for name in list(self.layers):
            if keep is not None and int(name) not in keep:
                del self.layers[name]

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x) if self.head is not None else x


class ToyLoader:
    """Stateful toy data: batch `pos` is a pure function of (seed, pos)."""

    def __init__(self, seed: int = 0):
        self.seed, self.pos = seed, 0

    def next_batch(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.pos)
        self.pos += 1
        return torch.randn(4, D, generator=g), torch.randn(4, 1, generator=g)

    def state_dict(self):
        return {"seed": self.seed, "pos": self.pos}

    def load_state_dict(self, sd):
        self.seed, self.pos = sd["seed"], sd["pos"]


def make_optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def build(seed: int, **kw):
    torch.manual_seed(seed)
    model = Toy(**kw)
    return (model, *make_optim(model))


def train_step(model, opt, sched, loader, rank: int = 0, world: int = 1) -> float:
    x, y = loader.next_batch()
    x, y = x[rank::world], y[rank::world]
    x = x + 0.1 * torch.randn_like(x)  # draws from the global RNG: a resume must restore it
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.item()


def cfg(**kw) -> Checkpoint:
    return Checkpoint(**{"enable": True, "interval": 2, **kw})


def snapshot(model, opt=None) -> dict:
    """Full (gathered under FSDP) FQN-keyed model and flattened optimizer state, cloned."""
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    out = {f"model.{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=full).items()}
    if opt is not None:
        for k, v in get_optimizer_state_dict(model, opt, options=full).items():
            out[f"optim.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


def assert_same(got: dict, want: dict, keys=None):
    """Exact equality of every key of want (or of the given keys); with no keys given, the same key sets."""
    if keys is None:
        assert sorted(got) == sorted(want)
        keys = sorted(want)
    assert keys and set(keys) <= set(got), sorted(set(keys) - set(got))[:5]
    for k in keys:
        a, b = got[k], want[k]
        if torch.is_tensor(b):
            assert torch.equal(a, b), k
        else:
            assert a == b, k


def manager(tmp_path, model, opt, sched, loader, extra=None, **kw):
    return CheckpointManager(cfg(**kw), str(tmp_path), [model], [opt], [sched], loader, extra)


def train_and_save(tmp_path, steps=4, **kw):
    model, opt, sched = build(0)
    loader, extra = ToyLoader(), {"tokens_seen": 0}
    mgr = manager(tmp_path, model, opt, sched, loader, extra, **kw)
    snaps = {}
    for step in range(1, steps + 1):
        train_step(model, opt, sched, loader)
        extra["tokens_seen"] += 4
        mgr.save(step)
        snaps[step] = snapshot(model, opt)
    mgr.close()
    return model, opt, sched, loader, mgr, snaps


# ------------------------------------------------------------------------------------------- single process
def test_resume_restores_everything_exactly(tmp_path):
    model, opt, sched, loader, mgr, snaps = train_and_save(tmp_path)
    assert complete_steps(mgr.folder) == [2, 4]
    sched_sd, lr = sched.state_dict(), opt.param_groups[0]["lr"]
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    ref_losses = [train_step(model, opt, sched, loader) for _ in range(3)]

    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    model2, opt2, sched2 = build(1)
    loader2, extra2 = ToyLoader(seed=9), {"tokens_seen": 0}
    mgr2 = manager(tmp_path, model2, opt2, sched2, loader2, extra2)
    assert mgr2.load() == 4
    assert_same(snapshot(model2, opt2), snaps[4])
    assert sched2.state_dict() == sched_sd and opt2.param_groups[0]["lr"] == lr != 1e-2
    assert loader2.state_dict() == {"seed": 0, "pos": 4} and extra2 == {"tokens_seen": 16}
    assert torch.equal(torch.get_rng_state(), rng[0])
    np_state = np.random.get_state()
    assert np_state[0] == rng[1][0] and np.array_equal(np_state[1], rng[1][1]) and np_state[2:] == rng[1][2:]
    assert random.getstate() == rng[2]
    # the resumed run continues with the uninterrupted run's losses, bit for bit
    assert [train_step(model2, opt2, sched2, loader2) for _ in range(3)] == ref_losses


def test_retention_and_unfinished_folders_are_never_chosen(tmp_path):
    *_, mgr, snaps = train_and_save(tmp_path, keep_latest_k=1)
    folder = mgr.folder
    assert complete_steps(folder) == [4] and not os.path.exists(os.path.join(folder, "step-2"))
    # a killed save's partial folder (even with .metadata) and a step folder without .metadata
    partial = os.path.join(folder, ".step-6.partial")
    os.makedirs(partial)
    with open(os.path.join(folder, "step-4", ".metadata"), "rb") as src, open(f"{partial}/.metadata", "wb") as dst:
        dst.write(src.read())
    os.makedirs(os.path.join(folder, "step-6"))
    open(os.path.join(folder, "step-6", "__0_0.distcp"), "w").close()

    model, opt, sched = build(1)
    loader = ToyLoader()
    mgr2 = manager(tmp_path, model, opt, sched, loader, {"tokens_seen": 0}, keep_latest_k=1)
    assert mgr2.load() == 4
    assert_same(snapshot(model, opt), snaps[4])
    assert not os.path.exists(partial), "stale partial folders are removed at load"
    # re-saving step 6 replaces the incomplete step-6 folder; retention keeps only it
    train_step(model, opt, sched, loader)
    mgr2.save(6)
    assert complete_steps(folder) == [6] and sorted(os.listdir(folder)) == ["step-6"]


def test_load_step(tmp_path):
    *_, mgr, snaps = train_and_save(tmp_path)
    model, opt, sched = build(1)
    assert manager(tmp_path, model, opt, sched, ToyLoader(), {"tokens_seen": 0}, load_step=2).load() == 2
    assert_same(snapshot(model, opt), snaps[2])
    # resuming an older step starts a new branch: the newer step-4 is moved aside (checkpoint/lineage.py)
    assert sorted(os.listdir(mgr.folder)) == ["abandoned-step-4", "step-2"]
    with pytest.raises(FileNotFoundError, match=r"load_step=3.*absent.*\[2\]"):
        manager(tmp_path, model, opt, sched, ToyLoader(), load_step=3).load()
    os.makedirs(os.path.join(mgr.folder, "step-6"))
    with pytest.raises(FileNotFoundError, match=r"incomplete.*\[2\]"):
        manager(tmp_path, model, opt, sched, ToyLoader(), load_step=6).load()


def test_async_save_snapshots_the_state_at_save_time(tmp_path):
    *_, mgr, snaps = train_and_save(tmp_path, steps=5, async_mode="async")
    assert complete_steps(mgr.folder) == [2, 4]
    for step in (4, 2):  # newest first: resuming step 2 moves step-4 aside (a new branch)
        model, opt, sched = build(1)
        assert manager(tmp_path, model, opt, sched, ToyLoader(), {"tokens_seen": 0}, load_step=step).load() == step
        assert_same(snapshot(model, opt), snaps[step])


def bf16_round(snap: dict) -> dict:
    return {k[len("model.") :]: v.to(torch.bfloat16).float() for k, v in snap.items() if k.startswith("model.")}


def test_model_only_save_then_initial_load_path(tmp_path):
    run = tmp_path / "run"
    *_, mgr, snaps = train_and_save(run, steps=3, last_save_model_only=True, export_dtype="bfloat16")
    model, opt, sched, loader = *build(0), ToyLoader()
    mgr = manager(run, model, opt, sched, loader, last_save_model_only=True, export_dtype="bfloat16")
    assert mgr.save(3, last_step=True)
    path = mgr.step_dir(3)
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    assert set(md) == {k for k in get_model_state_dict(model)} and md["head.weight"].properties.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model-only checkpoint"):
        manager(run, *build(1), ToyLoader()).load()

    model2, opt2, sched2 = build(1)
    mgr2 = manager(tmp_path / "fresh", model2, opt2, sched2, ToyLoader(), initial_load_path=path)
    assert mgr2.load() == 0 and len(opt2.state) == 0
    want = {k: v.to(torch.bfloat16).float() for k, v in get_model_state_dict(model).items()}
    assert_same(get_model_state_dict(model2), want)

    with pytest.raises(ValueError, match=r"missing from the checkpoint.*layers\.4\.weight"):
        load_model_weights([Toy(n_layers=5)], path)
    with pytest.raises(ValueError, match=r"the model does not have.*layers\.3\.bias"):
        load_model_weights([Toy(n_layers=3)], path)
    with pytest.raises(ValueError, match=r"shape mismatches.*layers\.0\.weight: checkpoint \(8, 8\) vs model \(6, 6\)"):
        load_model_weights([Toy(d=6)], path)


def test_export_cli_and_initial_load_from_full_checkpoint(tmp_path):
    *_, mgr, snaps = train_and_save(tmp_path / "run")
    out = str(tmp_path / "weights")
    export_main(["--checkpoint", mgr.step_dir(4), "--out", out, "--dtype", "bfloat16"])
    model = Toy()
    load_model_weights([model], out)
    assert_same(get_model_state_dict(model), bf16_round(snaps[4]))
    # initial_load_path may also point at a full training checkpoint: its "model" entries are read
    model2, opt2, sched2 = build(1)
    assert manager(tmp_path / "fresh", model2, opt2, sched2, None, initial_load_path=mgr.step_dir(2)).load() == 0
    assert_same(
        {f"model.{k}": v for k, v in get_model_state_dict(model2).items()},
        {k: v for k, v in snaps[2].items() if k.startswith("model.")},
    )


def test_clear_errors(tmp_path):
    model, opt, sched = build(0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        manager(tmp_path, model, opt, sched, None, folder=str(tmp_path / "file"))
    *_, mgr, _ = train_and_save(tmp_path / "run")
    data = os.path.join(mgr.step_dir(4), "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(100)
    # DCP's own errors, past the checksums (tests/test_checkpoint_resume_checks.py tests those)
    with pytest.raises(RuntimeError, match="failed to load checkpoint .*step-4"):
        manager(tmp_path / "run", *build(1), ToyLoader(), {"tokens_seen": 0}, checksums=False).load()
    with open(os.path.join(mgr.step_dir(4), ".metadata"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(RuntimeError, match="cannot read the DCP metadata"):
        manager(tmp_path / "run", *build(1), ToyLoader(), checksums=False).load()


# ------------------------------------------------------------------------------------------- layouts
def _portable(obj) -> bytes:
    """torch.save'd bytes: tensors put on an mp queue travel as shared-memory fds, which break when the
    sending worker exits first."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unportable(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=False)


def _fsdp(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_fsdp(rank, world, folder):
    torch.manual_seed(0)
    model = _fsdp(Toy(), world)
    opt, sched = make_optim(model)
    loader = ToyLoader()
    mgr = CheckpointManager(cfg(async_mode="async"), folder, [model], [opt], [sched], loader, None)
    for step in (1, 2):
        train_step(model, opt, sched, loader, rank, world)
        mgr.save(step)  # step 2: async, in flight during the next step
    snap = snapshot(model, opt)
    train_step(model, opt, sched, loader, rank, world)
    mgr.close()
    assert mgr.use_async, "async save fell back to sync under gloo"
    return _portable(snap) if rank == 0 else None


def _load_fsdp_and_stages(rank, world, folder):
    torch.manual_seed(5)
    model = _fsdp(Toy(), world)
    opt, sched = make_optim(model)
    loader = ToyLoader(seed=3)
    step = CheckpointManager(cfg(), folder, [model], [opt], [sched], loader, None).load()
    fsdp = (step, loader.pos, snapshot(model, opt))
    # pipeline-like, two virtual stages per rank: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 + head
    parts = [Toy(keep={rank}, head=False), Toy(keep={rank + 2}, head=rank == 1)]
    optims = [make_optim(p) for p in parts]
    mgr = CheckpointManager(cfg(), folder, parts, [o for o, _ in optims], [s for _, s in optims], ToyLoader(), None)
    step_pp = mgr.load()
    stages = [snapshot(p, o) for p, (o, _) in zip(parts, optims)]
    return _portable((fsdp, step_pp, stages))


def test_layout_independent_fsdp4_to_fsdp2_one_process_and_stages(tmp_path):
    folder = str(tmp_path)
    saved = _unportable(run_distributed(_save_fsdp, 4, folder)[0])
    assert complete_steps(os.path.join(folder, "checkpoint")) == [2]
    assert any(k.endswith("exp_avg") for k in saved)

    results = [_unportable(r) for r in run_distributed(_load_fsdp_and_stages, 2, folder)]
    for rank, ((step, pos, snap), step_pp, stages) in enumerate(results):
        assert (step, pos, step_pp) == (2, 2, 2)
        assert_same(snap, saved)
        for part, layer in zip(stages, (rank, rank + 2)):
            keys = [k for k in saved if f"layers.{layer}." in k or (layer == 3 and ".head." in k)]
            assert_same(part, saved, keys)

    model, opt, sched = build(7)
    assert manager(tmp_path, model, opt, sched, ToyLoader()).load() == 2
    assert_same(snapshot(model, opt), saved)


# ------------------------------------------------------------------------------------------- kill mid-save
_CHILD = r"""
import os, sys, time
import torch
import torch.distributed.checkpoint.filesystem as fs
from tests.test_checkpoint import build, ToyLoader, train_step, manager
mode, run = sys.argv[1], sys.argv[2]

def hang_after(orig):
    def wrapped(self, *a, **k):
        out = orig(self, *a, **k)
        if "step-4" in str(self.path):
            open(os.path.join(run, "HANGING"), "w").close()
            time.sleep(300)
        return out
    return wrapped

model, opt, sched = build(0)
loader = ToyLoader()
mgr = manager(run, model, opt, sched, loader)
for step in range(1, 5):
    train_step(model, opt, sched, loader)
    if step == 4:
        if mode == "write":   # data files written, no .metadata yet
            fs.FileSystemWriter.write_data = hang_after(fs.FileSystemWriter.write_data)
        else:                 # .metadata written into the partial folder, not yet renamed
            fs.FileSystemWriter.finish = hang_after(fs.FileSystemWriter.finish)
    mgr.save(step)
    if step == 2:
        torch.save(model.state_dict(), os.path.join(run, "params_step2.pt"))
"""


def test_sigkill_mid_save_never_leaves_a_complete_looking_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = {mode: tmp_path / mode for mode in ("write", "finish")}
    procs = {
        mode: subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(run)], cwd=REPO, env=env)
        for mode, run in runs.items()
    }
    try:
        deadline = time.time() + 90
        for mode, run in runs.items():
            while not (run / "HANGING").exists():
                assert procs[mode].poll() is None, f"child {mode} exited with {procs[mode].returncode}"
                assert time.time() < deadline, "child never reached the save"
                time.sleep(0.05)
            os.kill(procs[mode].pid, signal.SIGKILL)
            procs[mode].wait()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for mode, run in runs.items():
        folder = run / "checkpoint"
        partial = folder / ".step-4.partial"
        assert partial.is_dir() and (partial / ".metadata").exists() == (mode == "finish")
        assert not (folder / "step-4").exists() and complete_steps(str(folder)) == [2]
        model, opt, sched = build(1)
        loader = ToyLoader()
        mgr = manager(run, model, opt, sched, loader)
        assert mgr.load() == 2
        assert_same(model.state_dict(), torch.load(run / "params_step2.pt"))
        train_step(model, opt, sched, loader)
        mgr.save(4)
        assert complete_steps(str(folder)) == [2, 4] and not partial.exists()


def test_checkpoint_folder_is_resolved_in_one_place(tmp_path):
    """checkpoint.folder -> a path: relative to job.dump_folder unless absolute, `~` expanded; the manager saves
    there and evaluate.py reads from there (both through checkpoint.resolve_checkpoint_folder)."""
    import evaluate
    from checkpoint import resolve_checkpoint_folder
    from configs.job_config import JobConfig

    dump = str(tmp_path / "run")
    assert resolve_checkpoint_folder("ckpt", dump) == os.path.join(dump, "ckpt")
    assert resolve_checkpoint_folder(str(tmp_path / "elsewhere"), dump) == str(tmp_path / "elsewhere")
    assert resolve_checkpoint_folder("~/ckpt", dump) == os.path.expanduser("~/ckpt")
    model, opt, sched = build(0)
    mgr = CheckpointManager(cfg(folder="ckpt"), dump, [model], [opt], [sched], None)
    assert mgr.folder == resolve_checkpoint_folder("ckpt", dump)
    os.makedirs(os.path.join(mgr.folder, "step-3"))
    open(os.path.join(mgr.folder, "step-3", ".metadata"), "wb").close()
    job = JobConfig()
    job.job.dump_folder, job.checkpoint.folder = dump, "ckpt"
    assert evaluate.resolve_weights(job) == os.path.join(mgr.folder, "step-3")
