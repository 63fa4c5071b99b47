"""The default draft for SmolLM2-135M-Instruct: distillation tool, evaluation, shipped weights.

``default/`` holds what ships in the repository: the draft's non-embedding
weights (``draft.safetensors``, float16), ``draft-config.json``,
``provenance.json`` (how it was made) and ``eval.json`` (how good it is).
:func:`prepare_default_draft` assembles them with the prepared target's
embedding into a plain Llama checkpoint in the model cache; that checkpoint
is what vLLM loads as ``speculative_config["model"]``.

Modules: ``prompts`` (training and held-out prompts), ``teacher`` (target
samples and distributions), ``student`` (the draft and its assembly),
``train`` (distillation), ``distill`` (the ``distill-draft`` command),
``evaluate`` (the ``eval-draft`` command).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = Path(__file__).parent / "default"
DRAFT_NAME = "smollm2-135m-instruct-draft"


def shipped_source(shipped_dir: Path = DEFAULT_DIR) -> dict:
    """What an assembled draft is built from: recorded in its cache manifest."""
    from vllm_dsbd.model_cache import sha256_file
    from vllm_dsbd.draft.student import CONFIG, WEIGHTS

    return {
        "draft_weights_sha256": sha256_file(shipped_dir / WEIGHTS),
        "draft_config_sha256": sha256_file(shipped_dir / CONFIG),
        "dtype": "float32",
    }


def prepare_default_draft(target_dir: Path, cache_root: Path, shipped_dir: Path = DEFAULT_DIR) -> Path:
    """Assemble (once) the shipped draft with ``target_dir``'s embedding under ``cache_root``."""
    from vllm_dsbd.model_cache import build_atomically
    from vllm_dsbd.draft.student import assemble

    source = {**shipped_source(shipped_dir), "target": Path(target_dir).name}
    return build_atomically(
        Path(cache_root) / DRAFT_NAME, source, lambda out: assemble(shipped_dir, target_dir, out)
    )
