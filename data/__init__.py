"""Data: tokenizers (tokenizer.py), text sources (datasets.py), document packing (packing.py), the step loaders
(loader.py); token shards (preprocess.py writes them, shards.py reads them), mixtures (mixture.py), background
prefetching (prefetch.py)."""
