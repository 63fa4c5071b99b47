"""Each vLLM patch: upstream unchanged under it, and its effect (no engine start)."""

from __future__ import annotations

import json
import shutil

import pytest

import vllm_dsbd
from vllm_dsbd.engine import patches


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_dsbd.register()


@pytest.mark.parametrize("qualname", sorted(patches.UPSTREAM_SHA256))
def test_upstream_source_under_each_patch_is_unchanged(qualname):
    fn = patches.upstream_function(qualname)
    assert patches.source_sha256(fn) == patches.UPSTREAM_SHA256[qualname], (
        f"vLLM changed {qualname}: re-check the patch in vllm_dsbd/engine/patches.py"
    )


def test_upstream_method_literal_still_has_draft_model_and_not_dsbd():
    from vllm.config import speculative as S

    upstream = patches._flatten_literal(S.SpeculativeMethod) - {"dsbd"}
    assert {"draft_model", "ngram", "eagle", "custom_class"} <= upstream


def test_speculative_config_accepts_dsbd_method():
    from vllm.config.speculative import SpeculativeConfig

    fields = SpeculativeConfig.__pydantic_fields__
    assert "dsbd" in patches._flatten_literal(fields["method"].annotation)


def _parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def test_cli_speculative_method_alias_and_spec_method_accept_dsbd():
    parser = _parser()
    a = parser.parse_args(["--speculative-method", "dsbd", "--speculative-config", '{"beam_width": 8}'])
    assert a.spec_method == "dsbd" and a.speculative_config == {"beam_width": 8}
    assert parser.parse_args(["--spec-method", "dsbd"]).spec_method == "dsbd"
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-method", "beams"])


def _engine_args(tiny_pair, **spec):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(tiny_pair.target),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        block_size=32,
        speculative_config={"method": "dsbd", "model": str(tiny_pair.draft), **spec},
    )


def test_valid_dsbd_config_is_validated_then_refused_clearly(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=3, beam_width=8, width_threshold=0.5)
    with pytest.raises(patches.DSBDEngineNotImplementedError, match=r"beam_width=8.*not implemented"):
        args.create_engine_config()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"num_speculative_tokens": 2, "beam_width": 0}, r"'beam_width'=0"),
        ({"num_speculative_tokens": 2, "width_threshold": 2}, r"'width_threshold'=2"),
        ({"num_speculative_tokens": 2, "beam_widht": 4}, r"Unknown key\(s\) \['beam_widht'\]"),
    ],
)
def test_bad_dsbd_knob_in_speculative_config(tiny_pair, spec, message):
    with pytest.raises(ValueError, match=message):
        _engine_args(tiny_pair, **spec).create_engine_config()


def test_dsbd_without_a_draft_model_is_refused(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=2)
    del args.speculative_config["model"]
    with pytest.raises(ValueError, match=r"'dsbd' needs a draft model"):
        args.create_engine_config()


def test_dsbd_without_speculation_is_refused_as_not_implemented(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=0)
    with pytest.raises(patches.DSBDEngineNotImplementedError, match=r"'num_speculative_tokens'=0"):
        args.create_engine_config()


def test_draft_with_another_vocabulary_is_refused(tiny_pair, tmp_path):
    draft = tmp_path / "other-vocab-draft"
    shutil.copytree(tiny_pair.draft, draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["vocab_size"] = 32000
    (draft / "config.json").write_text(json.dumps(cfg))
    args = _engine_args(tiny_pair, num_speculative_tokens=2)
    args.speculative_config["model"] = str(draft)
    with pytest.raises(ValueError, match=r"vocab_size=49152.*vocab_size=32000"):
        args.create_engine_config()
