"""The ``vllm-dsbd`` command explains itself: every subcommand is listed, every flag has help, ``demo --draft``."""

from __future__ import annotations

import argparse

import pytest

from vllm_dsbd import cli


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags_without_help(parser: argparse.ArgumentParser, name: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                missing += _flags_without_help(sub, f"{name} {sub_name}")
        elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
            missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_help_lists_every_subcommand_serve_included(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    subcommands = _subcommands(cli.build_parser())
    assert {"models", "serve", "demo", "dtype", "train-drafter", "eval-head", "build-head"} <= set(subcommands)
    for name in subcommands:
        assert name in text


def test_every_flag_of_every_subcommand_has_help():
    assert _flags_without_help(cli.build_parser(), "vllm-dsbd") == []


def test_demo_takes_a_draft_and_refuses_it_with_no_draft(tmp_path, capsys):
    from vllm_dsbd.demo import demo_models

    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--model", str(tmp_path), "--draft", "some/draft"])
    assert demo_models(args)[:2] == (str(tmp_path), "some/draft")
    assert demo_models(parser.parse_args(["demo", "--model", str(tmp_path)]))[1] is not None  # the pair's own
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--draft", "d", "--no-draft"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_serve_hands_every_argument_to_vllm(monkeypatch):
    """``vllm-dsbd serve ...`` reaches vLLM's server with its arguments unchanged (vLLM is not started here)."""
    from vllm_dsbd import serve

    seen = []
    monkeypatch.setattr(serve, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["serve", "MODEL", "--help", "--speculative-method", "dsbd"]) == 0
    assert seen == [["MODEL", "--help", "--speculative-method", "dsbd"]]
