"""torchtitan's tokenizer and dataloader builders for Mamba-2, over mambatitan's data/ (its tokenizers, sources and
document packer), so `training.dataset = "default"` (the embedded corpus) trains with no download.

- Tokenizer: `model.hf_assets_path` empty -> the byte tokenizer (258 ids, the debug flavors' vocabulary); else a HF
  `tokenizer.json` or its folder (data/tokenizer.py).
- Data: `training.dataset` is what mambatitan's `training.dataset` takes ("default", local .txt / .jsonl / .parquet
  files, folder or glob; otherwise a HF hub name, streamed); `training.dataset_path` is its data_dir. Documents are
  packed into rows of `training.seq_len` with EOS after each, labels never cross a document (IGNORE_INDEX = -100,
  torchtitan's too). Every data-parallel rank runs the same packer over the global row stream and keeps rows
  dp_rank, dp_rank + dp, ... Its position (tiny, exact) is saved in torchtitan's checkpoints.
- Batches are ({"input": tokens [b, s], "seq_idx": int32 [b, s]}, labels [b, s]); torchtitan passes "seq_idx" to the
  model's forward, so the conv and SSM state restart at every document. Under pipeline parallel torchtitan gives such
  extra inputs to the first stage only, so the rows then carry no seq_idx (each row is one stream).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

from data.datasets import build_text_source
from data.packing import DocumentPacker
from data.tokenizer import build_tokenizer
from integrations.torchtitan.args import titan_flavors


class Mamba2Tokenizer(BaseTokenizer):
    """data/tokenizer.py's tokenizer behind torchtitan's BaseTokenizer (encode / decode / get_vocab_size / eos_id)."""

    def __init__(self, tokenizer_path: str):
        super().__init__()
        self.inner = build_tokenizer(tokenizer_path)
        self.eos_id = self.inner.eos_id
        self.bos_id = getattr(self.inner, "bos_id", None)
        self.pad_id = self.inner.pad_id

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids, *args, **kwargs) -> str:
        return self.inner.decode(ids)

    def get_vocab_size(self) -> int:
        """The ids the embedding must cover (largest id + 1), which the flavor's vocab_size must reach."""
        return self.inner.vocab_size


def build_mamba2_tokenizer(job_config) -> Mamba2Tokenizer:
    """The tokenizer, checked against the flavor first: torchtitan builds the tokenizer before the model, so an unknown
    flavor or a vocabulary the embedding cannot hold stops the run here, naming the fix."""
    tokenizer = Mamba2Tokenizer(job_config.model.hf_assets_path or "")
    check_tokenizer_fits_flavor(tokenizer.get_vocab_size(), job_config.model.flavor)
    return tokenizer


def check_tokenizer_fits_flavor(tokenizer_vocab: int, flavor: str) -> None:
    flavors = titan_flavors()
    if flavor not in flavors:
        raise ValueError(f"model.flavor={flavor!r} is not a mamba2 flavor; choose one of {sorted(flavors)}")
    if tokenizer_vocab > flavors[flavor].vocab_size:
        raise ValueError(
            f"the tokenizer has ids up to {tokenizer_vocab - 1} but flavor {flavor!r} embeds "
            f"vocab_size={flavors[flavor].vocab_size} ids; pick a flavor whose vocabulary holds the "
            "tokenizer's (or leave model.hf_assets_path empty for the byte tokenizer, 258 ids)"
        )


class PackedRows(IterableDataset, Stateful):
    """This data-parallel rank's rows of the packed global stream, as torchtitan's (input_dict, labels)."""

    def __init__(self, source, tokenizer, seq_len: int, dp_rank: int, dp_world_size: int, with_seq_idx: bool):
        self.packer = DocumentPacker(source, tokenizer, seq_len)
        self.dp_rank, self.dp_world_size, self.with_seq_idx = dp_rank, dp_world_size, with_seq_idx

    def __iter__(self):
        while True:
            # Skip the other ranks' rows around ours, so the saved position is always at a global row group.
            self.packer.skip_rows(self.dp_rank)
            row = self.packer.next_row()
            self.packer.skip_rows(self.dp_world_size - 1 - self.dp_rank)
            inputs = {"input": torch.from_numpy(row["input_ids"])}
            if self.with_seq_idx:
                inputs["seq_idx"] = torch.from_numpy(row["seq_idx"])
            yield inputs, torch.from_numpy(row["labels"])

    def state_dict(self) -> dict:
        return {"packer": self.packer.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.packer.load_state_dict(state_dict["packer"])


def build_mamba2_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: Mamba2Tokenizer, job_config, **kwargs
) -> ParallelAwareDataloader:
    """torchtitan's build_dataloader_fn: local_batch_size rows of seq_len tokens per call of next()."""
    del kwargs
    t = job_config.training
    if t.dataloader.num_workers:
        # Each worker would iterate its own copy of the packer: every row num_workers times. Packing is cheap (the
        # tokenizer runs in the packer's process either way); preprocessed shards are the path for large data.
        raise ValueError(
            f"training.dataloader.num_workers={t.dataloader.num_workers}: the mamba2 data loader packs "
            "one stream per rank in the training process; set it to 0"
        )
    source = build_text_source(t.dataset, "train", "text", t.dataset_path or "")
    rows = PackedRows(
        source,
        tokenizer.inner,
        t.seq_len,
        dp_rank,
        dp_world_size,
        with_seq_idx=job_config.parallelism.pipeline_parallel_degree == 1,
    )
    return ParallelAwareDataloader(
        rows, dp_rank=dp_rank, dp_world_size=dp_world_size, **asdict(t.dataloader), batch_size=t.local_batch_size
    )
