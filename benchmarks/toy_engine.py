"""A toy engine for DSBD: one group's iterations driven as the engine drives them (``BeamGroup`` and the
runner's ``spec_step`` / ``verify_step``), on plain token lists, with any ``logits_fn`` models
(``vllm_dsbd.algorithm.toy``, or :class:`HashedLM` at a real vocabulary's size). The unit tests check DSBD's
exactness through it; ``bench_decisions`` records the verifications it makes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from vllm_dsbd.engine.beam_group import BeamGroup, BeamParams
from vllm_dsbd.engine.group_effects import Extend, Fork, Free, PathRequest
from vllm_dsbd.engine.spec_step import DraftStore, draft_layer
from vllm_dsbd.engine.verify_step import GroupInput, verify


class Req:
    def __init__(self, rid, tokens):
        self.request_id, self.tokens = rid, list(tokens)


def params(**kw) -> BeamParams:
    base = dict(beam_width=3, n=3, temperature=0.0, top_k=0, top_p=1.0, length_penalty=1.0, max_tokens=6,
                ignore_eos=False, eos_token_id=0, num_logprobs=-1, seed=0, num_speculative_tokens=3,
                width_threshold=1.0, min_width=1, memory_efficient=False)
    return BeamParams(**{**base, **kw})


def run_dsbd(target, draft, prompt, p: BeamParams, trace=None, stops=None, support=None):
    """Decode one prompt the way the engine does; ``trace`` collects (num_passed, live requests). ``support``:
    the draft's proposable tokens, as the runner gives ``draft_layer`` (its joints then verified over them)."""
    ids = itertools.count()
    live: dict[str, Req] = {}

    def new(tokens):
        r = Req(f"r{next(ids)}", tokens)
        live[r.request_id] = r
        return r

    def carry_out(effects):
        for op in effects.ops:
            if isinstance(op, Fork):
                op.child.request = new(op.parent.tokens + [op.token])
            elif isinstance(op, Extend):
                op.request.tokens += op.tokens
            elif isinstance(op, Free):
                del live[op.request.request_id]
            elif isinstance(op, PathRequest):
                op.request = op.root if op.reuse_root else new(op.root.tokens)
                op.request.spec = list(op.spec_tokens)

    group = BeamGroup("g", ["u"], len(prompt), p, new(prompt))
    store = DraftStore()
    while not group.done:
        carry_out(group.start_iteration())
        while group.drafting:
            ds = group.draft_plan()
            logits = draft([live[r].tokens for r in ds.req_ids])
            decision, joint = draft_layer(logits, {r: i for i, r in enumerate(ds.req_ids)}, ds, support)
            if joint is not None:
                store.put("g", ds.step, ds.layer, joint, support)
            carry_out(group.apply_draft(decision))
        vs = group.verify_plan()
        path_logits = []
        for rid in vs.path_req_ids:
            r = live[rid]
            path_logits.append(target([r.tokens + r.spec[:j] for j in range(len(r.spec) + 1)]))
        joints, verified_support = None, None
        if p.temperature > 0 and vs.draft_parents:
            joints, verified_support = store.take("g", vs.step, len(vs.draft_parents))
        elif p.temperature > 0:
            joints = torch.zeros((0, p.beam_width * target.vocab_size))
        decision = verify(path_logits, vs, joints, stops, verified_support)
        carry_out(group.apply_verify(decision))
        for b in group.beams:  # every live beam's request holds exactly the beam's tokens
            assert b.request.tokens == prompt + b.tokens
        if trace is not None:
            trace.append((decision.num_passed, len(live), decision.num_proposed, decision.num_accepted))
    return group.results()


def packed_verifications(batch) -> tuple[Tensor, list[GroupInput]]:
    """Recorded verifications ``(path_logits, VerifyStep, joints, support, ...)`` as one step's logits (every
    group's paths, one after another) and each group's ``verify_step.GroupInput``."""
    rows, inputs = [], []
    for path_logits, vs, joints, support, *_ in batch:
        starts = []
        for logits in path_logits:
            starts.append(sum(t.shape[0] for t in rows))
            rows.append(logits)
        inputs.append(GroupInput(vs, starts, joints, support))
    return torch.cat(rows), inputs


class HashedLM:
    """A ``logits_fn`` over a vocabulary of any size whose next-token logits depend on the last two tokens,
    drawn lazily (``scale`` x a standard normal, seeded by those tokens and ``seed``); ``noise`` > 0 adds a
    second such draw (seed ``seed + 1``) times ``noise``: a draft that agrees with the ``noise`` 0 model less
    as ``noise`` grows."""

    def __init__(self, vocab_size: int, seed: int = 0, scale: float = 3.0, noise: float = 0.0) -> None:
        self.vocab_size, self.seed, self.scale, self.noise = vocab_size, seed, scale, noise

    def _draw(self, context: tuple[int, ...], seed: int) -> Tensor:
        g = torch.Generator().manual_seed(hash((seed, context)) % (2**62))
        return torch.randn(self.vocab_size, generator=g) * self.scale

    def __call__(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        rows = []
        for seq in sequences:
            context = tuple(seq[-2:])
            row = self._draw(context, self.seed)
            if self.noise:
                row = row + self.noise * self._draw(context, self.seed + 1)
            rows.append(row)
        return torch.stack(rows)
