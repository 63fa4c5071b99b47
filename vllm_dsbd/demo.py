"""The main job: beam decoding on the default pair (or ``--pair``), side by side, with timings.

A DSBD engine without a draft (``speculative_config={"method": "dsbd",
"num_speculative_tokens": 0}``) runs, on the same prompts: vLLM's greedy
decoding, vLLM's built-in ``LLM.beam_search`` (its front-end loop, run
unchanged on this engine), vllm-dsbd's in-engine beam search
(``llm.beam_search`` on a DSBD engine) and in-engine beam sampling
(``SamplingParams(n, temperature, extra_args={"beam_width": W})``). Then a
DSBD engine runs the same beam search (lossless: the same outputs) and beam
sampling with speculation, with ``auto_depth`` (each iteration drafts the
number of layers, up to γ, that the measured costs say pays; 0 is a plain
beam step). Its draft: on the default pair the shipped EAGLE-3 head (the best
draft this project has for that target), on another pair the pair's draft.
Each row runs once untimed first (a first run pays one-time costs), then
``TIMED_RUNS`` times; its time is the median, so that one-second timings
compare like with like (one run of a row swings by a fifth on a 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from vllm_dsbd import models, pairs
from vllm_dsbd.dtypes import resolve_dtype

TIMED_RUNS = 3
"""Timed runs per row (after one untimed run); a row's time is their median."""

DEMO_PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
]
# Code prefixes for the Qwen2.5-Coder pair (a coding model; the prompts are completed as they are).
PAIR_PROMPTS = {
    "qwen2.5-coder": [
        'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
        "# Check whether a string is a palindrome, ignoring case and spaces.\ndef is_palindrome(s: str) -> bool:\n",
    ],
}


def engine_kwargs(model: str, dtype: str = "float32", enforce_eager: bool = True) -> dict:
    """LLM(...) settings that work on a 2-core CPU machine (docs/knobs.md); ``dtype``: float32 unless
    asked (the exactness tests use it; the demo and benchmarks pass ``dtypes.machine_dtype()``'s).
    ``enforce_eager``: the tests' engines start in seconds eager; the demo, ``bench_dsbd`` and the harness
    run vLLM's default compiled mode unless their ``--enforce-eager`` asks otherwise."""
    return dict(
        model=model,
        dtype=dtype,
        max_model_len=1024,
        enforce_eager=enforce_eager,
        seed=0,
        kv_cache_memory_bytes=1 << 30,  # the default CPU sizing fails on small machines
        block_size=32,
    )


def beam_engine_kwargs(model: str, max_beam_width: int = 8, dtype: str = "float32", enforce_eager: bool = True) -> dict:
    """A DSBD engine without a draft: in-engine beam search and beam sampling."""
    return dict(engine_kwargs(model, dtype, enforce_eager), speculative_config={
        "method": "dsbd", "num_speculative_tokens": 0, "beam_width": max_beam_width})


def dsbd_engine_kwargs(model: str, draft: str, num_speculative_tokens: int = 4, max_beam_width: int = 8,
                       dtype: str = "float32", enforce_eager: bool = True, **knobs) -> dict:
    """A DSBD engine drafting with ``draft``: γ and W are the most a request may ask for."""
    spec = {"method": "dsbd", "model": draft, "num_speculative_tokens": num_speculative_tokens,
            "beam_width": max_beam_width, **knobs}
    return dict(engine_kwargs(model, dtype, enforce_eager), speculative_config=spec)


def engine_mode(enforce_eager: bool) -> str:
    """How the demo names an engine's mode beside its start time."""
    if enforce_eager:
        return "eager (--enforce-eager)"
    return ("compiled, vLLM's default: the first start compiles for minutes, later starts reuse the graphs "
            "vLLM caches under $VLLM_CACHE_ROOT/torch_compile_cache (default ~/.cache/vllm); "
            "--enforce-eager starts faster and runs slower")


def outputs_verdict(same: bool, dtype: str) -> str:
    """How the demo reports two T 0 beam searches' outputs: equal, or which of a bug and bf16 rounding
    (docs/dtype.md: in bf16 two shapes of forward may round a near-tie apart) explains a difference."""
    if same:
        return "the same outputs"
    if dtype == "bfloat16":
        return ("other outputs: in bf16 two forwards of other shapes may round a near-tie apart "
                "(docs/dtype.md); run with --dtype float32 for exact equality")
    return f"DIFFERENT outputs in {dtype} (a bug: please report it)"


def _completion(prompt: str, text: str) -> str:
    """vLLM's beam search returns prompt + completion; keep the completion."""
    return text[len(prompt):] if text.startswith(prompt) else text


def demo_models(args: argparse.Namespace):
    """(target, draft or None, prompts) of the demo: the pair's (``--pair``, default ``default``), or the draft
    ``--draft`` names."""
    pair = getattr(args, "pair", "default")
    if pair == "default":  # the shipped head needs nothing prepared but the target
        model = args.model or str(models.default_target_path(args.cache_dir))
        draft = None if args.no_draft else models.default_head_path()
    else:
        paths = pairs.pair_paths(pair, args.cache_dir)
        model, draft = args.model or str(paths.target), None if args.no_draft else paths.draft
    if getattr(args, "draft", None) and not args.no_draft:
        draft = args.draft  # --draft: the user's draft for the DSBD rows
    return model, draft, PAIR_PROMPTS.get(pair, DEMO_PROMPTS)


def run_demo(args: argparse.Namespace) -> int:
    model, pair_draft, demo_prompts = demo_models(args)  # a clear error before vLLM starts
    dtype = resolve_dtype(args.dtype)
    print(f"dtype: {dtype.dtype} ({dtype.reason})")
    # Before vLLM is imported. ERROR: in bf16 vLLM warns once per float32 weight it casts while loading
    # (hundreds of lines, docs/dtype.md); VLLM_LOGGING_LEVEL=WARNING shows them and vLLM's other warnings.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import BeamSearchParams

    from vllm_dsbd.entrypoints.beam_search import vllm_builtin_beam_search

    width, max_tokens = args.beam_width, args.max_tokens
    t0 = time.perf_counter()
    eager = args.enforce_eager
    llm = LLM(**beam_engine_kwargs(model, max(8, width), dtype.dtype, eager))
    print(f"\nengine start: {time.perf_counter() - t0:.1f} s  (model {model}, {dtype.dtype}, {engine_mode(eager)})")
    prompts = [{"prompt": p} for p in demo_prompts]
    search = BeamSearchParams(beam_width=width, max_tokens=max_tokens)

    def timed(name, run):
        run()  # warm-up, not timed (the module docstring)
        seconds = []
        for _ in range(TIMED_RUNS):
            start = time.perf_counter()
            texts = run()  # the last run's texts are shown (auto_depth makes seeded T > 0 timing-dependent)
            seconds.append(time.perf_counter() - start)
        rows.append((name, statistics.median(seconds), texts))

    rows: list[tuple[str, float, list[str]]] = []
    timed("vLLM greedy", lambda: [o.outputs[0].text for o in llm.generate(
        demo_prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)])
    timed(f"vLLM built-in beam search (W={width}, front-end loop)", lambda: [
        _completion(p, b.sequences[0].text) for p, b in zip(demo_prompts, vllm_builtin_beam_search(llm, prompts, search))])
    timed(f"vllm-dsbd in-engine beam search (W={width})", lambda: [
        _completion(p, b.sequences[0].text) for p, b in zip(demo_prompts, llm.beam_search(prompts, search))])
    sampling = SamplingParams(n=1, temperature=0.7, seed=0, max_tokens=max_tokens, extra_args={"beam_width": width})
    timed(f"vllm-dsbd in-engine beam sampling (W={width}, T=0.7)", lambda: [
        o.outputs[0].text for o in llm.generate(demo_prompts, sampling, use_tqdm=False)])

    draft = pair_draft
    if draft is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        t0 = time.perf_counter()
        gamma = args.num_speculative_tokens
        llm = LLM(**dsbd_engine_kwargs(model, str(draft), gamma, max(8, width), dtype.dtype, eager, auto_depth=True),
                  disable_log_stats=False)
        print(f"DSBD engine start: {time.perf_counter() - t0:.1f} s  (draft {draft}, auto depth γ ≤ {gamma})")
        timed(f"DSBD beam search (W={width}, auto depth γ ≤ {gamma}, lossless)", lambda: [
            _completion(p, b.sequences[0].text) for p, b in zip(demo_prompts, llm.beam_search(prompts, search))])
        timed(f"DSBD beam sampling (W={width}, auto depth γ ≤ {gamma}, T=0.7, dynamic width)", lambda: [
            o.outputs[0].text for o in llm.generate(demo_prompts, sampling, use_tqdm=False)])
        counts = {m.name: m.value for m in llm.get_metrics() if m.name.startswith(("vllm:spec_decode_num_", "vllm:dsbd_"))
                  and not m.name.endswith("per_pos")}

    base = rows[0][1]
    for name, secs, texts in rows:
        print(f"\n=== {name}: {secs:.2f} s ({secs / base:.1f}x greedy)")
        for prompt, text in zip(demo_prompts, texts):
            print(f"--- {prompt!r}\n{text.strip()}")
    builtin, ours = rows[1][1], rows[2][1]
    print(
        f"\n{len(demo_prompts)} prompts, {max_tokens} tokens each, {dtype.dtype}, "
        f"{'eager' if eager else 'compiled'}; wall clock on this machine. "
        f"In-engine beam search: {builtin / ours:.1f}x faster than vLLM's built-in loop, "
        f"{outputs_verdict(rows[1][2] == rows[2][2], dtype.dtype)} at temperature 0."
    )
    if draft is None:
        print("No DSBD rows: --no-draft.")
    else:
        iterations = counts.get("vllm:spec_decode_num_drafts", 0)
        print(f"DSBD: {iterations:.0f} iterations (one target forward each, per group), "
              f"{counts.get('vllm:spec_decode_num_accepted_tokens', 0):.0f} of "
              f"{counts.get('vllm:spec_decode_num_draft_tokens', 0):.0f} draft nodes accepted, "
              f"{counts.get('vllm:dsbd_tokens_per_target_forward', 0):.2f} tokens per target forward, "
              f"mean beam width {counts.get('vllm:dsbd_mean_beam_width', 0):.2f}.")
        same = outputs_verdict(rows[4][2] == rows[2][2], dtype.dtype)
        print(f"DSBD beam search: {ours / rows[4][1]:.2f}x the speed of in-engine beam search, {same}. "
              "auto_depth drafts only where it pays; on this target at T 0 that is rarely "
              "(docs/performance.md has the measurements).")
        print(f"DSBD beam sampling: {rows[3][1] / rows[5][1]:.2f}x the speed of in-engine beam sampling "
              "(dynamic width: fewer beams where drafts are rejected; fixed width would be exact beam sampling).")
        print(f"Each row ran once untimed first, then {TIMED_RUNS} times (its median time above); "
              "the DSBD counts above include every run.")
    return 0
