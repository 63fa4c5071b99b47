"""benchmarks.bench_rows: the shapes it times and how it takes the prompt steps out of a row."""

from types import SimpleNamespace

import pytest

from benchmarks.bench_rows import decode_step, projection_shapes, time_gemms

SMOLLM2_135M = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                               intermediate_size=1536, vocab_size=49152, num_hidden_layers=30)


def test_projection_shapes_follow_the_config():
    shapes = projection_shapes(SMOLLM2_135M)
    assert shapes == {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                      "logits": (576, 49152)}
    # with head_dim given (Qwen-style configs may set it apart from hidden / heads)
    assert projection_shapes(SimpleNamespace(**{**vars(SMOLLM2_135M), "head_dim": 32}))["qkv"] == (576, 480)


def test_decode_step_takes_the_prompt_steps_out():
    full = {"beam": {"steps": 33.0, "tokens": 4 * 32 + 100, "forward_s": 0.33 + 0.05, "step_s": 0.40}}
    prompt = {"beam": {"steps": 1.0, "tokens": 100.0, "forward_s": 0.05, "step_s": 0.06}}
    step = decode_step(full, prompt, "beam")
    assert step["steps"] == 32 and step["rows"] == 4
    assert step["forward_ms"] == pytest.approx(330 / 32)
    assert step["step_ms"] == pytest.approx(340 / 32)
    assert decode_step(full, {}, "beam")["rows"] == pytest.approx(228 / 33)  # nothing to take out
    with pytest.raises(ValueError, match="no verify step"):
        decode_step(full, {}, "verify")


def test_time_gemms_times_every_number_of_rows():
    tiny = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                           vocab_size=256, num_hidden_layers=3)
    import torch

    out = time_gemms(tiny, torch.float32, rows=(1, 4), repeats=1, rounds=1)
    assert [g["rows"] for g in out] == [1, 4]
    for g in out:
        assert g["forward_ms"] == pytest.approx(3 * g["layer_ms"] + g["logits_ms"])
        assert g["layer_ms"] > 0 and g["logits_ms"] > 0
