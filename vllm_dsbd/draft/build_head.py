"""``vllm-dsbd build-head``: a pair's EAGLE-3 head rebuilt by one command from its recipe.

A recipe (``draft/recipes/<pair>.json``, or ``--recipe FILE``) is the chain of
``train-drafter`` runs a head was made by: the flags every run shares, each
run's own flags (its teacher shards, tokens, unrolled steps), each run starting
from the head of the run before it, and the ``eval-head`` flags it was measured
with. Runs go in order, each ``--stage all`` (teach, train, export: each
resumable); a run whose head is already exported with the same flags is
skipped, so the command run again after a stop goes on where it stopped. The
last run's head goes to ``--out``; ``eval-head`` then measures it and the head's
``dsbd.json`` recommends the draft temperature scale of its best overlap at T 1
(docs/dev/eagle3-internals.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RECIPES = Path(__file__).parent / "recipes"
STEP_RECORD = "recipe-step.json"  # beside an exported run's head: the train-drafter flags it was made with


@dataclass(frozen=True)
class Recipe:
    pair: str
    flags: tuple[str, ...]  # train-drafter flags of every run
    steps: tuple[tuple[str, ...], ...]  # each run's own flags, in order
    eval_flags: tuple[str, ...] | None  # eval-head flags of the last head (None: not measured)
    measured: str  # what a build took, and where


def recipe_path(pair: str) -> Path:
    return RECIPES / f"{pair}.json"


def load_recipe(path: Path) -> Recipe:
    """A recipe file, refused naming what is missing."""
    from vllm_dsbd.draft.eagle3_head import Refused

    try:
        raw = json.loads(Path(path).read_text())
        recipe = Recipe(pair=raw["pair"], flags=tuple(raw.get("flags", ())),
                        steps=tuple(tuple(s) for s in raw["steps"]),
                        eval_flags=tuple(raw["eval"]) if raw.get("eval") is not None else None,
                        measured=raw.get("measured", ""))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Refused(f"--recipe {path}: not a recipe ({e!r}); allowed: a JSON object with 'pair', 'steps' (a "
                      "list of train-drafter flag lists), optional 'flags', 'eval', 'measured'") from None
    if not recipe.steps:
        raise Refused(f"--recipe {path}: no steps")
    return recipe


def step_argv(recipe: Recipe, index: int, out: Path, work: Path, previous: Path | None,
              runtime: tuple[str, ...]) -> list[str]:
    """The train-drafter flags of run ``index`` (0-based) writing its head to ``out``."""
    return ["--pair", recipe.pair, "--out", str(out), "--work-dir", str(work), "--stage", "all",
            *recipe.flags, *recipe.steps[index],
            *(["--from-pretrained", str(previous)] if previous is not None else []), *runtime]


def step_folder(recipe: Recipe, index: int, work: Path) -> Path:
    """Where run ``index``'s head is exported: named by the flags of every run up to it, so a changed recipe
    never takes an older chain's head (nor its checkpoint, whose name ends in this folder's)."""
    chain = json.dumps([recipe.pair, recipe.flags, recipe.steps[: index + 1]])
    return work / "recipe-heads" / f"{recipe.pair}-{index + 1}-{hashlib.sha256(chain.encode()).hexdigest()[:8]}"


def is_built(head: Path, argv: list[str]) -> bool:
    """Whether run ``head`` was exported with the flags ``argv`` (those that shape it: no --threads)."""
    return (head / "training.json").exists() and (head / STEP_RECORD).exists() \
        and json.loads((head / STEP_RECORD).read_text())["train_drafter"] == argv


def best_scale(overlap: dict[str, float]) -> float:
    """The draft temperature scale of the largest overlap at T 1 (``eval-head``'s ``overlap``); the larger
    scale where two tie."""
    return max((value, float(scale)) for scale, value in overlap.items())[1]


def draft_defaults(evaluation: dict, date: str) -> dict:
    """A ``dsbd.json`` from the head's ``eval-head`` result."""
    overlap = evaluation["overlap"]
    scale = best_scale(overlap)
    seen = ", ".join(f"{v} at {s}" for s, v in sorted(overlap.items(), key=lambda kv: -kv[1]))
    return {"draft_temperature_scale": scale,
            "_measured": f"{date}, vllm-dsbd build-head: eval-head overlap at T 1 on {evaluation['num_prompts']} "
                         f"held-out prompts: {seen} (docs/eagle3.md)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for the head (speculators format, with eval.json and "
                                                "dsbd.json)")
    p.add_argument("--recipe", default=None, help="a recipe file (default: the pair's, vllm_dsbd/draft/recipes/)")
    p.add_argument("--work-dir", default=None, help="teacher data, checkpoints and the chain's heads (default: "
                                                    "the model cache)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $VLLM_DSBD_CACHE or ~/.cache/vllm-dsbd)")


def run(args: argparse.Namespace, parse_args: Callable[[list[str]], argparse.Namespace]) -> int:
    """Build the head; ``parse_args`` parses a ``vllm-dsbd`` command line (cli's parser: each run is exactly
    the ``train-drafter`` / ``eval-head`` command it prints)."""
    from vllm_dsbd import models
    from vllm_dsbd.draft import eval_head, train_drafter
    from vllm_dsbd.draft.eagle3_head import Refused

    path = Path(args.recipe) if args.recipe else recipe_path(args.pair)
    if args.recipe is None and not path.exists():
        known = sorted(p.stem for p in RECIPES.glob("*.json"))
        raise Refused(f"--pair {args.pair}: no recipe (pairs with one: {', '.join(known)}; the default pair's "
                      "head ships in vllm_dsbd/draft/default-head)")
    recipe = load_recipe(path)
    if recipe.pair != args.pair:
        raise Refused(f"--recipe {path} is for --pair {recipe.pair}, not {args.pair}")
    work = Path(args.work_dir) if args.work_dir else models.cache_root(args.cache_dir) / "eagle3-work"
    runtime = (*(["--threads", str(args.threads)] if args.threads else []),
               *(["--cache-dir", args.cache_dir] if args.cache_dir else []))
    started, previous = time.monotonic(), None
    if recipe.measured:
        print(f"build-head {recipe.pair}: {len(recipe.steps)} train-drafter runs; measured: {recipe.measured}")
    for i in range(len(recipe.steps)):
        head = step_folder(recipe, i, work)
        shaping = step_argv(recipe, i, head, work, previous, ())
        if is_built(head, shaping):
            print(f"run {i + 1}/{len(recipe.steps)}: built already, {head}")
        else:
            argv = [*shaping, *runtime]
            print(f"run {i + 1}/{len(recipe.steps)}: vllm-dsbd train-drafter {' '.join(argv)}", flush=True)
            train_drafter.run(parse_args(["train-drafter", *argv]))
            (head / STEP_RECORD).write_text(json.dumps({"train_drafter": shaping}, indent=1) + "\n")
        previous = head
    out = Path(args.out)
    if out.resolve() != previous.resolve():
        for name in ("eval.json", "dsbd.json"):  # an earlier build's, measured on another head
            (out / name).unlink(missing_ok=True)
        shutil.copytree(previous, out, dirs_exist_ok=True)
    if recipe.eval_flags is not None:
        argv = ["--pair", recipe.pair, "--head", str(out), *recipe.eval_flags, *runtime]
        print(f"vllm-dsbd eval-head {' '.join(argv)}", flush=True)
        eval_head.run(parse_args(["eval-head", *argv]))
        evaluation = json.loads((out / "eval.json").read_text())
        (out / "dsbd.json").write_text(json.dumps(draft_defaults(evaluation, evaluation["date"][:10])) + "\n")
    print(f"head written to {out} ({(time.monotonic() - started) / 3600:.2f} hours this run)")
    return 0
