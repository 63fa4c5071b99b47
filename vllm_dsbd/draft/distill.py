"""``vllm-dsbd distill-draft``: teacher data, then distillation, then export.

Stages (``--stage``; ``all`` runs them in order, each resumable):

1. ``teach``: the target, in a vLLM engine, answers training prompts at T=1;
   its top-k next-token log-probs are stored per generated position, in
   shards, until they hold ``--tokens`` answer tokens (``teacher.py``).
2. ``train``: the student learns from the stored distributions
   (``train.py``); checkpoints every ``--ckpt-every`` rounds and resumes from
   the latest. Round ``r`` trains on a fixed window of shards, waiting for a
   shard the ``teach`` stage (which may run at the same time, in another
   process) has not written yet, so the result does not depend on timing.
3. ``export``: writes the shippable draft (non-embedding weights, config,
   provenance) into ``--out``.

Deterministic for a seed at a fixed thread count.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from vllm_dsbd import models


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target checkpoint (default: the prepared SmolLM2)")
    p.add_argument("--out", required=True, help="directory for the shippable draft")
    p.add_argument("--work-dir", default=None,
                   help="teacher data and checkpoints (default: <cache>/distill-work)")
    p.add_argument("--stage", choices=("all", "teach", "train", "export"), default="all",
                   help="run one stage (teach: the target's answers; train; export: the checkpoint) or all")
    p.add_argument("--layers", type=int, default=2, help="draft layers (initialised from the target's first ones)")
    p.add_argument("--hidden", type=int, default=576,
                   help="hidden size; must equal the target's (the draft shares its embedding)")
    p.add_argument("--head-rank", type=int, default=64,
                   help="rank of the trained correction added to the target's embedding in the output layer")
    p.add_argument("--tokens", type=int, default=400_000,
                   help="teacher answer tokens to generate and train on (whole shards: a little more)")
    p.add_argument("--seed", type=int, default=0, help="random seed of prompts, sampling and training")
    p.add_argument("--seqs-per-shard", type=int, default=512, help="prompts per teacher shard")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest teacher answer")
    p.add_argument("--top-k", type=int, default=64, help="teacher log-probs kept per position")
    p.add_argument("--window", type=int, default=3,
                   help="shards per training round: each shard is trained on this many times")
    p.add_argument("--batch-tokens", type=int, default=1024, help="answer tokens per optimiser step (about)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop training after this many rounds (the LR schedule still spans --tokens)")
    p.add_argument("--ckpt-every", type=int, default=1, help="rounds (shards) between checkpoints")
    p.add_argument("--threads", type=int, default=None, help="torch threads for training (default: torch's)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $VLLM_DSBD_CACHE or ~/.cache/vllm-dsbd)")
    p.add_argument("--note", action="append", default=[],
                   help="free text for provenance.json (repeatable), e.g. how the stages were run")


def teacher_config(args) -> "teacher.TeacherConfig":
    from vllm_dsbd.draft import teacher

    return teacher.TeacherConfig(seqs_per_shard=args.seqs_per_shard, max_new_tokens=args.max_new_tokens,
                                 top_k=args.top_k)


def paths(args) -> tuple[Path, Path, Path]:
    """(target, teacher data dir, checkpoint dir); the data dir is named by what shapes the data."""
    target = Path(args.target) if args.target else models.default_target_path(args.cache_dir)
    work = Path(args.work_dir) if args.work_dir else models.cache_root(args.cache_dir) / "distill-work"
    data = work / f"teacher-seed{args.seed}-n{args.seqs_per_shard}-t{args.max_new_tokens}-k{args.top_k}"
    return target, data, work / f"student-seed{args.seed}-L{args.layers}-r{args.head_rank}-tok{args.tokens}"


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from vllm_dsbd.draft import teacher, train

    if args.threads:
        torch.set_num_threads(args.threads)
    target, data_dir, ckpt_dir = paths(args)
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    if args.hidden != hidden:
        raise ValueError(f"--hidden must equal the target's hidden size {hidden} (the draft shares its embedding)")
    if args.stage in ("all", "teach"):
        with tqdm(total=args.tokens, desc="teacher", unit="tok", unit_scale=True) as bar:
            n = teacher.generate_shards(target, data_dir, tokens=args.tokens, seed=args.seed,
                                        cfg=teacher_config(args), progress=bar)
        print(f"teacher data: {n} shards in {data_dir}")
    if args.stage in ("all", "train"):
        train.train(args, target, data_dir, ckpt_dir)
    if args.stage in ("all", "export"):
        ck = train.export(args, target, ckpt_dir, Path(args.out))
        write_json(Path(args.out) / "provenance.json", provenance(args, target, data_dir, ck))
        print(f"draft written to {args.out}")
    return 0


def provenance(args, target: Path, data_dir: Path, ck: dict) -> dict:
    from vllm_dsbd.draft import teacher

    shards = ck["round"]  # round r trains on shards up to r - 1
    mtimes = sorted(teacher.shard_path(data_dir, i).stat().st_mtime for i in range(shards))
    return {
        "command": ck["command"],  # the train stage (the last process that trained this checkpoint)
        "export_command": "vllm-dsbd " + " ".join(sys.argv[1:]),
        "training_command_args": {k: v for k, v in ck["args"].items() if k not in ("stage", "out", "note")},
        "notes": args.note,
        "seed": args.seed,
        "target": str(target.name),
        "data": {
            "sources": [
                "prompts written for this tool (vllm_dsbd/draft/prompts.py: task templates x subjects, "
                "everyday requests)",
                f"functions and module docstrings from the Python {platform.python_version()} standard "
                "library shipped with the interpreter (PSF licence), inside prompts",
                "answers: the target's own samples at T=1 (vLLM), with its top-k next-token log-probs",
            ],
            "shards": shards,
            "seqs_per_shard": args.seqs_per_shard,
            "sequences": shards * args.seqs_per_shard,
            "teacher_tokens": sum(ck["shard_tokens"]),
            "teacher_top_k": args.top_k,
            "teacher_max_new_tokens": args.max_new_tokens,
            "teacher_wall_clock_first_to_last_shard_s": round(mtimes[-1] - mtimes[0], 1) if mtimes else 0.0,
        },
        "training": {
            "steps": ck["step"],
            "rounds": ck["round"],
            "trained_tokens": ck["trained_tokens"],
            "train_seconds": round(ck["elapsed"], 1),
            "final_kl_ema": ck["log"][-1]["kl_ema"] if ck["log"] else None,
            "log": ck["log"][:: max(1, len(ck["log"]) // 100)],
        },
        "machine": machine(ck["threads"]),
        "exported": now(),
    }


def machine(threads: int | None = None) -> str:
    """This machine in one line: CPU, cores, torch threads used, versions."""
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    threads = torch.get_num_threads() if threads is None else threads
    return (f"{cpu}, {os.cpu_count()} cores, {threads} torch thread(s), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
