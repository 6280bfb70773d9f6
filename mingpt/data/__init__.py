"""The tokenizer seam (tokenizer: characters, byte-level BPE) and the encoded-corpus cache (token_cache): text
sources encoded once per node into a token file, its tokenizer and a manifest, which char_dataset.py serves training
windows from."""
