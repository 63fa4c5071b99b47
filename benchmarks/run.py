"""Run a benchmark profile: every selected method, one process, the same prompts.

    .venv/bin/python -m benchmarks.run --config benchmarks/configs/quick.json
    .venv/bin/python -m benchmarks.run --config benchmarks/configs/quick.json \\
        --methods vllm-greedy,vllm-draft-model --draft PATH --out /tmp/bench

Backends (vLLM engines, the transformers model) start one at a time, in the
order their methods are listed, and each is shut down before the next. All
outputs are scored by one transformers pass after the last backend stops.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness, report, scoring
from benchmarks.machine import machine_facts
from benchmarks.methods import BACKENDS, METHODS, Settings, skip_reason
from benchmarks.scripts import add_enforce_eager_argument
from vllm_dsbd import models, pairs
from vllm_dsbd.dtypes import add_dtype_argument, resolve_dtype


@dataclass(frozen=True)
class BenchConfig:
    """A profile, read from a JSON file in ``benchmarks/configs/``."""

    profile: str
    prompts_file: str
    num_prompts: int | None  # None: the whole file
    max_tokens: int
    beam_width: int
    temperature: float
    batch_size: int
    seed: int
    warmup_tokens: int
    num_speculative_tokens: int
    width_threshold: float
    baseline: str
    methods: list[str]
    out_dir: str
    description: str = ""
    draft_model_tokens: int | None = None  # γ of vLLM's draft_model (default: num_speculative_tokens)

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; registered: {', '.join(METHODS)}")
        if self.baseline not in self.methods:
            raise ValueError(f"baseline {self.baseline!r} is not among the selected methods {self.methods}")
        for name in ("max_tokens", "beam_width", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def load(cls, path: Path, **overrides) -> BenchConfig:
        raw = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        if set(raw) - known:
            raise ValueError(f"{path}: unknown key(s) {sorted(set(raw) - known)}; allowed: {sorted(known)}")
        return cls(**(raw | {k: v for k, v in overrides.items() if v is not None}))


def load_prompts(path: Path, num_prompts: int | None, tokenizer) -> list[harness.Prompt]:
    """The first ``num_prompts`` prompts, each rendered as a user turn with the chat template."""
    entries = json.loads(path.read_text())["prompts"]
    if num_prompts is not None:
        if not 1 <= num_prompts <= len(entries):
            raise ValueError(f"num_prompts must be in [1, {len(entries)}] for {path}, got {num_prompts}")
        entries = entries[:num_prompts]
    prompts = []
    for e in entries:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": e["text"]}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(harness.Prompt(e["id"], e["category"], text, tuple(ids)))
    return prompts


def run_methods(
    config: BenchConfig, settings: Settings, prompts: list[harness.Prompt], eos_token_id: int | None,
    rounds: int = 1,
) -> tuple[dict[str, dict], list[harness.RequestRecord]]:
    """Every selected method on ``prompts``, backend by backend; scored and summarised. With ``rounds`` > 1
    the whole sequence runs that many times (each backend started anew every round), and each method is
    reported by its round of median wall time (every round's wall time is recorded), so that a machine
    whose speed drifts between engines weighs on every method alike.

    Returns the per-method summaries (status, metrics, speedup vs the config's
    baseline) and every request's record.
    """
    selected = [METHODS[name] for name in config.methods]
    status: dict[str, dict] = {}
    every: dict[str, list[harness.MethodRun]] = {}
    for round_ in range(rounds):
        if rounds > 1:
            print(f"[bench] round {round_ + 1} of {rounds}", flush=True)
        for name, run_ in _run_round(selected, config, settings, prompts, eos_token_id, status).items():
            every.setdefault(name, []).append(run_)
    runs = {name: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for name, rs in every.items()}

    records = [r for run_ in runs.values() for r in run_.requests]
    print("[bench] scoring", flush=True)
    scoring.score(settings.target, prompts, records)

    methods = {}
    for m in selected:
        methods[m.name] = {"description": m.description, "backend": m.backend} | status[m.name]
        if m.name in runs:
            methods[m.name] |= harness.summarize(runs[m.name])
            methods[m.name]["wall_s_rounds"] = [r.wall_s for r in every[m.name]]
    harness.add_speedups(methods, config.baseline)
    return methods, records


def _run_round(selected, config: BenchConfig, settings: Settings, prompts: list[harness.Prompt],
               eos_token_id: int | None, status: dict[str, dict]) -> dict[str, harness.MethodRun]:
    """One round: every runnable method, backend by backend (each started, used, shut down); ``status`` gets
    each method's outcome (a method that failed in any round stays failed)."""
    runs: dict[str, harness.MethodRun] = {}
    for backend in dict.fromkeys(m.backend for m in selected):
        runnable = []
        for m in (m for m in selected if m.backend == backend):
            reason = skip_reason(m, settings)
            if reason:
                status[m.name] = {"status": "skipped", "reason": reason}
            else:
                runnable.append(m)
        if not runnable:
            continue
        print(f"[bench] starting backend {backend} for {[m.name for m in runnable]}", flush=True)
        with contextlib.ExitStack() as stack:
            try:
                handle, probes = stack.enter_context(BACKENDS[backend](settings))
            except (NotImplementedError, models.ModelUnavailableError) as e:
                for m in runnable:
                    status[m.name] = {"status": "skipped", "reason": f"{type(e).__name__}: {e}"}
                continue
            for m in runnable:
                print(f"[bench] {m.name}", flush=True)
                try:
                    runs[m.name] = harness.run_method(
                        m.name,
                        m.make(handle, settings),
                        prompts,
                        max_tokens=config.max_tokens,
                        batch_size=config.batch_size,
                        warmup_tokens=config.warmup_tokens,
                        eos_token_id=eos_token_id,
                        probes=probes,
                    )
                    status.setdefault(m.name, {"status": "ok"})
                except Exception as e:  # recorded in the results and printed; the other methods go on
                    traceback.print_exc()
                    status[m.name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
                print(f"[bench] {m.name}: {status[m.name]}", flush=True)
    return runs


def run(config: BenchConfig, settings: Settings, out_dir: Path, rounds: int = 1) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.target)
    prompts = load_prompts(Path(config.prompts_file), config.num_prompts, tokenizer)
    methods, records = run_methods(config, settings, prompts, tokenizer.eos_token_id, rounds)

    result = {
        "profile": config.profile,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_facts(),
        "settings": dataclasses.asdict(settings)
        | {k: getattr(config, k) for k in ("max_tokens", "batch_size", "warmup_tokens")},
        "prompt_set": {
            "file": config.prompts_file,
            "num_prompts": len(prompts),
            "ids": [p.id for p in prompts],
            "hash": harness.prompt_set_hash(prompts),
            "chat_template": True,
        },
        "baseline": config.baseline,
        "rounds": rounds,
        "scoring": scoring.SCORING,
        "methods": methods,
    }
    texts = {(r.method, r.prompt_id): tokenizer.decode(r.beams[0], skip_special_tokens=True) for r in records}
    report.write_results(out_dir, result, records, texts)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, required=True, help="a profile in benchmarks/configs/")
    p.add_argument("--methods", default=None, help="comma-separated subset (default: the config's)")
    p.add_argument("--pair", default=None, help="a prepared model pair (vllm-dsbd models prepare --pair NAME); "
                   "default: the default pair")
    p.add_argument("--draft", default=None, help="draft checkpoint (default: the pair's draft)")
    p.add_argument("--target", default=None, help="target checkpoint (default: the pair's target)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="γ (default: the config's)")
    p.add_argument("--draft-model-tokens", type=int, default=None,
                   help="γ of vLLM's draft_model and eagle3 methods (default: the DSBD methods' γ)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--baseline", default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every method this many times, backends started anew each round; each method is "
                        "reported by its median round (default 1)")
    add_enforce_eager_argument(p)
    add_dtype_argument(p)
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the config's out_dir)")
    args = p.parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    print(f"[bench] dtype {dtype.dtype} ({dtype.reason})", flush=True)

    config = BenchConfig.load(
        args.config,
        methods=args.methods.split(",") if args.methods else None,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        baseline=args.baseline,
    )
    if args.pair:
        pair = pairs.pair_paths(args.pair)
        target, draft = args.target or str(pair.target), args.draft or pair.draft
    else:
        target, draft = args.target or str(models.default_target_path()), args.draft or models.default_draft_path()
    settings = Settings(
        target=target,
        draft=str(draft) if draft else None,
        beam_width=config.beam_width,
        temperature=config.temperature,
        seed=config.seed,
        num_speculative_tokens=args.num_speculative_tokens or config.num_speculative_tokens,
        width_threshold=config.width_threshold,
        draft_model_tokens=args.draft_model_tokens or config.draft_model_tokens,
        dtype=dtype.dtype,
        dtype_reason=dtype.reason,
        enforce_eager=args.enforce_eager,
    )
    out_dir = args.out or Path(config.out_dir)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    result = run(config, settings, out_dir, rounds=args.rounds)
    print((out_dir / "table.md").read_text())
    print(f"results in {out_dir}/")
    failed = failed_methods(result)
    if failed:
        print(f"[bench] FAILED: {', '.join(failed)} (their errors are in the results and above)", file=sys.stderr)
    return 1 if failed else 0


def failed_methods(result: dict) -> list[str]:
    """Methods whose run raised (skipped ones, e.g. an unavailable backend, are not failures)."""
    return [name for name, m in result["methods"].items() if m.get("status") == "error"]


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    sys.exit(main())
