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


@pytest.mark.parametrize("flags, eager", [([], False), (["--enforce-eager"], True)])
def test_the_demo_runs_vllms_default_compiled_mode_unless_asked_for_eager(tmp_path, monkeypatch, flags, eager):
    from vllm_dsbd import demo

    asked = []

    def engine_settings(model, max_beam_width, dtype, enforce_eager):
        asked.append(enforce_eager)
        raise KeyboardInterrupt  # stop before an engine starts

    monkeypatch.setattr(demo, "beam_engine_kwargs", engine_settings)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(cli.build_parser().parse_args(["demo", "--model", str(tmp_path), "--dtype", "float32", *flags]))
    assert asked == [eager]
    assert demo.engine_kwargs("m", enforce_eager=eager)["enforce_eager"] is eager


def test_serve_hands_every_argument_to_vllm(monkeypatch):
    """``vllm-dsbd serve ...`` reaches vLLM's server with its arguments unchanged (vLLM is not started here)."""
    from vllm_dsbd import serve

    seen = []
    monkeypatch.setattr(serve, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["serve", "MODEL", "--help", "--speculative-method", "dsbd"]) == 0
    assert seen == [["MODEL", "--help", "--speculative-method", "dsbd"]]


def test_train_drafter_takes_a_llama_or_qwen2_target_folder_and_refuses_others_in_one_line(tmp_path, capsys):
    import json

    from vllm_dsbd.draft import train_drafter

    llama, gpt2 = tmp_path / "my-llama", tmp_path / "my-gpt2"
    for folder, arch in ((llama, "LlamaForCausalLM"), (gpt2, "GPT2LMHeadModel")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch], "num_hidden_layers": 4}))
    args = cli.build_parser().parse_args(["train-drafter", "--out", "h", "--target", str(llama)])
    assert train_drafter.target_of(args) == (llama, "target-my-llama")
    assert train_drafter.checkpoint_name(args, 4, "target-my-llama").startswith("head-target-my-llama-seed0-")
    for folder, why in ((gpt2, "architecture GPT2LMHeadModel is not supported; allowed: LlamaForCausalLM, "
                                "Qwen2ForCausalLM"),
                        (tmp_path / "none", "no config.json there; allowed: a Hugging Face model folder")):
        assert cli.main(["train-drafter", "--out", str(tmp_path / "h"), "--target", str(folder),
                         "--work-dir", str(tmp_path / "w")]) == 2
        assert capsys.readouterr().err == f"error: --target {folder}: {why}\n"
    assert not (tmp_path / "w").exists()  # refused before any work
