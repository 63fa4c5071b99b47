"""The main job: beam decoding on the default target, with timings.

Today it compares vLLM's greedy decoding with vLLM's built-in
``LLM.beam_search`` (a front-end loop). In-engine beam search and DSBD join
the table as the engine lands.
"""

from __future__ import annotations

import argparse
import os
import time

from vllm_dsbd import models

DEMO_PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
]


def engine_kwargs(model: str) -> dict:
    """LLM(...) settings that work on a 2-core CPU machine (see ARCHITECTURE.md)."""
    return dict(
        model=model,
        dtype="float32",  # faster than bf16 on CPUs without native bf16
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=1 << 30,  # the default CPU sizing fails on small machines
        block_size=32,
    )


def _completion(prompt: str, text: str) -> str:
    """vLLM's built-in beam search returns prompt + completion; keep the completion."""
    return text[len(prompt):] if text.startswith(prompt) else text


def run_demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import BeamSearchParams

    model = args.model or str(models.default_target_path(args.cache_dir))
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(model))
    print(f"\nengine start: {time.perf_counter() - t0:.1f} s  (model {model})")

    rows = []
    t0 = time.perf_counter()
    outs = llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    rows.append(("vLLM greedy", time.perf_counter() - t0, [o.outputs[0].text for o in outs]))

    t0 = time.perf_counter()
    beams = llm.beam_search(
        [{"prompt": p} for p in DEMO_PROMPTS],
        BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens),
    )
    rows.append(
        (
            f"vLLM built-in beam search (W={args.beam_width})",
            time.perf_counter() - t0,
            [_completion(p, b.sequences[0].text) for p, b in zip(DEMO_PROMPTS, beams)],
        )
    )

    base = rows[0][1]
    for name, secs, texts in rows:
        print(f"\n=== {name}: {secs:.2f} s ({secs / base:.1f}x greedy)")
        for prompt, text in zip(DEMO_PROMPTS, texts):
            print(f"--- {prompt!r}\n{text.strip()}")
    print(
        f"\n{len(DEMO_PROMPTS)} prompts, {args.max_tokens} tokens each; "
        "times are wall clock on this machine."
    )
    return 0
