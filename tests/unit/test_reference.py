"""The reference decoders: exact beam sampling, argument checking, no-draft mode."""

from __future__ import annotations

import pytest
import torch

from exact_dist import ALPHA, chi2_pvalue, exact_beam_sampling, no_gc
from vllm_dsbd.algorithm import DecodeParams, beam_sampling, dsbd_decode
from vllm_dsbd.algorithm.toy import perturbed_draft, random_markov


def test_reference_beam_sampling_matches_enumeration():
    """beam_sampling's complete outputs (with EOS and top-p) follow the enumerated distribution."""
    target = random_markov(3, order=1, seed=91)
    params = DecodeParams(beam_width=2, temperature=0.8, top_p=0.9, max_tokens=3, eos_token_id=2)
    with no_gc():
        hyps = beam_sampling(target, [[0]] * 4000, params, torch.Generator().manual_seed(0))
    outputs = [tuple(sorted(h.token_ids for h in hs)) for hs in hyps]
    exact = exact_beam_sampling(target, (0,), 2, 3, 0.8, 0, 0.9, eos=2)
    assert chi2_pvalue(outputs, exact) >= ALPHA


def test_no_draft_mode_is_beam_sampling():
    """num_speculative_tokens = 0 needs no draft and samples exactly like beam sampling."""
    target = random_markov(3, order=1, seed=92)
    params = DecodeParams(beam_width=2, num_speculative_tokens=0, temperature=1.0, max_tokens=3)
    with no_gc():
        result = dsbd_decode(target, None, [[1]] * 10_000, params, torch.Generator().manual_seed(0))
    assert all(passed == [0, 0, 0] for passed in result.num_passed)
    outputs = [tuple(sorted(h.token_ids for h in hs)) for hs in result.hypotheses]
    assert chi2_pvalue(outputs, exact_beam_sampling(target, (1,), 2, 3)) >= ALPHA


def test_vocabulary_mismatch_is_refused():
    """A draft whose vocabulary differs from the target's is a ValueError naming both sizes."""
    target, draft = random_markov(6, seed=1), random_markov(5, seed=2)
    for temperature in (0.0, 1.0):
        params = DecodeParams(beam_width=2, num_speculative_tokens=2, temperature=temperature, max_tokens=3)
        with pytest.raises(ValueError, match="draft vocabulary size 5 differs from the target's 6"):
            dsbd_decode(target, draft, [[0]], params, torch.Generator())


@pytest.mark.parametrize(("knobs", "message"), [
    ({"beam_width": 0}, "beam_width"),
    ({"min_width": 5, "beam_width": 4}, "min_width"),
    ({"width_threshold": 0.0}, "width_threshold"),
    ({"temperature": 0.0, "top_k": 3}, "top_k/top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_knobs_are_refused(knobs: dict, message: str):
    """Invalid knob values raise ValueError naming the knob."""
    with pytest.raises(ValueError, match=message):
        DecodeParams(**knobs)


def test_sampling_without_generator_or_draft_is_refused():
    """Sampling needs an explicit generator; speculation needs a draft."""
    target = random_markov(4, seed=3)
    with pytest.raises(ValueError, match="Generator"):
        dsbd_decode(target, perturbed_draft(target, 0.5), [[0]], DecodeParams(temperature=1.0))
    with pytest.raises(ValueError, match="draft"):
        dsbd_decode(target, None, [[0]], DecodeParams(temperature=0.0))


def test_algorithm_package_imports_only_torch_and_stdlib():
    """vllm_dsbd.algorithm never imports vLLM (or anything beyond torch and the standard library)."""
    import ast
    import sys
    from pathlib import Path

    import vllm_dsbd.algorithm as algorithm

    allowed = {"torch", "vllm_dsbd", "__future__"} | set(sys.stdlib_module_names)
    for path in Path(algorithm.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                assert not name.startswith("vllm_dsbd") or name.startswith("vllm_dsbd.algorithm"), \
                    f"{path.name} imports {name}"
