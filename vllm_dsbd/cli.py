"""The ``vllm-dsbd`` command: prepare models, run the demo, serve, print the machine's dtype, and train and
evaluate drafts and EAGLE-3 heads. ``vllm-dsbd SUBCOMMAND --help`` describes each."""

from __future__ import annotations

import argparse
import sys

from vllm_dsbd import models, pairs
from vllm_dsbd.dtypes import add_dtype_argument, machine_dtype


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    try:
        pair = pairs.prepare(args.cache_dir, args.pair)
    except models.ModelUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"target: {pair.target}")
    print(f"draft:  {pair.draft if pair.draft else 'none'}")
    return 0


def _cmd_models_verify(args: argparse.Namespace) -> int:
    pair = pairs.get_pair(args.pair)
    ok = True
    for name in pair.verified:
        path = models.cache_root(args.cache_dir) / name
        good = models.is_complete(path, checksums=True)
        print(f"{path}: {'ok' if good else f'missing or corrupt (run: {pair.command()})'}")
        ok &= good
    return 0 if ok else 1


def _reporting(run, args: argparse.Namespace, refusals: tuple[type[Exception], ...] = ()) -> int:
    """``run(args)``, with a pair that is not prepared, or one of ``refusals`` (a run refused before its work,
    naming the flag and what is allowed), printed as one error line (exit status 2) rather than a traceback."""
    try:
        return run(args)
    except (models.ModelUnavailableError, *refusals) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_dsbd.demo import run_demo

    return _reporting(run_demo, args)


def _cmd_distill_draft(args: argparse.Namespace) -> int:
    from vllm_dsbd.draft import distill

    return distill.run(args)


def _cmd_eval_draft(args: argparse.Namespace) -> int:
    from vllm_dsbd.draft import evaluate

    return evaluate.run(args)


def _cmd_eval_head(args: argparse.Namespace) -> int:
    from vllm_dsbd.draft import eagle3_head, eval_head

    return _reporting(eval_head.run, args, (eagle3_head.Refused,))


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from vllm_dsbd.draft import eagle3_head, train_drafter

    return _reporting(train_drafter.run, args, (eagle3_head.Refused,))


def _cmd_build_head(args: argparse.Namespace) -> int:
    from vllm_dsbd.draft import build_head, eagle3_head

    return _reporting(lambda a: build_head.run(a, build_parser().parse_args), args, (eagle3_head.Refused,))


def _cmd_dtype(args: argparse.Namespace) -> int:
    choice = machine_dtype()
    print(choice.dtype)
    print(f"vllm-dsbd: {choice.dtype}: {choice.reason}", file=sys.stderr)
    return 0


def _add_pair_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=pairs.DEFAULT_PAIR, choices=list(pairs.PAIRS),
                   help="model pair: " + "; ".join(f"{k}: {v.description}" for k, v in pairs.PAIRS.items())
                   + f" (default: {pairs.DEFAULT_PAIR})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-dsbd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="prepare a model pair (the default one unless --pair)")
    msub = m.add_subparsers(dest="models_command", required=True)
    for name, fn, help_ in (
        ("prepare", _cmd_models_prepare, "build a pair's target and draft checkpoints"),
        ("verify", _cmd_models_verify, "check prepared checkpoints against their SHA-256 manifests"),
    ):
        p = msub.add_parser(name, help=help_)
        p.add_argument(
            "--cache-dir",
            default=None,
            help=f"model cache (default: ${models.CACHE_ENV} or ~/.cache/vllm-dsbd)",
        )
        _add_pair_argument(p)
        p.set_defaults(func=fn)

    s = sub.add_parser("serve", add_help=False,
                       help="vLLM's OpenAI-compatible server with the plugin loaded (`vllm serve`'s arguments, "
                            "which also run on the CPU build): vllm-dsbd serve MODEL --speculative-method dsbd "
                            "--speculative-config '{...}'; vllm-dsbd serve --help prints vLLM's options")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments of vLLM's `vllm serve`")

    d = sub.add_parser("demo", help="run beam decoding on a pair's target (and DSBD with its draft) with timings")
    d.add_argument("--model", default=None, help="target checkpoint (default: the pair's prepared target)")
    d.add_argument("--cache-dir", default=None, help=f"model cache (default: ${models.CACHE_ENV} or ~/.cache/vllm-dsbd)")
    _add_pair_argument(d)
    d.add_argument("--beam-width", type=int, default=4, help="beam width W of every beam row (default: 4)")
    d.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default: 32)")
    d.add_argument("--num-speculative-tokens", type=int, default=2,
                   help="the most draft layers γ a DSBD iteration may have (auto_depth picks 0..γ each iteration)")
    drafts = d.add_mutually_exclusive_group()
    drafts.add_argument("--draft", default=None,
                        help="the DSBD rows' draft: a draft model or EAGLE-3 head folder (or hub id) with the target's "
                             "vocabulary (default: the pair's: on the default pair the shipped head)")
    drafts.add_argument("--no-draft", action="store_true", help="skip the DSBD rows")
    d.add_argument("--enforce-eager", action="store_true",
                   help="run the engines eager: they start in about 25 s instead of minutes (the first start "
                        "compiles; later ones reuse vLLM's cache), and decode slower (default: vLLM's compiled mode)")
    add_dtype_argument(d)
    d.set_defaults(func=_cmd_demo)

    t = sub.add_parser("dtype", help="print the dtype this machine runs models fastest in (bfloat16 or float32; "
                                     "why on stderr): vllm-dsbd serve T --dtype \"$(vllm-dsbd dtype)\"")
    t.set_defaults(func=_cmd_dtype)

    from vllm_dsbd.draft import distill, evaluate

    dd = sub.add_parser("distill-draft", help="train a draft model for a target by distillation")
    distill.add_arguments(dd)
    dd.set_defaults(func=_cmd_distill_draft)

    ed = sub.add_parser("eval-draft", help="measure a draft against its target (writes eval.json)")
    evaluate.add_arguments(ed)
    ed.set_defaults(func=_cmd_eval_draft)

    from vllm_dsbd.draft import train_drafter

    td = sub.add_parser("train-drafter", help="train an EAGLE-3 head (speculators format) for a pair's target, or "
                                              "for a Llama or Qwen2 target folder (--target)")
    train_drafter.add_arguments(td)
    _add_pair_argument(td)
    td.set_defaults(func=_cmd_train_drafter)

    from vllm_dsbd.draft import eval_head

    eh = sub.add_parser("eval-head", help="per-depth agreement of an EAGLE-3 head with its target (writes eval.json)")
    eval_head.add_arguments(eh)
    _add_pair_argument(eh)
    eh.set_defaults(func=_cmd_eval_head)

    from vllm_dsbd.draft import build_head

    bh = sub.add_parser("build-head", help="rebuild a pair's EAGLE-3 head from its recipe: the chain of "
                                           "train-drafter runs it was made by, then eval-head (resumable)")
    build_head.add_arguments(bh)
    _add_pair_argument(bh)
    bh.set_defaults(func=_cmd_build_head)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # every argument belongs to vLLM's server
        from vllm_dsbd import serve

        return serve.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
