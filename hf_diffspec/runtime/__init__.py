"""The speculative decoding runtime: the loop, drafting, trees, verification, KV-cache compaction and the cost model.

This package is what a saved drafter's `custom_generate/` folder is (copied whole at save time, entry point
`generate.py`), so every module here imports only torch, transformers and its siblings (single-dot relative imports).
"""
