"""BeamGroup: which internal requests continue, fork or die, and how hypotheses are ranked."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_dsbd.engine.beam_group import BeamGroup, BeamParams
from vllm_dsbd.engine.group_effects import Extend, Fork, Free
from vllm_dsbd.engine.protocol import BeamChoice, GroupDecision, TokenLogprob

EOS = 2


@dataclass(eq=False)
class Req:
    request_id: str


def params(**kw) -> BeamParams:
    base = dict(beam_width=3, n=3, temperature=0.0, top_k=0, top_p=1.0, length_penalty=1.0, max_tokens=8,
                ignore_eos=False, eos_token_id=EOS, num_logprobs=-1, seed=0)
    return BeamParams(**{**base, **kw})


def choice(parent, token, score):
    return BeamChoice(parent, token, score, TokenLogprob(score, 1))


def decision(beams, finished=()):
    return GroupDecision("g", [choice(*b) for b in beams], [choice(*f) for f in finished])


def three_beam_group(**kw) -> tuple[BeamGroup, list[Req]]:
    """A group whose live beams are a, b, c (tokens 10, 11, 12 after the root step)."""
    root = Req("root")
    group = BeamGroup("g", ["u0", "u1", "u2"], prompt_len=4, params=params(**kw), root_request=root)
    effects = group.apply(decision([(0, 10, -1.0), (0, 11, -2.0), (0, 12, -3.0)]))
    reqs = [root]
    for fork in effects.forks:
        fork.child.request = Req(f"fork{len(reqs)}")
        reqs.append(fork.child.request)
    return group, reqs


def describe(effects):
    """The op list in a comparable form."""
    out = []
    for op in effects.ops:
        if isinstance(op, Fork):
            out.append(("fork", op.parent.request_id, op.token))
        elif isinstance(op, Extend):
            out.append(("extend", op.request.request_id, op.tokens))
        elif isinstance(op, Free):
            out.append(("free", op.request.request_id))
    return out


def test_root_step_continues_the_root_and_forks_the_rest():
    group, (a, b, c) = three_beam_group()
    assert [bm.tokens for bm in group.beams] == [[10], [11], [12]]
    assert [bm.request for bm in group.beams] == [a, b, c]
    assert group.num_generated == 1 and not group.done


def test_worked_example_first_child_continues_extra_children_fork_childless_parents_free():
    group, (a, b, c) = three_beam_group()
    effects = group.apply(decision([(0, 5, -1.5), (2, 7, -3.5), (0, 9, -2.5)]))
    # the fork copies a's tokens before a's own new token is appended
    assert describe(effects) == [("fork", "root", 9), ("extend", "root", [5]), ("free", "fork1"),
                                 ("extend", "fork2", [7])]
    assert effects.forks[0].child.tokens == [10, 9]
    assert [bm.tokens for bm in group.beams] == [[10, 5], [12, 7], [10, 9]]
    assert [bm.score for bm in group.beams] == [-1.5, -3.5, -2.5]
    assert group.beams[2].request is None  # the scheduler creates the fork's request


def test_finished_hypotheses_take_the_parent_tokens_plus_eos():
    group, _ = three_beam_group()
    group.apply(decision([(0, 5, -1.5)], finished=[(1, EOS, -2.2)]))
    assert [h.tokens for h in group.finished] == [(11, EOS)]
    assert group.finished[0].finish_reason == "stop"


def test_group_is_done_at_max_tokens_or_without_live_beams():
    group, _ = three_beam_group(max_tokens=2)
    group.apply(decision([(0, 5, -1.5)]))
    assert group.done
    with pytest.raises(RuntimeError, match="finished"):
        group.apply(decision([(0, 5, -1.5)]))
    group, _ = three_beam_group()
    group.apply(decision([], finished=[(0, EOS, -1.1)]))
    assert group.done and group.beams == []


def test_results_rank_finished_and_live_by_vllms_length_normalised_score():
    # prompt_len 4; the EOS hypothesis counts 4 + 2 - 1 = 5 tokens, live ones 4 + 2 = 6.
    group, _ = three_beam_group(length_penalty=1.0, n=2, max_tokens=2)
    group.apply(decision([(0, 5, -6.0), (1, 6, -6.9)], finished=[(2, EOS, -5.5)]))
    best = group.results()
    assert [h.tokens for h in best] == [(10, 5), (12, EOS)]  # -6/6 = -1.0 > -5.5/5 = -1.1 > -6.9/6
    assert [h.finish_reason for h in best] == ["length", "stop"]
    assert best[0].score == pytest.approx(-1.0) and best[1].score == pytest.approx(-1.1)


def test_length_penalty_zero_ranks_by_cumulative_score():
    group, _ = three_beam_group(length_penalty=0.0, n=3, max_tokens=2)
    group.apply(decision([(0, 5, -6.0), (1, 6, -6.9)], finished=[(2, EOS, -5.5)]))
    assert [h.cum_score for h in group.results()] == [-5.5, -6.0, -6.9]


def test_ties_keep_finished_before_live_as_vllm_does():
    group, _ = three_beam_group(length_penalty=0.0, n=2, max_tokens=2)
    group.apply(decision([(0, 5, -4.0)], finished=[(1, EOS, -4.0)]))
    assert [h.tokens for h in group.results()] == [(11, EOS), (10, 5)]


def test_ignore_eos_keeps_scoring_eos_as_vllm_does():
    group, _ = three_beam_group(ignore_eos=True, n=1, max_tokens=2)
    group.apply(decision([(0, EOS, -5.0)]))
    (best,) = group.results()
    assert best.tokens == (10, EOS) and best.score == pytest.approx(-5.0 / 5) and best.finish_reason == "length"


def test_parent_out_of_range_is_an_error():
    group, _ = three_beam_group()
    with pytest.raises(ValueError, match="out of range"):
        group.apply(decision([(3, 5, -1.0)]))


def test_plan_lists_live_beams_in_beam_order():
    group, (a, b, c) = three_beam_group(seed=7)
    plan = group.plan()
    assert plan.req_ids == ("root", "fork1", "fork2")
    assert plan.scores == (-1.0, -2.0, -3.0)
    assert plan.seq_len == 5 and plan.step == 1 and plan.seed == 7


def _mjsd_group(gamma=3):
    root = Req("root")
    group = BeamGroup("m", ["u"], prompt_len=4, params=params(n=1, temperature=1.0, num_speculative_tokens=gamma,
                                                              mjsd_tau=0.5), root_request=root)
    group.start_iteration()
    return group, root


def _draft(group, nodes):
    from vllm_dsbd.engine.protocol import DraftDecision

    effects = group.apply_draft(DraftDecision("m", [p for p, _, _ in nodes], [t for _, t, _ in nodes],
                                              [s for _, _, s in nodes]))
    for fork in effects.forks:
        fork.child.request = Req(f"n{fork.token}")
    return effects


def test_an_mjsd_group_verifies_one_path_to_its_best_draft_beam():
    """The draft starts from log Q = 0 (not the beam's target score); the path goes to the best-scoring
    candidate: a last-layer node, or a node that ended the sequence earlier (EOS)."""
    group, root = _mjsd_group()
    group.beams[0].score = -7.0  # the target's score so far: not part of the draft's path scores
    assert group.draft_plan().scores == (0.0,)
    _draft(group, [(0, 5, -0.5), (0, EOS, -1.6), (0, 6, -1.0)])  # W 3 slots; EOS ends its draft beam
    assert group.draft_plan().slots == (0, 2)
    _draft(group, [(0, 7, -1.2), (2, 8, -1.1), (0, 9, -3.0)])
    effects = _draft(group, [(1, 3, -2.5), (0, 4, -1.5), (1, 1, -1.5)])
    (path_request,) = [op for op in effects.ops if type(op).__name__ == "PathRequest"]
    assert group.paths == [(0, 3, 6, 10)]  # (layer 1, slot 0) -> (2, 0) -> (3, 1): -1.5, the first of a tie
    assert path_request.root is root and path_request.spec_tokens == [5, 7, 4] and path_request.reuse_root
    path_request.request = root  # the scheduler's part: the root's own request carries the path
    assert group.verify_plan().mjsd_tau == 0.5


def test_an_mjsd_path_may_end_at_an_earlier_eos():
    group, _ = _mjsd_group(gamma=2)
    _draft(group, [(0, EOS, -0.2), (0, 6, -0.4), (0, 7, -1.0)])
    _draft(group, [(1, 3, -0.6), (2, 4, -1.1), (1, 5, -2.0)])
    assert group.paths == [(0, 3)]  # the EOS node (score -0.2) beats every complete draft beam


def test_a_draft_layer_whose_nodes_all_finish_ends_the_forest():
    group, _ = _mjsd_group()
    effects = _draft(group, [(0, EOS, -0.2), (0, EOS, -0.2), (0, EOS, -0.2)])
    assert not group.drafting and group.num_draft_layers == 1 and group.paths == [(0, 3)]
    assert not effects.forks


def test_mjsd_and_dsbd_groups_never_share_depth_statistics():
    """auto_depth's acceptance statistics are keyed by decoding kind: an MJSD group (mjsd_tau set) that
    otherwise decodes like a DSBD group gets another key, two DSBD groups alike share one."""
    from vllm_dsbd.engine.group_commit import _depth_key

    def group(**kw):
        return BeamGroup("g", ["u0"], prompt_len=4, params=params(n=1, num_speculative_tokens=2, **kw),
                         root_request=Req("root"))

    assert _depth_key(group()) == _depth_key(group())
    assert _depth_key(group(mjsd_tau=0.5)) != _depth_key(group())


@pytest.mark.parametrize("kw, plain", [({}, True), ({"memory_efficient": True, "n": 1}, False),
                                       ({"mjsd_tau": 0.5, "n": 1}, False)])
def test_an_iteration_without_draft_layers_is_a_beam_step_unless_mjsd_or_memory_efficient(kw, plain):
    """Depth 0 (auto_depth, or the last token): a DSBD group's paths are its beams, so the iteration is
    planned and committed as one beam step, which ends it; MJSD verifies one path and a memory-efficient
    verification outputs one beam, so theirs stay verifications."""
    group, _ = three_beam_group(num_speculative_tokens=2, **kw)
    group.start_iteration(0)
    assert group.in_iteration and group.plain_iteration is plain
    group.start_iteration(1)
    assert not group.plain_iteration  # it drafts first
    if plain:
        group.start_iteration(0)
        group.apply(decision([(0, 13, -1.5), (1, 14, -2.5), (0, 15, -2.6)]))
        assert not group.in_iteration and group.path_requests == [] and group.num_generated == 2


@pytest.mark.parametrize("live", [1, 3])
def test_a_depth_0_iterations_paths_are_the_forests_root_to_leaf_paths_without_layers(live):
    """The paths of an iteration without draft layers, set up without building a forest, are those the
    forest algorithm gives for no layers: one per live beam, its root slot, verifying no token."""
    import torch

    from vllm_dsbd.algorithm.forest import build_forest, root_to_leaf_paths

    group, reqs = three_beam_group(num_speculative_tokens=2, beam_width=4, n=4)
    if live == 1:
        group = BeamGroup("g", ["u0", "u1", "u2", "u3"], prompt_len=4, params=params(beam_width=4, n=4),
                          root_request=Req("root"))
    assert len(group.beams) == live
    effects = group.start_iteration(0)
    no_layers = torch.zeros((0, 4), dtype=torch.long)
    forest = build_forest(4, no_layers, no_layers, no_layers.bool(), root_exists=torch.arange(4) < live)
    paths = root_to_leaf_paths(forest)
    flat, cu = paths.path_nodes.tolist(), paths.cu_num_positions.tolist()
    assert group.paths == [tuple(flat[cu[k]:cu[k + 1]]) for k in range(paths.num_paths)] and group.aliases == {}
    assert [(op.root, op.spec_tokens, op.reuse_root) for op in effects.ops] == [
        (group.beams[path[0]].request, [], True) for path in group.paths]


def test_layers_drafted_inside_the_verify_step_set_up_the_forest_at_once():
    """``apply_drafted`` (draft_in_step) makes no node requests: the forest's paths come at once, the same
    paths that the same layers committed one draft step at a time give; a forest ending early (its nodes
    finished) has fewer layers; more layers than the iteration's γ are refused."""
    from vllm_dsbd.engine.group_effects import PathRequest
    from vllm_dsbd.engine.protocol import DraftDecision

    layers = [DraftDecision("g", [0, 0, 2], [20, 21, 22], [-1.5, -1.6, -3.5]),
              DraftDecision("g", [1, 0, 0], [30, 31, 32], [-2.0, -2.1, -2.2])]
    by_steps, _ = three_beam_group(num_speculative_tokens=2)
    by_steps.start_iteration()
    for layer in layers:
        effects = by_steps.apply_draft(layer)
        for fork in effects.forks:
            fork.child.request = Req(f"node{fork.token}")
    at_once, _ = three_beam_group(num_speculative_tokens=2)
    at_once.start_iteration(2)
    effects = at_once.apply_drafted(layers)
    assert not effects.forks and all(isinstance(op, PathRequest) for op in effects.ops)
    assert at_once.paths == by_steps.paths and not at_once.drafting
    assert [op.spec_tokens for op in effects.ops] == [pr.spec_tokens for pr in by_steps.path_requests]

    early, _ = three_beam_group(num_speculative_tokens=2)
    early.start_iteration(2)
    early.apply_drafted(layers[:1])
    assert early.num_draft_layers == 1 and max(len(path) for path in early.paths) == 2
    refused, _ = three_beam_group(num_speculative_tokens=2)
    refused.start_iteration(1)
    with pytest.raises(RuntimeError, match="2 drafted layers for an iteration of 1"):
        refused.apply_drafted(layers)


def test_prune_floor_is_the_nth_best_finished_score_or_infinite_when_nothing_can_finish():
    """T 0's bound may leave out a beam whose finished children score below this: the n-th best hypothesis
    so far (its score, as the results rank it); -inf with fewer than n; +inf when no beam can finish."""
    group, _ = three_beam_group(n=2, length_penalty=1.0)
    assert group.prune_floor() == float("-inf")
    group.apply(decision([(0, 5, -1.5), (1, 6, -2.5), (2, 7, -3.0)], finished=[(0, EOS, -2.0)]))
    assert group.prune_floor() == float("-inf")  # one of n = 2
    group.apply(decision([(0, 8, -1.9), (1, 9, -2.9), (2, 3, -3.5)], finished=[(1, EOS, -2.6)]))
    assert group.prune_floor() == pytest.approx(-2.6 / 6)  # prompt 4 + 3 tokens, less the EOS
    assert [h.score for h in group.finished] == [pytest.approx(-2.0 / 5), pytest.approx(-2.6 / 6)]
    assert three_beam_group(ignore_eos=True)[0].prune_floor() == float("inf")
    assert three_beam_group(eos_token_id=None)[0].prune_floor() == float("inf")
    assert three_beam_group(ignore_eos=True, stop_token_ids=(7,))[0].prune_floor() == float("-inf")
    assert three_beam_group(ignore_eos=True, stop=("end",))[0].prune_floor() == float("-inf")
