"""The speculation-depth policy (auto_depth): cost fit, expected tokens, and the depth it picks."""

import random

import pytest

from vllm_dsbd.algorithm.depth import Batch, DepthPolicy, LinearCost, expected_tokens, iteration_seconds

KEY = (False, 1.0, 4, False, 0, 1.0)


def test_linear_cost_recovers_fixed_and_per_token_cost():
    cost = LinearCost()
    for n in (4, 8, 16, 4, 32, 8):
        cost.observe(n, 0.7 + 0.04 * n)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.7) and b == pytest.approx(0.04)
    assert cost.predict(12) == pytest.approx(0.7 + 0.48)


def test_linear_cost_with_one_step_size_splits_fixed_and_per_token_and_follows_a_slower_machine():
    cost = LinearCost(decay=0.5)
    assert cost.predict(4) is None
    cost.observe(4, 1.0)
    assert cost.coefficients() == pytest.approx((0.5, 0.125))
    for _ in range(20):  # the machine got twice as slow: old observations fade
        cost.observe(4, 2.0)
    assert cost.predict(4) == pytest.approx(2.0, rel=1e-4)


def test_expected_tokens_is_the_truncated_geometric_sum():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def _policy(draft_seconds_per_token: float, target_fixed: float = 0.7, target_per_token: float = 0.04,
            probe_budget: float = 0.05) -> DepthPolicy:
    policy = DepthPolicy(probe_budget=probe_budget)
    for n in (4, 8, 12, 40):  # a prefill and some verification steps
        policy.observe_step(False, n, target_fixed + target_per_token * n)
        policy.observe_step(True, n, 0.18 + draft_seconds_per_token * n)
    return policy


def test_no_measured_draft_means_one_layer_to_measure_it_and_no_depth_allowed_means_zero():
    policy = DepthPolicy()
    policy.observe_step(False, 4, 1.0)
    assert policy.choose(KEY, "g", max_depth=4, width=4, draft_lag=8) == 1
    assert policy.choose(KEY, "g", max_depth=0, width=4, draft_lag=8) == 0


def test_one_group_at_a_time_drafts_to_measure_the_costs_until_a_step_is_timed():
    """Under load every new group would otherwise draft one layer to measure the same costs: the first does,
    the others take depth 0 until a step has been timed; a look-ahead (no probing) still says one layer and
    does not hold the others back."""
    policy = DepthPolicy()
    batch = Batch(streams=16, other_tokens=60)
    assert policy.choose(KEY, "g0", max_depth=2, width=4, draft_lag=60, probe=False, batch=batch) == 1
    choices = [policy.choose(KEY, f"g{i}", max_depth=2, width=4, draft_lag=60, batch=batch, in_step=True)
               for i in range(16)]
    assert choices == [1] + [0] * 15
    policy.observe_step(False, 64, 0.3)  # a step ran: the target is timed, the drafting not yet
    assert [policy.choose(KEY, f"g{i}", max_depth=2, width=4, draft_lag=4, batch=batch, in_step=True)
            for i in range(3)] == [1, 0, 0]
    policy.observe_in_step(64, 0.05)  # the drafting was timed too: the model chooses from here on
    policy.observe_step(False, 128, 0.5)
    policy.observe_step(False, 64, 0.3)
    model = policy.choose(KEY, "g1", max_depth=2, width=4, draft_lag=4, batch=batch, in_step=True, probe=False)
    assert [policy.choose(KEY, f"g{i}", max_depth=2, width=4, draft_lag=4, batch=batch, in_step=True)
            for i in range(16)] == [model] * 16


def test_a_draft_that_always_passes_gets_depth_and_a_useless_one_none():
    """draft = target (every layer passes) on a cheap draft: speculate deep; a draft whose layers
    never pass: plain beam steps."""
    good = _policy(0.01)
    for _ in range(20):
        good.observe_iteration(KEY, "g", 3, 3)
    assert good.choose(KEY, "g", max_depth=4, width=4, draft_lag=8) >= 3

    useless = _policy(0.01)
    for _ in range(20):
        useless.observe_iteration(KEY, "g", 1, 0)
    assert useless.choose(KEY, "g", max_depth=4, width=4, draft_lag=8) == 0


def test_depth_maximises_the_modelled_rate():
    policy = _policy(0.01)
    for k in range(40):  # alpha about 0.7
        policy.observe_iteration(KEY, "g", 2, 2 if k % 10 < 5 else (1 if k % 10 < 7 else 0))
    alpha = policy.alpha(KEY, "g")
    seconds = [iteration_seconds(d, 4, 8, policy.draft, policy.target) for d in range(5)]
    rates = [expected_tokens(alpha, d) / seconds[d] for d in range(5)]
    # what speculation adds to a plain iteration counts 1 + margin times
    cautious = [expected_tokens(alpha, d) / (seconds[0] + (1 + policy.margin) * (seconds[d] - seconds[0]))
                for d in range(5)]
    best = max(range(5), key=cautious.__getitem__)
    assert policy.choose(KEY, "g", max_depth=4, width=4, draft_lag=8) == best
    assert best > 0 and max(rates) > rates[0] * 1.1  # the case is one where speculating pays
    assert cautious[best] < rates[best]


def test_iteration_seconds_alone_and_in_a_batch():
    """Alone, an iteration is its draft steps and one target step over its forest; in a batch the target
    step also computes the others' tokens and k drafting groups share each draft step's fixed cost."""
    policy = _policy(0.01)  # draft step: 0.18 + 0.01 n; target step: 0.7 + 0.04 n
    alone = iteration_seconds(2, 4, 8, policy.draft, policy.target)
    assert alone == pytest.approx((0.18 + 0.01 * 8) + (0.18 + 0.01 * 4) + 0.7 + 0.04 * 12)
    batch = Batch(streams=5, other_tokens=20, drafting=3)
    shared = iteration_seconds(2, 4, 8, policy.draft, policy.target, batch)
    assert shared == pytest.approx(2 * 0.18 / 3 + 0.01 * (8 + 4) + 0.7 + 0.04 * (20 + 12))
    assert iteration_seconds(0, 4, 8, policy.draft, policy.target, batch) == pytest.approx(0.7 + 0.04 * 24)
    with pytest.raises(ValueError, match="at least this group"):
        Batch(streams=0)


def test_a_draft_that_pays_alone_steps_aside_in_a_full_batch():
    """The same draft and acceptance: alone it speculates; among 15 other groups decoding 60 tokens per
    target step a draft step of its own stalls all of them, so depth 0 (rate (G - 1 + E) / seconds)."""
    policy = _policy(0.01, target_fixed=1.0, target_per_token=0.02)
    for _ in range(20):
        policy.observe_iteration(KEY, "g", 2, 2)
    assert policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=4, probe=False) >= 1
    crowd = Batch(streams=16, other_tokens=60, drafting=1)
    assert policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=4, probe=False, batch=crowd) == 0
    seconds = [iteration_seconds(d, 4, 4, policy.draft, policy.target, crowd) for d in range(4)]
    assert all((15 + expected_tokens(policy.alpha(KEY, "g"), d)) / seconds[d] < 16 / seconds[0] for d in (1, 2, 3))


def test_a_new_group_starts_from_the_engine_estimate_and_its_own_outcomes_move_it():
    policy = _policy(0.01)
    for k in range(50):
        policy.observe_iteration(KEY, f"old{k}", 3, 3)
    assert policy.alpha(KEY, "new") > 0.9
    for _ in range(30):
        policy.observe_iteration(KEY, "new", 3, 0)
    assert policy.alpha(KEY, "new") < 0.3
    assert policy.alpha(("other",), "fresh") == pytest.approx(0.5)  # other decoding kinds do not share


def _run_useless(policy: DepthPolicy, lag_per_zero: int, iterations: int = 500) -> list[int]:
    """Depths chosen for a draft whose layers pass 5 % of the time; the draft's lag grows by
    ``lag_per_zero`` tokens per depth-0 iteration and is caught up by a probe."""
    rng = random.Random(0)
    depths, lag = [], 8
    for _ in range(iterations):
        depth = policy.choose(KEY, "g", max_depth=4, width=4, draft_lag=lag)
        depths.append(depth)
        if depth:
            policy.observe_iteration(KEY, "g", depth, 0 if rng.random() < 0.95 else 1)
        lag = 8 if depth else lag + lag_per_zero
    return depths


def test_probes_of_a_useless_draft_thin_out():
    """While depth 0 wins, one probe (depth 1) after 4, 8, 16, ... choices: few over a long run."""
    policy = _policy(0.01)
    depths = _run_useless(policy, lag_per_zero=0)
    probes = [i for i, d in enumerate(depths) if d]
    assert 3 <= len(probes) <= 12
    assert all(d <= 1 for d in depths)
    assert probes[-1] - probes[-2] == policy.max_probe_interval


def test_probe_cost_stays_within_its_budget_when_the_draft_falls_behind():
    """The draft's catch-up grows with every depth-0 iteration; probes wait until their extra cost
    is at most probe_budget of the depth-0 time before them; a draft whose catch-up outgrows the
    budget (0.05 s/token against 0.04 s of budget per iteration) is never probed again."""
    assert sum(_run_useless(_policy(0.05), lag_per_zero=4)) == 0
    policy = _policy(0.005)
    depths = _run_useless(policy, lag_per_zero=4)
    probes = [i for i, d in enumerate(depths) if d]
    assert len(probes) >= 3
    plain = iteration_seconds(0, 4, 0, policy.draft, policy.target)
    for previous, probe in zip(probes, probes[1:]):
        lag = 8 + 4 * (probe - previous - 1)
        extra = iteration_seconds(1, 4, lag, policy.draft, policy.target) - plain
        # the depth-0 iterations since the last depth > 0 one, and the probe's own plain cost
        assert extra <= policy.probe_budget * plain * (probe - previous) * 1.001


def test_a_look_ahead_without_probing_neither_probes_nor_delays_the_next_probe():
    """choose(probe=False) (a group's admission) gives the model's choice: 0 for a useless draft even
    when a probe is due, and the due probe still comes at the next real choice."""
    policy, twin = _policy(0.001), _policy(0.001)
    for p in (policy, twin):
        for _ in range(20):
            p.observe_iteration(KEY, "g", 1, 0)
    due = None
    for i in range(40):
        assert policy.choose(KEY, "g", 4, 4, 8, probe=False) == 0  # never a probe, nothing recorded
        depth = policy.choose(KEY, "g", 4, 4, 8)
        assert depth == twin.choose(KEY, "g", 4, 4, 8)  # the look-aheads changed nothing
        if depth and due is None:
            due = i
    assert due is not None  # the probes did come


def test_in_a_batch_probes_stay_within_their_budget_of_the_engine_time():
    """16 groups of one decoding kind, each choosing once per target step, a useless draft: each choice
    counts its share (1/G) of the step, so all probes together cost at most probe_budget of the engine's
    time (counting a full step per choice would probe about G times as often)."""
    policy = _policy(0.05)  # a slow draft far behind: a probe costs 2.3 s, a step 3.3 s
    crowd = Batch(streams=16, other_tokens=60)
    for g in range(16):
        for _ in range(20):
            policy.observe_iteration(KEY, f"g{g}", 1, 0)
    num_steps, probes = 400, 0
    for _ in range(num_steps):
        for g in range(16):
            if policy.choose(KEY, f"g{g}", max_depth=4, width=4, draft_lag=40, batch=crowd):
                probes += 1
                policy.observe_iteration(KEY, f"g{g}", 1, 0)
    plain = iteration_seconds(0, 4, 40, policy.draft, policy.target, crowd)
    extra = iteration_seconds(1, 4, 40, policy.draft, policy.target, crowd) - plain
    assert probes >= 3
    assert probes * extra <= policy.probe_budget * num_steps * plain


def test_drafting_inside_the_verify_step_is_costed_by_its_own_timings_once_it_has_some():
    """In-step drafting has no draft steps: γ costs the target step plus d = a' + b' (lag + W γ) fitted on its
    own timings (by head rows: the lag tokens its head KV catches up on, then W a layer). Before any, the draft
    steps' cost stands in (the same choice); with a cheap measured d the same draft, whose draft steps cost
    too much to speculate deep, speculates deeper; after a long run of beam steps (a lag of 200 tokens) the
    catch-up makes it shallower again."""
    policy = _policy(0.05)  # draft step: 0.18 + 0.05 n, about a third of a target step
    for _ in range(20):
        policy.observe_iteration(KEY, "g", 2, 1)  # half the layers pass
    by_draft_steps = policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=4, probe=False)
    assert policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=4, probe=False, in_step=True) == by_draft_steps
    for layers in (1, 2, 3, 2):
        policy.observe_in_step(4 * layers, 0.01 + 0.005 * 4 * layers)
    assert iteration_seconds(2, 4, 4, policy.draft, policy.target, in_step=policy.in_step) == pytest.approx(
        0.01 + 0.005 * (4 + 8) + 0.7 + 0.04 * 12)
    deeper = policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=4, probe=False, in_step=True)
    assert deeper > by_draft_steps
    assert policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=200, probe=False, in_step=True) < deeper
    assert policy.choose(KEY, "g", max_depth=3, width=4, draft_lag=4, probe=False) == by_draft_steps


def test_in_step_drafting_without_any_draft_step_is_judged_by_its_own_timings():
    """Requests whose prompts fit a beam step's chain draft in-step from their first iteration: no draft step
    is ever timed. Their drafting's own timings measure the draft: a draft whose layers never pass stops
    (plain beam steps), one whose layers always pass keeps drafting; drafting by draft steps is still
    unmeasured (one layer, to measure it)."""
    def policy(passed: int) -> DepthPolicy:
        p = DepthPolicy()
        for n in (4, 8, 4, 8):
            p.observe_step(False, n, 0.02 + 0.001 * n)  # target steps only
        for layers in (1, 2, 1, 2):
            p.observe_in_step(4 * layers, 0.002 * layers)
        for _ in range(30):
            p.observe_iteration(KEY, "g", 1, passed)
        return p

    useless, perfect = policy(0), policy(1)
    assert useless.draft.num_observations == 0
    assert useless.choose(KEY, "g", max_depth=2, width=4, draft_lag=0, in_step=True) == 0
    assert perfect.choose(KEY, "g", max_depth=2, width=4, draft_lag=0, in_step=True) >= 1
    assert useless.choose(KEY, "g", max_depth=2, width=4, draft_lag=0) == 1


def test_the_runners_decisions_are_costed_per_group_once_timed():
    """A forest's verification costs ``v(W γ)`` on top of its target step, in place of a beam step's decision
    ``u(W)``, both fitted on the runner's own timings (nothing before one). The same draft that speculates in
    a batch of 4 while its verification is unmeasured stays at depth 0 once each group's verification is
    timed at a third of a step (the other 3 streams wait for it too), and speculates again once a beam
    step's decision is timed as dear (verifying then costs nothing more than deciding)."""
    policy = _policy(0.01, target_fixed=0.5, target_per_token=0.01)  # a target step of 4 groups: 0.66 s
    for k in range(20):
        policy.observe_iteration(KEY, "g", 1, k % 2)  # half the layers pass
    batch = Batch(streams=4, other_tokens=12, drafting=1)
    for layers in (1, 2, 1, 2):
        policy.observe_in_step(4 * layers, 0.002 * layers)

    def seconds(depth):
        return iteration_seconds(depth, 4, 0, policy.draft, policy.target, batch, policy.in_step, policy.decide,
                                 policy.verify)

    def choice():
        return policy.choose(KEY, "g", max_depth=2, width=4, draft_lag=0, probe=False, batch=batch, in_step=True)

    unmeasured = seconds(2)
    assert unmeasured == pytest.approx(iteration_seconds(2, 4, 0, policy.draft, policy.target, batch,
                                                         policy.in_step))
    assert choice() >= 1
    for layers in (1, 2, 1, 2):
        policy.observe_decision(4, 4 * layers, 0.2 + 0.005 * 4 * layers)
    assert seconds(2) == pytest.approx(unmeasured + 0.2 + 0.005 * 8)
    assert seconds(0) == pytest.approx(0.5 + 0.01 * 16)  # no beam step's decision timed yet
    assert choice() == 0
    for width in (4, 1, 4, 1):
        policy.observe_decision(width, 0, 0.2 + 0.01 * width)
    assert seconds(0) == pytest.approx(0.5 + 0.01 * 16 + 0.2 + 0.01 * 4)
    assert choice() >= 1


def test_depth_zero_waits_until_depth_one_would_not_pay_even_with_a_hopeful_alpha():
    """A group of an engine whose draft passes 45 % of its layers fails its first layers: by its mean α
    depth 0 wins after one failure (the look-ahead's choice), and at depth 0 it would learn nothing more.
    It drafts one layer while α one standard deviation higher makes that pay (two failures here), then
    depth 0. Without the hope (``hope=0``) it stops after the first failure."""
    def choices(hope: float) -> list[tuple[int, int]]:
        policy = _policy(0.002, target_per_token=0.02)
        policy.hope = hope
        for k in range(100):
            policy.observe_iteration(KEY, f"other{k % 10}", 1, 1 if k % 20 < 9 else 0)
        out = []
        for _ in range(6):
            out.append((policy.choose(KEY, "g", 3, 4, 4, probe=False), policy.choose(KEY, "g", 3, 4, 4)))
            policy.observe_iteration(KEY, "g", 1, 0)
        return out

    assert choices(1.0) == [(1, 1), (0, 1), (0, 1), (0, 0), (0, 0), (0, 0)]
    assert choices(0.0) == [(1, 1)] + [(0, 0)] * 5


def test_a_group_without_layers_of_its_own_gets_no_hope():
    """Hope is for a group's own few unlucky layers. A new group's α is the engine's estimate from every group
    before it: where that says depth 0, it takes depth 0 (under load, many new groups would otherwise draft
    together), while a group that failed a layer of its own, with a lower estimate, still gets one layer of
    hope before depth 0."""
    policy = _policy(0.002, target_per_token=0.02)
    for k in range(100):
        policy.observe_iteration(KEY, f"other{k % 10}", 1, 1 if k % 20 < 8 else 0)  # 40 % of layers pass
    policy.observe_iteration(KEY, "failed", 1, 0)
    assert policy.alpha(KEY, "new") > policy.alpha(KEY, "failed")
    assert policy.choose(KEY, "failed", 3, 4, 4, probe=False) == 0 and policy.choose(KEY, "failed", 3, 4, 4) == 1
    assert policy.choose(KEY, "new", 3, 4, 4, probe=False) == 0 and policy.choose(KEY, "new", 3, 4, 4) == 0
