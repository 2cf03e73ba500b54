"""Regenerate python_docs.jsonl.gz, the embedded default corpus, from CPython's pydoc topics.

    python data/default_corpus/make_corpus.py            # writes data/default_corpus/python_docs.jsonl.gz

The corpus is the Python reference manual as CPython ships it for `help()` (the stdlib module
`pydoc_data.topics`, PSF License 2.0; see LICENSE.md beside this file). One JSON object per topic,
{"title": ..., "text": ...}, sorted by title, gzip with mtime 0, so the output is byte-identical for a
given Python build. The committed file was generated with CPython 3.11; other versions ship a different
text, so regenerate only on purpose (the loader never regenerates it at run time).
"""

from __future__ import annotations

import gzip
import io
import json
import sys
from pathlib import Path
from pydoc_data.topics import topics

OUT_PATH = Path(__file__).resolve().parent / "python_docs.jsonl.gz"


def build_corpus_bytes() -> bytes:
    lines = [json.dumps({"title": title, "text": topics[title]}, ensure_ascii=False) for title in sorted(topics)]
    payload = ("\n".join(lines) + "\n").encode("utf-8")
    buf = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of anything that varies between runs.
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        gz.write(payload)
    return buf.getvalue()


def main() -> None:
    if sys.version_info[:2] != (3, 11):
        print(
            f"note: running Python {sys.version.split()[0]}; the committed corpus came from CPython 3.11",
            file=sys.stderr,
        )
    data = build_corpus_bytes()
    OUT_PATH.write_bytes(data)
    print(f"wrote {OUT_PATH} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
