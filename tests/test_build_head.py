"""``vllm-dsbd build-head``: a head rebuilt from its recipe (``vllm_dsbd.draft.build_head``), and the teacher
shards a run is limited to (``train-drafter --shards``), on the tiny target with fake teacher shards."""

from __future__ import annotations

import json

import pytest

from eagle3_heads import fake_teacher_shards as fake_shards  # tests/eagle3_heads.py

from vllm_dsbd.draft import build_head, eagle3_head, teacher

SETTINGS = eagle3_head.HeadSettings(aux_ids=(0, 1, 2), draft_vocab_size=512, tokens=300, batch_tokens=100, warmup=2)


def test_shards_limit_a_run_to_the_first_teacher_shards(tiny_pair, tmp_path):
    data = fake_shards(tmp_path / "data", num_shards=3, rows=4)
    limited = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "shards": 2})
    state = eagle3_head.train(limited, tiny_pair.target, data, tmp_path / "two", progress=False)
    store = eagle3_head.feature_dir(data, SETTINGS.aux_ids, SETTINGS.max_len, SETTINGS.features_dtype)
    assert sorted(p.name for p in store.glob("features-*.pt")) == ["features-00000.pt", "features-00001.pt"]
    rows = eagle3_head.training_rows(data, SETTINGS.max_len)
    first_two = {tuple(r["ids"]) for r in eagle3_head.training_rows(data, SETTINGS.max_len, 2)}
    assert len(rows) == 12 and len(first_two) == 8
    # the draft vocabulary counts the answers of shards 0-1 only: the same as a run over a folder of just them
    alone = eagle3_head.train(SETTINGS, tiny_pair.target, fake_shards(tmp_path / "alone", num_shards=2, rows=4),
                              tmp_path / "alone-ck", stop_after=0, progress=False)
    everything = eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "all", stop_after=0, progress=False)
    assert (state["d2t"] == alone["d2t"]).all() and not (state["d2t"] == everything["d2t"]).all()
    assert state["settings"]["shards"] == 2
    too_many = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "shards": 4})
    with pytest.raises(eagle3_head.Refused, match=r"^--shards 4: 3 teacher shards in .*; run the 'teach' stage "
                                                  r"with --shards 4 first$"):
        eagle3_head.train(too_many, tiny_pair.target, data, tmp_path / "four", progress=False)


def test_the_teacher_writes_up_to_the_shards_asked_whatever_their_tokens(tmp_path, monkeypatch):
    def start_engine(*args):
        raise RuntimeError("the engine started")

    data = fake_shards(tmp_path / "data", num_shards=3, rows=2)  # 60 answer tokens a shard
    monkeypatch.setattr(teacher, "start_engine", start_engine)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)
    cfg = teacher.TeacherConfig(top_k=0)
    assert teacher.generate_shards(tmp_path, data, tokens=10**9, seed=0, cfg=cfg, shards=2) == 2
    assert teacher.generate_shards(tmp_path, data, tokens=100, seed=0, cfg=cfg) == 2
    with pytest.raises(RuntimeError, match="the engine started"):  # shard 3 is missing
        teacher.generate_shards(tmp_path, data, tokens=1, seed=0, cfg=cfg, shards=4)


def _recipe(path, steps, pair="default"):
    flags = ["--teacher-dtype", "float32", "--features-dtype", "float32", "--draft-vocab-size", "512",
             "--batch-tokens", "100"]
    path.write_text(json.dumps({"pair": pair, "flags": flags, "steps": steps, "eval": None}))
    return path


@pytest.fixture
def tiny_as_default(tiny_pair, monkeypatch):
    """The tiny pair stands in for the default one (train-drafter and build-head take a pair's name)."""
    from vllm_dsbd import pairs

    monkeypatch.setattr(pairs, "pair_paths", lambda pair=None, cache_dir=None: tiny_pair)
    return tiny_pair


def test_build_head_runs_the_recipes_chain_each_from_the_last_and_skips_what_is_built(tiny_as_default, tmp_path,
                                                                                     monkeypatch, capsys):
    from vllm_dsbd import cli
    from vllm_dsbd.draft import train_drafter

    work, out = tmp_path / "work", tmp_path / "head"
    fake_shards(work / "teacher-default-seed0", num_shards=3, rows=4)  # the teach stage finds them written
    steps = [["--shards", "1", "--tokens", "200", "--ttt-steps", "1"],
             ["--shards", "2", "--tokens", "300", "--ttt-steps", "2"]]
    recipe = _recipe(tmp_path / "recipe.json", steps)
    command = ["build-head", "--recipe", str(recipe), "--out", str(out), "--work-dir", str(work)]
    assert cli.main(command) == 0
    training = json.loads((out / "training.json").read_text())
    assert training["settings"]["shards"] == 2 and training["settings"]["ttt_steps"] == 2
    assert training["tokens_seen"] >= 300
    first = training["started_from"]  # the training.json of the first run's head
    assert first["settings"]["shards"] == 1 and first["settings"]["ttt_steps"] == 1 and first["tokens_seen"] >= 200
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 512
    assert not (out / "dsbd.json").exists()  # the recipe measures nothing
    printed = capsys.readouterr().out
    assert "run 1/2: vllm-dsbd train-drafter --pair default" in printed and "--shards 1" in printed

    runs = []
    monkeypatch.setattr(train_drafter, "run", lambda args: runs.append(args) or pytest.fail("built already"))
    assert cli.main(command) == 0 and runs == []
    assert capsys.readouterr().out.count("built already") == 2
    assert cli.main([*command, "--threads", "1"]) == 0 and runs == []  # threads do not shape a head

    monkeypatch.undo()
    monkeypatch.setattr("vllm_dsbd.pairs.pair_paths", lambda pair=None, cache_dir=None: tiny_as_default)
    real, runs = train_drafter.run, []
    monkeypatch.setattr(train_drafter, "run", lambda args: runs.append(args) or real(args))
    _recipe(recipe, [steps[0], ["--shards", "3", "--tokens", "300", "--ttt-steps", "2"]])  # the second run changed
    assert cli.main(command) == 0
    assert [a.shards for a in runs] == [3]  # the first run's head was kept, the second made again
    assert json.loads((out / "training.json").read_text())["settings"]["shards"] == 3


def test_build_head_refuses_a_pair_without_a_recipe_or_a_recipe_of_another_pair(tmp_path, capsys):
    from vllm_dsbd import cli

    assert cli.main(["build-head", "--out", str(tmp_path / "h")]) == 2
    assert capsys.readouterr().err == ("error: --pair default: no recipe (pairs with one: qwen2.5-coder; the default "
                                       "pair's head ships in vllm_dsbd/draft/default-head)\n")
    recipe = _recipe(tmp_path / "r.json", [["--tokens", "100"]], pair="qwen2.5-coder")
    assert cli.main(["build-head", "--recipe", str(recipe), "--out", str(tmp_path / "h")]) == 2
    assert capsys.readouterr().err == f"error: --recipe {recipe} is for --pair qwen2.5-coder, not default\n"
    (tmp_path / "bad.json").write_text('{"pair": "default"}')
    assert cli.main(["build-head", "--recipe", str(tmp_path / "bad.json"), "--out", str(tmp_path / "h")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --recipe {tmp_path / 'bad.json'}: not a recipe (KeyError(")


def test_the_qwen_recipe_is_the_documented_chain_of_four_runs():
    """Each run parses as a train-drafter command line and is the run docs/dev/eagle3-internals.md records for that head."""
    from vllm_dsbd import cli

    recipe = build_head.load_recipe(build_head.recipe_path("qwen2.5-coder"))
    heads, previous = [], None
    for i in range(len(recipe.steps)):
        argv = build_head.step_argv(recipe, i, build_head.step_folder(recipe, i, build_head.Path("w")),
                                    build_head.Path("w"), previous, ())
        args = cli.build_parser().parse_args(["train-drafter", *argv])
        heads.append((args.shards, args.tokens, args.ttt_steps, args.fc_norm, args.draft_vocab_size,
                      args.from_pretrained is not None))
        previous = args.out
    assert heads == [(6, 600000, 1, True, 16384, False), (10, 1400000, 1, True, 16384, True),
                     (14, 1200000, 1, True, 16384, True), (14, 1400000, 2, True, 16384, True)]
    assert len({build_head.step_folder(recipe, i, build_head.Path("w")) for i in range(4)}) == 4
    assert cli.build_parser().parse_args(["eval-head", "--head", "h", *recipe.eval_flags]).depth == 3


def test_the_head_recommends_the_draft_temperature_scale_of_its_best_overlap():
    evaluation = {"overlap": {"0.5": 0.5297, "0.6": 0.5346, "0.75": 0.5316, "1.0": 0.4832}, "num_prompts": 48}
    defaults = build_head.draft_defaults(evaluation, "2026-11-29")
    assert defaults["draft_temperature_scale"] == 0.6
    assert defaults["_measured"].startswith("2026-11-29, vllm-dsbd build-head: eval-head overlap at T 1 on 48 "
                                            "held-out prompts: 0.5346 at 0.6, 0.5316 at 0.75")
    assert build_head.best_scale({"1.0": 0.5, "0.75": 0.5}) == 1.0
