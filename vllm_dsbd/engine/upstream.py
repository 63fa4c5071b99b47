"""What a patch wraps: the upstream function behind a patched attribute.

:mod:`vllm_dsbd.engine.patches` wraps vLLM functions with :func:`wrapped`,
which remembers the function it wraps; :func:`original` gives it back, patched
or not (for the patches themselves, their pinning test, and callers that
want vLLM's own behaviour on a DSBD engine, such as
``entrypoints.beam_search.vllm_builtin_beam_search``). No patch lives here.
"""

from __future__ import annotations

from typing import Any


def original(owner: type, name: str) -> Any:
    """The upstream function behind ``owner.name``, whether patched or not."""
    fn = owner.__dict__[name]
    fn = getattr(fn, "__func__", fn)  # staticmethod
    return getattr(fn, "__dsbd_original__", fn)


def wrapped(original: Any, wrapper: Any) -> Any:
    """``wrapper``, named and documented as ``original``, which :func:`original` returns for it."""
    wrapper.__dsbd_original__ = original
    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = original.__qualname__
    wrapper.__doc__ = original.__doc__
    return wrapper
