"""Pack tokenized documents into fixed-length rows of one endless token stream.

The stream is doc_0 + [EOS] + doc_1 + [EOS] + ... ; at the end of the source it starts over (epoch + 1).
Row k is stream[k*L : (k+1)*L] with L = seq_len, and for position t of the row:

    input_ids[t] = stream[k*L + t]                                        int64
    labels[t]    = stream[k*L + t + 1], or IGNORE_INDEX if input_ids[t] is a document's EOS
                   (so no target crosses a document boundary; the row's last label peeks one token
                   into the next row and is valid when that token is in the same document)
    seq_idx[t]   = number of document starts at row positions 1..t       int32, 0 at t = 0
                   (the EOS belongs to the document it ends)

The packer's position is exact and tiny: (epoch, doc_index, token_offset) of the next row's first
token. Resuming tokenizes only the document it lands in; indexed sources jump to it directly, streamed
ones read past the documents before it (see data/datasets.py).

With infinite=False the stream is one epoch: the last row is padded (pad_id, labels IGNORE_INDEX, its own
seq_idx segment) and next_row() then returns None.

A source with no document, or whose documents all tokenize to nothing, is refused when the packer is built
(its rows would hold only EOS, whose labels are ignored: a 0 / 0 loss). The check reads documents from the
start up to the first one with a token: one document for a usable dataset, a single pass for an empty one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from data.datasets import describe_source

# The label of tokens with no target (a document's EOS, padding): the loss skips it (models/loss.py holds the
# same value; kept apart so data/ imports neither torch nor models/, tests/test_import_boundaries.py checks).
IGNORE_INDEX = -100


@dataclass
class PackerState:
    epoch: int = 0
    doc_index: int = 0  # document of the next row's first token, in source order
    token_offset: int = 0  # offset of that token within the document's tokens + [EOS]


class DocumentPacker:
    def __init__(self, source, tokenizer, seq_len: int, *, infinite: bool = True):
        if seq_len < 1:
            raise ValueError(f"training.seq_len={seq_len}: must be >= 1")
        self.source, self.tokenizer, self.seq_len, self.infinite = source, tokenizer, seq_len, infinite
        self._check_source_has_tokens()
        self.load_state_dict(asdict(PackerState()))

    def _check_source_has_tokens(self) -> None:
        """Raise ValueError, naming the dataset and the fix, unless some document has a token."""
        n_docs = 0
        for text in self.source.iter_from(0):
            if text and len(self.tokenizer.encode(text)) > 0:
                return
            n_docs += 1
        where = describe_source(self.source)
        if n_docs == 0:
            raise ValueError(f"{where} yields no documents; give a non-empty dataset")
        documents = "its one document is" if n_docs == 1 else f"all {n_docs} documents are"
        raise ValueError(
            f"{where}: {documents} empty (no token after tokenization), so no position has a label "
            "and the loss would be 0 / 0; check that training.dataset_text_field names the field holding the text "
            "(parquet nulls read as empty), or give a non-empty dataset"
        )

    # -------------------------------------------------------------------------------- document stream

    def _restart_iterator(self, epoch: int, doc_index: int) -> None:
        self._next_key = (epoch, doc_index)  # (epoch, index) of the next document _fetch() reads
        # A shuffle buffer (datasets.ShuffleBufferSource) orders each epoch differently: it needs the epoch.
        self._it = (
            self.source.iter_from(doc_index, epoch)
            if getattr(self.source, "epoch_dependent", False)
            else self.source.iter_from(doc_index)
        )
        self._yielded = 0  # documents this iterator has produced

    def _fetch(self) -> bool:
        """Tokenize the next document onto the lookahead queue; False when a finite stream has ended."""
        while True:
            try:
                text = next(self._it)
                break
            except StopIteration:
                epoch, index = self._next_key
                if self._yielded == 0 and index == 0:  # the source changed since __init__ checked it
                    raise ValueError(
                        f"{describe_source(self.source)} yields no documents; give a non-empty dataset"
                    ) from None
                if not self.infinite:
                    self._ended = True
                    return False
                self._restart_iterator(epoch + 1, 0)
        tokens = np.asarray(self.tokenizer.encode(text) + [self.tokenizer.eos_id], dtype=np.int64)
        self._docs.append((*self._next_key, tokens))
        self._next_key = (self._next_key[0], self._next_key[1] + 1)
        self._yielded += 1
        return True

    def _has_doc(self, k: int) -> bool:
        """Make sure the k-th queued document exists (fetching ahead as needed)."""
        while len(self._docs) <= k:
            if self._ended or not self._fetch():
                return False
        return True

    # -------------------------------------------------------------------------------- rows

    @property
    def exhausted(self) -> bool:
        """Only for infinite=False: no token left for another row."""
        return not self._has_doc(0)

    def next_row(self) -> dict[str, np.ndarray] | None:
        """The next row (input_ids, labels, seq_idx as numpy arrays of [seq_len]); None once a finite stream is done."""
        L = self.seq_len
        tokens = np.empty(L + 1, dtype=np.int64)
        doc_start = np.zeros(L + 1, dtype=bool)
        no_target = np.zeros(L + 1, dtype=bool)  # EOS or padding: its label is IGNORE_INDEX
        filled, k, offset = 0, 0, self._offset
        while filled < L + 1 and self._has_doc(k):
            doc = self._docs[k][2]
            take = min(L + 1 - filled, len(doc) - offset)
            tokens[filled : filled + take] = doc[offset : offset + take]
            doc_start[filled] = offset == 0
            if offset + take == len(doc):
                no_target[filled + take - 1] = True
            filled, k, offset = filled + take, k + 1, 0
        if filled == 0:
            return None
        if filled < L + 1:  # end of a finite stream: pad as one extra segment
            tokens[filled:] = self.tokenizer.pad_id
            no_target[filled:] = True
            doc_start[filled] = True
        seq_idx = np.zeros(L, dtype=np.int32)
        np.cumsum(doc_start[1:L], out=seq_idx[1:])
        row = {
            "input_ids": tokens[:L].copy(),
            "labels": np.where(no_target[:L], IGNORE_INDEX, tokens[1 : L + 1]),
            "seq_idx": seq_idx,
        }
        self._advance(L)
        return row

    def skip_rows(self, n: int) -> None:
        """Move past n rows without building them (other ranks' rows)."""
        self._advance(n * self.seq_len)

    def _advance(self, n_tokens: int) -> None:
        while n_tokens > 0 and self._has_doc(0):
            avail = len(self._docs[0][2]) - self._offset
            if n_tokens < avail:
                self._offset += n_tokens
                return
            n_tokens -= avail
            self._docs.popleft()
            self._offset = 0

    # -------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        if self._has_doc(0):
            epoch, index, _ = self._docs[0]
        else:  # a finite stream past its end
            epoch, index = self._next_key
        return asdict(PackerState(epoch=int(epoch), doc_index=int(index), token_offset=int(self._offset)))

    def load_state_dict(self, state: dict) -> None:
        s = PackerState(**{k: int(state[k]) for k in ("epoch", "doc_index", "token_offset")})
        self._docs: deque = deque()  # (epoch, doc_index, tokens + [EOS]), the first is the current document
        self._ended = False
        self._restart_iterator(s.epoch, s.doc_index)
        self._offset = s.token_offset
        if self._has_doc(0) and self._offset >= len(self._docs[0][2]):
            raise ValueError(
                f"data position {s} is past the end of its document ({len(self._docs[0][2])} tokens): the dataset or "
                "tokenizer differs from the checkpoint's; resume with the same data, or start the data afresh"
            )
