"""DSBD beam sampling (T > 0) against exact distributions, with planted bugs that must be caught.

Statistical protocol: every check draws ``NUM_SAMPLES`` complete outputs (see
``exact_dist``) with a fixed seed and runs a Pearson chi-square test against
the exact distribution computed by enumeration; it passes when p >= ALPHA.
Seeds are fixed, so each verdict is reproducible; with ALPHA = 1e-3 a correct
implementation would fail one such check in a thousand seeds. The
planted-bug variants (test-only monkeypatches of small internal functions of
``verify``) must give p < ALPHA, which shows each check has the power to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from exact_dist import ALPHA, chi2_pvalue, combined_pvalue, exact_beam_sampling, exact_sequences, no_gc
from planted_bugs import BUGS
from vllm_dsbd.algorithm import DecodeParams, dsbd_decode, verify, verify_forest
from vllm_dsbd.algorithm.toy import MarkovLM, perturbed_draft, random_markov

NUM_SAMPLES = 20_000


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int
    width: int
    gamma: int
    max_tokens: int
    agreement: float
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    zero_target_top: int = 0
    eos: int | None = None
    seed: int = 0

    def models(self) -> tuple[MarkovLM, MarkovLM]:
        target = random_markov(self.vocab, order=1, seed=self.seed)
        if self.agreement == 1.0:
            return target, target
        draft = perturbed_draft(target, self.agreement, seed=self.seed + 100, zero_target_top=self.zero_target_top)
        return target, draft

    def params(self, **overrides) -> DecodeParams:
        values = dict(beam_width=self.width, num_speculative_tokens=self.gamma, fixed_width=True,
                      temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                      max_tokens=self.max_tokens, eos_token_id=self.eos)
        values.update(overrides)
        return DecodeParams(**values)


PROMPT = (0,)
CASES = [
    Case("draft-equals-target", vocab=3, width=2, gamma=2, max_tokens=3, agreement=1.0, seed=1),
    Case("unrelated-draft", vocab=3, width=2, gamma=2, max_tokens=3, agreement=0.0, temperature=0.7, seed=2),
    Case("draft-zero-on-target-top", vocab=3, width=2, gamma=3, max_tokens=3, agreement=0.5, zero_target_top=1, seed=3),
    Case("top-k-top-p-on-joint", vocab=4, width=2, gamma=2, max_tokens=3, agreement=0.3, temperature=1.3,
         top_k=5, top_p=0.8, seed=4),
    Case("eos-inside-forest", vocab=3, width=2, gamma=2, max_tokens=4, agreement=0.4, eos=2, seed=5),
    Case("width-3-gamma-1", vocab=2, width=3, gamma=1, max_tokens=3, agreement=0.2, seed=6),
    Case("width-3-unrelated-draft", vocab=3, width=3, gamma=2, max_tokens=2, agreement=0.0, seed=14),
]
# Chosen for power: rejections followed by acceptances in the same layer are frequent here.
BUG_CASE = CASES[-1]


def complete_outputs(case: Case, target: MarkovLM, draft: MarkovLM, num: int = NUM_SAMPLES, **overrides) -> list:
    gen = torch.Generator().manual_seed(1000 + case.seed)
    with no_gc():
        result = dsbd_decode(target, draft, [list(PROMPT)] * num, case.params(**overrides), gen)
    return [tuple(sorted(h.token_ids for h in hyps)) for hyps in result.hypotheses]


def exact_outputs(case: Case, target: MarkovLM) -> dict:
    return exact_beam_sampling(target, PROMPT, case.width, case.max_tokens, case.temperature, case.top_k,
                               case.top_p, case.eos)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fixed_width_dsbd_matches_exact_beam_sampling(case: Case):
    """With fixed width, DSBD's complete outputs follow exact beam sampling's distribution."""
    target, draft = case.models()
    p = chi2_pvalue(complete_outputs(case, target, draft), exact_outputs(case, target))
    assert p >= ALPHA, f"{case.name}: p = {p:.2e}"


@pytest.mark.parametrize("bug", ["no-residual-update", "no-reset-after-acceptance"])
def test_fixed_width_check_detects_planted_bug(bug: str, monkeypatch):
    """The exactness check above fails on a broken verifier (fixed width has no invalid parents)."""
    target, draft = BUG_CASE.models()
    monkeypatch.setattr(verify, *BUGS[bug])
    p = chi2_pvalue(complete_outputs(BUG_CASE, target, draft), exact_outputs(BUG_CASE, target))
    assert p < ALPHA, f"{bug} not detected on {BUG_CASE.name}: p = {p:.2e}"


# --- dynamic width: invalid parents appear -----------------------------------------------------

DYN_V, DYN_W, DYN_SAMPLES = 3, 3, 12_000


def _logprobs(model: MarkovLM, last: torch.Tensor) -> torch.Tensor:
    """[..., V] float32 next-token log-probs of an order-1 model after token ``last``."""
    return torch.log_softmax(model.table[last], dim=-1)


def _dynamic_width_iteration(seed: int):
    """One DSBD iteration (γ = 2, τ = 0.9) from one root, the forest drafted here, verified by verify_forest."""
    target = random_markov(DYN_V, order=1, seed=seed)
    draft = perturbed_draft(target, 0.3, seed=seed + 1)
    g, w, v = DYN_SAMPLES, DYN_W, DYN_V
    gen = torch.Generator().manual_seed(seed)
    root = torch.zeros(g, dtype=torch.long)
    # layer 1: W draws from the draft over the root; layer 2: W draws over the layer-1 nodes
    q1 = torch.zeros(g, w, v)
    q1[:, 0] = _logprobs(draft, root).exp()
    idx1 = torch.multinomial(q1.flatten(1), w, replacement=True, generator=gen)
    tok1 = idx1 % v
    score1 = _logprobs(draft, root).gather(1, tok1)  # draft scores of layer-1 nodes
    q2 = (score1[:, :, None] + _logprobs(draft, tok1)).flatten(1).exp()
    q2 = q2 / q2.sum(-1, keepdim=True)
    idx2 = torch.multinomial(q2, w, replacement=True, generator=gen)
    par2, tok2 = idx2 // v, idx2 % v
    target_lp = torch.zeros(g, 3, w, v)
    target_lp[:, 0, 0] = _logprobs(target, root)
    target_lp[:, 1] = _logprobs(target, tok1)
    target_lp[:, 2] = _logprobs(target, tok2)
    res = verify_forest(
        target_lp, torch.zeros(g, w, dtype=torch.float64), torch.arange(w)[None].expand(g, -1) == 0,
        torch.stack([q1.flatten(1), q2], 1), torch.stack([torch.zeros_like(par2), par2], 1),
        torch.stack([tok1, tok2], 1), torch.ones(g, 2, w, dtype=torch.bool), torch.full((g,), 2),
        torch.full((g,), 0.9), 1, w, gen,
    )
    return target, tok1, par2, tok2, res


def _layer2_first_slot_by_accepted_set(seed: int) -> tuple[list, int]:
    target, tok1, par2, tok2, res = _dynamic_width_iteration(seed)
    root_lp = _logprobs(target, torch.tensor(0)).double()
    groups: dict[tuple[int, ...], list] = {}
    for g in torch.nonzero(res.num_passed >= 1)[:, 0].tolist():
        accepted = tuple(sorted(tok1[g][res.accepted[g, 0]].tolist()))
        if res.num_passed[g] == 2:  # layer 2 passed: its first slot is its first accepted draft
            j = int(res.accepted[g, 1].nonzero()[0, 0])
            slot = (int(tok1[g, par2[g, j]]), int(tok2[g, j]))
        else:  # layer 2 failed: its first output is its first slot
            slot = (int(tok1[g, res.out_parent[g, 0]]), int(res.out_token[g, 0]))
        groups.setdefault(accepted, []).append(slot)
    checks = []
    for accepted, slots in groups.items():
        weights = {}
        for a in accepted:  # the exact target joint over the accepted beams
            for t, lp in enumerate(_logprobs(target, torch.tensor(a)).double().tolist()):
                weights[(a, t)] = weights.get((a, t), 0.0) + float(root_lp[a].exp()) * float(torch.tensor(lp).exp())
        total = sum(weights.values())
        checks.append((slots, {k: x / total for k, x in weights.items()}))
    return checks, int(res.widths[:, 0].max())


def test_dynamic_width_layer_slots_follow_target_joint_over_accepted_beams():
    """With dynamic width (invalid parents present), layer 2's first slot ~ target joint over accepted layer-1 beams."""
    checks, width1 = _layer2_first_slot_by_accepted_set(seed=11)
    assert width1 < DYN_W, "the case must keep fewer than W beams at layer 1, or no parent is invalid"
    p = combined_pvalue(checks)
    assert p >= ALPHA, f"p = {p:.2e}"


@pytest.mark.parametrize("bug", ["no-residual-update", "renormalised-restricted-draft", "invalid-parents-kept"])
def test_dynamic_width_check_detects_planted_bug(bug: str, monkeypatch):
    """The dynamic-width check fails on each broken verifier that touches a layer's first slot.

    (A missing reset changes later slots only; the fixed-width check catches it.)
    """
    monkeypatch.setattr(verify, *BUGS[bug])
    checks, _ = _layer2_first_slot_by_accepted_set(seed=11)
    p = combined_pvalue(checks)
    assert p < ALPHA, f"{bug} not detected: p = {p:.2e}"


# --- reductions and extremes ---------------------------------------------------------------------


def test_width_one_is_speculative_sampling():
    """W = 1: outputs are ancestral target samples and the first iteration accepts as standard speculative sampling."""
    case = Case("w1", vocab=3, width=1, gamma=3, max_tokens=4, agreement=0.3, temperature=0.9, seed=21)
    target, draft = case.models()
    gen = torch.Generator().manual_seed(21)
    with no_gc():
        result = dsbd_decode(target, draft, [list(PROMPT)] * NUM_SAMPLES, case.params(), gen)
    outputs = [hyps[0].token_ids for hyps in result.hypotheses]
    assert chi2_pvalue(outputs, exact_sequences(target, PROMPT, case.max_tokens, case.temperature)) >= ALPHA

    # Pr(first iteration passes layers 1..i with tokens x_1..x_i) = prod_l min(p, q)(x_l | x_<l)
    p_lp = exact_lp(target, case.temperature)
    q_lp = exact_lp(draft, case.temperature)
    reach = {(): 1.0}
    tail = [1.0]
    for _ in range(case.gamma):
        reach = {s + (t,): r * min(p_lp(s)[t], q_lp(s)[t]) for s, r in reach.items() for t in range(case.vocab)}
        tail.append(sum(reach.values()))
    expected = {k: tail[k] - (tail[k + 1] if k < case.gamma else 0.0) for k in range(case.gamma + 1)}
    first_passed = [passed[0] for passed in result.num_passed]
    assert chi2_pvalue(first_passed, expected) >= ALPHA


def exact_lp(model: MarkovLM, temperature: float):
    def probs(generated: tuple[int, ...]) -> list[float]:
        logits = model([list(PROMPT) + list(generated)])[0].double()
        return torch.softmax(logits / temperature, -1).tolist()

    return probs


def test_draft_equal_to_target_accepts_every_layer():
    """draft == target with fixed width: every layer passes, γ + 1 tokens per iteration up to max_tokens."""
    case = Case("same", vocab=4, width=3, gamma=3, max_tokens=9, agreement=1.0, seed=31)
    target, draft = case.models()
    result = dsbd_decode(target, draft, [[0], [1, 2]] * 50, case.params(), torch.Generator().manual_seed(0))
    for passed in result.num_passed:
        assert passed == [3, 3, 0]  # 4 + 4 tokens, then the last one from the bonus layer alone


def test_disjoint_draft_rejects_every_layer_and_stays_exact():
    """A draft with no mass where the target has any: nothing accepted, one token per iteration, still exact."""
    target = random_markov(4, order=1, seed=41).masked([2, 3])
    draft = random_markov(4, order=1, seed=42).masked([0, 1])
    case = Case("disjoint", vocab=4, width=2, gamma=2, max_tokens=3, agreement=0.0, seed=41)
    gen = torch.Generator().manual_seed(41)
    with no_gc():
        result = dsbd_decode(target, draft, [list(PROMPT)] * 5000, case.params(), gen)
    assert all(passed == [0, 0, 0] for passed in result.num_passed)
    outputs = [tuple(sorted(h.token_ids for h in hyps)) for hyps in result.hypotheses]
    assert chi2_pvalue(outputs, exact_outputs(case, target)) >= ALPHA


def test_max_tokens_bounds_every_hypothesis():
    """No hypothesis is longer than max_tokens; without EOS all have exactly max_tokens tokens."""
    for max_tokens in (1, 2, 5, 7):
        case = Case("len", vocab=5, width=3, gamma=4, max_tokens=max_tokens, agreement=0.7, seed=51)
        target, draft = case.models()
        result = dsbd_decode(target, draft, [[1, 2]] * 20, case.params(width_threshold=0.5, fixed_width=False),
                             torch.Generator().manual_seed(max_tokens))
        assert all(len(h.token_ids) == max_tokens for hyps in result.hypotheses for h in hyps)
        assert all(sum(p + 1 for p in passed) == max_tokens for passed in result.num_passed)


def test_memory_efficient_mode_carries_one_beam():
    """memory_efficient: each iteration ends with one live beam, so one hypothesis remains without EOS."""
    case = Case("mem", vocab=4, width=3, gamma=2, max_tokens=6, agreement=0.6, seed=61)
    target, draft = case.models()
    result = dsbd_decode(target, draft, [[0]] * 30, case.params(memory_efficient=True),
                         torch.Generator().manual_seed(0))
    assert all(len(hyps) == 1 and len(hyps[0].token_ids) == 6 for hyps in result.hypotheses)


def test_dynamic_width_respects_min_width_and_bounds():
    """Chosen widths stay within [min_width, W]; τ close to 0 keeps more beams than τ = 1 - ε on average."""
    case = Case("dyn", vocab=5, width=4, gamma=3, max_tokens=8, agreement=0.5, seed=71)
    target, draft = case.models()
    means = []
    for tau in (0.05, 0.95):
        params = case.params(fixed_width=False, width_threshold=tau, min_width=2)
        result = dsbd_decode(target, draft, [[0]] * 200, params, torch.Generator().manual_seed(1))
        widths = [w for it in result.widths for layer in it for w in layer]
        assert widths and all(2 <= w <= 4 for w in widths)
        means.append(sum(widths) / len(widths))
    assert means[0] > means[1]


def test_per_group_generators_make_groups_independent_of_the_batch():
    """With one generator per prompt, a prompt's output does not depend on the other prompts in the batch."""
    case = Case("gens", vocab=5, width=3, gamma=2, max_tokens=6, agreement=0.5, seed=81)
    target, draft = case.models()
    params = case.params(fixed_width=False, width_threshold=0.6)
    alone = dsbd_decode(target, draft, [[3]], params, [torch.Generator().manual_seed(7)])
    batch = dsbd_decode(target, draft, [[1], [3], [2, 2]], params,
                        [torch.Generator().manual_seed(s) for s in (5, 7, 9)])
    assert alone.hypotheses[0] == batch.hypotheses[1]
