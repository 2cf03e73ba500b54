"""The step loader: one global packed stream, each data-parallel rank keeping its slice of every step.

Every optimizer step consumes n x dp_degree consecutive rows of the ONE global stream (data/packing.py), n the
rows per data-parallel rank (the BatchPlan's rows_per_dp_rank, parallelisms/batch_plan.py); data-parallel rank r
keeps rows [r*n, (r+1)*n) of them. Context- and pipeline-parallel ranks of the same dp rank get the same rows
(they split them later).

Trade-off, on purpose: every rank runs the same deterministic packer over the whole global batch and
throws away the rows of other ranks. That costs each rank the tokenization of the global batch (cheap next
to a training step), and buys a data position that is global: state_dict() is identical on every rank and
does not depend on the layout, so a checkpoint saved at dp=4 resumes at dp=2 or dp=1 on the same data, and
any layout sees the single-process batches (loss parity).

The loader implements torch.distributed.checkpoint's Stateful protocol; its state is a small dict of ints
(JSON-able): steps and rows consumed, plus the packer position (epoch, doc_index, token_offset).

Token shards (data/shards.py, made by `python -m data.preprocess`) and mixtures of them (data/mixture.py) go
through RowStepLoader instead: there any row of the global stream is computed from its index, so a rank builds
only its own rows (its data work per step does not grow with the number of ranks), and the position is just
the global row count. build_loader wraps the training loader in a PrefetchLoader (data/prefetch.py) that
builds the next batches in a background thread.
"""

from __future__ import annotations

import torch

from data.datasets import ShuffleBufferSource, build_text_source
from data.mixture import MixtureRows, parse_mixture
from data.packing import IGNORE_INDEX, DocumentPacker
from data.prefetch import PrefetchLoader
from data.shards import PackedRows, ShardDataset, check_tokenizer, is_shard_folder, shard_identity
from parallelisms.batch_plan import BatchPlan

__all__ = ["StepBatchLoader", "RowStepLoader", "build_loader", "data_identity", "IGNORE_INDEX"]


def _check_layout(rows_per_rank: int, dp_rank: int, dp_degree: int) -> None:
    if rows_per_rank < 1 or dp_degree < 1 or not 0 <= dp_rank < dp_degree:
        raise ValueError(
            f"a loader needs rows_per_rank >= 1 and 0 <= dp_rank < dp_degree; got rows_per_rank="
            f"{rows_per_rank}, dp_rank={dp_rank}, dp_degree={dp_degree}"
        )


class StepBatchLoader:
    """Batches of `rows_per_rank` packed rows per step for one of `dp_degree` data-parallel ranks (a step
    consumes rows_per_rank x dp_degree rows of the global stream).

    next_batch() -> {"input_ids": int64 [n, seq_len], "labels": int64 [n, seq_len], "seq_idx": int32 [n, seq_len]}
    on CPU (pinned when pin_memory=True and CUDA is available; the caller moves it to the device).

    infinite=False (validation): one pass over the source; the last batch is padded with pad_id /
    IGNORE_INDEX rows as needed, then next_batch() raises StopIteration. reset() starts the pass again.
    """

    def __init__(
        self,
        tokenizer,
        source,
        seq_len: int,
        rows_per_rank: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        *,
        pin_memory: bool = False,
        infinite: bool = True,
    ):
        _check_layout(rows_per_rank, dp_rank, dp_degree)
        self.tokenizer, self.source, self.seq_len = tokenizer, source, seq_len
        self.rows_per_rank, self.dp_rank, self.dp_degree = rows_per_rank, dp_rank, dp_degree
        self.global_rows = rows_per_rank * dp_degree
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.infinite = infinite
        self.packer = DocumentPacker(source, tokenizer, seq_len, infinite=infinite)
        self.steps = 0
        self.rows_consumed = 0

    def _pad_row(self) -> dict:
        L = self.seq_len
        return {
            "input_ids": torch.full((L,), self.tokenizer.pad_id, dtype=torch.int64),
            "labels": torch.full((L,), IGNORE_INDEX, dtype=torch.int64),
            "seq_idx": torch.zeros(L, dtype=torch.int32),
        }

    def next_batch(self) -> dict[str, torch.Tensor]:
        if not self.infinite and self.packer.exhausted:
            raise StopIteration
        n, first = self.rows_per_rank, self.dp_rank * self.rows_per_rank
        # Rows of lower ranks, ours, then those of higher ranks: every rank walks the whole global batch.
        self.packer.skip_rows(first)
        rows = []
        for _ in range(n):
            row = self.packer.next_row()
            rows.append(self._pad_row() if row is None else {k: torch.from_numpy(v) for k, v in row.items()})
        self.packer.skip_rows(self.global_rows - first - n)
        self.steps += 1
        self.rows_consumed += self.global_rows
        batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "seq_idx")}
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    def reset(self) -> None:
        """Back to the start of the source (e.g. before each validation pass)."""
        self.packer.load_state_dict({"epoch": 0, "doc_index": 0, "token_offset": 0})
        self.steps = self.rows_consumed = 0

    # -------------------------------------------------------------------------------- Stateful

    def state_dict(self) -> dict:
        """The global data position, identical on every rank and independent of dp_rank / dp_degree."""
        return {
            "steps": self.steps,
            "rows_consumed": self.rows_consumed,
            "seq_len": self.seq_len,
            **self.packer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        def as_int(v):
            return int(v.item()) if isinstance(v, torch.Tensor) else int(v)

        missing = {"steps", "rows_consumed", "epoch", "doc_index", "token_offset"} - set(state_dict)
        if missing:
            raise KeyError(f"data loader state lacks {sorted(missing)}: not a StepBatchLoader state_dict")
        self.packer.load_state_dict({k: as_int(state_dict[k]) for k in ("epoch", "doc_index", "token_offset")})
        self.steps = as_int(state_dict["steps"])
        self.rows_consumed = as_int(state_dict["rows_consumed"])


class RowStepLoader:
    """StepBatchLoader's batches and contract, for row sources computable by index (row(k) -> numpy row, or
    None past the end of a finite source, whose num_rows counts its rows): dp rank r builds only rows
    [rows_consumed + r*n, ... + n) of the step. state_dict() = {"steps", "rows_consumed", "seq_len"}, global and
    layout-free."""

    def __init__(
        self,
        rows,
        seq_len: int,
        rows_per_rank: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        *,
        pad_id: int,
        pin_memory: bool = False,
        infinite: bool = True,
    ):
        _check_layout(rows_per_rank, dp_rank, dp_degree)
        self.rows, self.seq_len = rows, seq_len
        self.rows_per_rank, self.dp_rank, self.dp_degree = rows_per_rank, dp_rank, dp_degree
        self.global_rows = rows_per_rank * dp_degree
        self.pad_id, self.infinite = pad_id, infinite
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.steps = self.rows_consumed = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        first = self.rows_consumed + self.dp_rank * self.rows_per_rank
        if not self.infinite and self.rows_consumed >= self.rows.num_rows:
            raise StopIteration
        rows = [self.rows.row(first + i) for i in range(self.rows_per_rank)]
        L = self.seq_len
        batch = {
            "input_ids": torch.full((len(rows), L), self.pad_id, dtype=torch.int64),
            "labels": torch.full((len(rows), L), IGNORE_INDEX, dtype=torch.int64),
            "seq_idx": torch.zeros((len(rows), L), dtype=torch.int32),
        }
        for i, row in enumerate(rows):
            if row is not None:  # past the end of a finite pass: a padding row
                for k, v in row.items():
                    batch[k][i] = torch.from_numpy(v)
        self.steps += 1
        self.rows_consumed += self.global_rows
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    def reset(self) -> None:
        self.steps = self.rows_consumed = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps, "rows_consumed": self.rows_consumed, "seq_len": self.seq_len}

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"steps", "rows_consumed"} - set(state_dict)
        if missing:
            raise KeyError(f"data loader state lacks {sorted(missing)}: not a RowStepLoader state_dict")

        def as_int(v):
            return int(v.item()) if isinstance(v, torch.Tensor) else int(v)

        # A StepBatchLoader state loads too: its rows_consumed counts the same global rows, so a run moving from
        # text to shards of the same documents (training.shuffle false) continues at the same row.
        self.steps, self.rows_consumed = as_int(state_dict["steps"]), as_int(state_dict["rows_consumed"])


def build_row_source(job_config, tokenizer, split: str = "train"):
    """The row source of token-shard training data (PackedRows, or MixtureRows for training.datasets); None
    when the data is text, packed on the fly. Opening reads manifests and document offsets only."""
    t = job_config.training
    if split == "train" and t.datasets:
        entries = parse_mixture(t.datasets)
        streams = []
        for i, (path, _) in enumerate(entries):
            key = f"training.datasets[{i}].path"
            if not is_shard_folder(path, key):
                raise ValueError(
                    f"{key}='{path}' is not a token-shard folder (no manifest.json): mixtures read "
                    "preprocessed shards; make them with `python -m data.preprocess --input ... --out "
                    f"{path}`"
                )
            ds = ShardDataset(path, key)
            check_tokenizer(ds, tokenizer)
            streams.append(
                PackedRows(ds, t.seq_len, shuffle=t.shuffle, seed=t.seed, pad_id=tokenizer.pad_id, stream_id=i)
            )
        return MixtureRows(streams, [w for _, w in entries])
    dataset, key = (
        (t.dataset, "training.dataset") if split == "train" else (job_config.validation.dataset, "validation.dataset")
    )
    if not is_shard_folder(dataset, key):
        return None
    ds = ShardDataset(dataset, key)
    check_tokenizer(ds, tokenizer)
    if split == "train":
        return PackedRows(ds, t.seq_len, shuffle=t.shuffle, seed=t.seed, pad_id=tokenizer.pad_id)
    # Validation: file order; one pass when validation.steps == -1.
    return PackedRows(
        ds, t.seq_len, shuffle=False, seed=t.seed, pad_id=tokenizer.pad_id, finite=job_config.validation.steps == -1
    )


def data_identity(job_config) -> dict:
    """The training data beyond training.dataset & co., for the checkpoint's run record to compare on resume:
    the mixture, the shuffle settings, and each shard folder's content identity (data/shards.shard_identity)."""
    t = job_config.training
    mixture = parse_mixture(t.datasets) if t.datasets else []
    folders = [p for p, _ in mixture] or ([t.dataset] if is_shard_folder(t.dataset) else [])
    return {
        "datasets": [[p, w] for p, w in mixture],
        "shuffle": t.shuffle,
        "shuffle_buffer": t.shuffle_buffer,
        "shards": {p: shard_identity(p) for p in folders if is_shard_folder(p)},
    }


def build_loader(
    job_config, tokenizer, batch: BatchPlan, dp_rank: int = 0, split: str = "train", *, pin_memory: bool = False
):
    """The loader of `job_config` for data-parallel rank `dp_rank` of the job's `batch` plan (resolve_job's, in
    configs/checks.py: the batch sizes are computed and checked there, once).

    split="train": training.datasets (a mixture of shard folders), else training.dataset (a shard folder, or
    text: dataset_path / dataset_config / dataset_split / dataset_text_field, shuffle_buffer), training.seq_len,
    batch.rows_per_dp_rank rows per step; an endless stream, prefetched training.prefetch_batches ahead in a
    background thread (0: built in next_batch()).
    split="validation": validation.dataset / dataset_split, validation.local_batch_size rows per data-parallel
    rank and batch, training.seq_len and dataset_text_field (dataset_path / dataset_config too when the validation
    dataset is the training one); one pass when validation.steps == -1, else endless (call reset() before
    each validation so every evaluation sees the same batches).
    """
    t, dp_degree = job_config.training, batch.dp_degree
    if split == "train":
        n = batch.rows_per_dp_rank
        rows = build_row_source(job_config, tokenizer, "train")
        if rows is not None:
            loader = RowStepLoader(
                rows, t.seq_len, n, dp_rank, dp_degree, pad_id=tokenizer.pad_id, pin_memory=pin_memory
            )
        else:
            source = build_text_source(
                t.dataset,
                t.dataset_split,
                t.dataset_text_field,
                t.dataset_path,
                t.dataset_config,
                config_key="training.dataset",
            )
            if t.shuffle_buffer > 0:
                source = ShuffleBufferSource(source, t.shuffle_buffer, t.seed)
            loader = StepBatchLoader(tokenizer, source, t.seq_len, n, dp_rank, dp_degree, pin_memory=pin_memory)
        return PrefetchLoader(loader, t.prefetch_batches) if t.prefetch_batches > 0 else loader
    if split == "validation":
        v = job_config.validation
        rows = build_row_source(job_config, tokenizer, "validation")
        if rows is not None:
            return RowStepLoader(
                rows,
                t.seq_len,
                v.local_batch_size,
                dp_rank,
                dp_degree,
                pad_id=tokenizer.pad_id,
                pin_memory=pin_memory,
                infinite=v.steps != -1,
            )
        same = v.dataset == t.dataset
        source = build_text_source(
            v.dataset,
            v.dataset_split,
            t.dataset_text_field,
            t.dataset_path if same else "",
            t.dataset_config if same else "",
            config_key="validation.dataset",
        )
        return StepBatchLoader(
            tokenizer,
            source,
            t.seq_len,
            v.local_batch_size,
            dp_rank,
            dp_degree,
            pin_memory=pin_memory,
            infinite=v.steps != -1,
        )
    raise ValueError(f"split={split!r}: use 'train' or 'validation'")
