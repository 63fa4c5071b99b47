"""One-off measurements: each answered one question, recorded in the docs with its results folder.

Kept runnable (``python -m benchmarks.probes.NAME``) so the finding can be checked again; they are not
part of the benchmarks the docs' current figures come from.
"""
