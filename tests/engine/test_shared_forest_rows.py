"""Forest nodes on several verification paths, computed once by the target (``engine.shared_rows``), in a
real engine: a head drafting inside the verify step (the features path too), W 4, γ 2, float32."""

from __future__ import annotations

import pytest
from beam_checks import PROMPTS, beam_search  # tests/engine/beam_checks.py

pytestmark = pytest.mark.engine


def _beams(width, gamma, max_tokens, temperature=0.0, **kw):
    from vllm import SamplingParams

    return SamplingParams(n=width, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                          extra_args={"beam_width": width, "num_speculative_tokens": gamma}, **kw)


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-next-slot"])
def test_paths_hold_the_nodes_an_earlier_path_computes(inproc_in_step_llm, tiny_eos_llm, monkeypatch, planted):
    """The same requests with sharing off (every path computes all its nodes) and on (a later path holds its
    shared nodes as computed, their K/V and features copied into its slots in the forward): the target's
    logits at every node of every verified forest are the same (to 1e-4), each shared node's head feature
    is at its later paths' slots after the forward, on computes fewer rows in its
    verify steps and copies some, and both are vLLM's beam search token for token at T 0. The planted twin
    copies each shared node one slot too far (its own first row's K/V overwritten, the shared position
    left stale): the logits below the shared nodes differ, and the features at their slots."""
    import torch

    from vllm_dsbd.engine import shared_rows, verify_step

    llm = inproc_in_step_llm
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    sharing, copied, node_logits, features_equal, true_slots = {"on": True}, [], [], [], []
    create = type(core.scheduler)._create_group

    def create_group(self, group_id, users):
        create(self, group_id, users)
        self.groups[group_id].share_path_rows = sharing["on"]

    plan = shared_rows.plan

    def planning(*args, **kwargs):
        copies = plan(*args, **kwargs)
        if copies is not None:
            copied.append(copies.rows.numel())
            true_slots.append((copies.rows, copies.slots[runner._dsbd_features_gid].clone()))
            if planted:
                copies.slots = {gid: slots + 1 for gid, slots in copies.slots.items()}
        return copies

    read = verify_step._node_logits

    def reading(*args):
        out = read(*args)
        node_logits.append(out.clone())
        return out

    forward = runner._target_forward_with_features

    def forward_then_compare_features(*args, **kwargs):  # each shared node's feature, at its later paths' slots
        output = forward(*args, **kwargs)
        if runner._dsbd_shared.now is not None:
            rows, slots = true_slots[-1]
            computed = runner._dsbd_slots()[1][rows]
            features = runner._dsbd_features
            features_equal.append(torch.equal(features.read(slots), features.read(computed)))
        return output

    def verify_rows() -> int:
        return int(runner.dsbd_step_profile().get("verify", {}).get("tokens", 0))

    monkeypatch.setattr(type(core.scheduler), "_create_group", create_group)
    monkeypatch.setattr(shared_rows, "plan", planning)
    monkeypatch.setattr(verify_step, "_node_logits", reading)
    monkeypatch.setattr(runner, "_target_forward_with_features", forward_then_compare_features)
    want = beam_search(tiny_eos_llm, PROMPTS, 4, 10)
    runs = {}
    for mode in ("off", "on"):
        sharing["on"] = mode == "on"
        copied.clear()
        node_logits.clear()
        before = verify_rows()
        outs = llm.generate(PROMPTS, _beams(4, 2, 10), use_tqdm=False)
        runs[mode] = outs, verify_rows() - before, sum(copied), list(node_logits)
    (off, rows_off, copies_off, logits_off), (on, rows_on, copies_on, logits_on) = runs["off"], runs["on"]
    assert copies_off == 0 and copies_on > 0 and len(logits_on) == len(logits_off) > 0
    same = all(a.shape == b.shape and torch.allclose(a, b, atol=1e-4) for a, b in zip(logits_on, logits_off))
    if planted:
        assert not same and not all(features_equal)
        return
    assert same and features_equal and all(features_equal)
    assert rows_on + copies_on == rows_off, (rows_on, copies_on, rows_off)  # the same forests, fewer rows
    want_tokens = [[s.tokens[len(o.prompt_token_ids):] for s in w.sequences] for w, o in zip(want, off)]
    assert _tokens(off) == want_tokens and _tokens(on) == want_tokens
