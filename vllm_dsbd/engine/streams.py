"""The random streams of a beam group: one generator per (request seed, iteration, purpose).

Every random decision of a group is drawn from a generator seeded from the request's seed, the group's
iteration (``step``) and a *salt* naming what the draws are for, so the same on every tensor-parallel rank
and independent of the rest of the batch:

- draft layer ``i`` of an iteration: salt ``i`` (1..γ; in-step drafting draws the next iteration's layers
  with that iteration's step);
- the verification of an iteration (acceptances, residual and fresh draws, the bonus layer): ``VERIFY_SALT``;
- a beam step (an iteration of depth 0, in-engine beam sampling): ``BEAM_STEP_SALT``.

Streams that share a seed are the same random numbers, so no two purposes of one group may ever share
one: the acceptance rule is exact only when the uniforms it tests a draft with are independent of the
uniforms that drew the draft, and of those that draw the next layers. The seed is
``seed * 1_000_003 + step * STEP_STRIDE + salt`` with every salt below ``STEP_STRIDE``, so distinct
(step, salt) pairs of one request seed never meet. (A beam step once used ``seed * 1_000_003 + step``: the
beam step of iteration ``s <= γ`` then redrew the uniforms of iteration 0's draft layer ``s``, and
fixed-width DSBD with a draft that agreed often was measurably not beam sampling.)
"""

from __future__ import annotations

import torch

from vllm_dsbd.config import MAX_DRAFT_LAYERS

STEP_STRIDE = 10_007
VERIFY_SALT = MAX_DRAFT_LAYERS + 1  # draft layers use salts 1..γ, γ <= MAX_DRAFT_LAYERS (the config checks it)
BEAM_STEP_SALT = 2 * VERIFY_SALT


def generator(seed: int, step: int, salt: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one purpose (``salt``) of one iteration (``step``) of a request seeded ``seed``."""
    if not 0 < salt < STEP_STRIDE:
        raise ValueError(f"salt {salt} must be in 1..{STEP_STRIDE - 1}")
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step * STEP_STRIDE + salt) % (2**63 - 1))
    return g
