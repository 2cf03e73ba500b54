"""Tokenizers: a file-free byte tokenizer and a wrapper around a HF `tokenizers` tokenizer.json.

Both expose the same small interface, which is all the packer and the trainer use:

    encode(text) -> list[int]     no special tokens added (the packer appends EOS itself)
    decode(ids) -> str
    eos_id: int                   appended after every document
    pad_id: int                   fills the tail of the last batch of a finite (validation) pass
    vocab_size: int               number of ids the model's embedding must cover: the largest id + 1
                                  (more than the number of tokens when a tokenizer's ids have gaps)

`build_tokenizer("")` gives the byte tokenizer (vocab 258, matching the "debug" flavors).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# Special tokens that conventionally end a document, most common first.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "[SEP]")
_PAD_CANDIDATES = ("<|padding|>", "<pad>", "[PAD]", "<|pad|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then EOS = 256 (also usable as BOS) and PAD = 257; vocab_size 258."""

    eos_id = 256
    bos_id = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # Special ids have no bytes; invalid UTF-8 (a sequence cut mid-character) decodes leniently.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258, eos_id=256, pad_id=257)"


def _token_content(tok) -> str | None:
    """tokenizer_config.json writes special tokens either as a string or as {"content": ...}."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


class HFTokenizer:
    """A HF `tokenizers` tokenizer loaded from tokenizer.json (a file, or a folder that holds one).

    The EOS id comes from `eos_token` in a tokenizer_config.json next to tokenizer.json when present,
    otherwise from the first known end-of-text token found in the vocabulary (<|endoftext|>, </s>, <eos>, ...).
    """

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer  # lazy: the default byte tokenizer needs no `tokenizers`

        path = Path(os.path.expanduser(tokenizer_path))
        if path.is_dir():
            file = path / "tokenizer.json"
            if not file.is_file():
                raise FileNotFoundError(
                    f"model.tokenizer_path='{tokenizer_path}': the folder has no tokenizer.json; "
                    "point it at a HF `tokenizers` tokenizer.json file or the folder that holds one"
                )
        elif path.is_file():
            file = path
        else:
            raise FileNotFoundError(
                f"model.tokenizer_path='{tokenizer_path}': no such file or folder; give a tokenizer.json path, "
                "its folder, or '' for the built-in byte tokenizer"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(
                f"model.tokenizer_path='{tokenizer_path}': {file} is not a valid tokenizer.json ({e})"
            ) from e
        self.path = str(file)
        # The largest id + 1, over the model's vocabulary and the added tokens: ids may have gaps, and then
        # get_vocab_size() (a count) is too small for the embedding, which every id indexes.
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError(
                f"model.tokenizer_path='{tokenizer_path}': {file} has an empty vocabulary; "
                "give a trained tokenizer.json"
            )
        self.vocab_size = max(ids) + 1

        config = self._read_config(file.parent / "tokenizer_config.json")
        self.eos_id = self._find_special(config.get("eos_token"), _EOS_CANDIDATES)
        if self.eos_id is None:
            raise ValueError(
                f"model.tokenizer_path='{tokenizer_path}': cannot find an end-of-document token (looked for "
                f'tokenizer_config.json\'s eos_token and {", ".join(_EOS_CANDIDATES)}); add "eos_token" to a '
                f"tokenizer_config.json beside {file.name}"
            )
        pad = self._find_special(config.get("pad_token"), _PAD_CANDIDATES)
        self.pad_id = self.eos_id if pad is None else pad

    @staticmethod
    def _read_config(config_file: Path) -> dict:
        if not config_file.is_file():
            return {}
        try:
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_file}: unreadable tokenizer_config.json ({e}); fix or remove it") from e
        return config if isinstance(config, dict) else {}

    def _find_special(self, configured, candidates) -> int | None:
        name = _token_content(configured)
        if name is not None:
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise ValueError(
                    f"{self.path}: tokenizer_config.json names token {name!r}, which is not in the vocabulary"
                )
            return tid
        for name in candidates:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def build_tokenizer(tokenizer_path: str) -> ByteTokenizer | HFTokenizer:
    """'' -> ByteTokenizer(); else HFTokenizer(tokenizer_path) (a tokenizer.json or its folder)."""
    if not tokenizer_path:
        return ByteTokenizer()
    return HFTokenizer(tokenizer_path)


def tokenizer_fingerprint(tokenizer) -> dict:
    """Identity of a tokenizer: its kind, size, special ids and a sha256 of its vocabulary (token -> id, with
    added tokens). The built-in byte tokenizer has a fixed one. Checkpoints' run records and token shards'
    manifests hold it (a run refuses either when made with another tokenizer)."""
    ids = {"vocab_size": int(tokenizer.vocab_size), "eos_id": int(tokenizer.eos_id), "pad_id": int(tokenizer.pad_id)}
    inner = getattr(tokenizer, "_tok", None)
    if inner is None:
        vocab = f"{type(tokenizer).__name__}:{ids}"
        kind = type(tokenizer).__name__
    else:
        vocab = json.dumps(sorted(inner.get_vocab(with_added_tokens=True).items()), ensure_ascii=False)
        kind = "HFTokenizer"
    return {
        "kind": kind,
        **ids,
        "vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest(),
        "path": getattr(tokenizer, "path", ""),
    }
