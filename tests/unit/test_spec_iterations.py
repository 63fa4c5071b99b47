"""DSBD iterations as the engine runs them (BeamGroup + spec_step), driven with toy target/draft models.

A mock scheduler carries out the group's operations on plain token lists;
the runner side is the real ``engine.spec_step``. References: the port of
vLLM's beam search (T = 0, lossless speculative beam search) and exact
enumeration of beam sampling (T > 0, fixed width).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exact_dist import chi2_pvalue, exact_beam_sampling
from vllm_dsbd.algorithm.reference import DecodeParams, beam_search
from vllm_dsbd.algorithm.toy import MarkovLM, perturbed_draft, random_markov
from vllm_dsbd.engine.beam_group import BeamGroup, BeamParams
from vllm_dsbd.engine.group_effects import Extend, Fork, Free, PathRequest
from benchmarks.toy_engine import Req, params, run_dsbd
from vllm_dsbd.engine.spec_step import DraftStore, draft_layer, expand_joint


def eos_prone(vocab, seed):
    model = random_markov(vocab, order=2, seed=seed)
    table = model.table.clone()
    table[:, 0] += 1.0
    return MarkovLM(table, 2)


@pytest.mark.parametrize("width, gamma, agreement, length_penalty, seed",
                         [(1, 1, 0.5, 1.0, 0), (2, 3, 0.9, 1.0, 1), (3, 2, 0.0, 0.5, 2), (3, 4, 1.0, 1.0, 3),
                          (4, 3, 0.7, 2.0, 4), (2, 5, 0.9, 1.0, 5)])
def test_lossless_speculative_beam_search_equals_vllm_beam_search(width, gamma, agreement, length_penalty, seed):
    """T = 0 through draft layers, paths and verification: token for token vLLM's beam search (EOS included)."""
    target = eos_prone(6, seed)
    draft = perturbed_draft(target, agreement, seed=seed + 100)
    prompt = [1, 2]
    ref = beam_search(target, [prompt], DecodeParams(beam_width=width, temperature=0.0, max_tokens=7,
                                                     length_penalty=length_penalty, eos_token_id=0,
                                                     num_speculative_tokens=0))[0]
    trace = []
    ours = run_dsbd(target, draft, prompt, params(beam_width=width, n=width, max_tokens=7,
                                                  num_speculative_tokens=gamma, length_penalty=length_penalty),
                    trace)
    assert [h.tokens for h in ours] == [h.token_ids for h in ref]
    assert [h.cum_score for h in ours] == pytest.approx([h.cum_logprob for h in ref], abs=1e-6)
    if agreement == 1.0:  # the draft is the target: every layer passes
        assert all(t[2] == t[3] for t in trace)


def test_an_iteration_restarted_after_preemption_is_verified_with_its_own_draft_layers():
    """Preemption restarts a group's iteration (same step) without telling the runner: a restart that drafts
    fewer layers than before must not be verified with (or refused over) the stale deeper joints."""
    store = DraftStore()
    old = [torch.full((8,), 0.125), torch.full((8,), 0.125)]
    store.put("g", 5, 1, old[0])
    store.put("g", 5, 2, old[1])  # preempted here: the iteration restarts with one layer
    new = torch.arange(8.0) / 28
    store.put("g", 5, 1, new)
    joints, support = store.take("g", 5, 1)
    assert torch.equal(joints, new[None]) and support is None and len(store) == 0
    store.put("g", 6, 1, new)
    with pytest.raises(RuntimeError, match="iteration 6 layers \\[1\\], verifying iteration 6 with 2 layers"):
        store.take("g", 6, 2)  # a real mismatch is still refused


def test_draft_equal_to_target_passes_every_layer():
    target = random_markov(5, order=2, seed=9)
    trace = []
    run_dsbd(target, target, [1], params(beam_width=2, n=2, max_tokens=9, num_speculative_tokens=3,
                                         temperature=1.0, seed=4), trace)
    # 4 + 4 + 1 tokens: the last iteration has room for no draft layer
    assert [t[0] for t in trace] == [3, 3, 0]
    assert all(t[2] == t[3] == [2] * len(t[2]) for t in trace)  # every draft node accepted


def fixed_width_samples(target, draft, prompt, width, max_tokens, support=None, **kw):
    """The sorted outputs of 4,000 seeded fixed-width DSBD runs (γ 2, T 1; ``kw``: more BeamParams)."""
    samples = []
    for seed in range(4000):
        hyps = run_dsbd(target, draft, prompt, params(beam_width=width, n=width, max_tokens=max_tokens,
                                                      temperature=1.0, ignore_eos=True, eos_token_id=None,
                                                      num_speculative_tokens=2, seed=seed, **kw), support=support)
        samples.append(tuple(sorted(h.tokens for h in hyps)))
    return samples


def assert_exact_fixed_width_sampling(target, draft, prompt, width, max_tokens, expected, support=None, **kw):
    """4,000 seeded fixed-width DSBD runs (:func:`fixed_width_samples`) are distributed as ``expected``
    (exact beam sampling, chi-square) and reject beam sampling with uniform parent weights (a planted bug)."""
    samples = fixed_width_samples(target, draft, prompt, width, max_tokens, support, **kw)
    assert chi2_pvalue(samples, expected) > 1e-3
    wrong = exact_beam_sampling(target, tuple(prompt), width, max_tokens, temperature=1.0, ignore_eos=True,
                                uniform_parents=True)
    assert chi2_pvalue(samples, wrong) < 1e-3


def test_fixed_width_dsbd_is_distributed_as_beam_sampling():
    """T > 0, fixed width, an imperfect draft: complete outputs against exact beam sampling (4,000 seeds);
    the same samples reject beam sampling with uniform parent weights (a planted bug)."""
    target = random_markov(4, order=2, seed=11)
    draft = perturbed_draft(target, 0.5, seed=12)
    prompt, width, max_tokens = [1], 2, 4
    expected = exact_beam_sampling(target, tuple(prompt), width, max_tokens, temperature=1.0, ignore_eos=True)
    assert_exact_fixed_width_sampling(target, draft, prompt, width, max_tokens, expected)


RESTRICTED_SUPPORT = torch.tensor([0, 1, 2])  # the restricted draft's proposable tokens


def _restricted_case():
    target = random_markov(4, order=2, seed=21)
    draft = perturbed_draft(target, 0.8, seed=22).masked([3])  # draft_vocab_size = 3
    return target, draft, [1], 2, 4


@pytest.mark.parametrize("support", [None, RESTRICTED_SUPPORT], ids=["over-all-tokens", "over-its-columns"])
def test_a_draft_restricted_to_the_low_token_ids_keeps_dsbd_exact(support):
    """A draft that computes only the lowest token ids (``draft_vocab_size``: q = 0 on the others):
    T = 0 is still vLLM's beam search, fixed-width T > 0 still exact beam sampling (4,000 seeds, chi-square;
    the planted uniform-parent bug is rejected). The target puts real mass on the dropped token. With its
    ``support`` the draft's joints are kept and verified over its own columns (``algorithm.draft_columns``)."""
    target, draft, prompt, width, max_tokens = _restricted_case()
    ref = beam_search(target, [prompt], DecodeParams(beam_width=width, temperature=0.0, max_tokens=max_tokens,
                                                     eos_token_id=None, num_speculative_tokens=0))[0]
    ours = run_dsbd(target, draft, prompt, params(beam_width=width, n=width, max_tokens=max_tokens,
                                                  eos_token_id=None, ignore_eos=True, num_speculative_tokens=2),
                    support=support)
    assert [h.tokens for h in ours] == [h.token_ids for h in ref]
    expected = exact_beam_sampling(target, tuple(prompt), width, max_tokens, temperature=1.0, ignore_eos=True)
    assert sum(p for seq, p in expected.items() if any(3 in beam for beam in seq)) > 0.3
    assert_exact_fixed_width_sampling(target, draft, prompt, width, max_tokens, expected, support)


def test_verifying_over_the_drafts_columns_without_the_outside_mass_is_caught(monkeypatch):
    """Planted bug: a layer compacted to the draft's columns without each parent's mass outside them (the
    outside entry 0) is no longer beam sampling, and the chi-square check of the test above rejects it."""
    from vllm_dsbd.algorithm import draft_columns

    honest = draft_columns.DraftColumns.target

    def without_outside(self, target):
        compact, outside = honest(self, target)
        compact.view(target.shape[0], self.width, self.row)[:, :, -1] = 0
        return compact, outside

    monkeypatch.setattr(draft_columns.DraftColumns, "target", without_outside)
    target, draft, prompt, width, max_tokens = _restricted_case()
    expected = exact_beam_sampling(target, tuple(prompt), width, max_tokens, temperature=1.0, ignore_eos=True)
    samples = fixed_width_samples(target, draft, prompt, width, max_tokens, RESTRICTED_SUPPORT)
    assert chi2_pvalue(samples, expected) < 1e-3


def test_a_draft_sampled_at_another_temperature_keeps_dsbd_exact():
    """``draft_temperature_scale``: each draft layer is drawn at T * scale, its Q recorded as such (the same
    draws and joint as a draft step at that temperature, not those at T), and fixed-width DSBD stays exact
    beam sampling (4,000 seeds, chi-square; the planted uniform-parent bug is rejected)."""
    from vllm_dsbd.engine.protocol import DraftStep

    logits = torch.randn((2, 50), generator=torch.Generator().manual_seed(0))
    ds = DraftStep(group_id="g", beam_width=3, temperature=0.8, top_k=0, top_p=1.0, length_penalty=1.0,
                   ignore_eos=False, eos_token_id=0, seed=1, step=2, layer=1, req_ids=("a", "b"), slots=(0, 2),
                   scores=(-0.5, -1.0), seq_len=4, draft_temperature_scale=0.5)
    rows = {"a": 0, "b": 1}
    decision, q = draft_layer(logits, rows, ds)
    at_04 = draft_layer(logits, rows, dataclasses.replace(ds, temperature=0.4, draft_temperature_scale=1))
    assert decision.tokens == at_04[0].tokens and decision.parents == at_04[0].parents and torch.equal(q, at_04[1])
    assert not torch.allclose(q, draft_layer(logits, rows, dataclasses.replace(ds, draft_temperature_scale=1))[1])

    target = random_markov(4, order=2, seed=11)
    draft = perturbed_draft(target, 0.5, seed=12)
    prompt, width, max_tokens = [1], 2, 4
    expected = exact_beam_sampling(target, tuple(prompt), width, max_tokens, temperature=1.0, ignore_eos=True)
    assert_exact_fixed_width_sampling(target, draft, prompt, width, max_tokens, expected, draft_temperature_scale=0.5)


def test_at_t0_the_draft_ranks_its_candidates_at_its_scaled_temperature():
    """At T 0 a draft layer proposes the W best of beam score + log_softmax(z / scale): a scale below 1 lets a
    confident beam's candidate overtake a flat beam's, as it would at scale 1 only with a sharper draft."""
    from vllm_dsbd.engine.protocol import DraftStep

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # beam a: flat; beam b: leans to token 0
    ds = DraftStep(group_id="g", beam_width=2, temperature=0.0, top_k=0, top_p=1.0, length_penalty=1.0,
                   ignore_eos=True, eos_token_id=None, seed=1, step=0, layer=1, req_ids=("a", "b"), slots=(0, 1),
                   scores=(0.0, -1.2), seq_len=4)
    rows = {"a": 0, "b": 1}
    for scale in (1.0, 0.25):
        want = sorted(((score + float(torch.log_softmax(logits[p] / scale, -1)[t]), p, t)
                       for p, score in enumerate(ds.scores) for t in range(4)), key=lambda c: -c[0])[:2]
        decision, _ = draft_layer(logits, rows, dataclasses.replace(ds, draft_temperature_scale=scale))
        assert sorted(zip(decision.parents, decision.tokens)) == sorted((p, t) for _, p, t in want)
        assert sorted(decision.scores) == pytest.approx(sorted(c[0] for c in want))
        assert (1 in decision.parents) == (scale == 0.25)  # at 0.25 beam b's token 0 (-1.255) beats a's (-1.386)


@pytest.mark.parametrize("scale", [0.25, 3.0])
def test_lossless_speculative_beam_search_with_a_rescaled_draft(scale):
    """T = 0 with ``draft_temperature_scale``: other nodes are proposed, the same tokens come out."""
    target = eos_prone(6, 6)
    draft = perturbed_draft(target, 0.7, seed=106)
    prompt = [1, 2]
    ref = beam_search(target, [prompt], DecodeParams(beam_width=3, temperature=0.0, max_tokens=7, eos_token_id=0,
                                                     num_speculative_tokens=0))[0]
    ours = run_dsbd(target, draft, prompt, params(beam_width=3, n=3, max_tokens=7, num_speculative_tokens=3,
                                                  draft_temperature_scale=scale))
    assert [h.tokens for h in ours] == [h.token_ids for h in ref]
    assert [h.cum_score for h in ours] == pytest.approx([h.cum_logprob for h in ref], abs=1e-6)


def test_memory_efficient_mode_carries_one_beam_between_iterations():
    """W_out = 1: after every verification the group holds exactly one live request."""
    target = random_markov(5, order=2, seed=3)
    draft = perturbed_draft(target, 0.6, seed=4)
    trace = []
    hyps = run_dsbd(target, draft, [1, 2], params(beam_width=3, n=1, max_tokens=10, temperature=1.0, seed=1,
                                                  ignore_eos=True, memory_efficient=True,
                                                  width_threshold=0.5), trace)
    assert all(t[1] == 1 for t in trace)
    assert len(hyps[0].tokens) == 10


def test_a_leaf_drawn_twice_is_verified_once_and_its_beams_continue_on_its_twin():
    """γ 1, W 3, one beam: the draft draws (root, 7) twice and (root, 8) once. The verify step carries two
    paths, the repeated leaf is an alias of the first, and the new beams drawn from the repeated leaf
    continue on the first leaf's request: one extends it, the other forks it."""
    from vllm_dsbd.engine.protocol import DraftDecision, VerifyChoice, VerifyDecision

    root = Req("root", [1, 2])
    group = BeamGroup("g", ["u"], 2, params(beam_width=3, n=3, temperature=1.0, num_speculative_tokens=1,
                                            max_tokens=5), root)
    group.start_iteration()
    effects = group.apply_draft(DraftDecision("g", [0, 0, 0], [7, 8, 7], [-0.1, -1.0, -0.1]))
    paths = [op for op in effects.ops if isinstance(op, PathRequest)]
    assert [p.spec_tokens for p in paths] == [[7], [8]]
    paths[0].request, paths[1].request = Req("p0", [1, 2]), Req("p1", [1, 2])  # as the scheduler does
    vs = group.verify_plan()
    first_leaf, second_leaf, repeated_leaf = 3, 4, 5  # node ids of layer 1, slots 0-2
    assert vs.paths == ((0, first_leaf), (0, second_leaf)) and vs.aliases == ((repeated_leaf, first_leaf),)
    beams = [VerifyChoice(repeated_leaf, 9, -1.0, ()), VerifyChoice(first_leaf, 10, -2.0, ()),
             VerifyChoice(second_leaf, 11, -3.0, ())]
    effects = group.apply_verify(VerifyDecision("g", 1, beams, [], [3], [3], [3, 3]))
    extends = [(op.request.request_id, op.tokens) for op in effects.ops if isinstance(op, Extend)]
    forks = [(op.parent.request_id, op.token) for op in effects.ops if isinstance(op, Fork)]
    assert extends == [("p0", [7]), ("p0", [9]), ("p1", [8]), ("p1", [11])]
    assert forks == [("p0", 10)]
    assert [b.tokens for b in group.beams] == [[7, 9], [7, 10], [8, 11]]
    assert not any(isinstance(op, Free) for op in effects.ops)  # both path requests carry new beams


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.9)])
def test_a_heads_draft_layer_draws_what_sampling_over_the_whole_vocabulary_draws(top_k, top_p):
    """An EAGLE-3 head's logits are -inf outside its draft vocabulary, so draft_layer samples over those
    columns only (its ``support``, the runner's ``_draft_support``). Per seed it draws the same nodes, with the
    same scores and the same joint Q (0 outside the draft vocabulary), as the joint over all V tokens does."""
    from vllm_dsbd.algorithm import joint_probs, sample_joint, tempered_logprobs
    from vllm_dsbd.engine.protocol import DraftStep
    from vllm_dsbd.engine.streams import generator

    width, vocab = 4, 1000
    gen = torch.Generator().manual_seed(3)
    own = torch.randperm(vocab, generator=gen)[:300]  # the head's draft vocabulary, in no particular order
    for seed in range(40):
        logits = torch.full((3, vocab), float("-inf"))
        logits[:, own] = 2.0 * torch.randn((3, own.numel()), generator=gen)
        ds = DraftStep(group_id="g", beam_width=width, temperature=0.8, top_k=top_k, top_p=top_p,
                       length_penalty=1.0, ignore_eos=False, eos_token_id=0, seed=seed, step=5, layer=2,
                       req_ids=("a", "b", "c"), slots=(0, 2, 3), scores=(-0.5, -1.0, -2.5), seq_len=9)
        decision, q = draft_layer(logits, {"a": 0, "b": 1, "c": 2}, ds, own.sort().values)
        # a head's logits over its draft vocabulary's columns only (in-step drafting) draw the same
        columns = draft_layer(logits[:, own.sort().values], {"a": 0, "b": 1, "c": 2}, ds, own.sort().values, vocab)
        assert columns[0] == decision and torch.equal(columns[1], q)
        q = expand_joint(q, own.sort().values, width, vocab)  # Q over the draft vocabulary's columns, 0 elsewhere

        lp = torch.zeros((width, vocab))
        lp[[0, 2, 3]] = tempered_logprobs(logits, 0.8)
        scores = torch.tensor([[-0.5, float("-inf"), -1.0, -2.5]], dtype=torch.float64)
        valid = torch.tensor([[True, False, True, True]])
        want_q = joint_probs(scores, valid, lp[None], torch.tensor([top_k]), torch.tensor([top_p]))
        draws = sample_joint(want_q, width, generator(seed, 5, 2))[0]
        assert decision.parents == (draws // vocab).tolist() and decision.tokens == (draws % vocab).tolist()
        assert decision.scores == pytest.approx((scores[0, draws // vocab] + lp[draws // vocab, draws % vocab]
                                                 .double()).tolist(), abs=1e-5)
        torch.testing.assert_close(q, want_q[0], atol=1e-6, rtol=1e-5)
        assert bool((q.view(width, vocab)[:, own.sort().values].sum() - 1).abs() < 1e-5)
    with pytest.raises(ValueError, match="need the support"):
        draft_layer(logits[:, own.sort().values], {"a": 0, "b": 1, "c": 2}, ds, None, vocab)


@pytest.mark.parametrize("ignore_eos, stop_token_ids", [(False, ()), (True, ()), (False, (0, 11))])
def test_a_heads_draft_layer_at_t0_searches_its_columns_as_the_whole_vocabulary(ignore_eos, stop_token_ids):
    """At T 0 the draft's beam-search step over a head's draft vocabulary only (its support, or logits over
    its columns as in-step drafting gives them) keeps the W candidates that the step over all V keeps: the
    same parents, token ids and scores (to rounding), EOS and stop tokens (inside the draft vocabulary)
    finishing as over V, ties inside the top 2W broken by token id as over V."""
    from vllm_dsbd.engine.protocol import DraftStep

    width, vocab = 4, 1000
    gen = torch.Generator().manual_seed(5)
    own = torch.cat([torch.tensor([0, 7, 11]), 12 + torch.randperm(vocab - 12, generator=gen)[:297]]).sort().values
    rows = {"a": 0, "b": 1, "c": 2}
    for trial in range(60):
        logits = torch.full((3, vocab), float("-inf"))
        logits[:, own] = 2.0 * torch.randn((3, own.numel()), generator=gen)
        if trial % 3 == 0:  # ties inside each row's top 2W (EOS 7 and the stop tokens 0, 11 tied first; a tie
            # across the top-2W cut is unspecified, as in vLLM's top-k): broken by token id
            logits[:, own[:3]] = logits.max(-1, keepdim=True).values + 1.0
        ds = DraftStep(group_id="g", beam_width=width, temperature=0.0, top_k=0, top_p=1.0,
                       length_penalty=1.0, ignore_eos=ignore_eos, eos_token_id=7, seed=trial, step=5, layer=1,
                       req_ids=("a", "b", "c"), slots=(0, 2, 3), scores=(-0.5, -1.0, -2.5), seq_len=9,
                       stop_token_ids=stop_token_ids, draft_temperature_scale=0.75)
        whole, _ = draft_layer(logits, rows, ds)
        on_columns, _ = draft_layer(logits, rows, ds, own)  # the support's columns of the V logits
        assert draft_layer(logits[:, own], rows, ds, own, vocab)[0] == on_columns  # logits over the columns only
        # the normaliser sums over K columns instead of V: the scores agree to rounding, the choices exactly
        assert (on_columns.parents, on_columns.tokens) == (whole.parents, whole.tokens)
        assert on_columns.scores == pytest.approx(whole.scores, abs=1e-5)
        assert len(whole.tokens) == width and all(t in own.tolist() for t in whole.tokens)


def test_a_draft_vocabulary_is_checked_against_the_drafts_logits():
    """The runner draws over a head's draft vocabulary (``i + d2t[i]``) only after checking once that the head
    gives no finite logit outside it; a vocabulary missing one proposable token is refused."""
    from types import SimpleNamespace

    from vllm_dsbd.engine.eagle3 import draft_vocabulary, draft_vocabulary_logits, draft_vocabulary_order
    from vllm_dsbd.engine.spec_step import check_support, proposable_tokens

    head = SimpleNamespace(draft_id_to_target_id=torch.tensor([5, 5, 0, 0]))  # draft ids 0..3 -> 5, 6, 2, 3
    support = draft_vocabulary(head)
    assert support.tolist() == [2, 3, 5, 6]
    assert draft_vocabulary(SimpleNamespace(draft_id_to_target_id=None)) is None
    # the head's own logits (draft ids 0..3) come out in the support's order: tokens 2, 3, 5, 6
    head.lm_head, head.logits_processor = None, lambda lm_head, hidden: hidden
    order = draft_vocabulary_order(head)
    assert draft_vocabulary_logits(head, torch.tensor([[10.0, 11.0, 12.0, 13.0]]), order).tolist() == [
        [12.0, 13.0, 10.0, 11.0]]
    assert draft_vocabulary_order(SimpleNamespace(draft_id_to_target_id=None)) is None
    assert proposable_tokens(support, 8) is support and proposable_tokens(support, 7) is None
    logits = torch.full((2, 8), float("-inf"))
    logits[0, 2], logits[1, 6] = 1.0, 0.5
    check_support(logits, support)
    logits[1, 7] = 0.0
    with pytest.raises(RuntimeError, match="outside its draft vocabulary of 4 .*token 7"):
        check_support(logits, support)


def test_every_random_stream_of_a_request_is_its_own():
    """A request's draft layers, verifications and beam steps draw from distinct generators at every
    iteration: a beam step that redrew a draft layer's uniforms made fixed-width DSBD inexact."""
    from vllm_dsbd.config import MAX_DRAFT_LAYERS
    from vllm_dsbd.engine import beam_step, streams

    assert MAX_DRAFT_LAYERS < streams.VERIFY_SALT < streams.BEAM_STEP_SALT < streams.STEP_STRIDE
    seen = {}
    for step in range(40):
        for purpose, g in [(("beam", step), beam_step.group_generator(7, step)),
                           (("verify", step), streams.generator(7, step, streams.VERIFY_SALT))] + [
                (("draft", step, layer), streams.generator(7, step, layer)) for layer in range(1, 9)]:
            first = tuple(torch.rand(4, generator=g).tolist())
            assert first not in seen, f"{purpose} draws what {seen[first]} draws"
            seen[first] = purpose
    with pytest.raises(ValueError, match="salt"):
        streams.generator(7, 0, streams.STEP_STRIDE)
