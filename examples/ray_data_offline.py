"""Offline batches across Ray workers with Ray Data: one DSBD engine per actor (data parallel).

Each Ray actor holds one whole vLLM engine (target + draft); Ray Data spreads
the rows of a dataset of prompts over the actors in batches. Every row is an
independent request: beam search (``temperature`` 0) or seeded beam sampling
(``temperature`` > 0), with its own width. A request's result depends only on
the request (prompt, knobs, seed), never on which actor ran it or what it was
batched with, so the dataset's results equal a single engine's.

Use this for many independent requests (throughput); use vLLM's Ray executor
(``--distributed-executor-backend ray --tensor-parallel-size N``) when one model
must be split across devices. The two combine: each actor's engine may itself be
tensor parallel.

Run after `make demo` and `.venv/bin/pip install -e '.[ray]'`:

    .venv/bin/python examples/ray_data_offline.py
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sampling_params(width: int, temperature: float, seed: int | None, max_tokens: int):
    """One DSBD beam request: ``width`` hypotheses, beam search at ``temperature`` 0."""
    from vllm import SamplingParams

    return SamplingParams(n=width, temperature=temperature, seed=seed, max_tokens=max_tokens,
                          extra_args={"beam_width": width})


class DSBDEngine:
    """A Ray Data UDF: one vLLM engine per actor, built once from ``engine_kwargs``."""

    def __init__(self, engine_kwargs: dict[str, Any]):
        from vllm import LLM

        self.llm = LLM(**engine_kwargs)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        params = [sampling_params(int(w), float(t), None if s < 0 else int(s), int(m))
                  for w, t, s, m in zip(batch["width"], batch["temperature"], batch["seed"], batch["max_tokens"])]
        outputs = self.llm.generate(list(batch["prompt"]), params, use_tqdm=False)
        return {"id": list(batch["id"]),
                "texts": [[c.text for c in o.outputs] for o in outputs],
                "token_ids": [[list(c.token_ids) for c in o.outputs] for o in outputs]}


def decode(rows: list[dict[str, Any]], engine_kwargs: dict[str, Any], num_engines: int = 2,
           batch_size: int = 4, **ray_remote_args: Any) -> list[dict[str, Any]]:
    """Run ``rows`` (id, prompt, width, temperature, seed (-1: none), max_tokens) through
    ``num_engines`` engine actors; the results in the order of ``id``. ``ray_remote_args`` go to
    the actors: Ray Data restarts a dead actor forever unless ``max_restarts=0`` is given, and
    ``memory=BYTES`` reserves each actor's share of the cluster's memory resource."""
    import ray

    dataset = ray.data.from_items(rows).map_batches(
        DSBDEngine, fn_constructor_kwargs={"engine_kwargs": engine_kwargs}, batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=num_engines), num_cpus=1, **ray_remote_args)
    results = sorted(dataset.take_all(), key=lambda r: r["id"])
    return [{"id": r["id"], "texts": [str(t) for t in r["texts"]],
             "token_ids": [[int(i) for i in ids] for ids in r["token_ids"]]} for r in results]


def main() -> None:
    import ray

    from vllm_dsbd import pairs
    from vllm_dsbd.demo import dsbd_engine_kwargs
    from vllm_dsbd.dtypes import machine_dtype

    pair = pairs.prepare()
    dtype = machine_dtype()  # bfloat16 where the CPU computes it natively, else float32
    print(f"dtype: {dtype.dtype} ({dtype.reason})")
    engine_kwargs = dsbd_engine_kwargs(str(pair.target), str(pair.draft), num_speculative_tokens=2,
                                       dtype=dtype.dtype)
    prompts = ["The three primary colours are", "A haiku about the sea:", "def fibonacci(n):",
               "The capital of Japan is"]
    rows = [{"id": i, "prompt": p, "width": 4, "temperature": t, "seed": 100 + i if t > 0 else -1,
             "max_tokens": 24} for i, (p, t) in enumerate((p, t) for p in prompts for t in (0.0, 1.0))]
    ray.init()
    for row, result in zip(rows, decode(rows, engine_kwargs)):
        kind = "beam search" if row["temperature"] == 0 else f"beam sampling, seed {row['seed']}"
        print(f"{row['prompt']!r} ({kind}): {result['texts'][0]!r}")


if __name__ == "__main__":  # vLLM starts its processes by spawn
    main()
