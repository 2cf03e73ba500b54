"""Token shards: offline preprocessing, memory-mapped per-rank reading, shuffling, mixtures, prefetching (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from configs.checks import resolve_job
from data.datasets import ListSource
from data.loader import RowStepLoader, build_loader
from data.mixture import MixtureRows
from data.packing import DocumentPacker
from data.prefetch import PrefetchLoader
from data.preprocess import preprocess
from data.shards import PackedRows, ShardDataset
from data.tokenizer import ByteTokenizer
from tests.parity import PARITY_ARGS, REPO, assert_same_losses, run_training
from tests.test_data import DOCS, assert_batches_equal

PAD = ByteTokenizer.pad_id


def write_jsonl(path: Path, docs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return path


def make_shards(tmp_path: Path, docs, name="shards", **kw) -> Path:
    src = write_jsonl(tmp_path / f"{name}.jsonl", docs)
    preprocess([str(src)], "", str(tmp_path / name), progress=False, **kw)
    return tmp_path / name


def labelled_docs(tag: str, n: int, seed: int = 0) -> list[str]:
    """Documents of varied length whose first word names their dataset (for counting a mixture's rows)."""
    rng = np.random.default_rng(seed)
    return [f"{tag} {i} " + "w" * int(rng.integers(0, 200)) for i in range(n)]


def rows_of(loader, steps):
    return [loader.next_batch() for _ in range(steps)]


# ------------------------------------------------------------------------------------------- shuffle, ranks


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path):
    docs = [f"<{i}>" for i in range(50)]  # 3-4 bytes + EOS each
    ds = ShardDataset(str(make_shards(tmp_path, docs)))

    def epoch_docs(seed, epoch):
        rows = PackedRows(ds, 8, shuffle=True, seed=seed, pad_id=PAD)
        order, cum = rows._epoch_index(epoch)
        stream = np.concatenate([rows.row(k)["input_ids"] for k in range(-(-2 * ds.num_tokens // 8))])
        text = bytes(t for t in stream[epoch * ds.num_tokens : (epoch + 1) * ds.num_tokens] if t < 256).decode()
        return order.tolist(), text

    o0, t0 = epoch_docs(7, 0)
    o1, t1 = epoch_docs(7, 1)
    assert sorted(o0) == sorted(o1) == list(range(50)) and o0 != o1 and o0 != list(range(50))
    assert t0 == "".join(docs[i] for i in o0) and t1 == "".join(docs[i] for i in o1)  # the stream follows the order
    assert epoch_docs(7, 0)[0] == o0 and epoch_docs(8, 0)[0] != o0


def test_shuffle_buffer_for_text_sources_resumes_exactly(tmp_path):
    from data.datasets import ShuffleBufferSource
    from tests.test_data import global_batches

    docs = [f"<{i}>" for i in range(40)]
    shuffled = ShuffleBufferSource(ListSource(docs), buffer_size=8, seed=5)
    e0, e1 = list(shuffled.iter_from(0, epoch=0)), list(shuffled.iter_from(0, epoch=1))
    assert sorted(e0) == sorted(e1) == sorted(docs) and e0 != docs and e0 != e1
    assert list(shuffled.iter_from(13, epoch=1)) == e1[13:]
    assert list(ShuffleBufferSource(ListSource(docs), 1, seed=5)) == docs  # a one-document buffer keeps the order
    # Through the packer: the stream follows the shuffled order, epoch after epoch; resume at dp 4 / 2 / 1.
    reference, _ = global_batches(shuffled, 16, 4, 1, 12)
    text = bytes(t for b in reference for t in b["input_ids"].flatten().tolist() if t < 256).decode()
    assert text.startswith("".join(e0) + "".join(e1)[:100])
    _, saved = global_batches(shuffled, 16, 4, 4, 7)
    for dp in (4, 2, 1):
        resumed, _ = global_batches(shuffled, 16, 4, dp, 5, state=saved[0].state_dict())
        assert_batches_equal(resumed, reference[7:])
    cfg = _job(write_jsonl(tmp_path / "d.jsonl", docs), shuffle_buffer=8)
    assert isinstance(build_loader(cfg, ByteTokenizer(), _plan(cfg)).loader.packer.source, ShuffleBufferSource)


class CountingRows:
    def __init__(self, rows):
        self.rows, self.calls = rows, 0

    def row(self, k):
        self.calls += 1
        return self.rows.row(k)


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_builds_only_its_rows(tmp_path, dp):
    ds = ShardDataset(str(make_shards(tmp_path, labelled_docs("d", 100))))
    one = RowStepLoader(PackedRows(ds, 32, shuffle=True, seed=1, pad_id=PAD), 32, 8, pad_id=PAD)
    counted = [CountingRows(PackedRows(ds, 32, shuffle=True, seed=1, pad_id=PAD)) for _ in range(dp)]
    ranks = [RowStepLoader(c, 32, 8 // dp, r, dp, pad_id=PAD) for r, c in enumerate(counted)]
    for _ in range(5):
        parts = [ld.next_batch() for ld in ranks]
        assert_batches_equal([one.next_batch()], [{k: torch.cat([p[k] for p in parts]) for k in parts[0]}])
    assert [c.calls for c in counted] == [5 * 8 // dp] * dp
    assert len({json.dumps(ld.state_dict()) for ld in ranks}) == 1


# ------------------------------------------------------------------------------------------- mixtures


@pytest.fixture
def three_datasets(tmp_path):
    return [
        str(make_shards(tmp_path, labelled_docs(tag, n, seed=i), tag))
        for i, (tag, n) in enumerate((("alpha", 60), ("beta", 200), ("gamma", 25)))
    ]


def _mixture(folders, weights, seq_len=32, seed=3):
    streams = [
        PackedRows(ShardDataset(f), seq_len, shuffle=True, seed=seed, pad_id=PAD, stream_id=i)
        for i, f in enumerate(folders)
    ]
    return MixtureRows(streams, weights)


def test_mixture_proportions_over_10k_rows(three_datasets):
    weights = [0.5, 0.3, 0.2]
    mix = _mixture(three_datasets, weights)
    for start in (0, 123_457):  # from the start, and from an arbitrary position
        counts = Counter(mix.source_of(k)[0] for k in range(start, start + 10_000))
        assert all(abs(counts[d] / 10_000 - w) < 0.01 for d, w in enumerate(weights)), counts
    # Each dataset's rows are its own stream, consecutive, in order: no row lost or repeated.
    seen = [[k_d for k in range(30_000) for d, k_d in [mix.source_of(k)] if d == i] for i in range(3)]
    assert all(s == list(range(len(s))) for s in seen)
    # The rows come from the dataset the pattern names (documents are labelled with it).
    for k in range(0, 400, 7):
        d, _ = mix.source_of(k)
        text = bytes(t for t in mix.row(k)["input_ids"] if t < 256).decode(errors="replace")
        others = {"alpha", "beta", "gamma"} - {("alpha", "beta", "gamma")[d]}
        assert not any(o in text for o in others)
    with pytest.raises(ValueError, match="each must be a finite number > 0"):
        MixtureRows(mix.streams, [1.0, 0.0, 1.0])


def test_mixture_resumes_exactly_under_a_layout_change(three_datasets):
    """Saved at dp 4 after k steps (through the prefetching wrapper); resumed at dp 4, 2 and 1: the same batches."""
    k, gbs, seq = 6, 8, 32

    def loaders(dp, state=None):
        out = [
            PrefetchLoader(RowStepLoader(_mixture(three_datasets, [3, 2, 1], seq), seq, gbs // dp, r, dp, pad_id=PAD))
            for r in range(dp)
        ]
        for ld in out:
            if state is not None:
                ld.load_state_dict(state)
        return out

    def global_steps(lds, n):
        return [
            {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
            for parts in ([ld.next_batch() for ld in lds] for _ in range(n))
        ]

    reference = global_steps(loaders(1), k + 4)
    saved = loaders(4)
    global_steps(saved, k)
    state = json.loads(json.dumps(saved[3].state_dict()))  # prefetched batches are not in it
    assert state == {"steps": k, "rows_consumed": k * gbs, "seq_len": seq}
    for dp in (4, 2, 1):
        assert_batches_equal(global_steps(loaders(dp, state), 4), reference[k:])


# ------------------------------------------------------------------------------------------- prefetch


def test_prefetch_keeps_the_consumed_position_and_raises_data_errors():
    from data.loader import StepBatchLoader

    def inner():
        return StepBatchLoader(ByteTokenizer(), ListSource(DOCS * 4), 16, 4)

    plain, ahead = inner(), PrefetchLoader(inner(), depth=3)
    assert_batches_equal(rows_of(plain, 3), rows_of(ahead, 3))
    assert ahead.state_dict() == plain.state_dict() and ahead.batches == 3  # the thread is further on
    state = ahead.state_dict()
    assert_batches_equal(rows_of(plain, 2), rows_of(ahead, 2))
    ahead.load_state_dict(state)
    again = inner()
    again.load_state_dict(state)
    assert_batches_equal(rows_of(again, 4), rows_of(ahead, 4))
    ahead.close()

    class Failing:
        def state_dict(self):
            return {}

        def next_batch(self):
            raise ValueError("training.dataset: broken row")

    with pytest.raises(ValueError, match="broken row"):
        PrefetchLoader(Failing()).next_batch()


EXIT_WHILE_PREFETCHING = """
import sys, torch
sys.path.insert(0, {repo!r})
from data.prefetch import PrefetchLoader

class Busy:  # each batch is long torch work, so the thread is inside a torch op when the interpreter exits
    def state_dict(self):
        return {{}}
    def next_batch(self):
        x = torch.randn(600, 600)
        for _ in range(20):
            x = torch.tanh(x @ x)
        return {{"x": x}}

loader = PrefetchLoader(Busy(), depth=1)
loader.next_batch()
del loader  # dropped, never closed: as train.py leaves its loader at the end of a run
"""


def test_exit_while_the_prefetch_thread_is_busy_is_clean():
    """Without the join at exit this aborts ("terminate called without an active exception"), 5 runs in 5."""
    r = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_PREFETCHING.format(repo=str(REPO))],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0 and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])


# ------------------------------------------------------------------------------------------- config, training


def _plan(cfg):
    """The one-process BatchPlan of cfg, as configs/checks.resolve_job computes it for train.py."""
    return resolve_job(cfg, 1).batch


def _job(dataset="default", datasets=(), **training):
    from configs.job_config import JobConfig

    cfg = JobConfig()
    cfg.training.dataset, cfg.training.datasets = str(dataset), list(datasets)
    cfg.training.seq_len, cfg.training.global_batch_size, cfg.training.local_batch_size = 16, 4, -1
    for k, v in training.items():
        setattr(cfg.training, k, v)
    return cfg


def test_training_datasets_table_in_toml(tmp_path, three_datasets):
    from configs.parser import ConfigError, load_config

    toml = tmp_path / "mix.toml"
    toml.write_text(
        "[training]\nseq_len = 32\n"
        + "".join(f'[[training.datasets]]\npath = "{p}"\nweight = {w}\n' for p, w in zip(three_datasets, (5, 3, 2)))
    )
    cfg = load_config(["--job.config_file", str(toml)])
    assert cfg.training.datasets == [{"path": p, "weight": w} for p, w in zip(three_datasets, (5, 3, 2))]
    loader = build_loader(cfg, ByteTokenizer(), _plan(cfg))
    assert isinstance(loader, PrefetchLoader) and isinstance(loader.loader.rows, MixtureRows)
    assert loader.next_batch()["input_ids"].shape == (8, 32)
    loader.close()
    cli = load_config(["--training.datasets", f"{three_datasets[0]}:1,{three_datasets[1]}:3"])
    assert build_loader(cli, ByteTokenizer(), _plan(cli)).loader.rows.counts.tolist() == [2500, 7500]
    with pytest.raises(ConfigError, match=r"training.datasets\[1\]: weight -1.0 must be a finite number > 0"):
        load_config(["--training.datasets", f"{three_datasets[0]}:1,{three_datasets[1]}:-1"])
    with pytest.raises(ConfigError, match="training.dataset='x' and training.datasets are both set"):
        load_config(["--training.datasets", f"{three_datasets[0]}:1", "--training.dataset", "x"])
    cfg = _job(datasets=[{"path": str(tmp_path), "weight": 1}])
    with pytest.raises(ValueError, match=r"training.datasets\[0\].path='.*' is not a token-shard folder"):
        build_loader(cfg, ByteTokenizer(), _plan(cfg))


def test_data_identity_follows_the_shards_content(tmp_path, three_datasets):
    from data.loader import data_identity

    cfg = _job(datasets=[f"{three_datasets[0]}:2", f"{three_datasets[1]}:1"])
    before = data_identity(cfg)
    assert before["datasets"] == [[three_datasets[0], 2.0], [three_datasets[1], 1.0]] and before["shuffle"]
    assert data_identity(cfg) == before
    import shutil

    shutil.rmtree(three_datasets[1])
    make_shards(tmp_path, labelled_docs("beta", 200, seed=9), "beta")  # other documents, same path
    after = data_identity(cfg)
    assert after["shards"][three_datasets[0]] == before["shards"][three_datasets[0]]
    assert after["shards"][three_datasets[1]] != before["shards"][three_datasets[1]]
    assert data_identity(_job())["shards"] == {}


def test_validation_over_shards_is_one_padded_pass(tmp_path):
    folder = make_shards(tmp_path, DOCS)
    cfg = _job()
    cfg.validation.dataset, cfg.validation.steps, cfg.validation.local_batch_size = str(folder), -1, 2
    loader = build_loader(cfg, ByteTokenizer(), _plan(cfg), split="validation")
    batches = []
    with pytest.raises(StopIteration):
        while True:
            batches.append(loader.next_batch())
    text = DocumentPacker(ListSource(DOCS), ByteTokenizer(), 16, infinite=False)
    reference = []
    while (row := text.next_row()) is not None:
        reference.append(row)
    got = torch.cat([b["input_ids"] for b in batches])
    assert got.shape[0] == 2 * -(-len(reference) // 2)
    assert np.array_equal(got[: len(reference)].numpy(), np.stack([r["input_ids"] for r in reference]))
    assert (got[len(reference) :] == PAD).all()


def _corpus_docs(n_bytes: int, seed: int = 0):
    """Synthetic text documents (words of a small vocabulary, lengths 50..4000 bytes), about n_bytes in all."""
    rng = np.random.default_rng(seed)
    words = ["state", "space", "model", "token", "shard", "mamba", "layer", "the", "of", "and", "a", "scan"]
    total = 0
    while total < n_bytes:
        doc = " ".join(rng.choice(words, size=int(rng.integers(10, 700))))
        total += len(doc) + 12
        yield doc


def _trains_from_generated_corpus(tmp_path, n_bytes):
    write_jsonl(tmp_path / "corpus.jsonl", _corpus_docs(n_bytes))
    manifest = preprocess(
        [str(tmp_path / "corpus.jsonl")], "", str(tmp_path / "shards"), progress=False, workers=os.cpu_count() or 1
    )
    assert manifest["n_tokens"] > n_bytes * 0.95
    args = PARITY_ARGS + ["--training.shuffle", "false"]
    from_text = run_training(1, args + ["--training.dataset", str(tmp_path / "corpus.jsonl")], tmp_path / "text")
    from_shards = run_training(1, args + ["--training.dataset", str(tmp_path / "shards")], tmp_path / "shards_run")
    assert_same_losses(from_text, from_shards)  # same rows, so the same losses


def test_trains_from_a_generated_corpus(tmp_path):
    _trains_from_generated_corpus(tmp_path, 20 * 2**20)


@pytest.mark.slow
def test_trains_from_a_1gb_generated_corpus(tmp_path):
    _trains_from_generated_corpus(tmp_path, 2**30)


@pytest.mark.slow
def test_mixture_run_resumes_on_another_layout(tmp_path, three_datasets):
    """train.py with a mixture: 6 steps on 2 ranks (checkpoint at 3) resumed on 1 rank = 6 uninterrupted steps."""
    mix = ",".join(f"{p}:{w}" for p, w in zip(three_datasets, (5, 3, 2)))
    # A constant LR, so that the first run's shorter training.steps does not change its schedule.
    args = PARITY_ARGS + [
        "--training.datasets",
        mix,
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "3",
        "--lr_scheduler.min_lr_factor",
        "1.0",
        "--lr_scheduler.warmup_steps",
        "0",
    ]
    reference = run_training(1, args, tmp_path / "ref")
    run_training(2, args + ["--checkpoint.enable", "true", "--training.steps", "3"], tmp_path / "run")
    resumed = run_training(1, args + ["--checkpoint.enable", "true"], tmp_path / "run")
    assert_same_losses(reference, resumed)


def test_loader_benchmark_runs(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/data_loader.py",
            "loader",
            "--corpus_mb",
            "1",
            "--dp",
            "1,64",
            "--text_dp",
            "1",
            "--seq_len",
            "64",
            "--local_batch_size",
            "2",
            "--warmup",
            "1",
            "--steps",
            "3",
            "--work",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["kind"], x["dp"]) for x in records] == [("shards", 1), ("shards", 64), ("text_on_the_fly", 1)]
    assert all(x["ms_per_step"] > 0 for x in records)


@pytest.mark.slow
def test_stall_benchmark_runs_on_cpu(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "benchmarks/data_loader.py",
            "stall",
            "--config",
            "configs/debug.toml",
            "--cpu",
            "--corpus_mb",
            "1",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--work",
            str(tmp_path),
            "--",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(r.stdout.strip().splitlines()[-1])
    assert record["steps"] == 2 and 0 < record["data_fraction"] < 1
