"""The encoded-corpus cache (token_cache): text sources encoded once per node into a token file, a vocabulary
and a manifest, which char_dataset.py serves training windows from."""
