"""Speculation depth chosen per iteration: γ in 0..γmax maximising expected tokens per second.

Pure Python (no torch, no vLLM): the scheduler feeds it the wall time of
every engine step it ran and the outcome of every verified iteration, and
asks it, before each DSBD iteration of a group, how many draft layers to
build. The choice depends only on earlier steps, so every iteration stays
exact (any γ verifies exactly; γ = 0 is a plain beam step).

Model (one group; what it shares its steps with is a :class:`Batch`):

- **Step costs.** A draft step and a target step each cost
  ``c(n) = a + b n`` seconds for ``n`` tokens computed in the step
  (:class:`LinearCost`: least squares over the engine's own recent steps,
  exponentially forgotten; nothing is hard-coded for a machine). The
  scheduler feeds the target's fit decoding steps only: a step computing a
  prompt would flatten the cost per token, a prompt's tokens being far cheaper
  each than a forest's.
- **Acceptance.** A draft layer passes (all its kept nodes are accepted)
  with probability ``α``, the same at every depth; an iteration with ``γ``
  layers passes ``k`` layers with probability ``α^k (1 - α)`` (``k < γ``)
  and yields ``k + 1`` tokens, so ``E[tokens | γ] = sum_{i=0..γ} α^i``.
  ``α`` is estimated per group, shrunk toward the engine-wide estimate for
  groups decoding the same way (:class:`AcceptanceStats`).
- **Choice**: the γ with the highest modelled rate of the engine,
  ``(G - 1 + E[tokens | γ]) / seconds``, where the seconds speculation adds
  to a plain iteration count ``1 + margin`` times (the model is rough: one
  α for every depth, paths counted as ``W (γ + 1)`` tokens; measured on the
  Qwen pair, deeper forests cost more than it predicts).
- **Cost of an iteration** with ``W`` live beams whose draft KV lags
  ``lag`` tokens behind (the draft has not seen them yet), in a batch of
  ``G`` decoding streams (this group, other groups, plain requests) whose
  target step computes ``N`` tokens besides this group's, ``k`` groups
  drafting (this one included): ``γ = 0``: one target step over ``N + W``
  tokens; ``γ ≥ 1``: a first draft step over ``lag`` tokens, ``γ - 1``
  draft steps over ``W`` tokens, each draft step's fixed cost shared by the
  ``k`` groups, one target step over ``N + W (γ + 1)`` tokens (every
  root-to-leaf path of the forest), and the runner's verification of the
  forest's ``W γ`` draft nodes, ``v(W γ)``, in place of a beam step's
  decision over its ``W`` beams, ``u(W)`` (γ = 0 costs its target step
  plus ``u``). Both are fitted (linear) on the runner's own timings of them
  per group, nothing until one was timed, and taken off the target step's
  time before its fit: in a batch each verifying group pays its
  verification, and as a share of the step's tokens it was diluted by the
  groups taking plain beam steps beside it. The other streams gain one token each
  whatever this group does, so alone (``G = k = 1``, ``N = 0``) the rate is
  ``E[tokens | γ] / seconds``; in a full batch a draft step stalls
  everyone, and the same draft that pays alone may not.

Drafting inside the verify step (the engine knob ``draft_in_step``): the
runner draws the next iteration's γ layers in the step that verifies this
one, so its γ is chosen one iteration ahead (from the iterations verified
before) and it has no draft steps: ``γ ≥ 1`` costs the target step over
``N + W (γ + 1)`` tokens plus ``d = a' + b' (lag + W γ)`` for the drafting
(its head rows: the ``lag`` tokens whose head KV it first catches up on, about
one a beam after a verify step, every token since after a run of beam steps;
then W a layer), fitted on the runner's own timings of it (the target step's
time without it feeds the target's fit). Until such a drafting was timed, the
draft steps' cost stands in for it.

Exploration: a γ never tried tells nothing about itself. Until the draft's
cost has been measured (its draft steps, or for in-step drafting its own
timings: an ``auto_depth`` request whose prompt fits ``MAX_CHAIN`` drafts
in-step from its first iteration and may never run a draft step) the policy
drafts one layer, for one group at a time: the others choose depth 0 until
a step has been timed (under load every new group drafting to measure the
same cost would cost a whole batch a draft catching up on its prompt and a
forest to verify). A group's α is an
estimate from a few iterations, and while it chooses γ = 0 it learns nothing
more: a few unlucky layers would keep a good draft idle. So γ = 0 is chosen
only if γ = 1 would not pay even with α ``hope`` standard deviations higher
(the group's estimate counts ``prior_weight`` + its own trials); else one
layer is drafted, which tells. A group with no verified layer of its own
gets no hope: its α is the engine's estimate, from every group before it
(under load many new groups would otherwise all draft together). While the model says
γ = 0, it drafts one layer anyway once at least ``probe_interval`` such
choices were made *and* the probe's extra cost (the draft catching up on
every token it has not seen, which grows while γ = 0) is at most
``probe_budget`` of the time those choices took (the probing iteration's
own plain cost included); the interval doubles after each probe (up to
``max_probe_interval``). In a batch a choice counts ``1 / G`` (its share
of a step), so both the interval and the time are the engine's. So a
useless draft costs at most about ``probe_budget`` of the time, and less as
probes thin out.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class LinearCost:
    """Online least-squares fit of a step's seconds against its tokens: ``c(n) = a + b n``.

    Each observation's weight decays by ``decay`` per later observation, so
    the fit follows a machine whose load changes. With too little spread in
    ``n`` to see a slope, the cost is taken as half fixed, half per token.
    """

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self._s = [0.0] * 5  # sums of w, w n, w n^2, w c, w n c

    @property
    def num_observations(self) -> float:
        return self._s[0]

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        n = float(num_tokens)
        self._s = [x * self.decay for x in self._s]
        for i, v in enumerate((1.0, n, n * n, seconds, n * seconds)):
            self._s[i] += v

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token; None before any observation."""
        w, sn, snn, sc, snc = self._s
        if w <= 0:
            return None
        mean_n, mean_c = sn / w, sc / w
        var_n = snn / w - mean_n * mean_n
        if var_n < 1.0:  # all steps had about the same size
            return mean_c / 2, mean_c / (2 * mean_n)
        b = (snc / w - mean_n * mean_c) / var_n
        b = min(max(b, 0.0), mean_c / mean_n)  # 0 <= b, a >= 0
        return mean_c - b * mean_n, b

    def predict(self, num_tokens: int) -> float | None:
        coef = self.coefficients()
        return None if coef is None else coef[0] + coef[1] * max(num_tokens, 0)


@dataclass
class AcceptanceStats:
    """Passed and failed draft layers (decayed), for the per-layer pass rate α."""

    passed: float = 0.0
    failed: float = 0.0

    def observe(self, num_layers: int, num_passed: int, decay: float = 1.0) -> None:
        self.passed = self.passed * decay + num_passed
        self.failed = self.failed * decay + (1 if num_passed < num_layers else 0)

    @property
    def trials(self) -> float:
        return self.passed + self.failed


def measured(cost: LinearCost | None) -> bool:
    """Whether a cost has been timed at least once (None: not in use)."""
    return cost is not None and cost.num_observations > 0


def expected_tokens(alpha: float, depth: int) -> float:
    """E[tokens of one iteration] with ``depth`` draft layers, each passing with probability ``alpha``."""
    return sum(alpha**i for i in range(depth + 1))


@dataclass(frozen=True)
class Batch:
    """What a group's iteration shares its engine steps with (see the module docstring)."""

    streams: int = 1  # G: decoding streams in the target step, this group included (a group is one)
    other_tokens: int = 0  # N: tokens the target step computes for the others
    drafting: int = 1  # k: groups drafting in the draft steps, this group included

    def __post_init__(self) -> None:
        if self.streams < 1 or self.drafting < 1 or self.other_tokens < 0:
            raise ValueError(f"a batch has at least this group: {self}")


ALONE = Batch()


def iteration_seconds(depth: int, width: int, draft_lag: int, draft: LinearCost, target: LinearCost,
                      batch: Batch = ALONE, in_step: LinearCost | None = None, decide: LinearCost | None = None,
                      verify: LinearCost | None = None) -> float:
    """Predicted engine seconds of one iteration (see the module docstring); needs both step costs measured
    for depth > 0. ``in_step``: the cost of drafting γ layers inside the verify step, when the iteration's
    layers are drawn there (and it has been measured) instead of by draft steps. ``decide`` / ``verify``:
    the runner's cost of a beam step's decision over ``W`` beams / of verifying ``W γ`` draft nodes."""
    own = decision_seconds(depth, width, decide, verify)
    if depth == 0:
        return target.predict(batch.other_tokens + width) + own
    if measured(in_step):
        draft_seconds = in_step.predict(draft_lag + width * depth)
    else:
        fixed, per_token = draft.coefficients()
        draft_seconds = depth * fixed / batch.drafting + per_token * (max(draft_lag, width) + (depth - 1) * width)
    return draft_seconds + target.predict(batch.other_tokens + width * (depth + 1)) + own


def decision_seconds(depth: int, width: int, decide: LinearCost | None, verify: LinearCost | None) -> float:
    """The runner's time deciding a group's iteration: a beam step's decision (depth 0) or the verification
    of the forest; 0 while unmeasured."""
    cost, num = (decide, width) if depth == 0 else (verify, width * depth)
    return cost.predict(num) if measured(cost) else 0.0


@dataclass
class DepthPolicy:
    """The engine's depth chooser (one per scheduler)."""

    prior_weight: float = 4.0  # pseudo-trials of the engine-wide α in a group's estimate
    decay: float = 0.98  # of the engine-wide acceptance counts, per iteration observed
    probe_interval: int = 4
    max_probe_interval: int = 64
    probe_budget: float = 0.02  # the most a probe's extra cost may be, as a share of the depth-0 time before it
    margin: float = 0.15  # speculating is taken to cost this share more than modelled (deeper forests do)
    hope: float = 1.0  # depth 0 only when depth 1 does not pay with α this many standard deviations higher
    draft: LinearCost = field(default_factory=LinearCost)
    target: LinearCost = field(default_factory=LinearCost)
    in_step: LinearCost = field(default_factory=LinearCost)  # seconds of a drawing in a verify step, by head rows
    decide: LinearCost = field(default_factory=LinearCost)  # seconds of a beam step's decision over W beams
    verify: LinearCost = field(default_factory=LinearCost)  # seconds of verifying W γ draft nodes (the runner's)
    _engine: dict[object, AcceptanceStats] = field(default_factory=dict)
    _groups: dict[str, AcceptanceStats] = field(default_factory=dict)
    _zero_choices: dict[object, float] = field(default_factory=dict)  # in steps: 1 / G per choice
    _zero_seconds: dict[object, float] = field(default_factory=dict)
    _intervals: dict[object, int] = field(default_factory=dict)
    _measuring: bool = False  # a group drafts to measure the costs; the others wait for a timed step

    def observe_step(self, is_draft: bool, num_tokens: int, seconds: float) -> None:
        (self.draft if is_draft else self.target).observe(num_tokens, seconds)
        self._measuring = False

    def observe_in_step(self, num_rows: int, seconds: float) -> None:
        """A group's draft layers drawn inside a verify (or beam) step took ``seconds`` for ``num_rows`` head
        rows: the tokens its head KV caught up on, then W per layer (not counted in that step's
        :meth:`observe_step`)."""
        self.in_step.observe(num_rows, seconds)
        self._measuring = False

    def observe_decision(self, width: int, num_nodes: int, seconds: float) -> None:
        """The runner took ``seconds`` deciding a group's iteration over ``width`` beams: its verification of
        ``num_nodes`` draft nodes, or a beam step when 0 (not counted in that step's :meth:`observe_step`)."""
        if num_nodes:
            self.verify.observe(num_nodes, seconds)
        else:
            self.decide.observe(width, seconds)

    def observe_iteration(self, key: object, group_id: str, num_layers: int, num_passed: int) -> None:
        """A verified iteration of ``group_id`` (decoding kind ``key``): ``num_passed`` of ``num_layers`` passed."""
        if num_layers == 0:
            return
        self._engine.setdefault(key, AcceptanceStats()).observe(num_layers, num_passed, self.decay)
        self._groups.setdefault(group_id, AcceptanceStats()).observe(num_layers, num_passed)

    def forget(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    def alpha(self, key: object, group_id: str, hope: float = 0.0) -> float:
        """The group's α: its own outcomes shrunk toward the engine's for its decoding kind; ``hope`` standard
        deviations of that estimate above it (at most 1)."""
        engine = self._engine.get(key, AcceptanceStats())
        prior = (engine.passed + 1.0) / (engine.trials + 2.0)
        group = self._groups.get(group_id, AcceptanceStats())
        trials = group.trials + self.prior_weight
        alpha = (group.passed + self.prior_weight * prior) / trials
        return min(1.0, alpha + hope * (alpha * (1 - alpha) / (trials + 1)) ** 0.5)

    def choose(self, key: object, group_id: str, max_depth: int, width: int, draft_lag: int,
               probe: bool = True, batch: Batch = ALONE, in_step: bool = False) -> int:
        """γ in 0..max_depth for the group's next iteration in ``batch``. ``probe=False``: the model's choice
        only, no exploration and nothing recorded (a look ahead, e.g. at a group's admission). ``in_step``:
        its layers would be drawn inside the verify step before it (see the module docstring)."""
        if max_depth <= 0:
            return 0
        # the drafting's cost, as iteration_seconds takes it: in-step drafting's own timings once it has some
        # (a group of short prompts drafting in-step may never run a draft step), else the draft steps'
        in_step_cost = self.in_step if in_step else None
        if not (measured(in_step_cost) or measured(self.draft)) or not measured(self.target):
            if probe and self._measuring:
                return 0  # another group's iteration measures them
            self._measuring = probe
            return 1  # measure the draft before judging it
        alpha = self.alpha(key, group_id)
        others = batch.streams - 1  # they gain a token per iteration whatever this group does

        plain_seconds = iteration_seconds(0, width, draft_lag, self.draft, self.target, batch, decide=self.decide)

        def rate(depth: int, alpha: float = alpha) -> float:  # speculating is taken to cost ``margin`` more
            extra = iteration_seconds(depth, width, draft_lag, self.draft, self.target, batch,
                                      in_step_cost, self.decide, self.verify) - plain_seconds
            return (others + expected_tokens(alpha, depth)) / (plain_seconds + (1 + self.margin) * extra)

        best = max(range(max_depth + 1), key=rate)  # the shallowest of equals
        if not probe:
            return best
        if best > 0:
            self._zero_choices[key], self._zero_seconds[key] = 0, 0.0
            self._intervals[key] = self.probe_interval
            return best
        # hope is for a group's own few layers; one without any starts from the engine's estimate as it is
        own_trials = self._groups.get(group_id, AcceptanceStats()).trials
        hopeful = self.alpha(key, group_id, self.hope if own_trials > 0 else 0.0)
        if rate(1, hopeful) > rate(0, hopeful):  # depth 0 on a plausibly unlucky estimate: look again
            return 1
        count = self._zero_choices.get(key, 0) + 1 / batch.streams
        spent = self._zero_seconds.get(key, 0.0) + plain_seconds / batch.streams
        interval = self._intervals.get(key, self.probe_interval)
        extra = iteration_seconds(1, width, draft_lag, self.draft, self.target, batch, in_step_cost,
                                  self.decide, self.verify) - plain_seconds
        if count >= interval and extra <= self.probe_budget * spent:
            # probe: the draft may have got better (or the estimate was unlucky)
            self._zero_choices[key], self._zero_seconds[key] = 0, 0.0
            self._intervals[key] = min(2 * interval, self.max_probe_interval)
            return 1
        self._zero_choices[key], self._zero_seconds[key] = count, spent
        return 0
