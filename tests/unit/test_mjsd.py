"""MJSD (vllm_dsbd.algorithm.mjsd): the acceptance rule on hand-built numbers, and the reference decoder's
limits: τ = 0 accepts every path, a huge τ samples from the target, T = 0 is the target's greedy output."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dsbd.algorithm.mjsd import MJSDParams, accepted_length, mjsd_decode, token_logprobs
from vllm_dsbd.algorithm.toy import perturbed_draft, random_markov

from exact_dist import chi2_pvalue, exact_sequences


def _accept(target, draft, log_tau, num_tokens=None):
    t, d = torch.tensor([target], dtype=torch.float64), torch.tensor([draft], dtype=torch.float64)
    n = torch.tensor([len(target) if num_tokens is None else num_tokens])
    return int(accepted_length(t, d, n, torch.tensor([log_tau]))[0])


def test_the_longest_passing_prefix_is_accepted_not_the_first_failure():
    # per-token log P - log Q: -1.0, +0.9, -0.1 -> prefix sums -1.0, -0.1, -0.2
    assert _accept([-2.0, -0.1, -1.1], [-1.0, -1.0, -1.0], log_tau=-0.15) == 2
    assert _accept([-2.0, -0.1, -1.1], [-1.0, -1.0, -1.0], log_tau=-0.25) == 3
    assert _accept([-2.0, -0.1, -1.1], [-1.0, -1.0, -1.0], log_tau=-0.05) == 0  # none passes
    assert _accept([-0.5, -0.5], [-1.0, -1.0], log_tau=math.log(0.9)) == 2  # all accepted (then the bonus)
    assert _accept([-0.5, -0.5, -0.5], [-1.0, -1.0, -9.0], log_tau=0.0, num_tokens=2) == 2  # beyond the path
    assert _accept([float("-inf"), -0.1], [-1.0, -1.0], log_tau=-5.0) == 0  # P = 0 never passes


def test_tau_zero_accepts_every_path_and_a_huge_tau_none():
    target, draft = torch.randn(5, 4).log_softmax(-1), torch.randn(5, 4).log_softmax(-1)
    n = torch.tensor([4, 3, 1, 4, 2])
    assert accepted_length(target, draft, n, torch.full((5,), float("-inf"))).tolist() == n.tolist()
    assert accepted_length(target, draft, n, torch.full((5,), 1e9)).tolist() == [0] * 5


def test_token_logprobs_apply_temperature_top_k_top_p_and_one_hot_at_zero():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert token_logprobs(logits, 0.0).tolist() == [[0.0, float("-inf"), float("-inf"), float("-inf")]]
    raw = token_logprobs(logits, 0.0, one_hot_at_zero=False)
    assert torch.allclose(raw, logits.log_softmax(-1))
    k2 = token_logprobs(logits, 0.5, top_k=2).exp()[0]
    assert k2[2:].tolist() == [0.0, 0.0] and k2.sum().item() == pytest.approx(1.0)
    assert k2[0].item() == pytest.approx(1 / (1 + math.exp(-2.0)))


@pytest.mark.parametrize("tau", [0.3, 1.0, 5.0])
def test_temperature_zero_gives_the_target_greedy_output(tau):
    target = random_markov(6, order=2, seed=3)
    draft = perturbed_draft(target, 0.6, seed=4)
    params = MJSDParams(num_beams=3, num_speculative_tokens=3, tau=tau, temperature=0.0, max_tokens=12)
    got = mjsd_decode(target, draft, [[1, 2], [4]], params)
    for prompt, tokens in zip([[1, 2], [4]], got.tokens):
        seq = list(prompt)
        for _ in range(12):
            seq.append(int(target([seq])[0].argmax()))
        assert tokens == seq[len(prompt):]
    assert sum(map(sum, got.accepted)) > 0  # the draft was used


def test_tau_zero_accepts_every_draft_path():
    target = random_markov(5, order=2, seed=1)
    draft = perturbed_draft(target, 0.3, seed=2)
    got = mjsd_decode(target, draft, [[1]], MJSDParams(num_beams=2, num_speculative_tokens=3, tau=0.0,
                                                       max_tokens=13), torch.Generator().manual_seed(0))
    assert got.accepted[0] == got.path_lengths[0] == [3, 3, 3, 0]  # the last: no room for a draft
    assert len(got.tokens[0]) == 13


def test_a_huge_tau_samples_from_the_target_and_the_check_has_power():
    """Every token is a bonus draw: 3 tokens are distributed as the target's ancestral sampling (chi-square,
    4,000 seeds); the same samples reject the draft's distribution (a planted wrong sampler)."""
    target = random_markov(4, order=2, seed=7)
    draft = perturbed_draft(target, 0.2, seed=8)
    params = MJSDParams(num_beams=2, num_speculative_tokens=2, tau=1e6, temperature=1.0, max_tokens=3)
    samples = []
    for seed in range(4000):
        got = mjsd_decode(target, draft, [[1]], params, torch.Generator().manual_seed(seed))
        assert got.accepted[0] == [0, 0, 0]
        samples.append(tuple(got.tokens[0]))
    assert chi2_pvalue(samples, exact_sequences(target, (1,), 3)) > 1e-3
    assert chi2_pvalue(samples, exact_sequences(draft, (1,), 3)) < 1e-3


def test_eos_in_an_accepted_prefix_ends_the_sequence_without_a_bonus():
    target = random_markov(5, order=2, seed=5)
    table = target.table.clone()
    table[:, 0] += 3.0  # EOS (0) is likely
    from vllm_dsbd.algorithm.toy import MarkovLM

    eos_target = MarkovLM(table, 2)
    got = mjsd_decode(eos_target, eos_target, [[1, 2]], MJSDParams(num_beams=2, num_speculative_tokens=3, tau=0.0,
                                                                   eos_token_id=0, max_tokens=20),
                      torch.Generator().manual_seed(1))
    tokens = got.tokens[0]
    assert tokens[-1] == 0 and 0 not in tokens[:-1]


def test_bad_params_are_refused():
    for kw, message in [({"num_beams": 0}, "num_beams"), ({"num_speculative_tokens": 0}, "num_speculative"),
                        ({"tau": -1.0}, "tau"), ({"temperature": -0.5}, "temperature")]:
        with pytest.raises(ValueError, match=message):
            MJSDParams(**kw)


def _verify_step(tau, eos=None, temperature=1.0):
    """W 2, three draft layers, the path root 0 -> (1, 1) -> (2, 0) -> (3, 1) with tokens 1, 3, 4 (V 5).
    Per-token log P - log Q along it: -1.0, +0.9, -0.1 (prefix sums -1.0, -0.1, -0.2). The draft as the
    runner keeps it: at T > 0 each layer's joint (mass on its path node's parent slot only), at T 0 log-probs."""
    from vllm_dsbd.engine.protocol import VerifyStep

    def row(token, logprob):  # a distribution with `token` at exp(logprob), the rest spread evenly
        p = torch.full((5,), (1 - math.exp(logprob)) / 4)
        p[token] = math.exp(logprob)
        return p.log()

    target = torch.stack([row(1, -2.0), row(3, -0.1), row(4, -1.1), row(0, -0.01)])
    draft = torch.zeros((3, 2, 5))
    draft[0, 0], draft[1, 1], draft[2, 0] = row(1, -1.0), row(3, -1.0), row(4, -1.0)
    vs = VerifyStep(group_id="g", beam_width=2, temperature=temperature, top_k=0, top_p=1.0, length_penalty=1.0,
                    ignore_eos=False, eos_token_id=eos, seed=0, step=0, path_req_ids=("r",), paths=((0, 3, 4, 7),),
                    root_scores=(-0.5, float("-inf")), root_valid=(True, False),
                    draft_parents=((0, 0), (1, 1), (0, 0)), draft_tokens=((2, 1), (3, 0), (0, 4)),
                    draft_exists=((True,) * 2,) * 3, seq_len=4, num_out=2, width_threshold=1.0, min_width=1,
                    num_logprobs=0, mjsd_tau=tau)
    if temperature > 0:  # the runner keeps each layer's joint: 0.6 of its mass on the path node's parent row
        on_path = (torch.arange(2) == torch.tensor([0, 1, 0])[:, None])[..., None]
        draft = torch.where(on_path, 0.6 * draft.exp(), torch.full_like(draft, 0.4 / 5))
    return target, draft.reshape(3, -1), vs


@pytest.mark.parametrize("tau, passed", [(math.exp(-0.15), 2), (math.exp(-0.25), 3), (math.exp(-0.05), 0), (0.0, 3)])
def test_the_engine_step_accepts_the_longest_passing_prefix_then_draws_a_bonus(tau, passed):
    from vllm_dsbd.engine import mjsd_step

    target, draft, vs = _verify_step(tau)
    d = mjsd_step.verify([target], vs, draft)
    path, tokens = (0, 3, 4, 7), [1, 3, 4]
    assert d.num_passed == passed and not d.finished and len(d.beams) == 1
    (c,) = d.beams
    assert c.parent == path[passed] and [lp.logprob for lp in c.logprobs[:-1]] == pytest.approx(
        [float(target[i].log_softmax(-1)[t]) for i, t in enumerate(tokens[:passed])])
    assert target[passed].exp()[c.token] > 0  # the bonus comes from the target after the accepted prefix
    assert c.score == pytest.approx(-0.5 + sum(lp.logprob for lp in c.logprobs))
    assert d.num_proposed == [1, 1, 1] and d.num_accepted == [1] * passed + [0] * (3 - passed)


def test_the_engine_step_ends_at_an_accepted_eos_without_a_bonus():
    from vllm_dsbd.engine import mjsd_step

    target, draft, vs = _verify_step(0.0, eos=3)  # the second path token is EOS; τ 0 accepts all three
    d = mjsd_step.verify([target], vs, draft)
    assert d.num_passed == 1 and not d.beams
    (c,) = d.finished
    assert (c.parent, c.token, len(c.logprobs)) == (3, 3, 2)


def _nucleus_pair(vocab: int = 64):
    """Logits functions of a draft whose top-p joint keeps tokens its nodes' own nuclei drop, and a uniform
    target. The draft after token 1 (node A): 3 0.6, 4 0.3, 5 0.1; after 2 (node B): uniform over 6..63;
    after anything else: 1 or 2, 0.5 each. At step 2 with top_p 0.5, A and B weigh 0.5 each: the joint's
    nucleus is {A3, A4, A5} (B's tokens are each too small), while A's own nucleus is {3} alone."""
    def dist(last: int) -> torch.Tensor:
        p = torch.full((vocab,), 1e-12)
        if last == 1:
            p[3], p[4], p[5] = 0.6, 0.3, 0.1
        elif last == 2:
            p[6:] = 1.0 / (vocab - 6)
        else:
            p[1], p[2] = 0.5, 0.5
        return (p / p.sum()).log()

    def draft(rows):
        return torch.stack([dist(row[-1]) for row in rows])

    def target(rows):
        return torch.zeros((len(rows), vocab))

    return target, draft


def test_mjsd_q_is_the_distribution_the_draft_drew_from_under_top_p():
    """With top_p < 1 the draft draws from the joint's nucleus, which here keeps tokens 4 and 5 of node A
    that A's own nucleus drops. Q must be that joint's row, renormalised: with a huge τ no prefix then
    passes (every token is a target draw). Q from each node's own nucleus (the rule this replaced, planted
    here) gives those tokens log Q = -inf, so they pass any τ."""
    from vllm_dsbd.algorithm import mjsd
    from vllm_dsbd.algorithm.joint import restrict_joint

    target, draft = _nucleus_pair()
    params = MJSDParams(num_beams=2, num_speculative_tokens=2, tau=1e30, temperature=1.0, top_p=0.5,
                        max_tokens=60, ignore_eos=True)
    prompts = [[0]] * 6

    def run():
        out = mjsd_decode(target, draft, prompts, params, generator=[torch.Generator().manual_seed(s)
                                                                     for s in range(len(prompts))])
        return [l for per_prompt in out.accepted for l in per_prompt]

    accepted = run()
    assert len(accepted) >= 300 and set(accepted) == {0}
    real = mjsd.node_conditionals

    def per_node_nucleus(joint, width):  # each node's own top-p nucleus of its row
        rows = real(joint, width)
        return restrict_joint(rows, torch.zeros(width, dtype=torch.long), torch.full((width,), params.top_p))

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(mjsd, "node_conditionals", per_node_nucleus)
        planted = run()
    finally:
        mp.undo()
    assert sum(l > 0 for l in planted) >= 20  # a path token outside its node's nucleus passed a huge τ


def test_node_conditionals_read_at_drawn_nodes_equal_the_whole_table():
    """What verification reads of a draft layer (``node_conditionals_at``, one row sum per path node) is the
    whole table's entry bit for bit, drawn nodes finite; a slot without mass reads -inf."""
    from vllm_dsbd.algorithm.joint import joint_probs, sample_joint
    from vllm_dsbd.algorithm.mjsd import node_conditionals, node_conditionals_at

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        width, vocab = 1 + trial % 4, 50 + 37 * (trial % 5)
        scores = torch.randn((1, width), generator=g, dtype=torch.float64)
        valid = torch.rand((1, width), generator=g) < 0.8
        valid[0, 0] = True
        lp = torch.randn((1, width, vocab), generator=g).log_softmax(-1)
        joint = joint_probs(scores, valid, lp, torch.tensor([trial % 7]), torch.tensor([0.6 + 0.1 * (trial % 5)]))
        draws = sample_joint(joint, width, g)[0]
        parents, tokens = draws // vocab, draws % vocab
        got = node_conditionals_at(joint[0], width, parents, tokens)
        want = node_conditionals(joint[0], width)[parents, tokens]
        assert torch.equal(got, want) and bool(torch.isfinite(got).all())
        empty = (~valid[0]).nonzero()[:, 0]
        if len(empty):
            assert bool(torch.isneginf(node_conditionals_at(joint[0], width, empty[:1], tokens[:1])).all())

