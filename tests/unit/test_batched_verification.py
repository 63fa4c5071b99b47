"""The runner verifies every DSBD group of a step in one batched pass (``engine.verify_step.verify_groups``).

Each group's decision must be exactly what it gets verified alone, whatever groups share the pass and in
whatever order: groups of different modes, widths, temperatures and depths are recorded from solo runs of
toy models (``benchmarks.toy_engine.run_dsbd``), then replayed together, shuffled. And the decision path makes
no tensor on the CPU by default: every tensor it creates takes its device from its inputs.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from benchmarks import toy_engine as solo
from vllm_dsbd.algorithm.toy import perturbed_draft, random_markov
from vllm_dsbd.engine import verify_step
from vllm_dsbd.engine.verify_step import verify_groups

MODES = {  # BeamParams overrides: T 0, fixed and dynamic width, memory-efficient, another temperature, top-k
    "search": dict(temperature=0.0, length_penalty=0.5),
    "fixed": dict(temperature=1.0),
    "dynamic": dict(temperature=1.0, width_threshold=0.5),
    "memory-efficient": dict(temperature=1.0, memory_efficient=True, n=1, width_threshold=0.5),
    "tempered": dict(temperature=0.7, top_k=3),
    "search-wide": dict(temperature=0.0, beam_width=4, n=4),
}


def _recorded_verifications(monkeypatch) -> list[tuple[list[torch.Tensor], object, object, object, object]]:
    """(path_logits, VerifyStep, joints, support, solo decision) of every verification of a few solo runs; each
    run's group id made unique. max_tokens 7 with γ 3 cuts the last forests: depths differ within a mode."""
    calls = []

    def recording(path_logits, vs, joints, stops=None, support=None):
        decision = verify_step.verify(path_logits, vs, joints, stops, support)
        calls.append((path_logits, vs, joints, support, decision))
        return decision

    monkeypatch.setattr(solo, "verify", recording)
    target = random_markov(6, order=2, seed=21)
    draft = perturbed_draft(target, 0.5, seed=22)
    out = []
    for name, overrides in MODES.items():
        for seed, prompt in enumerate(([1], [2, 3])):
            start = len(calls)
            solo.run_dsbd(target, draft, prompt, solo.params(**{"max_tokens": 7, "seed": seed, **overrides}))
            gid = f"{name}-{seed}"
            for path_logits, vs, joints, support, decision in calls[start:]:
                out.append((path_logits, dataclasses.replace(vs, group_id=gid), joints, support,
                            dataclasses.replace(decision, group_id=gid)))
    return out


@pytest.mark.parametrize("chunk", [None, 1, 3], ids=["budget", "chunks-of-1", "chunks-of-3"])
def test_groups_verified_together_decide_as_each_alone(monkeypatch, chunk):
    """Whatever groups share the pass, in whatever order and in chunks of whatever size (the budget's chunks
    hold every group of these small-vocabulary forests)."""
    if chunk is not None:
        monkeypatch.setattr(verify_step, "_chunk_size", lambda members, vocab: chunk)
    records = _recorded_verifications(monkeypatch)
    depths = {len(vs.draft_parents) for _, vs, *_ in records}
    assert len(records) > 30 and len(depths) > 1  # several iterations each, forests of several depths
    rng = random.Random(0)
    for trial in range(12):  # one verification per group a step (a group verifies one iteration at a time)
        picked = {}
        for r in rng.sample(records, len(records)):
            picked.setdefault(r[1].group_id, r)
        batch = list(picked.values())
        got = verify_groups(*solo.packed_verifications(batch))
        assert set(got) == {vs.group_id for _, vs, *_ in batch}
        for _, vs, _, _, want in batch:
            assert got[vs.group_id] == want, (trial, vs.group_id)


@pytest.mark.parametrize("temperature, width, depth, groups", [
    (1.0, 4, 1, 4), (1.0, 4, 2, 4), (0.0, 4, 1, 16), (0.0, 4, 2, 10), (0.0, 4, 0, 16), (0.0, 8, 1, 8)])
def test_a_bucket_is_decided_in_chunks_whose_largest_buffer_fits_the_budget(temperature, width, depth, groups):
    """V 49,152: at T > 0 the residual ladder [W + 1, G, W x V] float32 under 16 MiB; at T 0 the node logits
    [G, γ + 1, W, V] float32 (at least the [G, W x V] float64 candidates) under 24 MiB; as many groups as fit."""
    from types import SimpleNamespace

    vocab = 49152
    member = SimpleNamespace(vs=SimpleNamespace(beam_width=width, temperature=temperature,
                                                draft_parents=[[0] * width] * depth))
    shallow = SimpleNamespace(vs=SimpleNamespace(beam_width=width, temperature=temperature, draft_parents=[]))
    size = verify_step._chunk_size([shallow, member], vocab)  # the bucket's deepest forest sets it
    assert size == groups
    per_group = ((width + 1) * width if temperature > 0 else max(depth + 1, 2) * width) * vocab * 4
    budget = verify_step.CHUNK_BYTES if temperature > 0 else verify_step.GREEDY_CHUNK_BYTES
    assert size * per_group <= budget < (size + 1) * per_group


class _NoImplicitDevice(TorchFunctionMode):
    """Records every tensor factory called without a device (it would make the tensor on the CPU)."""

    FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand,
                 torch.randn, torch.randint, torch.linspace, torch.eye, torch.as_tensor}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None and not (
                func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)):
            import traceback

            frame = traceback.extract_stack(limit=2)[0]  # the factory's caller
            self.calls.append(f"{func.__name__} at {frame.filename.split('/')[-1]}:{frame.lineno}")
        return func(*args, **kwargs)


def test_the_batched_verification_makes_no_tensor_on_an_implicit_device(monkeypatch):
    """Run on the CPU, a tensor made without ``device=`` lands where its inputs are only by luck; on a GPU the
    same call would put it on the CPU. Every factory call of the verification path names its device."""
    records = _recorded_verifications(monkeypatch)
    by_group = {}
    for r in records:
        by_group.setdefault(r[1].group_id, r)
    logits, inputs = solo.packed_verifications(list(by_group.values()))
    with _NoImplicitDevice() as mode:
        verify_groups(logits, inputs)
    assert mode.calls == []


def test_the_implicit_device_check_catches_a_tensor_made_on_the_cpu():
    with _NoImplicitDevice() as mode:
        torch.zeros(3, device="cpu")
        torch.tensor([1, 2])
    assert len(mode.calls) == 1 and mode.calls[0].startswith("tensor")


@pytest.mark.parametrize("mode", ["fixed", "search"])
def test_a_verification_sharing_one_generator_across_groups_is_caught(monkeypatch, mode):
    """The planted bug the batched test must reject: the groups of a pass drawing from one generator (at T 0
    nothing is drawn, so only T > 0 can differ: the search mode stays equal)."""
    records = [r for r in _recorded_verifications(monkeypatch) if r[1].group_id.startswith(mode + "-")]
    first = {}
    for r in records:
        first.setdefault(r[1].group_id, r)
    batch = list(first.values())
    real = verify_step.generator
    shared = real(1, 0, 1000)
    monkeypatch.setattr(verify_step, "generator", lambda *a, **k: shared)
    got = verify_groups(*solo.packed_verifications(batch))
    same = all(got[vs.group_id] == want for _, vs, _, _, want in batch)
    assert same == (mode == "search")


def test_beam_steps_and_draft_layers_make_no_tensor_on_an_implicit_device():
    """The rest of the step's decisions: beam steps (search and sampling) and a draft layer's draw."""
    from test_beam_step import step  # tests/unit/test_beam_step.py

    from vllm_dsbd.engine import beam_step, spec_step
    from vllm_dsbd.engine.protocol import DraftStep

    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    groups = [step(group_id="s", req_ids=("a", "b"), scores=(-1.0, -2.0), num_logprobs=2, eos_token_id=2),
              step(group_id="t", req_ids=("c", "d"), scores=(-1.0, -1.5), temperature=0.8, top_k=3)]
    fields = {f.name for f in dataclasses.fields(DraftStep)}
    draft = DraftStep(**{k: v for k, v in dataclasses.asdict(groups[1]).items() if k in fields},
                      layer=1, slots=(0, 1))
    with _NoImplicitDevice() as mode:
        beam_step.decide(logits, {"a": 0, "b": 1, "c": 2, "d": 3}, groups)
        spec_step.draft_layer(logits, {"c": 2, "d": 3}, draft)
        spec_step.draft_layers(logits, [[0, 1], [2, 3]], [dataclasses.replace(draft, temperature=0.0), draft])
    assert mode.calls == []


def _draft_steps(seed: int) -> tuple[torch.Tensor, list, list]:
    """A step's draft layers of 9 groups of every kind (T 0 and T > 0, widths 2 and 4, top-k / top-p, EOS,
    scaled draft temperatures, some slots empty) over one [rows, 40] logits tensor: (logits, rows, steps)."""
    from vllm_dsbd.engine.protocol import DraftStep

    rng = random.Random(seed)
    steps, rows, next_row = [], [], 0
    for g in range(9):
        width = rng.choice([2, 4])
        slots = tuple(sorted(rng.sample(range(width), rng.randint(1, width))))
        steps.append(DraftStep(
            group_id=f"g{g}", beam_width=width, temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]), length_penalty=rng.choice([1.0, 0.5]),
            ignore_eos=rng.random() < 0.5, eos_token_id=3, seed=rng.randint(0, 99), step=rng.randint(0, 5),
            layer=rng.randint(1, 3), req_ids=tuple(f"g{g}-{s}" for s in slots), slots=slots,
            scores=tuple(-rng.random() * 3 for _ in slots), seq_len=rng.randint(4, 9),
            draft_temperature_scale=rng.choice([1.0, 0.75])))
        rows.append(list(range(next_row, next_row + len(slots))))
        next_row += len(slots)
    logits = torch.randn((next_row, 40), generator=torch.Generator().manual_seed(seed)) * 2
    return logits, rows, steps


def _same_draft(a, b) -> bool:
    """The same nodes, scores and joint (a restricted group's joint to the rounding of its renormalisation,
    whose path ``restrict_joint`` chooses per pass)."""
    (da, qa), (db, qb) = a, b
    same_q = (qa is None and qb is None) or (qa is not None and qb is not None
                                             and torch.allclose(qa, qb, rtol=1e-6, atol=1e-9))
    return (da.parents, da.tokens) == (db.parents, db.tokens) and da.scores == pytest.approx(db.scores) and same_q


@pytest.mark.parametrize("seed", range(6))
def test_draft_layers_decided_together_decide_as_each_alone(seed):
    """``spec_step.draft_layers`` over a step's groups of every kind gives each group what it gets alone (its
    draws from its own generator), in the groups' order or reversed."""
    from vllm_dsbd.engine import spec_step

    logits, rows, steps = _draft_steps(seed)
    alone = [spec_step.draft_layers(logits, [r], [ds])[0] for r, ds in zip(rows, steps)]
    together = spec_step.draft_layers(logits, rows, steps)
    backwards = spec_step.draft_layers(logits, rows[::-1], steps[::-1])[::-1]
    assert all(_same_draft(a, t) and _same_draft(a, b) for a, t, b in zip(alone, together, backwards))


def test_draft_layers_sharing_one_generator_across_groups_are_caught(monkeypatch):
    """The planted bug the test above must reject: the groups' draws from one generator."""
    from vllm_dsbd.engine import spec_step

    logits, rows, steps = _draft_steps(0)
    alone = [spec_step.draft_layers(logits, [r], [ds])[0] for r, ds in zip(rows, steps)]
    shared = spec_step.generator(1, 0, 1000)
    monkeypatch.setattr(spec_step, "generator", lambda *a, **k: shared)
    together = spec_step.draft_layers(logits, rows, steps)
    assert not all(_same_draft(a, t) for a, t in zip(alone, together))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_mjsd_verification_makes_no_tensor_on_an_implicit_device(temperature):
    """MJSD groups are verified one at a time (``mjsd_step.verify``), on the logits' device too."""
    from test_mjsd import _verify_step  # tests/unit/test_mjsd.py

    from vllm_dsbd.engine import mjsd_step

    target, draft, vs = _verify_step(0.0, temperature=temperature)
    with _NoImplicitDevice() as mode:
        mjsd_step.verify([target], vs, draft)
    assert mode.calls == []
