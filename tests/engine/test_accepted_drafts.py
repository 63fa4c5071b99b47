"""Distribution tests whose drafts are accepted: an EAGLE-3 head that agrees with its target, in a real engine.

A test that drafts with a random draft checks only the residual: every draft node is rejected and the
residual is the target itself. Here the target is a soft bigram model (the next token is a fixed
permutation of the current one, logit scale 0.5: within the top 3 the permutation's token holds most of
the mass, the two others share the rest), and the head predicts the permutation's token from the feature
of the position before, as EAGLE-3 lays out its inputs, at the same scale (tests/eagle3_heads.py). Its
first candidate is the target's, its others are not: drafts are accepted about four times in ten, layers
pass, fail after acceptances and end in residual draws beside accepted nodes. The draft-model mode drafts
with a draft *model* in draft steps instead (the same bigram at a sharper logit scale), the path of a pair
such as Qwen2.5-Coder 1.5B with its 0.5B draft. Each check asserts that
acceptance, compares the returned beam sets with exact beam sampling enumerated over Hugging Face logits
(chi-square), and has a planted twin in the engine path the same check rejects: the runner verifying
against the draft joint at four times the temperature the layer drew its nodes from.
"""

from __future__ import annotations

import pytest
from beam_checks import (  # tests/engine/beam_checks.py
    beam_sampling_pvalue, plant_draft_joint_at_another_temperature, recording_policy, sample_with_acceptances,
    start_spec_llm)

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"
SOFT = 0.5  # the permutation target's and head's logit scale
MODES = {  # (engine fixture, auto_depth)
    "in-step": ("soft_permutation_in_step_llm", False),
    "draft-steps": ("soft_permutation_llm", False),
    "in-step-auto-depth": ("soft_permutation_in_step_llm", True),
    "in-step-draft-vocabulary": ("soft_permutation_draft_vocab_llm", False),
    "draft-model": ("soft_permutation_draft_model_llm", False),
}
DRAFT_MODEL_SCALE = 1.0  # the draft model's logit scale: the target's first candidate, more sharply than the target


@pytest.fixture(scope="session")
def soft_permutation(tiny_pair, tmp_path_factory):
    """(target, head): the soft bigram target made from the tiny target and the head that agrees with it."""
    from eagle3_heads import write_permutation_head, write_permutation_target  # tests/eagle3_heads.py

    root = tmp_path_factory.mktemp("soft-permutation")
    target = write_permutation_target(tiny_pair.target, root / "target", logit_scale=SOFT)
    return target, write_permutation_head(target, root / "head", logit_scale=SOFT)


@pytest.fixture(scope="session")
def soft_permutation_draft_vocab_head(soft_permutation, tmp_path_factory):
    """The head with a draft vocabulary of a few tokens (``d2t``): the permutation's token after every token
    the requests can reach (the target's top 3 after the prompt, three layers deep), not the other two. The
    head proposes the target's first candidate; the others lie outside its vocabulary, so every draw of them
    is a residual draw from the target's mass outside the draft's columns."""
    import torch
    from eagle3_heads import write_permutation_head  # tests/eagle3_heads.py
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = soft_permutation[0]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    frontier, tokens = [AutoTokenizer.from_pretrained(str(target))(PROMPT).input_ids[-1]], set()
    for _ in range(3):  # a bigram model: the next token's logits depend on the current token alone
        with torch.inference_mode():
            top = model(input_ids=torch.tensor(frontier)[:, None]).logits[:, -1].topk(3).indices
        tokens |= set(top[:, 0].tolist())
        frontier = sorted(set(top.flatten().tolist()))
    root = tmp_path_factory.mktemp("soft-permutation-draft-vocab")
    return write_permutation_head(target, root / "head", logit_scale=SOFT, draft_tokens=tokens)


@pytest.fixture
def soft_permutation_draft_vocab_llm(engine_pool, soft_permutation, soft_permutation_draft_vocab_head):
    """The soft target (γ <= 2), the reduced-vocabulary head drafting inside the verify step."""
    return engine_pool.get("soft_permutation_draft_vocab_llm", lambda: start_spec_llm(
        soft_permutation[0], soft_permutation_draft_vocab_head, {}, gamma=2, knobs={"draft_in_step": True}))


@pytest.fixture
def soft_permutation_draft_model_llm(engine_pool, soft_permutation, tiny_pair, tmp_path_factory):
    """The soft target (γ <= 2) with a draft *model* in draft steps, as a pair like the Qwen pair runs: the same
    bigram made from the tiny target at a sharper logit scale, so it proposes the target's first candidate
    more often than the target draws it and its drafts are both accepted and rejected."""
    from eagle3_heads import write_permutation_target  # tests/eagle3_heads.py

    def start():
        root = tmp_path_factory.mktemp("soft-permutation-draft-model")
        draft = write_permutation_target(tiny_pair.target, root / "draft", logit_scale=DRAFT_MODEL_SCALE)
        return start_spec_llm(soft_permutation[0], draft, {}, gamma=2)

    return engine_pool.get("soft_permutation_draft_model_llm", start)


@pytest.fixture
def soft_permutation_llm(engine_pool, soft_permutation):
    """The soft pair (γ <= 2), the head drafting in draft steps."""
    return engine_pool.get("soft_permutation_llm", lambda: start_spec_llm(
        *soft_permutation, {}, gamma=2, knobs={"draft_in_step": False}))


@pytest.fixture
def soft_permutation_in_step_llm(engine_pool, soft_permutation):
    """The soft pair (γ <= 2), the head drafting inside the verify step."""
    return engine_pool.get("soft_permutation_in_step_llm", lambda: start_spec_llm(
        *soft_permutation, {}, gamma=2, knobs={"draft_in_step": True}))


def _requests(num: int, auto_depth: bool) -> list:
    """Fixed-width T 1 requests: W 2, γ 2 (with ``auto_depth``: at most 2, chosen per iteration), 3 tokens,
    top-k 3 on the joint, seeds 0 .. num - 1."""
    from vllm import SamplingParams

    extra = {"beam_width": 2, "num_speculative_tokens": 2, "fixed_width": True, "auto_depth": auto_depth}
    return [SamplingParams(n=2, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=seed,
                           extra_args=extra) for seed in range(num)]


def _sample(request, mode: str, num: int) -> list:
    """``num`` requests on the mode's engine, at least 0.3 of the proposed draft nodes accepted. With
    ``auto_depth`` the engine is told draft steps cost almost nothing (the measured costs of the tiny models
    make depth 0 the choice), so it speculates while its acceptance estimate is high: mixed depths."""
    fixture, auto_depth = MODES[mode]
    llm = request.getfixturevalue(fixture)
    chosen = recording_policy(llm, 1e-4, 1.0) if auto_depth else None
    outs = sample_with_acceptances(llm, PROMPT, _requests(num, auto_depth), min_acceptance=0.3)
    if auto_depth:
        assert {0, 2} <= set(chosen) or {1, 2} <= set(chosen), sorted(set(chosen))  # depths were chosen, mixed
    return outs


@pytest.mark.parametrize("mode", list(MODES))
def test_a_head_whose_drafts_are_accepted_gives_beam_samplings_distribution(request, soft_permutation, mode):
    """2,000 seeded requests: the sets of returned sequences follow exact beam sampling."""
    outs = _sample(request, mode, 2000)
    assert beam_sampling_pvalue(outs, soft_permutation[0], 2, 3, 3) > 1e-3


@pytest.mark.parametrize("mode", ["in-step", "in-step-auto-depth", "draft-model"])
def test_the_accepted_head_check_rejects_verification_against_the_wrong_draft_joint(request, soft_permutation,
                                                                                   mode, monkeypatch):
    """The same check on an engine whose runner keeps the draft joint at 4x the temperature the layer drew
    from (measured: p ~ 1e-8 at 2,000 requests; 1e-2 at 0.5x or 2x with 1,200, too weak to plant)."""
    plant_draft_joint_at_another_temperature(monkeypatch, 4.0)
    outs = _sample(request, mode, 1500)
    assert beam_sampling_pvalue(outs, soft_permutation[0], 2, 3, 3) < 1e-3


def _plant_outside_mass_dropped(monkeypatch) -> None:
    """A planted bug in the path a reduced-vocabulary draft's verification takes: the target's mass outside
    the draft's columns is dropped (its outside entry set to 0), so a residual never draws a token the draft
    cannot propose."""
    from vllm_dsbd.algorithm import draft_columns

    original = draft_columns.DraftColumns.target

    def planted(self, target):
        compact, outside = original(self, target)
        compact.view(compact.shape[0], self.width, self.row)[..., -1] = 0.0
        return compact, outside

    monkeypatch.setattr(draft_columns.DraftColumns, "target", planted)


def test_the_draft_vocabulary_check_rejects_dropping_the_mass_outside_it(request, soft_permutation, monkeypatch):
    """The reduced-vocabulary check on an engine whose verification drops the target's mass outside the
    draft's columns."""
    _plant_outside_mass_dropped(monkeypatch)
    outs = _sample(request, "in-step-draft-vocabulary", 1500)
    assert beam_sampling_pvalue(outs, soft_permutation[0], 2, 3, 3) < 1e-3


def _mixed_jobs() -> list:
    """A batch of head-drafted groups of every kind, seeded, 8 tokens each: fixed width (W 2-3, γ 1-2),
    dynamic width, T 0, memory-efficient and MJSD."""
    from beam_checks import PROMPTS  # tests/engine/beam_checks.py
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(width, gamma, temperature=1.0, seed=None, n=None, **extra):
        return SamplingParams(n=n or width, temperature=temperature, top_k=3, max_tokens=8, ignore_eos=True,
                              seed=seed, output_kind=RequestOutputKind.FINAL_ONLY,
                              extra_args={"beam_width": width, "num_speculative_tokens": gamma, **extra})

    jobs = [(PROMPTS[k % 3], params(2, 2, seed=k, fixed_width=True)) for k in range(4)]
    return jobs + [(PROMPTS[1], params(3, 1, seed=7, fixed_width=True)), (PROMPTS[2], params(4, 2, seed=8)),
                   (PROMPTS[0], params(3, 2, temperature=0.0)),
                   (PROMPTS[2], params(3, 2, seed=9, n=1, fixed_width=True, memory_efficient=True)),
                   (PROMPTS[1], params(2, 2, seed=10, n=1, decoder="mjsd"))]


def _staggered(llm, jobs: list, order: list[int], steps: int) -> list:
    """Each job's beams when the jobs are added in ``order``: the first half, then ``steps`` engine steps
    later (those groups mid-decoding) the second half."""
    engine, got = llm.llm_engine, {}
    half = len(order) // 2
    ids = [f"staggered-{k}" for k in range(len(jobs))]

    def add(ks):
        for k in ks:
            engine.add_request(ids[k], *jobs[k])

    def step():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [c.token_ids for c in out.outputs]

    try:
        add(order[:half])
        for _ in range(steps):
            step()
        assert len(got) < half, "the first groups ended before the others joined"
        add(order[half:])
        for _ in range(1000):
            step()
            if not engine.has_unfinished_requests():
                break
    finally:  # never leave requests behind for the tests sharing this engine
        engine.abort_request(ids, internal=False)
    return [got[rid] for rid in ids]


def _batch_dependent(llm) -> list[int]:
    """The jobs of :func:`_mixed_jobs` whose beams, run together in reverse order or joining mid-run, differ
    from their solo runs' (drafts accepted throughout: at least 0.3 of the proposed nodes)."""
    from beam_checks import engine_metric  # tests/engine/beam_checks.py

    jobs = _mixed_jobs()
    names = [f"vllm:spec_decode_num_{k}" for k in ("draft_tokens", "accepted_tokens")]
    before = [engine_metric(llm, n) for n in names]
    alone = [[c.token_ids for c in llm.generate([p], s, use_tqdm=False)[0].outputs] for p, s in jobs]
    backwards = llm.generate([p for p, _ in jobs[::-1]], [s for _, s in jobs[::-1]], use_tqdm=False)[::-1]
    joined = _staggered(llm, jobs, list(range(1, len(jobs), 2)) + list(range(0, len(jobs), 2)), steps=3)
    proposed, accepted = (engine_metric(llm, n) - b for n, b in zip(names, before))
    assert accepted >= 0.3 * proposed > 0, (accepted, proposed)
    return [k for k, (a, b, j) in enumerate(zip(alone, backwards, joined))
            if a != [c.token_ids for c in b.outputs] or a != j]


def test_a_groups_beams_do_not_depend_on_the_groups_sharing_its_steps(soft_permutation_in_step_llm, monkeypatch):
    """Every group drafting inside the verify step draws its next forest in one batched head forward with the
    others (several groups per drawing, asserted); each group's draws use its own seed. Run alone, together
    in reverse order, or joining while the others are mid-decoding, each group returns the same beams."""
    from vllm_dsbd.engine import forest_draft

    drawn, draw = [], forest_draft.draw
    monkeypatch.setattr(forest_draft, "draw", lambda runner, jobs: (drawn.append(len(jobs)), draw(runner, jobs)))
    assert _batch_dependent(soft_permutation_in_step_llm) == []
    assert max(drawn) >= 4, drawn


def test_the_batch_check_rejects_draft_draws_shared_across_groups(soft_permutation_in_step_llm, monkeypatch):
    """The same check on an engine whose draft layers draw from one stream shared by every group (a group's
    draws then depend on the groups drawn before it)."""
    import torch

    from vllm_dsbd.engine import spec_step

    shared = torch.Generator().manual_seed(0)
    monkeypatch.setattr(spec_step, "generator", lambda *args, **kwargs: shared)
    assert _batch_dependent(soft_permutation_in_step_llm) != []
