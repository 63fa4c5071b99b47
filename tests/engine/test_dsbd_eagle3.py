"""DSBD and MJSD drafting with EAGLE-3 heads (``engine.eagle3``) in real engines on CPU.

Random heads (tests/eagle3_heads.py, a 1,024-token draft vocabulary) check exactness: T = 0 is
vLLM's beam search token for token, fixed-width T > 0 is beam sampling, MJSD at T = 0 is greedy,
mixed batches equal solo runs, and no KV leaks. A head built to be right (a bigram target whose
next token is a permutation of the current one, and a head that reads that token from the
target's features) checks that the head gets the features EAGLE-3 defines: every draft after a
prompt's first is accepted.
"""

from __future__ import annotations

import sys

import pytest
import torch
from beam_checks import (  # tests/engine/beam_checks.py
    PROMPTS, assert_distributed_as_beam_sampling, assert_kv_freed_after_finish_and_abort,
    assert_the_permutation_head_is_right_after_each_prompt, beam_search, engine_metric, recording_policy,
    start_spec_llm)

pytestmark = pytest.mark.engine

PICKLE = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc with a function (the probe below)


@pytest.fixture
def head_llm(engine_pool, tiny_eos_target, heads):
    """A speculative DSBD engine (γ <= 3, W <= 8) drafting with a random speculators-layout head in draft steps
    (``draft_in_step`` false; the engines started without the knob draft inside the verify step)."""
    return engine_pool.get("head_llm", lambda: start_spec_llm(tiny_eos_target, heads["speculators"], PICKLE,
                                                              knobs={"draft_in_step": False}))


def _beams(width, gamma, max_tokens, temperature=0.0, **kw):
    from vllm import SamplingParams

    extra = {"beam_width": width, "num_speculative_tokens": gamma, **kw.pop("extra", {})}
    return SamplingParams(n=width, temperature=temperature, max_tokens=max_tokens, logprobs=0, extra_args=extra, **kw)


def _assert_same_search(want, got):
    for w, g in zip(want, got, strict=True):
        prompt_len = len(g.prompt_token_ids)
        assert [list(c.token_ids) for c in g.outputs] == [s.tokens[prompt_len:] for s in w.sequences]
        assert [c.cumulative_logprob for c in g.outputs] == pytest.approx([s.cum_logprob for s in w.sequences],
                                                                          abs=1e-3)


def _shared_embeddings(worker) -> dict:
    """Runs in the worker: does the head use the target's embedding table, and how wide are its logits."""
    runner = worker.model_runner
    head, target = runner.drafter.model, runner.get_model()
    logits = head.compute_logits(torch.zeros((1, head.config.hidden_size)))
    return {"same": head.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr(),
            "finite": int(torch.isfinite(logits).sum()), "width": logits.shape[-1],
            "support": None if runner._dsbd_support is None else runner._dsbd_support.tolist(),
            "logit_support": torch.isfinite(logits[0]).nonzero()[:, 0].tolist(),
            "features": tuple(runner._dsbd_features.features.shape)}


def _head_layers(worker) -> tuple[int, int]:
    """Runs in the worker: the decoder layers of the engine's head, and its per-aux-state norms before ``fc``."""
    model = worker.model_runner.drafter.model.model
    return len(model.layers), 0 if model.fc_norm is None else len(model.fc_norm)


def test_a_head_shares_the_target_embeddings_and_drafts_over_its_own_vocabulary(head_llm, monkeypatch):
    import cloudpickle

    monkeypatch.setenv(*next(iter(PICKLE.items())))
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    (probe,) = head_llm.collective_rpc(_shared_embeddings)
    assert probe["same"] and probe["width"] == 49152 and probe["finite"] == 1024
    assert probe["support"] == probe["logit_support"]  # the draws run over the head's draft vocabulary
    assert probe["features"][1] == 64 and probe["features"][0] % 16 == 0  # one row per KV slot


@pytest.mark.parametrize("width, gamma", [(1, 2), (2, 1), (4, 3), (8, 2)])
def test_lossless_speculative_beam_search_with_a_head(head_llm, tiny_eos_llm, width, gamma):
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
    _assert_same_search(want, head_llm.generate(PROMPTS, _beams(width, gamma, 10), use_tqdm=False))


@pytest.mark.parametrize("engine", ["head_llm", "in_step_llm"])
def test_lossless_with_a_head_whose_candidates_are_ranked_at_a_scaled_temperature(request, engine, tiny_eos_llm):
    """T 0 with ``draft_temperature_scale`` 0.5 (the head ranks its candidates as if sharper), in draft steps
    and inside the verify step: other drafts, vLLM's beam search's tokens."""
    llm = request.getfixturevalue(engine)
    want = beam_search(tiny_eos_llm, PROMPTS, 4, 10)
    got = llm.generate(PROMPTS, _beams(4, 2, 10, extra={"draft_temperature_scale": 0.5}), use_tqdm=False)
    _assert_same_search(want, got)


def test_lossless_with_a_head_in_the_original_eagle3_layout(engine_pool, tiny_eos_target, tiny_eos_llm, heads):
    """Started without ``draft_in_step``: a head on CPU drafts inside the verify step by default."""
    from vllm_dsbd.config import DSBDConfig

    llm = engine_pool.get("head_eagle3_layout_llm", lambda: start_spec_llm(tiny_eos_target, heads["eagle3"], {}))
    assert DSBDConfig.from_vllm_config(llm.llm_engine.vllm_config).draft_in_step is True
    want = beam_search(tiny_eos_llm, PROMPTS, 4, 10)
    _assert_same_search(want, llm.generate(PROMPTS, _beams(4, 2, 10), use_tqdm=False))


def test_fixed_width_dsbd_with_a_head_is_distributed_as_beam_sampling(head_llm, tiny_eos_target):
    """2,000 seeded requests (γ = 2, T = 1, top-k 3 on the joint) drafted from a 1,024-token vocabulary against
    exact enumeration of beam sampling; the same samples reject a planted bug (uniform parent weights)."""
    params = [_beams(2, 2, 3, temperature=1.0, top_k=3, ignore_eos=True, seed=seed, extra={"fixed_width": True})
              for seed in range(2000)]
    outs = head_llm.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    assert_distributed_as_beam_sampling(outs, tiny_eos_target, 2, 3, 3)


def test_temperature_zero_mjsd_with_a_head_is_greedy(head_llm, tiny_eos_llm):
    from vllm import SamplingParams

    want = tiny_eos_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    mjsd = SamplingParams(temperature=0.0, max_tokens=24,
                          extra_args={"decoder": "mjsd", "beam_width": 4, "num_speculative_tokens": 3, "mjsd_tau": 0.5})
    got = head_llm.generate(PROMPTS, mjsd, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_mixed_batch_of_head_drafted_dsbd_mjsd_and_plain_requests(head_llm):
    from vllm import SamplingParams

    jobs = [(PROMPTS[0], _beams(2, 3, 8)), (PROMPTS[1], _beams(4, 1, 8, temperature=0.8, seed=4)),
            (PROMPTS[2], _beams(3, 0, 6)),
            (PROMPTS[1], SamplingParams(temperature=1.0, seed=2, max_tokens=8,
                                        extra_args={"decoder": "mjsd", "beam_width": 2, "num_speculative_tokens": 2})),
            (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8)),
            (PROMPTS[0], SamplingParams(temperature=1.0, seed=7, max_tokens=8))] * 2
    together = head_llm.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    for (prompt, params), out in zip(jobs, together):
        alone = head_llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]


def test_no_kv_blocks_leak_with_a_head(head_llm):
    assert_kv_freed_after_finish_and_abort(head_llm, _beams(3, 3, 30, temperature=0.9, seed=1),
                                           lambda i: _beams(4, 3, 200, temperature=1.0, seed=i), "abort-head")


def test_a_head_trained_here_drafts_losslessly(engine_pool, tiny_eos_target, tiny_eos_llm, tmp_path_factory):
    """A head from ``vllm-dsbd train-drafter``'s code (a few steps on random teacher rows, exported in the
    speculators format without embeddings; two decoder layers, ``--head-layers 2``, and a norm on each aux
    state, ``--fc-norm``) loads as a DSBD draft with both and drafts inside the verify step (the default);
    T 0 stays vLLM's beam search. (One-layer heads trained here: the shipped head's test on SmolLM2.)"""
    from eagle3_heads import fake_teacher_shards  # tests/eagle3_heads.py

    from vllm_dsbd.draft import eagle3_head

    def start():
        root = tmp_path_factory.mktemp("trained-head")
        settings = eagle3_head.HeadSettings(aux_ids=(0, 1, 2), draft_vocab_size=512, tokens=300, batch_tokens=100,
                                            num_layers=2, fc_norm=True)
        eagle3_head.train(settings, tiny_eos_target, fake_teacher_shards(root / "data"), root / "ck", progress=False)
        return start_spec_llm(tiny_eos_target, eagle3_head.export(settings, tiny_eos_target, root / "ck", root / "head"),
                              PICKLE)

    llm = engine_pool.get("trained_head_llm", start)
    import cloudpickle

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(*next(iter(PICKLE.items())))
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        assert [tuple(r) for r in llm.collective_rpc(_head_layers)] == [(2, 3)]
    want = beam_search(tiny_eos_llm, PROMPTS, 4, 10)
    _assert_same_search(want, llm.generate(PROMPTS, _beams(4, 2, 10), use_tqdm=False))


def test_mjsd_drafting_inside_the_verify_step_feeds_the_head_the_accepted_tokens(permutation_in_step_llm):
    """MJSD (K 1, γ 2, T 0) on the permutation pair with ``draft_in_step``: depth 1 is right after a
    request's first iteration, depth 2 (fed the head's own output) never, so every later iteration accepts
    one draft token, and the next draft, drawn in that verify step, reads the target's feature of it. A
    chain left without its accepted tokens (planted) reads the wrong feature after every acceptance."""
    from vllm import SamplingParams

    llm = permutation_in_step_llm
    names = {k: f"vllm:spec_decode_num_{k}" for k in ("drafts", "accepted_tokens")}
    before = {k: engine_metric(llm, n) for k, n in names.items()}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, extra_args={
        "decoder": "mjsd", "beam_width": 1, "num_speculative_tokens": 2, "mjsd_tau": 0.5})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = {k: engine_metric(llm, n) - before[k] for k, n in names.items()}
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    # all but two iterations a request accept one: its first (after a prompt the head is wrong) and its last
    # (one token left: no draft); 9 iterations of 1 + 7 x 2 + 1 tokens (the planted chain: 11, 5 accepted)
    assert after["accepted_tokens"] == after["drafts"] - 2 * len(PROMPTS) == 7 * len(PROMPTS), after


def test_memory_efficient_drafting_inside_the_verify_step_draws_what_draft_steps_draw(permutation_in_step_llm):
    """Memory-efficient DSBD (W 4, γ 2, one beam carried) on the permutation pair with ``draft_in_step``, at
    T 2, where the head's depth-1 distribution is the target's own spread over many tokens: its drafts pass,
    and which tokens it draws decides the output. Each seeded request gives the tokens it gives drafting in
    draft steps (the in-step layers drawn with the draft steps' seeds, from the one beam the verification
    kept), with dynamic and with fixed width, and takes draft steps only in its first iteration."""
    llm = permutation_in_step_llm

    def run(seed: int, **extra):
        accepted = engine_metric(llm, "vllm:spec_decode_num_accepted_tokens")
        params = [_beams(1, 2, 16, temperature=2.0, seed=seed + i, ignore_eos=True,
                         extra={"beam_width": 4, "memory_efficient": True, **extra}) for i in range(len(PROMPTS))]
        outs, drafts = _generate_counting_draft_steps(llm, PROMPTS, params)
        return ([list(o.outputs[0].token_ids) for o in outs], drafts,
                engine_metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted)

    for extra in ({"width_threshold": 0.9}, {"fixed_width": True}):
        got, drafts, accepted = run(7, **extra)
        off, drafts_off, accepted_off = run(7, draft_in_step=False, **extra)
        assert got == off, (extra, got, off)
        assert accepted == accepted_off >= 2 * len(PROMPTS), (extra, accepted, accepted_off)
        assert drafts <= 2 * len(PROMPTS) < drafts_off, (extra, drafts, drafts_off)


def test_a_head_reads_the_feature_of_the_position_before_each_token(permutation_llm):
    """W = 1, γ = 1 on the permutation pair: every draft after each prompt's first iteration is right."""
    assert_the_permutation_head_is_right_after_each_prompt(permutation_llm)


def _compiled(model) -> list[bool]:
    """Whether each ``@support_torch_compile`` module of ``model`` runs compiled."""
    return [not m.do_not_compile for m in model.modules() if hasattr(m, "do_not_compile")]


@pytest.fixture
def compiled_permutation_llm(engine_pool, tiny_pair, tmp_path_factory):
    """The permutation pair in vLLM's default compiled mode, drafting inside the verify step."""
    from beam_checks import start_permutation_llm  # tests/engine/beam_checks.py

    return engine_pool.get("compiled_permutation_llm", lambda: start_permutation_llm(
        tiny_pair.target, tmp_path_factory.mktemp("compiled-permutation"), knobs={"draft_in_step": True},
        enforce_eager=False))


@pytest.fixture
def compiled_in_step_llm(engine_pool, tiny_eos_target, heads):
    """``in_step_llm`` in vLLM's default compiled mode."""
    return engine_pool.get("compiled_in_step_llm", lambda: start_spec_llm(
        tiny_eos_target, heads["speculators"], {}, knobs={"draft_in_step": True}, enforce_eager=False))


def test_a_head_in_a_compiled_engine_reads_the_targets_features(compiled_permutation_llm):
    """vLLM's default mode compiles the target and the head: the permutation head, which reads the next token
    from the compiled target's features, drafts right after each prompt (drafting inside the verify step)."""
    llm = compiled_permutation_llm
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert llm.llm_engine.vllm_config.model_config.enforce_eager is False
    assert _compiled(runner.model) == [True] and _compiled(runner.drafter.model) == [True]
    assert_the_permutation_head_is_right_after_each_prompt(llm)


class _EagerBesideCompiled:
    """Runs every head forward eager, then compiled on the same inputs (the compiled output goes on), and
    records the largest difference. ``planted``: the compiled call gets int64 tokens (the bug that kept the
    head eager until it was found: vLLM calls a compiled graph without guards, and the head's graph is traced
    with vLLM's int32 input ids)."""

    def __init__(self, runner, planted: bool = False) -> None:
        self.head, self.planted, self.diffs = runner.drafter.model, planted, {"forest": [], "draft step": []}

    def _mode(self, compiled: bool) -> None:
        for m in self.head.modules():
            if hasattr(m, "do_not_compile"):
                m.do_not_compile = not compiled

    def _both(self, kind: str, call, rollback, tokens_key: str, kwargs: dict):
        self._mode(False)
        eager = call(**kwargs)
        rollback()
        if self.planted:
            kwargs = {**kwargs, tokens_key: kwargs[tokens_key].long()}
        self._mode(True)
        compiled = call(**kwargs)
        scale = float(eager[0].abs().max())
        self.diffs[kind].append(float((eager[0] - compiled[0]).abs().max()) / max(scale, 1.0))
        return compiled

    def forest(self, original):
        def head_forward(head, names, config, tokens, positions, features, rows):
            lengths = {name: len(keys) for name, keys in rows.scratch.keys.items()}

            def rollback():  # the eager call's rows leave the scratch: the compiled call adds them again
                for name in rows.scratch.keys:
                    del rows.scratch.keys[name][lengths.get(name, 0):]
                    del rows.scratch.values[name][lengths.get(name, 0):]

            call = lambda **kw: original(head, names, config, rows=rows, **kw)  # noqa: E731
            return self._both("forest", call, rollback, "tokens",
                              {"tokens": tokens, "positions": positions, "features": features})
        return head_forward

    def draft_step(self, original):
        def head_forward(**kwargs):  # its writes (features, paged KV) are written again by the compiled call
            return self._both("draft step", original, lambda: None, "input_ids", kwargs)
        return head_forward


@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-int64-tokens"])
def test_a_compiled_head_drafts_as_the_eager_head(compiled_in_step_llm, tiny_eos_llm, monkeypatch, planted):
    """In vLLM's default compiled mode the head runs compiled, in draft steps and inside the verify step, and
    its outputs equal its eager outputs on every call (a random head, whose output depends on every input;
    float32). The same check rejects the head called with int64 tokens."""
    from vllm_dsbd.engine import forest_attention

    llm = compiled_in_step_llm
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert _compiled(runner.model) == [True] and _compiled(runner.drafter.model) == [True]
    probe = _EagerBesideCompiled(runner, planted)
    monkeypatch.setattr(forest_attention, "head_forward", probe.forest(forest_attention.head_forward))
    monkeypatch.setattr(runner, "_head_forward", probe.draft_step(runner._head_forward))
    got = llm.generate(PROMPTS, _beams(4, 2, 12), use_tqdm=False)
    _assert_same_search(beam_search(tiny_eos_llm, PROMPTS, 4, 12), got)  # exact either way
    # the prompts' first iterations draft together, in γ draft steps; each later one inside a verify step
    assert len(probe.diffs["forest"]) >= 8 and len(probe.diffs["draft step"]) >= 2, probe.diffs
    worst = {kind: max(diffs) for kind, diffs in probe.diffs.items()}
    if planted:
        assert min(worst.values()) > 1e-3, worst  # measured: 0.009 (forest), 0.97 (draft step)
    else:
        assert max(worst.values()) < 1e-5, worst  # measured: 1e-7 (float32)


def test_the_heads_kv_of_accepted_drafts_is_recomputed_from_the_targets_features(permutation_llm):
    """W = 1, γ = 2 on the permutation pair: depth 1 is always right after the first iteration, depth 2 (fed
    the head's own output) never, so each iteration accepts one draft and adds two tokens. The head computed
    the accepted draft's KV in draft layer 2 from its own feature; the next iteration's first draft layer
    computes it again (from the target's feature, as the head was trained) with the new last token: three
    draft rows per iteration, two if the draft node's KV were kept. (New beams are forks of their root that
    share only the root's draft KV, so this holds by construction; the test keeps it so.)"""
    profile = lambda: permutation_llm.collective_rpc("dsbd_step_profile")[0].get("draft", {}).get("tokens", 0)  # noqa
    prompt = PROMPTS[:1]
    tokens = {}
    for n in (8, 16):
        before = profile()
        outs = permutation_llm.generate(prompt, _beams(1, 2, n, ignore_eos=True), use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == n
        tokens[n] = profile() - before
    assert tokens[16] - tokens[8] == 3 * (16 - 8) // 2


def _check_forest_attention(worker) -> None:
    """Runs in the worker: after every draft step, the head's logits at its drafted rows are computed again
    with ``engine.forest_attention`` (the paged KV of the beam's context, then scratch rows): a beam's
    last token as a forest row of its own, and a layer-2 node as a row whose ancestor is its beam's row."""
    from vllm_dsbd.engine import eagle3, forest_attention

    runner = worker.model_runner
    head = runner.drafter.model
    names = forest_attention.install(head)
    sample = runner._sample
    runner._forest_check = record = {"diffs": {1: [], 2: []}, "parents": {}, "sample": sample}

    def forward(tokens, positions, features, rows):
        normed, own = forest_attention.head_forward(head, names, runner.vllm_config, torch.tensor(tokens),
                                                    torch.tensor(positions), features, rows)
        return head.compute_logits(normed), own

    def compare(got, want):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        return float((got[finite] - want[finite]).abs().max())

    def checked(logits, metadata):
        plan = runner._dsbd_plan
        out = sample(logits, metadata)
        if plan is None or not plan.draft or logits is None:
            return out
        batch, gid = runner.input_batch, runner._dsbd_features_gid
        table = batch.block_table[gid]
        for ds in plan.draft_steps:
            for rid in ds.req_ids:
                i = batch.req_id_to_index[rid]
                n = int(batch.num_tokens_no_spec[i])
                tokens = batch.token_ids_cpu[i, :n].tolist()
                blocks = table.block_table.cpu[i].clone()
                if ds.layer == 1:  # the beam's last token: paged context 0 .. n - 2, no ancestors
                    prev = eagle3.previous_slots(torch.tensor([n - 1]), torch.tensor([0]), blocks[None],
                                                 table.block_size)
                    rows = forest_attention.ForestRows([blocks], [n - 1], [[]], forest_attention.ScratchKV())
                    got, own = forward([tokens[-1]], [n - 1], runner._dsbd_features.read(prev), rows)
                    record["parents"][tuple(tokens)] = (blocks, rows.scratch, rows.row_ids[0], own)
                elif ds.layer == 2 and tuple(tokens[:-1]) in record["parents"]:  # a node: its beam's row first
                    parent_blocks, scratch, parent_row, parent_own = record["parents"][tuple(tokens[:-1])]
                    rows = forest_attention.ForestRows([parent_blocks], [n - 2], [[parent_row]], scratch)
                    got, _ = forward([tokens[-1]], [n - 1], parent_own, rows)
                else:
                    continue
                record["diffs"][ds.layer].append(compare(got[0], logits[i]))
        return out

    runner._sample = checked


def _forest_check_result(worker) -> dict:
    """Runs in the worker: the differences found, and the runner's own ``_sample`` back (the wrapped attention
    stays: other metadata goes to vLLM's kernel)."""
    record = worker.model_runner._forest_check
    worker.model_runner._sample = record["sample"]
    return record["diffs"]


def test_forest_attention_gives_the_draft_steps_logits(head_llm, monkeypatch):
    """The head run on forest rows (paged context + scratch ancestors, as drafting inside the verify step
    will) gives the logits that its paged draft steps give, at layer 1 and at layer 2."""
    import cloudpickle

    monkeypatch.setenv(*next(iter(PICKLE.items())))
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    head_llm.collective_rpc(_check_forest_attention)
    try:
        head_llm.generate(PROMPTS, _beams(2, 2, 8, ignore_eos=True), use_tqdm=False)
    finally:
        (diffs,) = head_llm.collective_rpc(_forest_check_result)
    assert len(diffs[1]) >= 3 * 4 and len(diffs[2]) >= 3 * 4, {k: len(v) for k, v in diffs.items()}
    assert max(diffs[1] + diffs[2]) < 1e-3, diffs


def _steps(llm) -> dict[str, int]:
    return {kind: int(p["steps"]) for kind, p in llm.collective_rpc("dsbd_step_profile")[0].items()}


def _generate_counting_draft_steps(llm, prompts, params) -> tuple[list, int]:
    """``llm.generate``'s outputs and the draft steps the engine took for them."""
    before = _steps(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, _steps(llm).get("draft", 0) - before.get("draft", 0)


def test_only_a_requests_first_iteration_takes_draft_steps_when_drafting_inside_the_verify_step(in_step_llm):
    """Every later forest is drawn in the verify step before it: at most γ draft steps per request. A request
    that turns the knob off drafts in draft steps (γ per iteration, 4 iterations or more), to the same beams
    at T 0. The step profile counts the drawing as part of the verify steps' decisions, and none without it."""
    def run(**extra):
        before = in_step_llm.collective_rpc("dsbd_step_profile")[0]
        outs = in_step_llm.generate(PROMPTS, _beams(4, 2, 12, ignore_eos=True, extra=extra), use_tqdm=False)
        after = in_step_llm.collective_rpc("dsbd_step_profile")[0]
        return outs, {kind: {k: v - before.get(kind, {}).get(k, 0.0) for k, v in p.items()}
                      for kind, p in after.items()}

    outs, profile = run()
    drafts, verify = profile.get("draft", {}).get("steps", 0), profile["verify"]
    assert drafts <= 2 * len(PROMPTS) and verify["steps"] >= 12 // 3, (drafts, verify)
    assert 0 < verify["draft_s"] < verify["decide_s"], verify
    off, profile_off = run(draft_in_step=False)
    drafts_off = profile_off.get("draft", {}).get("steps", 0)
    assert drafts_off > 2 * len(PROMPTS), drafts_off  # 23 here: γ per iteration, the prompts batched
    assert sum(p["draft_s"] for p in profile_off.values()) == 0, profile_off
    assert [[list(c.token_ids) for c in o.outputs] for o in off] == [[list(c.token_ids) for c in o.outputs]
                                                                     for o in outs]


@pytest.mark.parametrize("width, gamma", [(2, 1), (4, 3), (8, 2)])
def test_drafting_inside_the_verify_step_equals_beam_search_with_eos(in_step_llm, tiny_eos_llm, width, gamma):
    want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
    _assert_same_search(want, in_step_llm.generate(PROMPTS, _beams(width, gamma, 10), use_tqdm=False))


def test_auto_depth_chooses_one_iteration_ahead_and_drafts_inside_the_verify_step(inproc_in_step_llm, tiny_eos_llm):
    """auto_depth on an engine that drafts inside the verify step: each later iteration's γ is chosen as the
    verify step before it is planned, and its layers are drawn in that step (the runner's timings of it feed
    the policy's cost of in-step drafting). Draft steps are made to look free, so the policy speculates while
    its acceptance estimate is high and falls back to depth 0 as the random head fails: mixed depths, still
    vLLM's beam search token for token."""
    llm = inproc_in_step_llm
    chosen = recording_policy(llm, 1e-4, 1.0)
    policy = llm.llm_engine.engine_core.engine_core.scheduler._depth
    for width in (2, 4):
        want = beam_search(tiny_eos_llm, PROMPTS, width, 10)
        got = llm.generate(PROMPTS, _beams(width, 3, 10, extra={"auto_depth": True}), use_tqdm=False)
        _assert_same_search(want, got)
    assert policy.in_step_choices > 0 and policy.in_step.num_observations > 0, (policy.in_step_choices, chosen)
    assert 0 in chosen and max(chosen) >= 2, chosen


def test_an_iteration_of_depth_zero_draws_the_next_forest_in_its_beam_step(inproc_in_step_llm, tiny_eos_llm):
    """auto_depth with ``draft_in_step``: an iteration of depth 0 is a beam step, and that step draws the next
    iteration's layers too (its γ chosen as the step is planned), the first one (the prompt's step) after the
    head's KV of the prompt. Depths 0 and 2 alternate: no request takes a draft step (they did, γ per
    iteration after each depth 0, before), and the beams are vLLM's beam search token for token; at T > 0
    the drawn layers' joints are where the verification takes them."""
    llm = inproc_in_step_llm
    recording_policy(llm, 1e-4, 1.0)
    policy = llm.llm_engine.engine_core.engine_core.scheduler._depth
    in_step = []

    def alternate(key, group_id, max_depth, *args, **kw):  # 0, 2, 0, ... (a look-ahead: γ 2)
        if kw.get("in_step"):
            in_step.append(0 if len(in_step) % 2 == 0 else min(2, max_depth))
            return in_step[-1]
        return min(2, max_depth)

    policy.choose = alternate
    for width in (2, 4):
        want = beam_search(tiny_eos_llm, PROMPTS, width, 12)
        before = _steps(llm)
        got = llm.generate(PROMPTS, _beams(width, 2, 12, extra={"auto_depth": True}), use_tqdm=False)
        after = _steps(llm)
        _assert_same_search(want, got)
        assert after.get("draft", 0) == before.get("draft", 0), (before, after, in_step)
    assert 0 in in_step and 2 in in_step, in_step
    before = _steps(llm)
    outs = llm.generate(PROMPTS, _beams(4, 2, 12, temperature=0.8, seed=3, ignore_eos=True,
                                        extra={"auto_depth": True}), use_tqdm=False)
    after = _steps(llm)
    assert all(len(c.token_ids) == 12 for o in outs for c in o.outputs), outs
    assert after.get("draft", 0) == before.get("draft", 0), (before, after)


def test_mjsd_drafts_inside_the_verify_step(in_step_llm, tiny_eos_llm):
    """MJSD on an engine that drafts inside the verify step: each later iteration's K draft beams are drawn in
    the verify step before it, so only a request's first iteration takes draft steps (γ of them; a request
    that turns the knob off takes γ per iteration). T 0 stays greedy; at T 1 each seeded request gives the
    tokens it gives drafting in draft steps (the same draws and acceptances, the head's logits on forest
    rows); no KV leaks after finishing and aborts. (That the head reads the accepted tokens: the permutation
    test below.)"""
    from vllm import SamplingParams

    def mjsd(temperature: float, max_tokens: int = 16, seed: int = 5, ignore_eos: bool = False,
             **extra) -> SamplingParams:
        knobs = {"decoder": "mjsd", "beam_width": 4, "num_speculative_tokens": 3, "mjsd_tau": 0.5, **extra}
        return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos,
                              extra_args=knobs)

    def run(params):
        outs, drafts = _generate_counting_draft_steps(in_step_llm, PROMPTS, params)
        return [list(o.outputs[0].token_ids) for o in outs], drafts

    greedy = tiny_eos_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    got, drafts = run(mjsd(0.0))
    assert got == [list(o.outputs[0].token_ids) for o in greedy]
    assert drafts <= 3 * len(PROMPTS), drafts
    off, drafts_off = run(mjsd(0.0, draft_in_step=False))
    assert off == got and drafts_off > 3 * len(PROMPTS), drafts_off
    # stop strings that greedy decoding writes halfway (after iterations drafted in the step): the greedy
    # request's text and finish reason
    texts = [o.outputs[0].text for o in greedy if len(o.outputs[0].text) >= 8]
    stops = [t[len(t) // 2:len(t) // 2 + 2] for t in texts]
    want = tiny_eos_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, stop=stops), use_tqdm=False)
    cut = SamplingParams(temperature=0.0, max_tokens=16, stop=stops, extra_args=mjsd(0.0).extra_args)
    fields = ("text", "token_ids", "finish_reason", "stop_reason")
    for g, w in zip(in_step_llm.generate(PROMPTS, cut, use_tqdm=False), want, strict=True):
        assert [getattr(g.outputs[0], f) for f in fields] == [getattr(w.outputs[0], f) for f in fields]
    assert sum(w.outputs[0].stop_reason in stops for w in want) >= 1  # a stop was hit
    # T 1: τ so low that the random head's drafts pass now and then, so the draws and the draft log-probs the
    # verification reads decide the outputs (in-step layers drawn with another iteration's seed, planted,
    # change them)
    accepted = engine_metric(in_step_llm, "vllm:spec_decode_num_accepted_tokens")
    sampled, drafts = run(mjsd(1.0, ignore_eos=True, mjsd_tau=1e-4))
    assert engine_metric(in_step_llm, "vllm:spec_decode_num_accepted_tokens") > accepted
    sampled_off, _ = run(mjsd(1.0, ignore_eos=True, mjsd_tau=1e-4, draft_in_step=False))
    assert sampled == sampled_off and drafts <= 3 * len(PROMPTS), (sampled, sampled_off, drafts)
    assert_kv_freed_after_finish_and_abort(in_step_llm, mjsd(0.9, 30, seed=1),
                                           lambda i: mjsd(1.0, 200, seed=i, ignore_eos=True), "abort-mjsd-in-step")


def test_memory_efficient_requests_draft_inside_the_verify_step(in_step_llm):
    """Memory-efficient DSBD (one beam carried between iterations) on an engine that drafts inside the verify
    step: each later forest grows from the one beam the verification kept, drawn in that step, so only a
    request's first iteration takes draft steps (γ of them; γ per iteration with the knob off), at T 0 and T 1
    each seeded request gives the tokens it gives drafting in draft steps, and no KV leaks after finishing and
    aborts. (The random head's drafts never pass here; that the in-step draws are the draft steps' draws: the
    permutation-pair test above.)"""
    def me(temperature: float, seed: int, max_tokens: int = 12, **extra):
        return _beams(1, 2, max_tokens, temperature=temperature, seed=seed, ignore_eos=temperature > 0,
                      extra={"beam_width": 4, "memory_efficient": True, "width_threshold": 0.9, **extra})

    def run(params):
        outs, drafts = _generate_counting_draft_steps(in_step_llm, PROMPTS, params)
        return [[list(c.token_ids) for c in o.outputs] for o in outs], drafts

    for temperature in (0.0, 1.0):
        got, drafts = run([me(temperature, 3 + i) for i in range(len(PROMPTS))])
        off, drafts_off = run([me(temperature, 3 + i, draft_in_step=False) for i in range(len(PROMPTS))])
        assert got == off, (temperature, got, off)
        assert drafts <= 2 * len(PROMPTS) < drafts_off, (temperature, drafts, drafts_off)
    assert_kv_freed_after_finish_and_abort(in_step_llm, me(0.9, 1, 30),
                                           lambda i: me(1.0, i, 200), "abort-me-in-step")


def test_drafting_inside_the_verify_step_is_distributed_as_beam_sampling(in_step_llm, tiny_eos_target):
    """As the draft-step test above: 2,000 seeded requests, γ = 2 (the second iteration's forest is drawn
    in the first verify step), against exact enumeration; the planted bug is rejected."""
    params = [_beams(2, 2, 3, temperature=1.0, top_k=3, ignore_eos=True, seed=seed, extra={"fixed_width": True})
              for seed in range(2000)]
    outs = in_step_llm.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    assert_distributed_as_beam_sampling(outs, tiny_eos_target, 2, 3, 3)


def test_drafting_inside_the_verify_step_in_a_mixed_batch_and_without_leaks(in_step_llm):
    from vllm import SamplingParams

    jobs = [(PROMPTS[0], _beams(2, 3, 8)), (PROMPTS[1], _beams(4, 1, 8, temperature=0.8, seed=4)),
            (PROMPTS[2], _beams(3, 2, 8, extra={"auto_depth": True})),
            (PROMPTS[1], SamplingParams(temperature=1.0, seed=2, max_tokens=8,
                                        extra_args={"decoder": "mjsd", "beam_width": 2, "num_speculative_tokens": 2})),
            (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8))] * 2
    together = in_step_llm.generate([p for p, _ in jobs], [s for _, s in jobs], use_tqdm=False)
    for (prompt, params), out in zip(jobs, together):
        alone = in_step_llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert_kv_freed_after_finish_and_abort(in_step_llm, _beams(3, 3, 30, temperature=0.9, seed=1),
                                           lambda i: _beams(4, 3, 200, temperature=1.0, seed=i), "abort-in-step")


def _wrong_beams_kv(store, width: int):
    """A planted bug in the kept head KV's lookup: beam ``slot`` gets the next beam's K/V, unchecked."""
    def take(group_id, step, slot, position, token):
        kept_step, rows = store._kept.get(group_id, (None, {}))
        row = rows.get((slot + 1) % width) if kept_step == step else None
        return None if row is None else row[2]
    return take


def _same_layers(drawn: list, recomputed: list) -> bool:
    """Whether two runs' drawn layers agree: per step and group (in the step's order; request ids differ between
    runs), the same parents and tokens, scores to 1e-5."""
    if len(drawn) != len(recomputed):
        return False
    for on, off in zip(drawn, recomputed):
        if [len(layers) for _, _, layers in on] != [len(layers) for _, _, layers in off]:  # groups in step order
            return False
        for (_, _, layers_on), (_, _, layers_off) in zip(on, off):
            for (p_on, t_on, s_on), (p_off, t_off, s_off) in zip(layers_on, layers_off):
                if (p_on, t_on) != (p_off, t_off) or s_on != pytest.approx(s_off, abs=1e-5):
                    return False
    return True


@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-wrong-beam"])
def test_the_next_iteration_writes_the_kept_head_kv_of_its_roots_instead_of_computing_it(
        inproc_in_step_llm, tiny_eos_llm, monkeypatch, planted):
    """A verify step that draws the next forest computes the head's K/V of each new beam's last token (a forest
    row written to no paged slot: sibling beams still share a request); the next iteration writes that K/V to
    its chains' slots instead of computing the row again (``forest_draft.KeptHeadKV``). Against the same
    engine with the lookup turned off (every chain recomputes its root's last token): the same drawn layers
    (tokens, parents, scores to 1e-5), one head row fewer per chain that found its root kept, and the same
    outputs (T 0: vLLM's beam search). The planted twin hands each chain the next beam's K/V: its drafts differ."""
    from vllm_dsbd.engine import forest_draft

    llm = inproc_in_step_llm
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    store = runner._dsbd_head_kv
    draws, draw = [], forest_draft.draw

    def recording_draw(runner, jobs):
        draw(runner, jobs)
        draws.append([(job.group.group_id, job.rows, [(d.parents, d.tokens, d.scores) for d in job.decisions])
                      for job in jobs])

    monkeypatch.setattr(forest_draft, "draw", recording_draw)
    width, params = 4, [_beams(4, 2, 10), _beams(4, 1, 10, temperature=0.8, seed=5, ignore_eos=True)]
    take = _wrong_beams_kv(store, width) if planted else store.take
    runs, used = {}, []

    def counting_take(*args):
        found = take(*args)
        used.extend([args] if found is not None else [])
        return found

    for mode in ("recompute", "kept"):
        monkeypatch.setattr(store, "take", (lambda *args: None) if mode == "recompute" else counting_take)
        draws.clear()
        outs = [llm.generate(PROMPTS, p, use_tqdm=False) for p in params]
        runs[mode] = list(draws), outs
    (recomputed, outs_off), (drawn, outs_on) = runs["recompute"], runs["kept"]
    rows = lambda run: sum(r for step in run for _, r, _ in step)  # noqa: E731
    assert len(used) > 0 and rows(recomputed) - rows(drawn) == len(used), (len(used), rows(recomputed), rows(drawn))
    if planted:
        assert not _same_layers(drawn, recomputed)
        return
    assert _same_layers(drawn, recomputed)
    _assert_same_search(beam_search(tiny_eos_llm, PROMPTS, width, 10), outs_on[0])
    assert [[list(c.token_ids) for c in o.outputs] for o in outs_on[1]] == \
        [[list(c.token_ids) for c in o.outputs] for o in outs_off[1]]
