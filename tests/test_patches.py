"""Each vLLM patch: upstream unchanged under it, and its effect (no engine start)."""

from __future__ import annotations

import json
import re
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
        f"vLLM changed {qualname}: re-check the patch in vllm_dsbd/engine/patches/"
    )


@pytest.mark.parametrize("qualname", sorted(patches.SUBCLASSED_SHA256))
def test_upstream_source_the_dsbd_engine_subclasses_is_unchanged(qualname):
    fn = patches.upstream_function(qualname)
    assert patches.source_sha256(fn) == patches.SUBCLASSED_SHA256[qualname], (
        f"vLLM changed {qualname}: re-check the DSBD scheduler/runner/worker in vllm_dsbd/engine/"
    )


def test_upstream_method_literal_still_has_draft_model_and_not_dsbd():
    from vllm.config import speculative as S

    upstream = patches._flatten_literal(S.SpeculativeMethod) - {"dsbd"}
    assert {"draft_model", "ngram", "eagle", "custom_class"} <= upstream


def test_prometheus_logger_builds_dsbd_spec_decoding_metrics_and_nothing_else_reads_their_carrier():
    """Patch 10's premise: vLLM's front end reads SpecDecodingStats.num_draft_tokens_per_pos nowhere."""
    import pathlib

    import vllm
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from vllm_dsbd.engine.metrics import DSBDSpecDecodingProm

    assert PrometheusStatLogger._spec_decoding_cls is DSBDSpecDecodingProm
    root = pathlib.Path(vllm.__file__).parent
    users = sorted(str(f.relative_to(root)) for f in root.rglob("*.py") if "num_draft_tokens_per_pos" in f.read_text())
    assert users == ["v1/spec_decode/metrics.py"]


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


def test_dsbd_with_a_draft_builds_a_speculative_engine(tiny_pair):
    """A draft and γ >= 1: vLLM loads the draft (draft_model-style KV), DSBD classes installed, prefix caching off."""
    from vllm_dsbd.config import DSBDConfig

    args = _engine_args(tiny_pair, num_speculative_tokens=3, beam_width=8, width_threshold=0.5)
    config = args.create_engine_config()
    assert config.speculative_config.method == "dsbd" and config.speculative_config.num_speculative_tokens == 3
    assert config.speculative_config.uses_draft_model()
    assert config.scheduler_config.scheduler_cls == patches.ENGINE_CLASSES["scheduler_cls"]
    assert not config.cache_config.enable_prefix_caching
    assert DSBDConfig.from_vllm_config(config) == DSBDConfig(beam_width=8, num_speculative_tokens=3,
                                                             width_threshold=0.5, draft_in_step=False)


def test_gamma_too_large_for_max_model_len_is_refused(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=40)
    args.max_model_len = 32
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'=40 does not fit max_model_len=32"):
        args.create_engine_config()


def test_dsbd_without_a_draft_installs_the_beam_engine(tiny_pair):
    """num_speculative_tokens=0: no vLLM speculative config; DSBD scheduler, worker and knobs installed."""
    from vllm_dsbd.config import DSBDConfig

    args = _engine_args(tiny_pair, num_speculative_tokens=0, beam_width=8, length_penalty=0.5)
    del args.speculative_config["model"]
    config = args.create_engine_config()
    assert config.speculative_config is None
    assert config.scheduler_config.scheduler_cls == patches.ENGINE_CLASSES["scheduler_cls"]
    assert config.parallel_config.worker_cls == patches.ENGINE_CLASSES["cpu_worker_cls"]
    assert not config.scheduler_config.async_scheduling
    assert DSBDConfig.from_vllm_config(config) == DSBDConfig(beam_width=8, num_speculative_tokens=0,
                                                             length_penalty=0.5, draft_in_step=False)


def test_other_engines_are_untouched(tiny_pair):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsbd.config import DSBDConfig

    config = EngineArgs(model=str(tiny_pair.target), dtype="float32", max_model_len=512, enforce_eager=True,
                        kv_cache_memory_bytes=256 << 20, block_size=32).create_engine_config()
    assert DSBDConfig.from_vllm_config(config) is None
    assert "dsbd" not in str(config.scheduler_config.scheduler_cls)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"num_speculative_tokens": 2, "beam_width": 0}, r"'beam_width'=0"),
        ({"num_speculative_tokens": 2, "width_threshold": 2}, r"'width_threshold'=2"),
        ({"num_speculative_tokens": 2, "beam_widht": 4}, r"Unknown key\(s\) \['beam_widht'\]"),
        ({"num_speculative_tokens": 0}, r"'num_speculative_tokens'=0 decodes beams without a draft"),
        ({"num_speculative_tokens": 2, "length_penalty": -1.0}, r"'length_penalty'=-1.0"),
        ({"num_speculative_tokens": 2, "draft_vocab_size": 49152},
         r"'draft_vocab_size'=49152 is not smaller than the draft's vocabulary \(49152\); allowed: 0 .* 1..49151"),
        ({"num_speculative_tokens": 2, "draft_vocab_size": -5}, r"'draft_vocab_size'=-5"),
        ({"num_speculative_tokens": 2, "draft_dtype": "fp8"},
         r"'draft_dtype'='fp8' is invalid; allowed: 'auto', 'float32', 'bfloat16', 'float16'"),
        ({"num_speculative_tokens": 2, "draft_dtype": "bf16"}, r"'draft_dtype'='bf16' is invalid"),
    ],
)
def test_bad_dsbd_knob_in_speculative_config(tiny_pair, spec, message):
    with pytest.raises(ValueError, match=message):
        _engine_args(tiny_pair, **spec).create_engine_config()


def test_draft_vocab_size_without_a_draft_is_refused(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=0, draft_vocab_size=1000)
    del args.speculative_config["model"]
    with pytest.raises(ValueError, match=r"'draft_vocab_size'=1000 shapes the draft's head.*uses no draft"):
        args.create_engine_config()


def test_draft_dtype_without_a_draft_is_refused(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=0, draft_dtype="bfloat16")
    del args.speculative_config["model"]
    with pytest.raises(ValueError, match=r"'draft_dtype'='bfloat16' sets the draft's dtype.*uses no draft"):
        args.create_engine_config()


def test_draft_in_step_needs_an_eagle3_head_and_a_draft(tiny_pair):
    with pytest.raises(ValueError, match=r"'draft_in_step'=True needs an EAGLE-3 head as the draft; .* is a causal LM"):
        _engine_args(tiny_pair, draft_in_step=True).create_engine_config()
    args = _engine_args(tiny_pair, num_speculative_tokens=0, draft_in_step=True)
    del args.speculative_config["model"]
    with pytest.raises(ValueError, match=r"'draft_in_step'=True drafts inside the verify step.*uses no draft"):
        args.create_engine_config()


@pytest.mark.parametrize("target, draft_dtype, want", [
    ("float32", "bfloat16", "bfloat16"), ("bfloat16", "float32", "float32"),
    ("bfloat16", "auto", "bfloat16"), ("float32", "auto", "float32"),
])
def test_the_draft_gets_its_own_dtype(tiny_pair, target, draft_dtype, want):
    import torch

    args = _engine_args(tiny_pair, num_speculative_tokens=2, draft_dtype=draft_dtype)
    args.dtype = target
    config = args.create_engine_config()
    assert config.model_config.dtype == getattr(torch, target)
    assert config.speculative_config.draft_model_config.dtype == getattr(torch, want)


def _head_engine_args(tiny_pair, tmp_path, layout="speculators", edit_config=None, edit_weights=None, **spec):
    """Engine args drafting with a random EAGLE-3 head for the tiny target, its config.json / weights edited."""
    import json

    from eagle3_heads import write_tiny_head  # tests/eagle3_heads.py
    from safetensors.torch import load_file, save_file

    head = write_tiny_head(tiny_pair.target, tmp_path / layout, layout)
    if edit_config is not None:
        config = json.loads((head / "config.json").read_text())
        edit_config(config)
        (head / "config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        weights = load_file(str(head / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(head / "model.safetensors"))
    args = _engine_args(tiny_pair, num_speculative_tokens=2, **spec)
    args.speculative_config["model"] = str(head)
    return args


@pytest.mark.parametrize("layout", ["speculators", "eagle3"])
def test_an_eagle3_head_is_a_dsbd_draft(tiny_pair, tmp_path, layout):
    """Both checkpoint layouts load as vLLM's EAGLE-3 head under "dsbd", with a rotary cache as long as the
    target's context (as vLLM's eagle3 method sizes it)."""
    def short_rope(config):
        (config.get("transformer_layer_config") or config)["max_position_embeddings"] = 64

    config = _head_engine_args(tiny_pair, tmp_path, layout, edit_config=short_rope).create_engine_config()
    head = config.speculative_config.draft_model_config.hf_config
    assert head.architectures[0] in ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
    assert head.draft_vocab_size == 1024 and head.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert head.max_position_embeddings == config.model_config.max_model_len == 512


@pytest.mark.parametrize("spec, want", [
    ({}, 0.75),  # the head's recommendation fills the unset knob
    ({"draft_temperature_scale": 1.0}, 1.0),  # the user's value wins
    ({"decoder": "mjsd"}, 1.0),  # MJSD compares likelihoods: no recommendation applies
])
def test_a_heads_dsbd_json_sets_the_knobs_the_user_left_unset(tiny_pair, tmp_path, spec, want):
    from vllm_dsbd.config import DRAFT_DEFAULTS_FILE, DSBDConfig

    args = _head_engine_args(tiny_pair, tmp_path, **spec)
    (tmp_path / "speculators" / DRAFT_DEFAULTS_FILE).write_text('{"draft_temperature_scale": 0.75}')
    assert DSBDConfig.from_vllm_config(args.create_engine_config()).draft_temperature_scale == want


@pytest.mark.parametrize("spec, want", [
    ({}, True),  # unset: a head on a CPU engine drafts inside the verify step
    ({"decoder": "mjsd"}, True),
    ({"draft_in_step": False}, False),  # the user's value wins
])
def test_a_head_on_cpu_drafts_inside_the_verify_step_unless_told_not_to(tiny_pair, tmp_path, spec, want):
    from vllm_dsbd.config import DSBDConfig

    config = _head_engine_args(tiny_pair, tmp_path, **spec).create_engine_config()
    assert DSBDConfig.from_vllm_config(config).draft_in_step is want


def test_a_draft_model_or_no_draft_drafts_in_draft_steps(tiny_pair):
    """Unset, ``draft_in_step`` is chosen off where it cannot run, and stored chosen (a request asking for it is
    then refused by the engine's config)."""
    from vllm_dsbd.config import DSBDConfig

    assert DSBDConfig.from_vllm_config(_engine_args(tiny_pair, num_speculative_tokens=2).create_engine_config()
                                       ).draft_in_step is False
    args = _engine_args(tiny_pair, num_speculative_tokens=0)
    del args.speculative_config["model"]
    assert DSBDConfig.from_vllm_config(args.create_engine_config()).draft_in_step is False


def test_a_head_off_cpu_drafts_in_draft_steps_and_refuses_draft_in_step(tiny_pair, tmp_path, monkeypatch):
    """On another platform (only ``is_cpu`` is faked, for the head's preparation alone) an unset knob is chosen
    off, and an explicit true is refused naming the knob."""
    from vllm.platforms import current_platform

    from vllm_dsbd.config import DSBDConfig
    from vllm_dsbd.engine.patches.engine_config import prepare_eagle3_head

    spec = _head_engine_args(tiny_pair, tmp_path, draft_in_step=False).create_engine_config().speculative_config
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert prepare_eagle3_head(spec, DSBDConfig(num_speculative_tokens=2)).draft_in_step is False
    with pytest.raises(ValueError, match=r"'draft_in_step'=True runs on CPU engines only .* Set draft_in_step to false"):
        prepare_eagle3_head(spec, DSBDConfig(num_speculative_tokens=2, draft_in_step=True))


def test_a_heads_bad_dsbd_json_is_refused_at_engine_start(tiny_pair, tmp_path):
    from vllm_dsbd.config import DRAFT_DEFAULTS_FILE

    args = _head_engine_args(tiny_pair, tmp_path)
    (tmp_path / "speculators" / DRAFT_DEFAULTS_FILE).write_text('{"width_threshold": 0.5}')
    with pytest.raises(ValueError, match=rf"{DRAFT_DEFAULTS_FILE} recommends \['width_threshold'\]"):
        args.create_engine_config()


def _set_layer_config(key, value):
    def edit(config):
        config["transformer_layer_config"][key] = value
    return edit


@pytest.mark.parametrize("edit_config, edit_weights, match", [
    (lambda c: c.update(target_hidden_size=32), None, r"target hidden states of size 32 \(target_hidden_size\), "
                                                       r"the target's hidden_size is 64"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 3]), None, r"aux layer ids \[0, 1, 3\] must lie "
                                                                             r"in 0..2"),
    (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), None, r"aux layer ids \[-1, 1, 2\] must lie in 0..2.*"
                                                                 r"set eagle_aux_hidden_state_layer_ids"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2]), None, r"its fc takes 3 aux hidden states, but "
                                                                          r"its aux layer ids \[0, 2\] name 2"),
    (_set_layer_config("hidden_size", 128), None, r"hidden_size 128 differs from the target's 64, and the head has "
                                                   r"no embeddings of its own"),
    (None, lambda w: w.update(d2t=w["d2t"] + 48500), r"d2t map \(1024 entries\) must send each of its "
                                                        r"draft_vocab_size=1024 ids to a distinct target id in 0..49151"),
    (None, lambda w: w.pop("d2t"), r"draft_vocab_size=1024 is not the target's vocabulary \(49152\), and the "
                                    r"checkpoint has no d2t map"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_naming_the_mismatch(tiny_pair, tmp_path, edit_config,
                                                                            edit_weights, match):
    args = _head_engine_args(tiny_pair, tmp_path, edit_config=edit_config, edit_weights=edit_weights)
    with pytest.raises(ValueError, match="EAGLE-3 head .*" + match):
        args.create_engine_config()


def _set_heads(heads, kv_heads):
    def edit(config):
        config["transformer_layer_config"].update(num_attention_heads=heads, num_key_value_heads=kv_heads,
                                                  head_dim=32)
    return edit


@pytest.mark.parametrize("heads, kv_heads, match", [
    (3, 1, r"The DSBD draft .*speculators is sharded like the target, so its heads must split over the "
           r"tensor-parallel size: .*Total number of attention heads \(3\) must be divisible by tensor parallel "
           r"size \(2\)\.$"),
    (4, 3, r"The DSBD draft .*speculators has 3 KV heads, which tensor_parallel_size=2 neither divides nor is a "
           r"multiple of \(vLLM shards or replicates them\); allowed for this draft: \[1\]"),
    (4, 1, None),  # one KV head, replicated on both ranks
])
def test_a_draft_whose_heads_do_not_split_over_tensor_parallel_ranks_is_refused(tiny_pair, tmp_path, heads,
                                                                                  kv_heads, match):
    """At config time, naming the draft: vLLM's own check names neither model, and a KV head count that is
    neither a divisor nor a multiple of the TP size passes it and fails each worker's model load."""
    args = _head_engine_args(tiny_pair, tmp_path, edit_config=_set_heads(heads, kv_heads))
    args.tensor_parallel_size = 2
    if match is None:
        config = args.create_engine_config()
        assert config.speculative_config.draft_model_config.get_total_num_kv_heads() == kv_heads
        return
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()


def test_a_small_draft_model_whose_heads_do_not_split_is_refused_naming_it(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=2)
    args.tensor_parallel_size = 2  # the tiny draft has one attention head
    with pytest.raises(ValueError, match=r"The DSBD draft .*tiny-draft is sharded like the target.*attention heads "
                                         r"\(1\) must be divisible by tensor parallel size \(2\)"):
        args.create_engine_config()


def test_draft_vocab_size_is_refused_with_an_eagle3_head(tiny_pair, tmp_path):
    args = _head_engine_args(tiny_pair, tmp_path, draft_vocab_size=500)
    with pytest.raises(ValueError, match=r"'draft_vocab_size'=500 cuts a draft model's vocabulary, but the draft .* "
                                         r"is an EAGLE-3 head \(Eagle3LlamaForCausalLM\).*remove the knob"):
        args.create_engine_config()


def test_dsbd_speculation_without_a_draft_model_is_refused(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=2)
    del args.speculative_config["model"]
    with pytest.raises(ValueError, match=r"needs a draft model.*num_speculative_tokens to 0"):
        args.create_engine_config()


def test_user_scheduler_or_worker_class_is_refused(tiny_pair):
    args = _engine_args(tiny_pair, num_speculative_tokens=0)
    del args.speculative_config["model"]
    args.worker_cls = "my.Worker"
    with pytest.raises(ValueError, match=r"installs its own worker"):
        args.create_engine_config()


def test_greedy_n_above_one_is_allowed_for_beam_requests_only():
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    assert SamplingParams(n=3, temperature=0.0, extra_args={"beam_width": 4}).n == 3
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=3, temperature=0.0)


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


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_use_beam_search_params_keep_the_requests_stop_rules(kind):
    """Patch 11: the server's BeamSearchParams carry `stop` and `stop_token_ids` into the beam request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_dsbd.entrypoints.beam_search import sampling_params_for

    common = dict(model="m", n=3, use_beam_search=True, length_penalty=0.5, stop_token_ids=[7, 9])
    if kind == "completion":
        request = CompletionRequest(prompt="p", stop="\n", **common)
    else:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "p"}], stop=["\n", "END"], **common)
    params = request.to_beam_search_params(8, {})
    beam = sampling_params_for(params)
    assert (params.beam_width, params.max_tokens, params.length_penalty) == (3, 8, 0.5)
    assert beam.stop == (["\n"] if kind == "completion" else ["\n", "END"]) and beam.stop_token_ids == [7, 9]
    assert beam.n == 3 and beam.extra_args["beam_width"] == 3 and beam.extra_args["length_penalty"] == 0.5
    none = sampling_params_for(CompletionRequest(model="m", prompt="p", n=2).to_beam_search_params(8, {}))
    assert none.stop == [] and none.stop_token_ids == []


def _beam_request(kind: str, **options):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    if kind == "completion":
        return CompletionRequest(model="m", prompt="p", n=2, use_beam_search=True, **options)
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "p"}], n=2, use_beam_search=True,
                                 **options)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("option", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"presence_penalty": 0.5},
                                    {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2},
                                    {"logit_bias": {"5": 2.0}}, {"min_tokens": 3}, {"bad_words": ["x"]},
                                    {"prompt_logprobs": 1}, {"allowed_token_ids": [1, 2]}])
def test_use_beam_search_refuses_options_a_search_does_not_apply_naming_them(kind, option):
    """Patch 11: vLLM's server dropped them without a word; on a DSBD engine they are refused by name."""
    from vllm_dsbd.engine.requests import BeamRequestError
    from vllm_dsbd.entrypoints.beam_search import sampling_params_for

    (name, value), = option.items()
    params = _beam_request(kind, **option).to_beam_search_params(8, {})
    with pytest.raises(BeamRequestError, match=re.escape(f"use_beam_search does not apply {name}={value!r}")):
        sampling_params_for(params)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_use_beam_search_takes_neutral_options_logprobs_and_dsbd_knobs(kind):
    from vllm_dsbd.entrypoints.beam_search import sampling_params_for

    neutral = dict(top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0,
                   seed=3, vllm_xargs={"num_speculative_tokens": 1, "beam_width": 2})
    logprobs = {"logprobs": 3} if kind == "completion" else {"logprobs": True, "top_logprobs": 3}
    beam = sampling_params_for(_beam_request(kind, **neutral, **logprobs).to_beam_search_params(8, {}))
    assert beam.logprobs == 3
    assert beam.extra_args == {"num_speculative_tokens": 1, "beam_width": 2, "decoder": "dsbd", "length_penalty": 1.0}
    plain = sampling_params_for(_beam_request(kind).to_beam_search_params(8, {}))
    assert plain.logprobs == 0 and plain.extra_args == {"beam_width": 2, "decoder": "dsbd", "length_penalty": 1.0}


@pytest.mark.parametrize("xargs, match", [({"beam_width": 4}, r"'beam_width'=4 contradicts n"),
                                          ({"decoder": "mjsd"}, r"'decoder'='mjsd' contradicts use_beam_search"),
                                          ({"length_penalty": 0.5}, r"'length_penalty'=0.5 contradicts length_penalty")])
def test_use_beam_search_refuses_vllm_xargs_that_contradict_it(xargs, match):
    from vllm_dsbd.engine.requests import BeamRequestError
    from vllm_dsbd.entrypoints.beam_search import sampling_params_for

    params = _beam_request("completion", length_penalty=2.0, vllm_xargs=xargs).to_beam_search_params(8, {})
    with pytest.raises(BeamRequestError, match=match):
        sampling_params_for(params)
    given_once = _beam_request("completion", vllm_xargs={"length_penalty": 0.5}).to_beam_search_params(8, {})
    assert sampling_params_for(given_once).extra_args["length_penalty"] == 0.5
