"""Data: tokenizers (tokenizer.py), text sources (datasets.py), document packing (packing.py),
the step loader (loader.py)."""
