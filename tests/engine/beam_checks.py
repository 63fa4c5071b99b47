"""What the in-engine beam tests and the DSBD engine tests share: prompts, references, checks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from exact_dist import chi2_pvalue, exact_beam_sampling  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
EOS = 2


def engine_metric(llm, name: str) -> float:
    """``name`` summed over its labels, read from ``llm``'s own Prometheus collectors.

    ``llm.get_metrics()`` reads vLLM's process-global Prometheus registry, and
    every new engine unregisters the collectors of the previous ones: with
    session-scoped engines it would read whichever engine started last.
    """
    from prometheus_client.metrics import MetricWrapperBase
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    (prom,) = [lg for lg in llm.llm_engine.logger_manager.stat_loggers if isinstance(lg, PrometheusStatLogger)]
    total, seen, todo = 0.0, set(), [prom]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, MetricWrapperBase):
            total += sum(s.value for m in obj.collect() for s in m.samples if s.name in (name, name + "_total"))
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif type(obj).__module__.startswith(("vllm.v1.", "vllm_dsbd.engine.metrics")) and hasattr(obj, "__dict__"):
            # metric holders, not configs
            todo.extend(vars(obj).values())
    return total



def tiny_draft_two_heads():
    """A tiny draft with two attention heads: tensor parallelism splits heads, so TP 2 needs an even
    number (the tiny pair's draft has one; head_dim 32 for CPU attention)."""
    from vllm_dsbd import models

    return models.build_tiny_llama(models.cache_root() / "tiny" / "tiny-draft-2h", num_layers=1, hidden_size=64,
                                   num_heads=2, num_kv_heads=2, intermediate_size=64, seed=1)


def start_spec_llm(model, draft, env: dict[str, str], gamma: int = 3, knobs: dict | None = None, **overrides):
    """A speculative DSBD engine on the tiny models (γ <= ``gamma``, W <= 8, stats on, engine-wide DSBD
    ``knobs``) started with ``env`` set (the engine's processes read it at start), the environment restored
    afterwards."""
    from engine_pool import environment  # tests/engine_pool.py
    from vllm import LLM

    from vllm_dsbd.demo import dsbd_engine_kwargs

    with environment(env):
        return LLM(**{**dsbd_engine_kwargs(str(model), str(draft), gamma, 8, **(knobs or {})),
                      "disable_log_stats": False,
                      "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20, **overrides})


def start_permutation_llm(tiny_target, root: Path, env: dict[str, str] | None = None, logit_scale: float | None = None,
                          **kw):
    """A DSBD engine (γ <= 2) on a bigram target written under ``root`` (next token = a permutation of the
    current one, made from ``tiny_target``) with a head that predicts it from the feature of the position
    before (as EAGLE-3 lays out its inputs): every draft after a prompt's first iteration is right."""
    from eagle3_heads import write_permutation_head, write_permutation_target  # tests/eagle3_heads.py

    scale = {} if logit_scale is None else {"logit_scale": logit_scale}
    target = write_permutation_target(tiny_target, root / "target", **scale)
    return start_spec_llm(target, write_permutation_head(target, root / "head", **scale), env or {}, gamma=2, **kw)


def assert_the_permutation_head_is_right_after_each_prompt(llm) -> None:
    """W 1, γ 1, T 0 on a :func:`start_permutation_llm` engine: each iteration drafts one token from the last
    token and the target's feature of the one before it. After a prompt, whose last token does not follow its
    previous one, every draft is right: the head is wrong only in each prompt's first iteration (a zero or
    misplaced feature is never right)."""
    from vllm import SamplingParams

    names = {k: f"vllm:spec_decode_num_{k}" for k in ("draft_tokens", "accepted_tokens")}
    before = {k: engine_metric(llm, n) for k, n in names.items()}
    params = SamplingParams(n=1, temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True,
                            extra_args={"beam_width": 1, "num_speculative_tokens": 1})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = {k: engine_metric(llm, n) - before[k] for k, n in names.items()}
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert after["draft_tokens"] >= 8 * len(PROMPTS)
    assert after["accepted_tokens"] == after["draft_tokens"] - len(PROMPTS), after


def beam_search(llm, prompts, width, max_tokens, length_penalty=1.0):
    """``llm.beam_search`` (vLLM's front-end loop on a plain engine, the engine's on a DSBD engine)."""
    from vllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty)
    return llm.beam_search([{"prompt": p} for p in prompts], params)


def _hf_logits_fn(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits_fn(sequences):
        return model(torch.tensor(sequences)).logits[:, -1].float()

    return logits_fn


def assert_distributed_as_beam_sampling(outs, target_path, width, max_tokens, top_k) -> None:
    """The sets of returned sequences (ignore_eos, T = 1) follow exact beam sampling (chi-square, p > 1e-3),
    and the same samples reject beam sampling with uniform parent weights (a planted bug)."""
    samples = [tuple(sorted(tuple(c.token_ids) for c in o.outputs)) for o in outs]
    fn = _hf_logits_fn(target_path)
    prompt_ids = tuple(outs[0].prompt_token_ids)
    expected = exact_beam_sampling(fn, prompt_ids, width, max_tokens, top_k=top_k, ignore_eos=True)
    assert chi2_pvalue(samples, expected) > 1e-3
    wrong = exact_beam_sampling(fn, prompt_ids, width, max_tokens, top_k=top_k, ignore_eos=True,
                                uniform_parents=True)
    assert chi2_pvalue(samples, wrong) < 1e-3


def sample_with_acceptances(llm, prompt: str, params: list, min_acceptance: float = 0.3) -> list:
    """``llm``'s outputs for ``params`` on ``prompt``, checking that drafts were accepted: the share of proposed
    draft nodes accepted (vLLM's spec-decode counters) is at least ``min_acceptance``. A distribution test
    whose drafts are all rejected checks only the residual, which is then the target itself."""
    names = {k: f"vllm:spec_decode_num_{k}" for k in ("draft_tokens", "accepted_tokens")}
    before = {k: engine_metric(llm, n) for k, n in names.items()}
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    after = {k: engine_metric(llm, n) - before[k] for k, n in names.items()}
    acceptance = after["accepted_tokens"] / max(after["draft_tokens"], 1)
    assert acceptance >= min_acceptance, f"only {acceptance:.2f} of {after['draft_tokens']:.0f} draft nodes accepted"
    return outs


def beam_sampling_pvalue(outs, target_path, width, max_tokens, top_k) -> float:
    """The chi-square p-value of the sets of returned sequences (ignore_eos, T = 1) against exact beam sampling."""
    samples = [tuple(sorted(tuple(c.token_ids) for c in o.outputs)) for o in outs]
    expected = exact_beam_sampling(_hf_logits_fn(target_path), tuple(outs[0].prompt_token_ids), width, max_tokens,
                                   top_k=top_k, ignore_eos=True)
    return chi2_pvalue(samples, expected)


def plant_draft_joint_at_another_temperature(monkeypatch, scale: float = 1.0) -> None:
    """A planted bug in the engine path: the runner keeps, for verification, the draft joint at draft
    temperature scale ``scale`` rather than the one the draft layer drew its nodes from."""
    import dataclasses

    from vllm_dsbd.engine import spec_step

    original = spec_step.draft_layers

    def planted(logits, rows, steps, support=None, vocab_size=None):
        drawn = original(logits, rows, steps, support, vocab_size)
        other = original(logits, rows, [dataclasses.replace(ds, draft_temperature_scale=scale) for ds in steps],
                         support, vocab_size)
        return [(decision, joint if joint is None else wrong) for (decision, joint), (_, wrong) in zip(drawn, other)]

    monkeypatch.setattr(spec_step, "draft_layers", planted)


def plant_beam_steps_on_the_draft_layers_streams(monkeypatch) -> None:
    """A planted bug in the engine path (the one fixed-width DSBD had): a beam step at iteration s draws from
    the generator iteration 0's draft layer s drew from."""
    from vllm_dsbd.engine import beam_step

    def old(seed, step, device="cpu"):
        g = torch.Generator(device=device)
        g.manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
        return g

    monkeypatch.setattr(beam_step, "group_generator", old)


def assert_kv_freed_after_finish_and_abort(llm, finished_params, aborted_params, prefix: str) -> None:
    """KV usage is 0 after ``finished_params`` ran on every prompt, and after requests made from
    ``aborted_params(i)`` held KV and were aborted mid-generation."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    llm.generate(PROMPTS, finished_params, use_tqdm=False)
    assert engine_metric(llm, "vllm:kv_cache_usage_perc") == 0.0
    ids = [f"{prefix}-{i}" for i in range(len(PROMPTS))]
    for i, (rid, prompt) in enumerate(zip(ids, PROMPTS)):
        engine.add_request(rid, prompt, aborted_params(i))
    try:
        for _ in range(30):  # stats of earlier steps may still be queued
            engine.step()
            if engine_metric(llm, "vllm:kv_cache_usage_perc") > 0.0:
                break
        assert engine_metric(llm, "vllm:kv_cache_usage_perc") > 0.0
    finally:  # never leave requests behind for the tests sharing this engine
        engine.abort_request(ids, internal=False)
    assert not engine.has_unfinished_requests()
    # A plain request afterwards runs the engine past the aborts; its stats come after its own free.
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert engine_metric(llm, "vllm:kv_cache_usage_perc") == 0.0


def recording_policy(llm, draft_seconds: float, target_seconds: float, batches: list | None = None):
    """A fresh depth policy in the in-process engine with fixed step costs (whatever the step's size);
    returns the list the γ chosen at each iteration start (not the admissions' look-aheads) goes to.
    ``batches``: gets the batch each choice saw, look-aheads included. ``policy.in_step_choices``: how many
    choices were made for drafting inside a verify step."""
    from vllm_dsbd.algorithm.depth import DepthPolicy

    policy = DepthPolicy()
    for tokens in (4, 32):
        policy.draft.observe(tokens, draft_seconds)
        policy.target.observe(tokens, target_seconds)
    policy.observe_step = lambda *args: None  # keep those costs
    policy.in_step_choices = 0
    chosen = []
    choose = policy.choose

    def record(*args, **kw):
        depth = choose(*args, **kw)
        if batches is not None:
            batches.append(kw["batch"])
        if kw.get("probe", True):
            chosen.append(depth)
        policy.in_step_choices += bool(kw.get("in_step"))
        return depth

    policy.choose = record
    llm.llm_engine.engine_core.engine_core.scheduler._depth = policy
    return chosen
