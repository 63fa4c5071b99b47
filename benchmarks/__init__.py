"""Side-by-side benchmarks of decoding methods (not tests).

``python -m benchmarks.run --config benchmarks/configs/quick.json`` runs every
selected method of :mod:`benchmarks.methods` in one process on the same
prompts and writes per-request JSONL, a summary JSON, a markdown table and a
PNG plot. :mod:`benchmarks.harness` holds the method-independent logic
(timing, metrics, prompt-set hashing, comparison checks).
"""
