"""`vllm-dsbd serve` (vLLM's OpenAI server) with a DSBD engine, over real HTTP with the openai client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.e2e]

PROMPT = "Once upon a time"
STOP_PROMPT = "The capital of France is"  # the tiny target's greedy text and best beams here run past 5 characters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(engine_pool, tiny_eos_target, tiny_pair, tmp_path_factory):
    """DSBD drafting with the tiny draft (γ 2): beam requests speculate unless they ask for γ 0. Started with
    no pooled engine alive."""
    engine_pool.clear()
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "vllm_dsbd.cli", "serve", str(tiny_eos_target), "--served-model-name", "tiny",
           "--speculative-method", "dsbd",
           "--speculative-config", json.dumps({"model": str(tiny_pair.draft), "num_speculative_tokens": 2,
                                               "beam_width": 128}),  # wide beams served too
           "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
           "--kv-cache-memory-bytes", str(256 << 20), "--block-size", "32",
           "--max-num-seqs", "640", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _offline(llm, prompt=PROMPT, **params):
    from vllm import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return [c.text for c in out.outputs]


def test_completions_use_beam_search_is_in_engine_beam_search(client, dsbd_tiny_llm):
    """use_beam_search with n: the engine's n best hypotheses (speculative beam search, lossless), as the
    offline API returns them from an engine without a draft."""
    r = client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=8, temperature=0.0,
                                  extra_body={"use_beam_search": True})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == _offline(dsbd_tiny_llm, n=4, temperature=0.0, max_tokens=8, extra_args={"beam_width": 4})
    assert len(set(texts)) == 4


def test_use_beam_search_honours_stop_strings(client, dsbd_tiny_llm):
    """use_beam_search with `stop` (vLLM's server dropped it): the hypotheses of the same beam request
    offline, under the same stop rule; the stop string was reached."""
    free = _offline(dsbd_tiny_llm, STOP_PROMPT, n=4, temperature=0.0, max_tokens=12, extra_args={"beam_width": 4})
    assert len(free[0]) >= 6
    stop = free[0][3:5]  # two characters the best hypothesis writes mid-text
    r = client.completions.create(model="tiny", prompt=STOP_PROMPT, n=4, max_tokens=12, temperature=0.0,
                                  stop=[stop], extra_body={"use_beam_search": True})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == _offline(dsbd_tiny_llm, STOP_PROMPT, n=4, temperature=0.0, max_tokens=12, stop=[stop],
                             extra_args={"beam_width": 4})
    assert texts != free and not any(stop in t for t in texts)


def test_mjsd_with_a_stop_string_is_served_and_the_server_keeps_serving(client, dsbd_tiny_llm):
    """An MJSD request with a stop string (it once killed the engine: every later request answered 500):
    T 0 gives the greedy text cut at the stop string."""
    free = _offline(dsbd_tiny_llm, STOP_PROMPT, temperature=0.0, max_tokens=16)[0]
    assert len(free) >= 6
    stop = free[3:5]  # two characters greedy decoding writes mid-text
    for _ in range(2):  # the second request proves the engine survived the first
        r = client.completions.create(model="tiny", prompt=STOP_PROMPT, max_tokens=16, temperature=0.0,
                                      stop=[stop], extra_body={"vllm_xargs": {"decoder": "mjsd", "beam_width": 4}})
        want = _offline(dsbd_tiny_llm, STOP_PROMPT, temperature=0.0, max_tokens=16, stop=[stop])[0]
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) < len(free)


def test_use_beam_search_ignores_temperature_as_vllm_does(client):
    """The server passes temperature 1.0 when none is set; beam search stays a search."""
    a = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=6, extra_body={"use_beam_search": True})
    b = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=6, temperature=0.0,
                                  extra_body={"use_beam_search": True})
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_chat_completions_use_beam_search(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3,
                                       max_tokens=6, extra_body={"use_beam_search": True})
    assert len(r.choices) == 3 and all(c.message.content is not None for c in r.choices)


def test_vllm_xargs_beam_sampling_matches_offline(client, dsbd_tiny_llm):
    """Beam sampling with knobs in vllm_xargs (γ 0: no speculation): seeded, so equal to the same request
    offline."""
    r = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=8, temperature=0.8, seed=3,
                                  extra_body={"vllm_xargs": {"beam_width": 4, "length_penalty": 0.5,
                                                             "num_speculative_tokens": 0}})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == _offline(dsbd_tiny_llm, n=2, temperature=0.8, seed=3, max_tokens=8,
                             extra_args={"beam_width": 4, "length_penalty": 0.5})


def _served_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_dsbd_metrics_are_served(client, server):
    """/metrics: target forwards, beam layers and widths of a speculative beam-sampling request."""
    before = _served_metrics(server)
    client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=0,
                              extra_body={"ignore_eos": True, "vllm_xargs": {"beam_width": 4}})
    deadline = time.time() + 10  # the front end records an engine step's stats after handing out its outputs
    while True:
        after = _served_metrics(server)
        layers = after.get("vllm:dsbd_beam_layers_total", 0.0) - before.get("vllm:dsbd_beam_layers_total", 0.0)
        if layers >= 8 or time.time() > deadline:
            break
        time.sleep(0.2)
    forwards = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0.0)
    widths = after["vllm:dsbd_beam_width_sum_total"] - before.get("vllm:dsbd_beam_width_sum_total", 0.0)
    assert layers == 8 and 1 <= forwards <= 8
    assert layers <= widths <= 4 * layers
    assert after["vllm:dsbd_tokens_per_target_forward"] == pytest.approx(
        after["vllm:dsbd_beam_layers_total"] / after["vllm:spec_decode_num_drafts_total"])
    assert after["vllm:dsbd_mean_beam_width"] == pytest.approx(
        after["vllm:dsbd_beam_width_sum_total"] / after["vllm:dsbd_beam_layers_total"])


def test_bad_knob_is_a_400_naming_it_and_the_server_keeps_serving(client):
    import openai

    with pytest.raises(openai.BadRequestError, match=r"beam_width'=0"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                  extra_body={"vllm_xargs": {"beam_width": 0}})
    with pytest.raises(openai.BadRequestError, match=r"above the engine's maximum 128"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=129,
                                  extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match=r"'beam_widht' resembles DSBD knob 'beam_width'"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,  # a typo: no silent plain request
                                  extra_body={"vllm_xargs": {"beam_widht": 4}})
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_wide_beams_are_served_and_speculation_stays_lossless(client):
    """W 128 over HTTP: DSBD (γ 2) returns the texts of in-engine beam search (γ 0) at T 0."""
    def texts(**knobs):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3, temperature=0.0,
                                      extra_body={"vllm_xargs": {"beam_width": 128, **knobs}})
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    speculative, plain = texts(), texts(num_speculative_tokens=0)
    assert len(speculative) == 3 and speculative == plain


def test_fuzzed_requests_over_http_are_answered_or_refused_by_name(server, tiny_eos_target):
    """The fuzz test's batches (tests/engine/test_fuzz.py) as completions requests, concurrent, with clients
    hanging up: each answered with its guarantees or refused (400) naming an option; the server keeps
    serving with no KV in use."""
    from benchmarks.fuzz import Tally, run_fuzz
    from benchmarks.fuzz_served import Served

    tally = Tally()
    run_fuzz(Served(server, "tiny", str(tiny_eos_target), 512), 15, None, tally)
    assert tally.requests >= 15 and tally.engine_deaths == 0 and tally.kv_leaks == 0
    assert {outcome for (_, outcome), count in tally.outcomes.items() if count} >= {"answered", "refused"}


def test_use_beam_search_returns_logprobs_and_refuses_options_it_does_not_apply(client):
    import openai

    r = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=5, logprobs=2,
                                  extra_body={"use_beam_search": True})
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) >= 1 for c in r.choices)
    with pytest.raises(openai.BadRequestError, match=r"use_beam_search does not apply top_p=0.5"):
        client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=5, top_p=0.5,
                                  extra_body={"use_beam_search": True})


def test_boolean_knobs_are_taken_over_http(client):
    """vllm_xargs carries JSON true as 1 (vLLM types its values str | int | float | list)."""
    for knobs, n in (({"beam_width": 4, "fixed_width": True}, 2), ({"beam_width": 4, "memory_efficient": True}, 1),
                     ({"beam_width": 4, "auto_depth": True}, 2)):
        r = client.completions.create(model="tiny", prompt=PROMPT, n=n, max_tokens=5, temperature=1.0, seed=1,
                                      extra_body={"vllm_xargs": knobs})
        assert len(r.choices) == n


def test_the_served_example_gets_beams_from_completions_and_chat(client):
    """examples/served_openai_client.py's requests against this server: each returns the beams it asks for."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "served_openai_client.py"
    spec = importlib.util.spec_from_file_location("example_served_openai_client", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    got = example.query(client, "tiny", width=4, max_tokens=8)
    assert [len(got[name]) for name in ("completions, use_beam_search", "completions, DSBD beam sampling",
                                        "chat, use_beam_search", "chat, in-engine beam sampling")] == [4, 2, 2, 1]
    assert all(isinstance(text, str) for texts in got.values() for text in texts)
