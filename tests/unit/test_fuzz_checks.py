"""The fuzz run's checks (benchmarks/fuzz.py) catch what they must: planted wrong answers, no engine."""

from __future__ import annotations

from benchmarks.fuzz import Completion, Result, Spec, Tally, check, fuzz_batch, twin

EOS = 0


def _spec(kind="plain", **options):
    options = {"max_tokens": 4, "temperature": 0.0, **options}
    knobs = {} if kind == "plain" else {"beam_width": 2, "num_speculative_tokens": 2}
    return Spec(kind, "Once upon a time", options, knobs)


def _answer(*completions):
    return Result("answered", [Completion(list(ids), text, finish, stop, None) for ids, text, finish, stop in completions])


def test_a_good_answer_passes_and_each_planted_fault_is_caught():
    spec = _spec(stop=["e"], stop_token_ids=[7])
    assert check(spec, _answer(([3, 4, 5, 6], "abcd", "length", None)), EOS, 512, 4) == []
    assert check(spec, _answer(([3, 4], "ab", "stop", "e")), EOS, 512, 4) == []
    faults = [
        _answer(([3, 4, 5, 6], "a e b", "length", None)),  # the stop string inside the text
        _answer(([3, 7, 5], "abc", "stop", 5)),  # a stop token before the last token
        _answer(([3, EOS, 5], "abc", "stop", None)),  # EOS before the last token
        _answer(([3, 4, 5, 6, 8], "abcde", "length", None)),  # past max_tokens
        _answer(([3, 4], "ab", "length", None)),  # "length" short of max_tokens
        _answer(([3, 4], "ab", "abort", None)),  # an unfinished completion
        _answer(([3, 4, 5, 6], "abcd", "length", None), ([3], "a", "stop", None)),  # two answers for n = 1
        Result("failed", message="HTTP 500"),
    ]
    for fault in faults:
        assert check(spec, fault, EOS, 512, 4), fault


def test_refusals_must_name_an_option_of_the_request():
    spec = _spec("dsbd_fixed", min_p=0.1)
    assert check(spec, Result("refused", message="SamplingParams.min_p=0.1 is not supported"), EOS, 512, 4) == []
    assert check(spec, Result("refused", message="DSBD knob 'beam_width'=2 is too small"), EOS, 512, 4) == []
    assert check(spec, Result("refused", message="something went wrong"), EOS, 512, 4)
    assert check(spec, Result("refused", message="top_p must be in (0, 1]"), EOS, 512, 4)  # top_p was not sent


def test_options_beam_requests_refuse_must_not_be_answered_and_honoured_ones_are_checked():
    beam = _spec("dsbd_fixed", n=1, logit_bias={30: 100.0})
    assert any("must be refused" in p for p in check(beam, _answer(([30, 30], "x", "stop", None)), EOS, 512, 4))
    plain = _spec(logit_bias={30: 100.0}, ignore_eos=True)
    assert check(plain, _answer(([30, 30, 30, 30], "xxxx", "length", None)), EOS, 512, 4) == []
    assert check(plain, _answer(([30, 31, 30, 30], "xxxx", "length", None)), EOS, 512, 4)
    logprobs = _spec(logprobs=2)
    ok = Result("answered", [Completion([3, 4, 5, 6], "abcd", "length", None, [[3], [4], [5], [6]])])
    short = Result("answered", [Completion([3, 4, 5, 6], "abcd", "length", None, [[3], [4]])])
    assert check(logprobs, ok, EOS, 512, 4) == [] and check(logprobs, short, EOS, 512, 4)


def test_twins_of_greedy_speculation_and_mjsd_and_none_for_sampling():
    dsbd = _spec("dsbd_dynamic", n=2, stop=["e"])
    t = twin(dsbd)
    assert t.kind == "beam_sampling" and t.knobs["num_speculative_tokens"] == 0 and t.options["stop"] == ["e"]
    mjsd = Spec("mjsd", "p", {"max_tokens": 4, "temperature": 0.0, "n": 1}, {"decoder": "mjsd", "beam_width": 4})
    assert twin(mjsd) == Spec("plain", "p", {"max_tokens": 4, "temperature": 0.0, "n": 1})
    search = Spec("beam_search", "p", {"max_tokens": 4, "n": 2}, {"num_speculative_tokens": 2})
    assert twin(search).api and twin(search).knobs == {"num_speculative_tokens": 0}
    assert twin(_spec("dsbd_fixed", temperature=1.0)) is None
    assert twin(Spec("dsbd_fixed", "p", {"max_tokens": 4, "temperature": 0.0}, {"memory_efficient": True})) is None


class _Transport:
    """Answers every request with the same tokens, or its twins (γ 0) with others: a planted lossy speculation."""

    eos, max_model_len = EOS, 512

    def __init__(self, lossy=False, alive=True, kv=0.0, held=0):
        self.lossy, self._alive, self._kv, self._held = lossy, alive, kv, held

    def prompt_len(self, prompt):
        return 4

    def run(self, batch):
        def tokens(spec):
            return [9, 9, 9, 9] if self.lossy and spec.knobs.get("num_speculative_tokens") == 0 else [3, 4, 5, 6]
        return [Result("answered", [Completion(tokens(s), "abcd", "length", None, None)] * s.n) for s in batch]

    def alive(self):
        return self._alive

    def kv_usage(self):
        return self._kv

    def held_groups(self):
        return self._held

    def preemptions(self):
        return 0.0


def test_fuzz_batch_catches_lossy_speculation_engine_death_and_kv_leaks():
    batch = [_spec("dsbd_fixed", n=1)]
    assert fuzz_batch(_Transport(), batch, Tally()) == []
    tally = Tally()
    assert any("twin" in p for p in fuzz_batch(_Transport(lossy=True), batch, tally)) and tally.twins_compared == 1
    tally = Tally()
    assert fuzz_batch(_Transport(alive=False), batch, tally) and tally.engine_deaths == 1
    tally = Tally()
    assert fuzz_batch(_Transport(kv=0.25), batch, tally) and tally.kv_leaks == 1
    tally = Tally()
    assert fuzz_batch(_Transport(held=2), batch, tally) and tally.store_leaks == 1
