"""The ``vllm-dsbd train-drafter`` command: an EAGLE-3 head for a pair's target, or for any Llama- or
Qwen2-architecture target folder (``--target``) (``draft.eagle3_head``).

Stages (``--stage``; ``all`` runs them in order, each resumable): ``teach`` (the
target answers training prompts with vLLM: ``draft.teacher`` shards), ``train``
(the target's features of every row, computed once and stored beside the teacher
shards; speculators' head trained over them, checkpoints in the work folder),
``export`` (speculators' format in ``--out``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from vllm_dsbd.dtypes import DTYPE_CHOICES


def _layers(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: an integer >= 1 (decoder layers of the head)")
    return int(text)


def _shards(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: an integer >= 0 (teacher shards; 0: every "
                                         "shard written)")
    return int(text)


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: a finite number >= 0 (0: greedy answers)")
    return value


def _aux_layers(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts) or len({int(p) for p in parts}) != len(parts):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: distinct layer ids >= 0 separated by commas "
                                         "(id i: the state entering target layer i, id L: its last layer's output)")
    return tuple(sorted(int(p) for p in parts))


def aux_layer_ids(asked: tuple[int, ...] | None, target_layers: int) -> tuple[int, ...]:
    """``--aux-layers`` checked against the target's depth, or vLLM's default for it."""
    if asked is None:
        from vllm_dsbd.draft.eagle3_head import default_aux_ids

        return default_aux_ids(target_layers)
    if asked[-1] > target_layers:
        raise SystemExit(f"--aux-layers {','.join(map(str, asked))}: the target has {target_layers} layers; "
                         f"allowed ids: 0..{target_layers}")
    return asked


def aux_tag(asked: tuple[int, ...] | None, target_layers: int) -> str:
    """The suffix of the checkpoint name: none for the target's default aux layers (the name older versions used)."""
    aux_ids = aux_layer_ids(asked, target_layers)
    return "" if aux_ids == aux_layer_ids(None, target_layers) else "-aux" + "-".join(map(str, aux_ids))


def data_tag(teacher_temperature: float) -> str:
    """The suffix of the teacher folder and checkpoint names: none at T 1 (the names older versions used)."""
    return "" if teacher_temperature == 1.0 else f"-t{teacher_temperature:g}"


def dtype_tag(dtype: str) -> str:
    """The suffix of the teacher folder for answers of a bf16 target (none in float32: the name older versions
    used)."""
    return "" if dtype == "float32" else "-bf16"


#: Target architectures a head can be trained for: those whose hidden states this project's feature extraction
#: and vLLM's EAGLE-3 support (``SupportsEagle3``) have been run on here.
TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def target_of(args: argparse.Namespace) -> tuple[Path, str]:
    """(the target folder, the name its teacher data and checkpoints carry): ``--target DIR`` (refused unless a
    model folder of a supported architecture) or the prepared target of ``--pair``."""
    import json

    from vllm_dsbd import pairs
    from vllm_dsbd.draft.eagle3_head import Refused

    if not getattr(args, "target", None):
        return Path(pairs.pair_paths(args.pair, args.cache_dir).target), args.pair
    target = Path(args.target)
    config = target / "config.json"
    if not config.is_file():
        raise Refused(f"--target {target}: no config.json there; allowed: a Hugging Face model folder")
    architectures = json.loads(config.read_text()).get("architectures") or []
    if not set(architectures) & set(TARGET_ARCHITECTURES):
        raise Refused(f"--target {target}: architecture {', '.join(architectures) or 'unknown'} is not supported; "
                      f"allowed: {', '.join(TARGET_ARCHITECTURES)}")
    return target, f"target-{target.resolve().name}"


def checkpoint_name(args: argparse.Namespace, target_layers: int, source: str | None = None) -> str:
    """The checkpoint folder of a run: a suffix per setting away from its default (none: the names older
    versions used), since a checkpoint resumes only with the settings it was trained with. ``source``: what
    the head is for (default: ``--pair``; ``target_of`` names a ``--target``)."""
    return (f"head-{source or args.pair}-seed{args.seed}-v{args.draft_vocab_size}-ttt{args.ttt_steps}-tok{args.tokens}"
            + (f"-layers{args.head_layers}" if args.head_layers != 1 else "")
            + aux_tag(args.aux_layers, target_layers) + ("-fcnorm" if args.fc_norm else "")
            + data_tag(args.teacher_temperature) + ("-teachbf16" if target_dtype(args, "teacher") == "bfloat16" else "")
            + ("-featbf16" if target_dtype(args, "features") == "bfloat16" else "")
            + (f"-shards{args.shards}" if args.shards else "")
            + (f"-from-{Path(args.from_pretrained).resolve().name}" if args.from_pretrained else ""))


def target_dtype(args: argparse.Namespace, which: str) -> str:
    """``--teacher-dtype`` / ``--features-dtype`` (``which``: teacher, features); "auto" is the machine's faster
    dtype (``dtypes.resolve_dtype``)."""
    from vllm_dsbd.dtypes import resolve_dtype

    return resolve_dtype(getattr(args, f"{which}_dtype"), f"--{which}-dtype").dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for the head (speculators format)")
    p.add_argument("--target", default=None,
                   help="a target model folder to train for instead of --pair's, of a Llama or Qwen2 architecture "
                        "(its teacher data and checkpoints are named after the folder)")
    p.add_argument("--work-dir", default=None, help="teacher data and checkpoints (default: the model cache)")
    p.add_argument("--stage", choices=("all", "teach", "train", "export"), default="all",
                   help="run one stage (teach: the target's answers and features; train; export) or all")
    p.add_argument("--tokens", type=int, default=500_000, help="answer tokens to train on")
    p.add_argument("--teach-tokens", type=int, default=None, help="answer tokens to generate (default: --tokens)")
    p.add_argument("--shards", type=_shards, default=0,
                   help="teacher shards 0..N-1 (512 answers each): 'teach' writes them, whatever --teach-tokens, "
                        "and 'train' reads only them (default 0: 'train' reads every shard written; own checkpoint)")
    p.add_argument("--teacher-temperature", type=_temperature, default=1.0,
                   help="temperature of the target's training answers (0: its greedy answers; own folder per value)")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="the head's vocabulary: the target's most frequent answer tokens (a d2t map)")
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps (at least the γ you will use)")
    p.add_argument("--head-layers", type=_layers, default=1,
                   help="decoder layers of the head (1: EAGLE-3's; more cost a draft forward each)")
    p.add_argument("--aux-layers", type=_aux_layers, default=None,
                   help="target layers whose states the head reads, e.g. 2,15,30 (default: vLLM's (2, L//2, L-3))")
    p.add_argument("--fc-norm", action="store_true",
                   help="normalise each aux state (RMSNorm) before the head's fc; its own checkpoint")
    p.add_argument("--from-pretrained", default=None,
                   help="an exported head (train-drafter --out) to start from: its weights and draft vocabulary; "
                        "the other settings must be its own; its own checkpoint")
    p.add_argument("--teacher-dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype the target writes its training answers in (auto: bfloat16 on a machine with native "
                        "bf16, else float32; own teacher folder and checkpoint for bfloat16)")
    p.add_argument("--features-dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype the target computes the head's training features in (auto: bfloat16 on a machine "
                        "with native bf16, else float32; own feature store and checkpoint for bfloat16)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--batch-tokens", type=int, default=2048, help="answer tokens per optimiser step (about)")
    p.add_argument("--seed", type=int, default=0, help="random seed of prompts, sampling and training")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the train stage (target features and the head), e.g. cuda; "
                        "the teach stage runs on vLLM's platform")
    p.add_argument("--stop-after", type=int, default=None, help="optimiser steps to run, then stop (resumable)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $VLLM_DSBD_CACHE or ~/.cache/vllm-dsbd)")


def run(args: argparse.Namespace) -> int:
    import json

    import torch
    from tqdm import tqdm

    from vllm_dsbd import models
    from vllm_dsbd.draft import eagle3_head, teacher

    device = eagle3_head.training_device(args.device)  # before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    target, source = target_of(args)  # before any work: a bad --target is one error line
    work = Path(args.work_dir) if args.work_dir else models.cache_root(args.cache_dir) / "eagle3-work"
    tag = data_tag(args.teacher_temperature)
    teach_dtype = target_dtype(args, "teacher")
    data = work / f"teacher-{source}-seed{args.seed}{tag}{dtype_tag(teach_dtype)}"
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    aux_ids = aux_layer_ids(args.aux_layers, layers)
    settings = eagle3_head.HeadSettings(
        aux_ids=aux_ids, draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
        lr=args.lr, batch_tokens=args.batch_tokens, tokens=args.tokens, seed=args.seed, num_layers=args.head_layers,
        teacher_temperature=args.teacher_temperature, fc_norm=args.fc_norm,
        teacher_dtype=teach_dtype, features_dtype=target_dtype(args, "features"),
        from_pretrained=str(Path(args.from_pretrained).resolve()) if args.from_pretrained else "",
        shards=args.shards)
    ckpt = work / checkpoint_name(args, layers, source)
    if args.stage in ("all", "teach"):
        with tqdm(total=None if args.shards else args.teach_tokens or args.tokens, desc="teacher", unit="tok",
                  unit_scale=True) as bar:
            n = teacher.generate_shards(target, data, tokens=args.teach_tokens or args.tokens, seed=args.seed,
                                        cfg=teacher.TeacherConfig(top_k=0, temperature=args.teacher_temperature,
                                                                  dtype=teach_dtype),
                                        progress=bar, shards=args.shards or None)
        print(f"teacher data: {n} shards in {data}")
    if args.stage in ("all", "train"):
        state = eagle3_head.train(settings, target, data, ckpt, stop_after=args.stop_after, device=device)
        print(f"head checkpoint: step {state['step']}, {state['tokens_seen']} tokens, in {ckpt}")
    if args.stage in ("all", "export"):
        out = eagle3_head.export(settings, target, ckpt, Path(args.out), verifier_name=target.name)
        print(f"head written to {out}")
    return 0
