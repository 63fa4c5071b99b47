"""Property-based fuzzing of requests on a DSBD engine: every decoder and option, mixed in batches, with aborts.

    .venv/bin/python -m benchmarks.fuzz                      # 2,000 requests offline, then 2,000 served
    .venv/bin/python -m benchmarks.fuzz --requests 300 --only offline --out /tmp/fuzz

hypothesis draws batches of requests on the tiny pair (speculative DSBD
engine, γ <= 3, W <= 8): the decoder (plain, beam search, beam sampling,
DSBD fixed and dynamic width, MJSD), the options users send (``n``,
temperature, top-k/p, min-p, seed, ``max_tokens`` down to 1, ``min_tokens``,
stop strings and token ids, ``include_stop_str_in_output``, ``ignore_eos``,
logprobs, prompt logprobs, bad words, logit bias, penalties, structured
outputs, ``detokenize=False``, empty and too-long prompts), every DSBD and
MJSD knob with good and bad values, and aborts. Each request must be either
refused with an error that names one of its options, or answered with its
guarantees holding (:func:`check`); T 0 speculation must return what the
same request without speculation returns, and T 0 MJSD the greedy text.
After every batch the engine must still serve and hold no KV.

``tests/engine/test_fuzz.py`` runs a seeded, bounded part of it in ``make
test``. The script writes ``fuzz.json`` and ``fuzz.png`` into ``--out``
(default ``benchmarks/results/fuzz``); the figures are in docs/testing.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_requests import PROMPTS, Completion, Result, Spec  # the requests and answers

LONG_PROMPT = "word " * 600  # longer than the engines' max_model_len (512)
BIASED = 30  # the token id logit_bias pushes up (in no stop-token pool)
STOP_RANGE = list(range(1000, 6000))  # about one token in ten of the random-weight tiny model stops
KINDS = ("plain", "beam_search", "beam_sampling", "dsbd_fixed", "dsbd_dynamic", "mjsd")
BEAM_KINDS = KINDS[1:]

#: Options and the values drawn for them (unset most of the time).
OPTIONS: dict[str, list] = {
    "top_k": [5, -1], "top_p": [0.9, 1.0], "min_p": [0.1], "seed": [0, 7], "min_tokens": [2],
    "stop": [["e"], ["th", "\n"], [" a"]], "stop_token_ids": [[11, 12], STOP_RANGE],
    "include_stop_str_in_output": [True], "ignore_eos": [True], "logprobs": [0, 2], "prompt_logprobs": [1],
    "bad_words": [["the"]], "logit_bias": [{BIASED: 100.0}], "presence_penalty": [0.5],
    "frequency_penalty": [0.5], "repetition_penalty": [1.2], "structured_outputs": [{"choice": ["yes", "no"]}],
    "detokenize": [False],
}
#: What beam requests refuse (the engine's requests._UNSUPPORTED), so an answered beam request with one is a bug.
BEAM_REFUSED = {"min_p", "min_tokens", "bad_words", "logit_bias", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "structured_outputs", "prompt_logprobs"}
#: Knobs a DSBD request may add, and the value drawn (``draft_in_step`` off: every engine allows that per request).
DSBD_EXTRAS = {"memory_efficient": True, "auto_depth": True, "length_penalty": 0.5, "draft_temperature_scale": 0.75,
               "draft_in_step": False}
#: Knob values that are wrong for the tiny engine (γ <= 3, W <= 8), and typo'd knob names.
BAD_KNOBS = [{"beam_width": 0}, {"beam_width": 9}, {"beam_width": "x"}, {"num_speculative_tokens": 4},
             {"num_speculative_tokens": -1}, {"width_threshold": 1.5}, {"min_width": 0}, {"mjsd_tau": -1.0},
             {"decoder": "beams"}, {"beam_widht": 4}, {"length_penalty": "long"}, {"draft_temperature_scale": 0}]


@st.composite
def specs(draw) -> Spec:
    kind = draw(st.sampled_from(KINDS))
    prompt = draw(st.sampled_from(PROMPTS * 6 + ["", LONG_PROMPT]))
    options: dict[str, Any] = {"max_tokens": draw(st.sampled_from([1, 3, 6, 6, 8]))}
    for name, values in OPTIONS.items():
        if kind == "beam_search" and name == "detokenize":
            continue  # neither BeamSearchParams nor the completions API has it
        value = draw(st.sampled_from([None] * (8 if kind == "plain" else 24) + values))
        if value is not None:
            options[name] = value
    knobs: dict[str, Any] = {}
    if kind == "plain":
        options["temperature"] = draw(st.sampled_from([0.0, 0.8]))
        options["n"] = draw(st.sampled_from([1, 1, 2]))
    else:
        width = draw(st.sampled_from([1, 2, 3, 4, 4, 8]))
        options["n"] = draw(st.integers(1, width))
        temperature = 0.0 if kind == "beam_search" else draw(st.sampled_from([0.0, 0.7, 1.0, 1.0]))
        options["temperature"] = temperature
        gamma = draw(st.integers(0 if kind != "mjsd" else 1, 3))
        knobs = {"beam_width": width, "num_speculative_tokens": gamma}
        if kind == "beam_search":
            knobs = draw(st.sampled_from([{}, {}, {"num_speculative_tokens": gamma}]))
        elif kind == "beam_sampling":
            knobs["num_speculative_tokens"] = 0
        elif kind == "dsbd_fixed":
            knobs["fixed_width"] = True
        elif kind == "dsbd_dynamic":
            knobs["width_threshold"] = draw(st.sampled_from([0.3, 0.7, 0.95]))
            knobs["min_width"] = draw(st.integers(1, width))
        else:
            knobs["decoder"] = "mjsd"
            knobs["mjsd_tau"] = draw(st.sampled_from([0.1, 0.5, 0.9]))
            options["n"] = 1
            if draw(st.integers(0, 3)) == 0:
                knobs["draft_in_step"] = False
        if kind in ("dsbd_fixed", "dsbd_dynamic"):
            for extra in draw(st.lists(st.sampled_from(list(DSBD_EXTRAS)), max_size=2, unique=True)):
                knobs[extra] = DSBD_EXTRAS[extra]
            if knobs.get("memory_efficient"):
                options["n"] = 1
    if draw(st.integers(0, 9)) == 0:
        knobs.update(draw(st.sampled_from(BAD_KNOBS)))
    abort_after = draw(st.sampled_from([None] * 6 + [1, 3]))
    return Spec(kind, prompt, options, knobs, abort_after)


def batches(max_size: int = 4):
    return st.lists(specs(), min_size=1, max_size=max_size)


def _named(message: str, names: set[str]) -> bool:
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", message) for name in names)


def check(spec: Spec, result: Result, eos: int, max_model_len: int, prompt_len: int | None) -> list[str]:
    """What is wrong with ``result`` as the answer to ``spec`` (empty: nothing)."""
    if result.outcome == "failed":
        return [f"failed: {result.message[:300]}"]
    if result.outcome == "refused":
        return [] if _named(result.message, spec.names()) else [f"refused naming none of its options: "
                                                                f"{result.message[:300]}"]
    if result.outcome == "aborted":
        return []
    o = spec.options
    bad = []
    refused = BEAM_REFUSED - ({"min_p"} if spec.greedy else set())  # vLLM resets min_p (top-k/p) at T 0
    if spec.kind != "plain" and refused & set(o):
        bad.append(f"beam request answered with {sorted(refused & set(o))} set (must be refused)")
    if len(result.completions) != spec.n:
        bad.append(f"{len(result.completions)} completions for n={spec.n}")
    stop_ids = set(o.get("stop_token_ids") or ())
    max_tokens = o["max_tokens"] if prompt_len is None else min(o["max_tokens"], max_model_len - prompt_len)
    for c in result.completions:
        ids = c.token_ids
        if c.finish_reason not in ("stop", "length"):
            bad.append(f"finish_reason {c.finish_reason!r}")
        if len(ids) > o["max_tokens"] or (c.finish_reason == "length" and len(ids) != max_tokens):
            bad.append(f"{len(ids)} tokens, finish {c.finish_reason!r}, max_tokens {o['max_tokens']}")
        if stop_ids & set(ids[:-1]) or (not o.get("ignore_eos") and eos in ids[:-1]):
            bad.append(f"a stop token or EOS before the last token: {ids}")
        if spec.kind == "plain" and len(ids) < min(o.get("min_tokens", 0), max_tokens):
            bad.append(f"{len(ids)} tokens, min_tokens {o['min_tokens']}")
        if spec.kind == "plain" and "logit_bias" in o and not {"bad_words", "structured_outputs"} & set(o):
            if any(t != BIASED for t in ids):
                bad.append(f"logit_bias +100 on {BIASED} not honoured: {ids}")
        if o.get("logprobs") is not None and (c.logprobs is None or len(c.logprobs) != len(ids)):
            bad.append(f"logprobs for {None if c.logprobs is None else len(c.logprobs)} of {len(ids)} tokens")
        if c.text is not None and o.get("detokenize") is False and c.text:
            bad.append(f"text {c.text!r} with detokenize=False")
        if c.text is not None and o.get("stop") and o.get("detokenize", True):
            if isinstance(c.stop_reason, str) and o.get("include_stop_str_in_output"):
                if not c.text.endswith(c.stop_reason):
                    bad.append(f"text {c.text!r} does not end with its stop string {c.stop_reason!r}")
            elif not o.get("include_stop_str_in_output") and not o.get("min_tokens") and any(
                    s in c.text for s in o["stop"]):  # (vLLM looks for stop strings only after min_tokens)
                bad.append(f"stop string of {o['stop']} inside {c.text!r}")
    return bad


def twin(spec: Spec) -> Spec | None:
    """The request whose answer ``spec``'s must equal token for token, or None.

    T 0 speculation (DSBD, beam search with its drafts, auto depth) returns in-engine beam search (γ 0);
    T 0 MJSD returns the target's greedy text. Both under the same stop rules.
    """
    if not spec.greedy or spec.abort_after is not None:
        return None
    keep = {k: v for k, v in spec.options.items()
            if k in ("n", "temperature", "max_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
                     "ignore_eos", "detokenize")}
    if spec.kind == "mjsd":
        return Spec("plain", spec.prompt, {**keep, "n": 1, "temperature": 0.0})
    if spec.kind == "plain" or spec.knobs.get("memory_efficient"):
        return None
    knobs = {k: v for k, v in spec.knobs.items() if k not in ("auto_depth", "num_speculative_tokens")}
    knobs["num_speculative_tokens"] = 0
    if spec.kind == "beam_search":  # offline through LLM.beam_search itself
        return Spec("beam_search", spec.prompt, {**keep, "temperature": 0.0}, knobs, api=True)
    return Spec("beam_sampling", spec.prompt, {**keep, "temperature": 0.0}, knobs)


@dataclass
class Tally:
    """What a fuzz run tried and found."""

    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome)
    combinations: set = field(default_factory=set)  # (kind, option and knob names)
    twins_compared: int = 0
    engine_deaths: int = 0
    kv_leaks: int = 0
    store_leaks: int = 0  # batches after which the runner still held draft joints (offline only)
    preemptions: float = 0.0  # requests vLLM preempted while the batches ran
    violations: list = field(default_factory=list)
    refusals: Counter = field(default_factory=Counter)  # (kind, the refusal's first words)

    def add(self, spec: Spec, result: Result) -> None:
        self.requests += 1
        if result.outcome == "refused":
            self.refusals[(spec.kind, re.sub(r"\d+", "N", result.message)[:90])] += 1
        self.outcomes[(spec.kind, result.outcome)] += 1
        self.combinations.add((spec.kind, tuple(sorted(set(spec.options) | set(spec.knobs)))))

    def summary(self) -> dict:
        kinds = {kind: {outcome: self.outcomes[(kind, outcome)] for outcome in ("answered", "refused", "aborted",
                                                                                 "failed")} for kind in KINDS}
        return {"requests": self.requests, "option_combinations": len(self.combinations),
                "twins_compared": self.twins_compared, "engine_deaths": self.engine_deaths,
                "kv_leaks": self.kv_leaks, "store_leaks": self.store_leaks, "preemptions": self.preemptions,
                "violations": self.violations[:50], "by_decoder": kinds,
                "refusals": [[kind, why, n] for (kind, why), n in self.refusals.most_common()]}


BALLAST = Spec("plain", "word " * 200, {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0})
"""Under memory pressure, requests that run beside each batch (not tallied): beam groups reserve the KV their
iterations may claim before they are admitted, plain requests do not, so these grow into the groups' room
until vLLM must preempt."""


def fuzz_batch(transport, batch: list[Spec], tally: Tally, ballast: int = 0) -> list[str]:
    """Run ``batch`` (and the twins of its answered requests) on ``transport``, with ``ballast`` copies of
    :data:`BALLAST` beside it; what went wrong."""
    preempted = transport.preemptions()
    results = transport.run([BALLAST] * ballast + batch)[ballast:]
    problems = []
    for spec, result in zip(batch, results):
        tally.add(spec, result)
        for p in check(spec, result, transport.eos, transport.max_model_len, transport.prompt_len(spec.prompt)):
            problems.append(f"{spec}: {p}")
    pairs = [(spec, twin(spec), result) for spec, result in zip(batch, results) if result.outcome == "answered"]
    pairs = [(s, t, r) for s, t, r in pairs if t is not None]
    for (spec, other, result), other_result in zip(pairs, transport.run([t for _, t, _ in pairs])):
        tally.twins_compared += 1
        got = [c.token_ids for c in result.completions]
        want = [c.token_ids for c in other_result.completions]
        if other_result.outcome != "answered" or got != want:
            problems.append(f"{spec}: {got} but its twin {other} gave {other_result.outcome} {want}")
    if not transport.alive():
        tally.engine_deaths += 1
        problems.append("the engine died")
    else:
        if transport.kv_usage() != 0.0:
            tally.kv_leaks += 1
            problems.append(f"KV usage {transport.kv_usage()} after the batch")
        if transport.held_groups():
            tally.store_leaks += 1
            problems.append(f"the runner holds draft joints of {transport.held_groups()} groups after the batch")
        tally.preemptions += transport.preemptions() - preempted
    tally.violations += problems
    return problems


class Offline:
    """Requests through ``LLM.llm_engine`` (add_request, step, abort_request), mixed in one batch."""

    def __init__(self, llm, metric):
        """``metric(llm, name)``: the value of one of ``llm``'s Prometheus metrics, summed over its labels."""
        self.llm, self.engine, self._metric = llm, llm.llm_engine, metric
        tokenizer = llm.get_tokenizer()
        self.eos, self.tokenize = tokenizer.eos_token_id, tokenizer.encode
        self.max_model_len = llm.llm_engine.model_config.max_model_len
        self._ids = itertools.count()
        self.dead: str | None = None  # the error that killed the engine: every later request fails at once

    def prompt_len(self, prompt: str) -> int:
        return len(self.tokenize(prompt))

    def run(self, batch: list[Spec]) -> list[Result]:
        from vllm.sampling_params import RequestOutputKind

        if self.dead:
            return [Result("failed", message=f"engine dead: {self.dead}") for _ in batch]
        results: list[Result | None] = [None] * len(batch)
        live: dict[str, int] = {}
        for i, spec in enumerate(batch):
            if spec.api:
                continue
            rid = f"fuzz-{next(self._ids)}"
            try:
                params = spec.sampling_params()
                params.output_kind = RequestOutputKind.FINAL_ONLY  # all n completions at once, as LLM.generate
                self.engine.add_request(rid, spec.prompt, params)
            except Exception as e:  # a refusal (an engine death shows in alive())
                results[i] = Result("refused", message=f"{type(e).__name__}: {e}")
                continue
            live[rid] = i
        for step in itertools.count(1):
            if not self.engine.has_unfinished_requests():
                break
            try:
                outputs = self.engine.step()
            except Exception as e:
                self.dead = f"{type(e).__name__}: {e}"
                break
            for out in outputs:
                if out.finished and out.request_id in live:
                    results[live.pop(out.request_id)] = Result("answered", [
                        Completion(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                                   None if c.logprobs is None else [list(d) for d in c.logprobs])
                        for c in out.outputs])
            aborts = [rid for rid, i in live.items() if batch[i].abort_after == step]
            if aborts:
                self.engine.abort_request(aborts, internal=False)
                for rid in aborts:
                    results[live.pop(rid)] = Result("aborted")
        for i, spec in enumerate(batch):
            if spec.api and not self.dead:
                results[i] = self._beam_search(spec)
        why = f"engine dead: {self.dead}" if self.dead else "no output"
        return [r if r is not None else Result("failed", message=why) for r in results]

    def _beam_search(self, spec: Spec) -> Result:
        """``LLM.beam_search`` with the request's stop rules, logprobs and knobs (``BeamRequestParams``)."""
        try:
            params = spec.beam_search_params()
            (out,) = self.llm.beam_search([{"prompt": spec.prompt}], params)
        except Exception as e:  # a refusal (an engine death shows in alive())
            return Result("refused", message=f"{type(e).__name__}: {e}")
        return Result("answered", [
            Completion(seq.tokens[len(seq.orig_prompt["prompt_token_ids"]):], None, seq.finish_reason,
                       seq.stop_reason, [list(d) for d in seq.logprobs]) for seq in out.sequences])

    def alive(self) -> bool:
        from vllm import SamplingParams

        if self.dead:
            return False
        try:
            self.llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)  # also flushes stats
        except Exception as e:
            self.dead = f"{type(e).__name__}: {e}"
            return False
        return True

    def kv_usage(self) -> float:
        return self._metric(self.llm, "vllm:kv_cache_usage_perc")

    def preemptions(self) -> float:
        """Requests vLLM preempted since the engine started (``vllm:num_preemptions``)."""
        return self._metric(self.llm, "vllm:num_preemptions")

    def held_groups(self) -> int:
        """Groups whose draft joints the runner (the output rank's) still holds."""
        return self.llm.collective_rpc("dsbd_held_state")[0]["draft_store_groups"]


def run_fuzz(transport, examples: int, seed: int | None, tally: Tally, max_batch: int = 4, ballast: int = 0) -> None:
    """``examples`` hypothesis examples, derandomized when ``seed`` is None; raises on the first problem,
    showing the batch as drawn."""
    from hypothesis import seed as hypothesis_seed

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), print_blob=True,
              phases=(Phase.explicit, Phase.generate))  # no shrinking: every example costs engine steps
    @given(batch=batches(max_batch))
    def one(batch):
        problems = fuzz_batch(transport, batch, tally, ballast)
        assert not problems, "\n".join(problems)

    (one if seed is None else hypothesis_seed(seed)(one))()


def _metric(llm, name: str) -> float:
    """``name`` from ``llm.get_metrics()`` (vLLM's process-global registry: the engine started last)."""
    return sum(m.value for m in llm.get_metrics() if m.name in (name, name + "_total"))


PRESSURE_KV_BYTES = 36 * 32 * 768
"""Under memory pressure: 36 KV blocks of 32 tokens on the tiny pair (768 B a token, target and draft); the
ballast alone grows to more than that."""
PRESSURE_BALLAST = 3


def _tiny_engine_kwargs(kv_cache_memory_bytes: int = 256 << 20) -> dict:
    from vllm_dsbd import models
    from vllm_dsbd.demo import dsbd_engine_kwargs

    pair = models.build_tiny_pair(models.cache_root() / "tiny", seed=0)
    return {**dsbd_engine_kwargs(str(pair.target), str(pair.draft), 3, 8), "disable_log_stats": False,
            "max_model_len": 512, "kv_cache_memory_bytes": kv_cache_memory_bytes}


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary["runs"]), figsize=(6 * len(summary["runs"]), 4), squeeze=False)
    for ax, (name, run) in zip(axes[0], summary["runs"].items()):
        bottom = [0] * len(KINDS)
        for outcome in ("answered", "refused", "aborted", "failed"):
            values = [run["by_decoder"][k][outcome] for k in KINDS]
            ax.bar(KINDS, values, bottom=bottom, label=outcome)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"{name}: {run['requests']} requests, {run['engine_deaths']} deaths, {run['kv_leaks']} KV leaks, "
                     f"{run.get('preemptions', 0):.0f} preemptions", fontsize=9)
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per run (about)")
    parser.add_argument("--only", choices=["offline", "served"], help="one run only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fuzz"))
    parser.add_argument("--pressure", action="store_true",
                        help="a KV cache that fits about a third of each batch, with growing plain requests beside "
                             "it: vLLM preempts beam groups (fails if it never did)")
    args = parser.parse_args(argv)
    kv_bytes = PRESSURE_KV_BYTES if args.pressure else 256 << 20
    ballast = PRESSURE_BALLAST if args.pressure else 0
    from benchmarks.fuzz_served import Served  # no cycle: fuzz_served imports fuzz_requests, not this
    from benchmarks.machine import machine_facts

    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"machine": machine_facts(), "seed": args.seed, "pressure": args.pressure,
                               "kv_cache_memory_bytes": kv_bytes, "ballast": ballast, "runs": {}}
    for name in ("offline", "served"):
        if args.only and name != args.only:
            continue
        tally, start = Tally(), time.time()
        if name == "offline":
            from vllm import LLM

            transport = Offline(LLM(**_tiny_engine_kwargs(kv_bytes)), _metric)
        else:
            log = Path(tempfile.mkdtemp(prefix="fuzz-")) / "server.log"
            print(f"served: the server's log is {log}", flush=True)
            transport = Served.start(_tiny_engine_kwargs(kv_bytes), log)
        try:
            for chunk in itertools.count():
                if tally.requests >= args.requests:
                    break
                run_fuzz(transport, 50, args.seed * 1000 + chunk, tally, ballast=ballast)
                print(f"{name}: {tally.requests} requests, {tally.preemptions:.0f} preemptions, "
                      f"{time.time() - start:.0f} s", flush=True)
        except AssertionError as e:
            print(f"{name}: a problem (hypothesis's smallest example above):\n{e}", file=sys.stderr)
        finally:
            getattr(transport, "stop", lambda: None)()
        summary["runs"][name] = {**tally.summary(), "seconds": round(time.time() - start, 1)}
        print(json.dumps({name: {k: v for k, v in summary["runs"][name].items() if k != "violations"}}, indent=1))
    (args.out / "fuzz.json").write_text(json.dumps(summary, indent=1))
    _plot(summary, args.out / "fuzz.png")
    bad = any(r["engine_deaths"] or r["kv_leaks"] or r["store_leaks"] or r["violations"]
              or (args.pressure and not r["preemptions"]) for r in summary["runs"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
