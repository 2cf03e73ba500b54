"""Text sources: the embedded default corpus, local files, or a streamed HF hub dataset.

A source is a re-iterable, deterministic sequence of document strings with one extra method the
packer relies on for exact, cheap resume:

    iter_from(start) -> Iterator[str]   the documents from index `start` to the end
    num_documents: int | None           None for streamed sources (length unknown)

Indexed sources (embedded corpus, local files) also support len() and [i], so resuming jumps straight
to document i. A streamed HF source resumes by reading past the first `start` documents (no tokenizing;
exact as long as the remote dataset does not change between the runs). `describe_source(source)` names a
source in error messages by its config key and value.

`ShuffleBufferSource` wraps any source in a seeded, per-epoch shuffle buffer (training.shuffle_buffer);
the packer passes it the epoch.

Local files must be UTF-8, strictly: a bad byte is an error naming the file, line and byte, raised when the
dataset is built (every .jsonl line and every .txt file is decoded once then), never a silent U+FFFD that
would train the model on replacement characters. Parquet text columns must be string-typed.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import itertools
import json
import os
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

DEFAULT_CORPUS = Path(__file__).resolve().parent / "default_corpus" / "python_docs.jsonl.gz"
# Every 20th document of the embedded corpus (indices 10, 30, 50, ...) is held out for validation.
_VALIDATION_EVERY, _VALIDATION_PHASE = 20, 10
_SUPPORTED_EXT = (".txt", ".jsonl", ".json", ".parquet")


class TextSource(Protocol):
    num_documents: int | None
    name: str  # the dataset as configured, for messages
    config_key: str  # the config key that named it ("training.dataset"), for messages; "" when built by hand

    def __iter__(self) -> Iterator[str]: ...

    def iter_from(self, start: int) -> Iterator[str]: ...


class IndexedSource:
    """Base of random-access sources: subclasses define __len__ and __getitem__."""

    config_key = ""  # set by build_text_source

    @property
    def num_documents(self) -> int:
        return len(self)

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def iter_from(self, start: int) -> Iterator[str]:
        for i in range(start, len(self)):
            yield self[i]

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)


class ListSource(IndexedSource):
    """Documents held in memory (the embedded corpus, a JSON-array file, tests)."""

    def __init__(self, docs: Sequence[str], name: str = "list"):
        self.docs = list(docs)
        self.name = name

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> str:
        return self.docs[i]


class ConcatSource(IndexedSource):
    """Several indexed sources one after the other (the files of a folder or glob, sorted by name)."""

    def __init__(self, parts: list[IndexedSource], name: str):
        self.parts = parts
        self.name = name
        self._ends = list(itertools.accumulate(len(p) for p in parts))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self._ends, i)
        return self.parts[k][i - (self._ends[k - 1] if k else 0)]


# ---------------------------------------------------------------------------------------------- local files


def _utf8_error(key: str, path: str, data: bytes, error: UnicodeDecodeError, first_line: int = 1) -> ValueError:
    """A decoding failure at byte `error.start` of `data` (which starts at line `first_line` of `path`)."""
    line = first_line + data.count(b"\n", 0, error.start)
    column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
    bad = data[error.start : error.end].hex(" ")
    return ValueError(
        f"{key}: {path} line {line}, byte {column}: not valid UTF-8 (bytes {bad}: {error.reason}); local datasets "
        "must be UTF-8 text: re-encode the file (e.g. `iconv -f latin1 -t utf-8`) or remove the bad bytes"
    )


def _decode_utf8(data: bytes, path: str, key: str, first_line: int = 1) -> str:
    """Strict UTF-8, a leading byte-order mark dropped; a bad byte raises _utf8_error."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise _utf8_error(key, path, data, e, first_line) from None


class TxtFile(IndexedSource):
    """A .txt file is one document. It is decoded once when opened, so that a non-UTF-8 byte stops the run
    before training (naming its line), not when the packer reaches the file."""

    def __init__(self, path: str, key: str = "training.dataset"):
        self.path, self.key = path, key
        self._read()

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> str:
        if i != 0:
            raise IndexError(i)
        return self._read()

    def _read(self) -> str:
        with open(self.path, "rb") as f:
            return _decode_utf8(f.read(), self.path, self.key)


def _field(row, text_field: str, where: str | Callable[[], str], key: str) -> str:
    """row[text_field], a string; `where` (or where(), computed only for an error) names the row."""
    if not isinstance(row, dict) or text_field not in row:
        fields = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise KeyError(
            f"{where() if callable(where) else where} has no field '{text_field}' (it has {fields}); "
            "set training.dataset_text_field to the field holding the text"
        )
    text = row[text_field]
    if not isinstance(text, str):
        raise TypeError(
            f"{where() if callable(where) else where}: field '{text_field}' is {type(text).__name__}, "
            "not a string; set training.dataset_text_field to the field holding the text"
        )
    return text


class JsonlFile(IndexedSource):
    """One JSON object per non-blank line; a line-offset index gives random access without holding the text.

    Building the index reads the file once and checks every line is UTF-8 (errors name the line). A .json file
    whose first character is '[' is read whole as a JSON array of objects instead.
    """

    def __init__(self, path: str, text_field: str, key: str):
        self.path, self.text_field, self.key = path, text_field, key
        self._rows: list | None = None
        self._offsets: list[int] = []
        self._fh = None
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
            if head.startswith(b"\xef\xbb\xbf"):
                head = head[3:].lstrip()
            f.seek(0)
            if head.startswith(b"["):
                text = _decode_utf8(f.read(), path, key)
                try:
                    self._rows = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{key}: {path} is not valid JSON ({e})") from e
                return
            pos = 0
            for line_number, line in enumerate(f, 1):
                _decode_utf8(line, path, key, first_line=line_number)
                if line.strip():
                    self._offsets.append(pos)
                pos += len(line)

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self._offsets)

    def __getitem__(self, i: int) -> str:
        if self._rows is not None:
            return _field(self._rows[i], self.text_field, f"{self.path} item {i}", self.key)
        if self._fh is None:
            self._fh = open(self.path, "rb")
        self._fh.seek(self._offsets[i])
        line = self._fh.readline()
        try:  # checked when the index was built; fails only if the file changed since
            text = line.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as e:
            raise _utf8_error(self.key, self.path, line, e, self._line_number(i)) from None
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{self.key}: {self.path} line {self._line_number(i)}: not a JSON object per line "
                f"({e}); fix the line or remove it"
            ) from e
        return _field(row, self.text_field, lambda: f"{self.path} line {self._line_number(i)}", self.key)

    def _line_number(self, i: int) -> int:
        """1-based line of document i (blank lines are not documents); reads the file up to it, so only for errors."""
        if self._offsets[i] == 0:
            return 1
        with open(self.path, "rb") as f:
            return f.read(self._offsets[i]).count(b"\n") + 1

    def __getstate__(self):  # open file handles do not pickle; reopened on demand
        return {**self.__dict__, "_fh": None}


class ParquetFile(IndexedSource):
    """The rows of a parquet file, read one row group at a time (the current one is cached).

    The text column must be string-typed (checked from the schema when opened); null rows are empty documents.
    """

    def __init__(self, path: str, text_field: str, key: str):
        import pyarrow as pa  # lazy: optional (the `data` extra), needed for parquet files only
        import pyarrow.parquet as pq

        self.path, self.text_field = path, text_field
        meta = pq.ParquetFile(path)
        schema = meta.schema_arrow
        if text_field not in schema.names:
            raise KeyError(
                f"{path} has no field '{text_field}' (columns: {schema.names}); "
                "set training.dataset_text_field to the column holding the text"
            )

        def is_text(typ) -> bool:  # string_view is newer than some pyarrow versions
            return pa.types.is_string(typ) or pa.types.is_large_string(typ) or str(typ) == "string_view"

        # An all-null column has the null type: empty documents, which the packer reports.
        if not (is_text(schema.field(text_field).type) or pa.types.is_null(schema.field(text_field).type)):
            text_columns = [f.name for f in schema if is_text(f.type)]
            raise ValueError(
                f"{key}: {path}: column '{text_field}' holds {schema.field(text_field).type} values, not text; set "
                f"training.dataset_text_field to a string column (this file's: {text_columns or 'none'})"
            )
        sizes = [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._ends = list(itertools.accumulate(sizes))
        self._cached_group, self._cached_texts = -1, []

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = bisect.bisect_right(self._ends, i)
        if g != self._cached_group:
            import pyarrow.parquet as pq  # lazy: optional (see __init__)

            table = pq.ParquetFile(self.path).read_row_group(g, columns=[self.text_field])
            self._cached_group, self._cached_texts = g, table.column(0).to_pylist()
        text = self._cached_texts[i - (self._ends[g - 1] if g else 0)]
        return "" if text is None else text


def _file_source(path: str, text_field: str, key: str) -> IndexedSource:
    ext = Path(path).suffix.lower()
    if ext == ".txt":
        return TxtFile(path, key)
    if ext in (".jsonl", ".json"):
        return JsonlFile(path, text_field, key)
    if ext == ".parquet":
        return ParquetFile(path, text_field, key)
    raise ValueError(f"{key}: {path}: unsupported file type '{ext}'; use one of {', '.join(_SUPPORTED_EXT)}")


def _local_files(dataset: str, key: str) -> list[str]:
    """The files named by a file, folder (recursive) or glob, sorted by path."""
    where = f"{key}='{dataset}'"
    expanded = os.path.expanduser(dataset)
    if any(c in expanded for c in "*?["):
        matched = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        if not matched:
            raise FileNotFoundError(f"{where}: the glob matches no file; check the pattern")
        files = [p for p in matched if Path(p).suffix.lower() in _SUPPORTED_EXT]
        if not files:
            raise ValueError(
                f"{where}: the glob matches only unsupported files ({matched[:3]}...); use {', '.join(_SUPPORTED_EXT)}"
            )
        return files
    if os.path.isdir(expanded):
        files = sorted(str(p) for p in Path(expanded).rglob("*") if p.is_file() and p.suffix.lower() in _SUPPORTED_EXT)
        if not files:
            raise FileNotFoundError(f"{where}: the folder holds no {', '.join(_SUPPORTED_EXT)} file")
        return files
    if os.path.isfile(expanded):
        if Path(expanded).suffix.lower() not in _SUPPORTED_EXT:
            raise ValueError(f"{where}: unsupported file type; use one of {', '.join(_SUPPORTED_EXT)}")
        return [expanded]
    raise FileNotFoundError(
        f"{where}: no such file or folder; give an existing path (absolute, or relative to {os.getcwd()}), "
        "a glob, 'default' for the embedded corpus, or a HF hub dataset name"
    )


def _looks_local(dataset: str) -> bool:
    """A name is a local path if it exists, is a glob, or is written like a path rather than 'org/name'."""
    if os.path.exists(os.path.expanduser(dataset)) or any(c in dataset for c in "*?["):
        return True
    return dataset.startswith((".", "/", "~")) or Path(dataset).suffix.lower() in _SUPPORTED_EXT


# ---------------------------------------------------------------------------------------------- embedded corpus


def load_default_corpus(split: str) -> ListSource:
    """The embedded Python reference manual (data/default_corpus), "train" or "validation"."""
    if split not in ("train", "validation"):
        raise ValueError(
            f"dataset 'default' has splits 'train' and 'validation', not '{split}'; set the dataset_split accordingly"
        )
    with gzip.open(DEFAULT_CORPUS, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    held_out = [i % _VALIDATION_EVERY == _VALIDATION_PHASE for i in range(len(rows))]
    docs = [r["text"] for r, h in zip(rows, held_out) if h == (split == "validation")]
    return ListSource(docs, name=f"default:{split}")


# ---------------------------------------------------------------------------------------------- HF hub


class HFStreamSource:
    """A HF hub dataset, streamed; each iteration starts again at the first row."""

    num_documents = None
    config_key = ""  # set by build_text_source

    def __init__(self, name: str, split: str, text_field: str, dataset_path: str, dataset_config: str, key: str):
        self.name, self.split, self.text_field, self.key = name, split, text_field, key
        self.dataset_path, self.dataset_config = dataset_path, dataset_config
        self._ds = None

    def _dataset(self):
        if self._ds is None:
            try:
                import datasets  # lazy: optional (the `data` extra), and slow to import
            except ImportError as e:
                raise ImportError(
                    f"{self.key}='{self.name}' is a HF hub dataset name, which needs the `datasets` package "
                    "(pip install datasets); or give a local file / folder, or 'default'"
                ) from e
            try:
                self._ds = datasets.load_dataset(
                    self.name,
                    self.dataset_config or None,
                    split=self.split,
                    streaming=True,
                    data_dir=self.dataset_path or None,
                )
            except Exception as e:
                raise RuntimeError(
                    f"{self.key}='{self.name}': could not open it as a HF hub dataset ({type(e).__name__}: {e}). "
                    "Check the name, the split / config, and network access; a local path must exist"
                ) from e
        return self._ds

    def iter_from(self, start: int) -> Iterator[str]:
        for i, row in enumerate(itertools.islice(self._dataset(), start, None), start):
            yield _field(row, self.text_field, f"{self.key}='{self.name}' row {i}", self.key)

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)


# ---------------------------------------------------------------------------------------------- shuffle buffer


class ShuffleBufferSource:
    """The documents of `source` through a seeded shuffle buffer, a different order each epoch.

    Epoch e reads the source in order into a buffer of `buffer_size` documents; each further document replaces
    a buffer slot drawn by numpy PCG64 seeded with (seed, e), whose document is yielded; at the end the rest of
    the buffer is yielded in a seeded order. A document moves at most about buffer_size places earlier, any
    number later. iter_from(start, epoch) replays the epoch from its first document and drops `start` outputs:
    exact resume reads (never tokenizes) the documents before the position again, like a streamed source.
    """

    epoch_dependent = True  # the packer passes the epoch to iter_from

    def __init__(self, source, buffer_size: int, seed: int):
        if buffer_size < 1:
            raise ValueError(f"training.shuffle_buffer={buffer_size}: must be >= 1 (0 = no shuffle buffer)")
        self.source, self.buffer_size, self.seed = source, buffer_size, seed
        self.name = getattr(source, "name", type(source).__name__)
        self.config_key = getattr(source, "config_key", "")
        self.num_documents = source.num_documents

    def _epoch(self, epoch: int) -> Iterator[str]:
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        buffer: list[str] = []
        for text in self.source.iter_from(0):
            if len(buffer) < self.buffer_size:
                buffer.append(text)
                continue
            slot = int(rng.integers(len(buffer)))
            yield buffer[slot]
            buffer[slot] = text
        for i in rng.permutation(len(buffer)):
            yield buffer[i]

    def iter_from(self, start: int, epoch: int = 0) -> Iterator[str]:
        return itertools.islice(self._epoch(epoch), start, None)

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)


# ---------------------------------------------------------------------------------------------- entry point


def build_text_source(
    dataset: str,
    split: str,
    text_field: str,
    dataset_path: str = "",
    dataset_config: str = "",
    *,
    config_key: str = "training.dataset",
) -> IndexedSource | HFStreamSource:
    """The documents of `dataset` ("default", a local file / folder / glob, or a HF hub name).

    `split` selects the embedded corpus' split or the HF split (local files ignore it). `config_key`
    names the config key in error messages ("training.dataset" or "validation.dataset").
    Local files are opened (indexed, UTF-8 checked) here; whether the documents hold any token is checked by the
    packer (data/packing.py), which has the tokenizer.
    """
    if not dataset:
        raise ValueError(f"{config_key} is empty; use 'default', a local path, or a HF hub dataset name")
    if dataset == "default":
        source = load_default_corpus(split)
    elif _looks_local(dataset):
        files = _local_files(dataset, config_key)
        source = ConcatSource([_file_source(p, text_field, config_key) for p in files], name=dataset)
        if len(source) == 0:
            raise ValueError(f"{config_key}='{dataset}': contains no documents (empty files); give a non-empty dataset")
        source[0]  # fail now, not mid-training, on a missing text field or unreadable first row
    else:
        source = HFStreamSource(dataset, split, text_field, dataset_path, dataset_config, config_key)
    source.config_key = config_key
    return source


def describe_source(source) -> str:
    """How error messages name a source: "<config key>='<dataset>'" for those of build_text_source."""
    name = getattr(source, "name", type(source).__name__)
    key = getattr(source, "config_key", "")
    return f"{key}='{name}'" if key else f"dataset '{name}'"
