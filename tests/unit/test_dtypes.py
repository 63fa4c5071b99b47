"""The dtype the demo, the examples and the benchmarks pick for this machine (``vllm_dsbd.dtypes``)."""

from __future__ import annotations

import argparse

import pytest

from vllm_dsbd import dtypes

AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_tile amx_bf16 amx_int8\n"
PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"


@pytest.mark.parametrize("cpuinfo, flags", [(AVX512_BF16, ["avx512_bf16"]), (AMX, ["amx_bf16"]), (PLAIN, []),
                                            ("", [])])
def test_native_bf16_flags_are_read_from_cpuinfo(cpuinfo, flags):
    assert dtypes.cpu_bf16_flags(cpuinfo) == flags


@pytest.mark.parametrize("cpuinfo", [AVX512_BF16, AMX])
def test_bf16_where_the_cpu_computes_it_natively(cpuinfo):
    choice = dtypes.machine_dtype(cpuinfo, gpu_bf16=False)
    assert choice.dtype == "bfloat16"
    assert "bf16" in choice.reason and dtypes.cpu_bf16_flags(cpuinfo)[0] in choice.reason


def test_float32_elsewhere_and_the_reason_says_why():
    choice = dtypes.machine_dtype(PLAIN, gpu_bf16=False)
    assert choice == dtypes.DtypeChoice("float32", choice.reason)
    assert "no native bf16" in choice.reason
    assert choice.as_dict() == {"dtype": "float32", "dtype_reason": choice.reason}


def test_a_gpu_with_bf16_gets_bf16_whatever_the_cpu():
    assert dtypes.machine_dtype(PLAIN, gpu_bf16=True).dtype == "bfloat16"


def test_this_machine_agrees_with_its_cpuinfo():
    want = "bfloat16" if dtypes.cpu_bf16_flags() else "float32"
    assert dtypes.resolve_dtype("auto").dtype == want


def test_an_explicit_dtype_is_kept_and_a_bad_one_refused_naming_the_option():
    assert dtypes.resolve_dtype("float32") == dtypes.DtypeChoice("float32", "asked for (--dtype float32)")
    with pytest.raises(ValueError, match=r"--dtype='fp16' is invalid; allowed: auto, float32, bfloat16"):
        dtypes.resolve_dtype("fp16")


def test_the_dtype_option_defaults_to_auto():
    parser = argparse.ArgumentParser()
    dtypes.add_dtype_argument(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "half"])


def test_the_demo_calls_a_t0_difference_a_bug_in_float32_and_names_the_rounding_in_bf16():
    """vllm_dsbd/demo.py: in float32 DSBD and in-engine beam search must agree (a difference is a bug); in
    bf16 a difference may be rounding of a near-tie (docs/dtype.md), so the demo says so and how to check."""
    from vllm_dsbd.demo import outputs_verdict

    for dtype in ("float32", "bfloat16"):
        assert outputs_verdict(True, dtype) == "the same outputs"
    assert "a bug" in outputs_verdict(False, "float32") and "float32" in outputs_verdict(False, "float32")
    bf16 = outputs_verdict(False, "bfloat16")
    assert "bug" not in bf16 and "docs/dtype.md" in bf16 and "--dtype float32" in bf16
