"""Token shards on disk (written by `python -m data.preprocess`), read by memory map, packed into rows by arithmetic.

A shard folder holds:

    manifest.json               format, token dtype, eos_id, tokenizer fingerprint, counts, source, shard list
    shard_NNNNN.tokens.npy      uint16 / uint32 [n_tokens]: the shard's documents, each followed by its EOS
    shard_NNNNN.docs.npy        int64 [n_docs + 1]: token offset of each document in the shard, then n_tokens

Global document g is document g - first(s) of the shard s holding it (shards in manifest order). Every document
is at least its EOS (an empty text is one EOS), exactly as data/packing.py streams it.

`PackedRows` turns the documents into the endless packed stream of data/packing.py, with one difference made
on purpose: epoch e visits the documents in a seeded permutation (`shuffle=True`; numpy PCG64 seeded with
(seed, stream_id, e)), or in file order (`shuffle=False`, then the rows are byte-identical to DocumentPacker's
over the same documents). Row k covers the stream tokens [k*L, k*L + L] (L = seq_len, one token peeked for the
last label), and is computed from k alone: epoch = position // tokens_per_epoch, then a binary search in the
epoch's cumulative document lengths. So any rank builds exactly the rows it trains on, and a data position is
one global row count, whatever the number of ranks.

Cost: opening reads the manifest and the document offsets (no token) and keeps each document's length (4 bytes
per document); each epoch's index (permutation + cumulative lengths, 12-16 bytes per document) is built when
first needed, and the last two are kept. So start-up and memory grow with the number of documents, never with
the number of tokens (measured in docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from data.packing import IGNORE_INDEX
from data.tokenizer import tokenizer_fingerprint

MANIFEST = "manifest.json"
PLAN = "plan.json"  # written first by data.preprocess: a folder with it but no manifest is unfinished
FORMAT = 1


def tokens_file(index: int) -> str:
    return f"shard_{index:05d}.tokens.npy"


def docs_file(index: int) -> str:
    return f"shard_{index:05d}.docs.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_shard_folder(path: str, config_key: str = "training.dataset") -> bool:
    """True for a finished shard folder; raises for an unfinished one (which would otherwise read as a folder
    of .json text files)."""
    folder = os.path.expanduser(path) if path else ""
    if not folder or not os.path.isdir(folder):
        return False
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return True
    if os.path.isfile(os.path.join(folder, PLAN)):
        raise ValueError(
            f"{config_key}='{path}': its preprocessing did not finish (plan.json but no manifest.json); "
            "re-run the same `python -m data.preprocess` command, which resumes it"
        )
    return False


def _rerun_hint(folder: str) -> str:
    return (
        f"re-run `python -m data.preprocess` into {folder} (it resumes: delete the damaged shard's files "
        "first so that it is rewritten)"
    )


class ShardDataset:
    """The documents of one shard folder, memory-mapped. doc_tokens(g) -> the tokens (+ EOS) of document g.

    Opening checks what is cheap to check, so that a damaged folder fails before training and names the
    file: the manifest parses, every shard's two files exist with valid .npy headers, the token file holds the
    manifest's count of the manifest's dtype, and the offsets start at 0, rise strictly and end at the count.
    """

    def __init__(self, folder: str, config_key: str = "training.dataset"):
        self.folder = os.path.expanduser(folder)
        self.key = config_key
        where = f"{config_key}='{folder}'"
        manifest_path = os.path.join(self.folder, MANIFEST)
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where}: no {MANIFEST}; it is not a token-shard folder (make one with "
                "`python -m data.preprocess --input ... --tokenizer ... --out DIR`)"
            ) from None
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: {manifest_path} is unreadable ({e}); {_rerun_hint(self.folder)}") from e
        if self.manifest.get("format") != FORMAT or not self.manifest.get("complete"):
            raise ValueError(
                f"{where}: {manifest_path} is not a complete format-{FORMAT} manifest "
                f"(format {self.manifest.get('format')!r}, complete {self.manifest.get('complete')!r}); "
                f"{_rerun_hint(self.folder)}"
            )
        self.dtype = np.dtype(self.manifest["dtype"])
        self.eos_id = int(self.manifest["eos_id"])
        self._tokens: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        first_doc = [0]
        for index, shard in enumerate(self.manifest["shards"]):
            tokens, docs = self._open_shard(index, shard)
            self._tokens.append(tokens)
            self._offsets.append(docs)
            first_doc.append(first_doc[-1] + len(docs) - 1)
        self.num_documents = first_doc[-1]
        if self.num_documents == 0:
            raise ValueError(f"{where}: the shards hold no document; preprocess a non-empty dataset")
        self._first_doc = np.asarray(first_doc, dtype=np.int64)
        # The length (EOS included) of every global document: the one per-document array kept in memory.
        self.doc_lengths = np.concatenate([np.diff(d).astype(np.int32) for d in self._offsets])
        self.num_tokens = int(self.doc_lengths.sum(dtype=np.int64))

    def _open_shard(self, index: int, shard: dict) -> tuple[np.ndarray, np.ndarray]:
        arrays = []
        for name, dtype, count in (
            (shard["tokens"], self.dtype, shard["n_tokens"]),
            (shard["docs"], np.dtype(np.int64), shard["n_docs"] + 1),
        ):
            path = os.path.join(self.folder, name)
            try:
                a = np.load(path, mmap_mode="r")
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{self.key}: shard file {path} is missing; {_rerun_hint(self.folder)}"
                ) from None
            except (OSError, ValueError, EOFError) as e:  # bad header, or shorter than its header says
                raise ValueError(
                    f"{self.key}: shard file {path} is corrupt or truncated ({e}); {_rerun_hint(self.folder)}"
                ) from e
            if a.dtype != dtype or a.ndim != 1 or len(a) != count:
                raise ValueError(
                    f"{self.key}: shard file {path} holds {a.dtype} {list(a.shape)}, the manifest says "
                    f"{dtype} [{count}]; {_rerun_hint(self.folder)}"
                )
            arrays.append(a)
        tokens, docs = arrays
        if docs[0] != 0 or docs[-1] != len(tokens) or (len(docs) > 1 and not np.all(docs[1:] > docs[:-1])):
            raise ValueError(
                f"{self.key}: shard file {os.path.join(self.folder, shard['docs'])} has inconsistent "
                f"document offsets (not rising from 0 to {len(tokens)}); {_rerun_hint(self.folder)}"
            )
        return tokens, docs

    def doc_tokens(self, doc: int) -> np.ndarray:
        """The tokens of global document `doc`, its EOS last (a view into the memory map)."""
        shard = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        local = doc - int(self._first_doc[shard])
        start, end = self._offsets[shard][local : local + 2]
        return self._tokens[shard][int(start) : int(end)]

    def __repr__(self) -> str:
        return (
            f"ShardDataset('{self.folder}', {self.num_documents} documents, {self.num_tokens} tokens, "
            f"{len(self._tokens)} shards)"
        )


class PackedRows:
    """Row k of the packed, per-epoch shuffled stream of a ShardDataset: row(k) -> numpy input_ids / labels /
    seq_idx [seq_len], the semantics of data/packing.py (labels never cross a document end).

    finite=True (validation): one epoch, in file order unless shuffled; rows past its last token are None and
    the last row is padded with pad_id / IGNORE_INDEX as one extra segment. num_rows is then the row count.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        seq_len: int,
        *,
        shuffle: bool,
        seed: int,
        pad_id: int,
        stream_id: int = 0,
        finite: bool = False,
    ):
        if seq_len < 1:
            raise ValueError(f"training.seq_len={seq_len}: must be >= 1")
        self.dataset, self.seq_len, self.shuffle, self.seed = dataset, seq_len, shuffle, seed
        self.pad_id, self.stream_id, self.finite = pad_id, stream_id, finite
        self.tokens_per_epoch = dataset.num_tokens
        self.num_rows = -(-self.tokens_per_epoch // seq_len) if finite else None
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch_index(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative lengths in that order with a leading 0) of `epoch`."""
        if epoch not in self._epochs:
            n = self.dataset.num_documents
            index_dtype = np.int32 if n < 2**31 else np.int64
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, self.stream_id, epoch]))
                order = rng.permutation(n).astype(index_dtype)
            else:
                order = np.arange(n, dtype=index_dtype)
            cum = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(self.dataset.doc_lengths[order], out=cum[1:])
            if len(self._epochs) >= 2:  # rows move forward: the oldest epoch is done with
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = (order, cum)
        return self._epochs[epoch]

    def row(self, k: int) -> dict[str, np.ndarray] | None:
        L = self.seq_len
        if self.finite and k >= self.num_rows:
            return None
        tokens = np.empty(L + 1, dtype=np.int64)
        doc_start = np.zeros(L + 1, dtype=bool)
        no_target = np.zeros(L + 1, dtype=bool)  # EOS or padding: its label is IGNORE_INDEX
        end = self.tokens_per_epoch if self.finite else None
        position, filled = k * L, 0
        while filled < L + 1 and (end is None or position < end):
            epoch, within = divmod(position, self.tokens_per_epoch)
            order, cum = self._epoch_index(epoch)
            j = int(np.searchsorted(cum, within, side="right")) - 1
            offset = within - int(cum[j])
            doc = self.dataset.doc_tokens(int(order[j]))
            take = min(L + 1 - filled, len(doc) - offset)
            tokens[filled : filled + take] = doc[offset : offset + take]
            doc_start[filled] = offset == 0
            if offset + take == len(doc):
                no_target[filled + take - 1] = True
            filled, position = filled + take, position + take
        if filled < L + 1:  # end of a finite pass: pad as one extra segment
            tokens[filled:] = self.pad_id
            no_target[filled:] = True
            doc_start[filled] = True
        seq_idx = np.zeros(L, dtype=np.int32)
        np.cumsum(doc_start[1:L], out=seq_idx[1:])
        return {
            "input_ids": tokens[:L].copy(),
            "labels": np.where(no_target[:L], IGNORE_INDEX, tokens[1 : L + 1]),
            "seq_idx": seq_idx,
        }


def check_tokenizer(dataset: ShardDataset, tokenizer) -> None:
    """Refuse shards made with another tokenizer (data/tokenizer.py's fingerprint, the file path aside)."""
    made = {k: v for k, v in dataset.manifest.get("tokenizer", {}).items() if k != "path"}
    now = {k: v for k, v in tokenizer_fingerprint(tokenizer).items() if k != "path"}
    if made != now:
        diff = [
            f"{k}: shards {made.get(k)!r}, this run {now.get(k)!r}"
            for k in sorted(set(made) | set(now))
            if made.get(k) != now.get(k)
        ]
        raise ValueError(
            f"{dataset.key}='{dataset.folder}' was tokenized with another tokenizer "
            f"({dataset.manifest.get('tokenizer', {}).get('path') or 'built-in'}) than this run's "
            f"({getattr(tokenizer, 'path', '') or 'built-in'}): {'; '.join(diff)}. Set model.tokenizer_path to the "
            "tokenizer the shards were made with, or re-run `python -m data.preprocess` with this one"
        )


def shard_identity(folder: str) -> dict:
    """What identifies a shard folder's content, from its manifest alone (cheap): counts, token dtype and a
    sha256 over the shard list (file names, counts, CRC-32s). Re-preprocessing other data into the same path
    changes it; moving the folder does not."""
    with open(os.path.join(os.path.expanduser(folder), MANIFEST)) as f:
        manifest = json.load(f)
    shards = json.dumps(manifest["shards"], sort_keys=True)
    return {
        "n_docs": manifest["n_docs"],
        "n_tokens": manifest["n_tokens"],
        "dtype": manifest["dtype"],
        "shards_sha256": hashlib.sha256(shards.encode()).hexdigest(),
    }
