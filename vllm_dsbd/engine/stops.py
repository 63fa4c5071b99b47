"""Stop strings of beam requests: which candidate tokens complete one (no vLLM, no torch).

A hypothesis finishes when its generated text (the prompt is never searched,
as for vLLM's plain requests) comes to contain one of the request's stop
strings; it then finishes and is ranked as one that drew EOS. The runner
decides from the logits which candidates finish, so it must know, for a
beam (or a draft node) and a candidate token, whether the token completes a
stop string. It knows the beam's last generated tokens (the scheduler sends
a *tail* of :func:`tail_length` tokens with each step) and decodes the tail
with and without the candidate: the token completes a stop string when the
longer text contains one and the shorter does not. The front-end then
detokenizes the whole hypothesis as it does for plain requests: it finds the
stop string, truncates the text (``include_stop_str_in_output`` honoured) and
reports ``finish_reason="stop"`` with the string as ``stop_reason``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache

#: Tail tokens per character of the longest stop string (a token decodes to >= 1 character, except
#: pieces of a multi-byte character), plus a margin.
_TOKENS_PER_CHAR, _TAIL_MARGIN = 1, 8


def tail_length(stop: Sequence[str]) -> int:
    """Generated tokens the runner needs to see of each beam to check ``stop``."""
    return _TOKENS_PER_CHAR * max((len(s) for s in stop), default=0) + _TAIL_MARGIN


class StopStrings:
    """``completes(tail, token)`` for one set of stop strings over one tokenizer's ``decode``."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        if not stop or any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = tuple(stop)
        self._decode = lru_cache(maxsize=4096)(lambda tokens: decode(list(tokens)))

    def completes(self, tail: Sequence[int], token: int) -> bool:
        """Whether the text of ``tail + [token]`` holds a stop string that the text of ``tail`` does not."""
        before = self._decode(tuple(tail))
        after = self._decode((*tail, token))
        return any(s in after and s not in before for s in self.stop)


MAX_CHECKERS = 64
"""Distinct stop-string sets whose checkers (each with its decode cache) a runner keeps, the least recently
used dropped first: a server sees a new set with every request that brings its own."""


class StopCheckers:
    """One :class:`StopStrings` per distinct set of stop strings (the :data:`MAX_CHECKERS` most recently used),
    over a lazily loaded ``decode``."""

    def __init__(self, load_decode: Callable[[], Callable[[list[int]], str]], max_checkers: int = MAX_CHECKERS) -> None:
        self._load_decode = load_decode
        self._decode: Callable[[list[int]], str] | None = None
        self._checkers: OrderedDict[tuple[str, ...], StopStrings] = OrderedDict()
        self._max_checkers = max_checkers

    def get(self, stop: Sequence[str]) -> StopStrings | None:
        if not stop:
            return None
        key = tuple(stop)
        if key in self._checkers:
            self._checkers.move_to_end(key)
            return self._checkers[key]
        if self._decode is None:
            self._decode = self._load_decode()
        checker = self._checkers[key] = StopStrings(self._decode, key)
        while len(self._checkers) > self._max_checkers:
            self._checkers.popitem(last=False)
        return checker

    def __len__(self) -> int:
        return len(self._checkers)
