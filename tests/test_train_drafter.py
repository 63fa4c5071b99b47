"""Training EAGLE-3 heads (``vllm_dsbd.draft.eagle3_head``) on the tiny target: features, resumption, export.
(A trained head drafting in an engine: tests/engine/test_dsbd_eagle3.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_heads import fake_teacher_shards as fake_shards  # tests/eagle3_heads.py

from vllm_dsbd.draft import eagle3_head


SETTINGS = eagle3_head.HeadSettings(aux_ids=(0, 1, 2), draft_vocab_size=512, tokens=500, batch_tokens=100, warmup=2)


def test_target_features_are_vllms_aux_states_and_the_last_state_before_the_norm(tiny_pair):
    from transformers import AutoModelForCausalLM

    features = eagle3_head.TargetFeatures(tiny_pair.target, (2, 0, 1))
    ids = [5, 17, 300, 4000, 12]
    aux, last = features(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32)
    out = model(torch.tensor([ids]), output_hidden_states=True)
    h = 64
    assert torch.equal(aux[:, :h], out.hidden_states[0][0]) and torch.equal(aux[:, h:2 * h], out.hidden_states[1][0])
    assert torch.equal(aux[:, 2 * h:], last)  # id 2 = L: the last layer's output, before the final norm
    assert torch.allclose(model.lm_head(model.model.norm(last)), out.logits[0], atol=1e-5)


def test_rows_pair_each_token_with_the_feature_before_it():
    aux, last = torch.arange(12.).reshape(4, 3), torch.ones(4, 2)
    row = eagle3_head.example([7, 8, 9, 10], 2, aux, last)
    assert row["input_ids"].tolist() == [[7, 8, 9, 10]] and row["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert torch.equal(row["hidden_states"][0], torch.cat([torch.zeros(1, 3), aux[:3]]))
    assert row["loss_mask"].tolist() == [[False, True, True, True]]  # rows 1..3 predict answer tokens (and after)


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens():
    rows = [{"answer": [5] * 9 + [7] * 5 + [3]}, {"answer": [7] * 5 + [11] * 2}]
    d2t, t2d = eagle3_head.draft_vocabulary(rows, 20, 3)
    assert (torch.arange(3) + d2t).tolist() == [5, 7, 11] and t2d.nonzero().flatten().tolist() == [5, 7, 11]


def test_features_are_stored_once_per_teacher_shard_and_read_back_per_row(tiny_pair, tmp_path):
    data = fake_shards(tmp_path / "data", num_shards=2, rows=3)
    out = eagle3_head.store_features(tiny_pair.target, data, (0, 1, 2), 25, progress=False)
    rows = eagle3_head.training_rows(data, 25)
    stored, _ = eagle3_head.stored_features(out, 2)
    features = eagle3_head.TargetFeatures(tiny_pair.target, (0, 1, 2))
    assert len(stored) == len(rows) == 6
    for r, (aux, last) in zip(rows, stored):
        want_aux, want_last = features(r["ids"])  # rows cut to 25 tokens
        assert aux.shape == (25, 192) and torch.equal(aux, want_aux.to(eagle3_head.FEATURE_DTYPE))
        assert torch.equal(last, want_last.to(eagle3_head.FEATURE_DTYPE))
    first = (out / "features-00000.pt").stat().st_mtime_ns
    (out / "features-00001.pt").unlink()
    fake_shards(data, num_shards=3, rows=3)  # the teacher went on: a third shard
    eagle3_head.store_features(tiny_pair.target, data, (0, 1, 2), 25, progress=False)
    assert (out / "features-00000.pt").stat().st_mtime_ns == first  # computed once
    assert len(eagle3_head.stored_features(out, 3)[0]) == 9


def test_features_of_other_aux_layers_are_cut_from_a_store_that_holds_them(tiny_pair, tmp_path, monkeypatch):
    """Ids (1, 2) come from the (0, 1, 2) store without the target (id 2 = L: its ``last``); the same values."""
    data = fake_shards(tmp_path / "data", num_shards=2, rows=3)
    eagle3_head.store_features(tiny_pair.target, data, (0, 1, 2), 25, progress=False)
    fresh = fake_shards(tmp_path / "fresh", num_shards=2, rows=3)
    want, _ = eagle3_head.stored_features(eagle3_head.store_features(tiny_pair.target, fresh, (1, 2), 25, False), 2)
    monkeypatch.setattr(eagle3_head, "TargetFeatures", None)  # computing them would fail
    got, _ = eagle3_head.stored_features(eagle3_head.store_features(tiny_pair.target, data, (1, 2), 25, False), 2)
    assert len(got) == len(want) == 6
    for (aux, last), (want_aux, want_last) in zip(got, want):
        assert aux.shape == (25, 128) and torch.equal(aux, want_aux) and torch.equal(last, want_last)
    with pytest.raises(TypeError):  # ids (0, 1) are in no other store of ``fresh``: computed, which fails here
        eagle3_head.store_features(tiny_pair.target, fresh, (0, 1), 25, False)


def test_features_computed_in_bf16_have_their_own_store_and_are_never_cut_from_float32_ones(tiny_pair, tmp_path,
                                                                                          monkeypatch):
    data = fake_shards(tmp_path / "data", num_shards=1, rows=3)
    fp32 = eagle3_head.store_features(tiny_pair.target, data, (0, 1, 2), 25, progress=False)
    bf16 = eagle3_head.store_features(tiny_pair.target, data, (0, 1, 2), 25, progress=False, dtype="bfloat16")
    assert (fp32.name, bf16.name) == ("features-aux0-1-2-len25", "features-bf16-aux0-1-2-len25")
    exact, _ = eagle3_head.stored_features(fp32, 1)
    rounded, _ = eagle3_head.stored_features(bf16, 1)
    model = eagle3_head.TargetFeatures(tiny_pair.target, (0, 1, 2), dtype="bfloat16").model
    assert next(model.parameters()).dtype == torch.bfloat16  # the target computed them in bf16
    for (aux, last), (want_aux, want_last) in zip(rounded, exact):
        assert aux.shape == want_aux.shape and last.shape == want_last.shape
        for got, want in ((aux, want_aux), (last, want_last)):
            assert (got.float() - want.float()).norm() <= 0.05 * want.float().norm()
    assert any(not torch.equal(a, b) for (a, _), (b, _) in zip(rounded, exact))
    only_fp32 = fake_shards(tmp_path / "only-fp32", num_shards=1, rows=3)
    eagle3_head.store_features(tiny_pair.target, only_fp32, (0, 1, 2), 25, progress=False)
    monkeypatch.setattr(eagle3_head, "TargetFeatures", None)  # computing them would fail
    for store, want in ((None, exact), ("bfloat16", rounded)):  # ids (1, 2): cut from the store of their dtype
        dtype = store or "float32"
        got, _ = eagle3_head.stored_features(eagle3_head.store_features(tiny_pair.target, data, (1, 2), 25, False,
                                                                        dtype=dtype), 1)
        assert all(torch.equal(g[0], w[0][:, 64:]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))
    with pytest.raises(TypeError):  # a float32 store holds them, no bf16 one: computed, which fails here
        eagle3_head.store_features(tiny_pair.target, only_fp32, (1, 2), 25, False, dtype="bfloat16")


def test_training_refuses_stored_features_of_other_teacher_rows(tiny_pair, tmp_path):
    data = fake_shards(tmp_path / "data")
    eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "a", stop_after=1, progress=False)
    fake_shards(data, num_shards=1, rows=4, seed=1)  # shard 0 replaced after its features were stored
    with pytest.raises(ValueError, match="do not match the teacher rows"):
        eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "a", progress=False)


def test_training_learns_and_resumes_to_the_same_weights(tiny_pair, tmp_path):
    data = fake_shards(tmp_path / "data")
    full = eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "a", progress=False)
    assert full["tokens_seen"] >= 500 and full["step"] == 5
    assert full["log"][-1]["loss"] < full["log"][0]["loss"]
    part = eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "b", stop_after=2, progress=False)
    assert part["step"] == 2
    resumed = eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "b", progress=False)
    assert resumed["step"] == full["step"]
    assert all(torch.equal(full["model"][k], resumed["model"][k]) for k in full["model"])
    other = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "lr": 0.5})
    with pytest.raises(ValueError, match="other settings"):
        eagle3_head.train(other, tiny_pair.target, data, tmp_path / "b", progress=False)
    deeper = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "num_layers": 2})
    with pytest.raises(ValueError, match="other settings"):
        eagle3_head.train(deeper, tiny_pair.target, data, tmp_path / "b", progress=False)
    # a checkpoint of a version that did not record num_layers resumes as the 1-layer head it is
    path = tmp_path / "b" / eagle3_head.CHECKPOINT
    state = torch.load(path, weights_only=False)
    del state["settings"]["num_layers"]
    torch.save(state, path)
    assert eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "b", progress=False)["step"] == full["step"]


def test_an_exported_head_is_a_speculators_checkpoint_without_embeddings(tiny_pair, tmp_path):
    from safetensors import safe_open

    data = fake_shards(tmp_path / "data")
    eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "ck", stop_after=1, progress=False)
    out = eagle3_head.export(SETTINGS, tiny_pair.target, tmp_path / "ck", tmp_path / "head", verifier_name="tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 512
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["norm_before_residual"] is False
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        d2t = f.get_tensor("d2t")
    assert "embed_tokens.weight" not in keys and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys
    assert ((torch.arange(512) + d2t) < 2000).all()  # the answers' tokens
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1


def test_a_head_of_two_layers_exports_both(tiny_pair, tmp_path):
    """``train-drafter --head-layers 2``: the first layer takes [embedding, feature], the second is a plain
    decoder layer; both are trained and exported (the engine test runs such a head in DSBD)."""
    from safetensors import safe_open

    settings = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "num_layers": 2})
    eagle3_head.train(settings, tiny_pair.target, fake_shards(tmp_path / "data"), tmp_path / "ck", stop_after=1,
                      progress=False)
    out = eagle3_head.export(settings, tiny_pair.target, tmp_path / "ck", tmp_path / "head")
    assert json.loads((out / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith("self_attn.q_proj.weight")}
    hidden = json.loads((tiny_pair.target / "config.json").read_text())["hidden_size"]
    assert {k: v[1] for k, v in shapes.items()} == {"layers.0.self_attn.q_proj.weight": 2 * hidden,
                                                     "layers.1.self_attn.q_proj.weight": hidden}


def test_an_fc_norm_head_normalises_each_aux_state_before_fc_and_exports_the_norms(tiny_pair, tmp_path):
    """``train-drafter --fc-norm``: an RMSNorm per aux state before ``fc``, trained, exported, and read back by
    ``eval-head`` (the engine test runs such a head in DSBD)."""
    from safetensors import safe_open

    from vllm_dsbd.draft import eval_head

    settings = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "fc_norm": True, "lr": 0.05})
    eagle3_head.train(settings, tiny_pair.target, fake_shards(tmp_path / "data"), tmp_path / "ck", stop_after=2,
                      progress=False)
    out = eagle3_head.export(settings, tiny_pair.target, tmp_path / "ck", tmp_path / "head", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["fc_norm"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        norms = [f.get_tensor(f"fc_norm.{i}.weight") for i in range(3)]
    assert all(not torch.equal(n, torch.ones_like(n)) for n in norms)  # trained, not the initial ones
    head = eval_head.load_head(out, tiny_pair.target)
    assert all(torch.equal(m.weight, n) for m, n in zip(head.fc_norm, norms, strict=True))


def test_a_run_from_a_pretrained_head_starts_from_its_weights_and_vocabulary(tiny_pair, tmp_path):
    """``train-drafter --from-pretrained HEAD`` (speculators' flag): the run's first weights and draft vocabulary
    are the exported head's (made on other data), it trains and resumes from there, and the new head's
    training.json keeps the record of the one it started from."""
    from safetensors.torch import load_file

    first = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "lr": 0.05})
    eagle3_head.train(first, tiny_pair.target, fake_shards(tmp_path / "other", seed=1), tmp_path / "a", stop_after=2,
                      progress=False)
    head = eagle3_head.export(first, tiny_pair.target, tmp_path / "a", tmp_path / "head", dtype=torch.float32)
    weights = load_file(str(head / "model.safetensors"))
    data = fake_shards(tmp_path / "data")
    fresh = eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "fresh", stop_after=0, progress=False)
    assert not torch.equal(fresh["d2t"], weights["d2t"]) and not torch.equal(fresh["model"]["fc.weight"],
                                                                           weights["fc.weight"])
    warm = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "from_pretrained": str(head)})
    start = eagle3_head.train(warm, tiny_pair.target, data, tmp_path / "b", stop_after=0, progress=False)
    assert start["step"] == 0 and torch.equal(start["d2t"], weights["d2t"]) and torch.equal(start["t2d"],
                                                                                          weights["t2d"])
    assert start["model"].keys() <= weights.keys() and "fc.weight" in start["model"]
    assert all(torch.equal(v, weights[k]) for k, v in start["model"].items())
    done = eagle3_head.train(warm, tiny_pair.target, data, tmp_path / "b", progress=False)
    assert done["step"] == 5 and torch.equal(done["d2t"], weights["d2t"])
    assert not torch.equal(done["model"]["fc.weight"], weights["fc.weight"])
    out = eagle3_head.export(warm, tiny_pair.target, tmp_path / "b", tmp_path / "warm-head")
    training = json.loads((out / "training.json").read_text())
    assert training["started_from"]["steps"] == 2 and training["settings"]["from_pretrained"] == str(head)


def test_a_pretrained_head_built_otherwise_is_refused_naming_each_mismatch(tiny_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    data = fake_shards(tmp_path / "data")
    eagle3_head.train(SETTINGS, tiny_pair.target, data, tmp_path / "a", stop_after=1, progress=False)
    head = eagle3_head.export(SETTINGS, tiny_pair.target, tmp_path / "a", tmp_path / "head")

    def start(path, **changes):
        settings = eagle3_head.HeadSettings(**{**SETTINGS.__dict__, "from_pretrained": str(path), **changes})
        eagle3_head.train(settings, tiny_pair.target, data, tmp_path / "b", stop_after=0, progress=False)

    with pytest.raises(ValueError, match=r"--draft-vocab-size is 256 but the head has 512; "
                                         r"--fc-norm is True but the head has False \(train with"):
        start(head, fc_norm=True, draft_vocab_size=256)
    with pytest.raises(ValueError, match=r"--aux-layers is \(0, 2\) but the head has \(0, 1, 2\)"):
        start(head, aux_ids=(0, 2))
    with pytest.raises(ValueError, match="no config.json; allowed: a head train-drafter exported"):
        start(tmp_path / "data")
    weights = load_file(str(head / "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()
    del weights["norm.weight"]
    save_file(weights, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not fit this target's head: no norm.weight; fc.weight \("):
        start(head)
    assert not (tmp_path / "b" / eagle3_head.CHECKPOINT).exists()  # nothing was saved from a refused start


@pytest.mark.parametrize("flag, value, allowed", [
    *[("--teacher-temperature", v, "a finite number >= 0") for v in ("-1", "nan", "inf", "hot")],
    *[("--aux-layers", v, "distinct layer ids >= 0") for v in ("2,15,x", "2,,3", "1,-2", "4,4")],
    *[("--shards", v, "an integer >= 0") for v in ("-1", "2.5", "six")],
])
def test_train_drafter_refuses_a_bad_value_naming_the_flag_and_what_is_allowed(flag, value, allowed, capsys):
    from vllm_dsbd import cli

    with pytest.raises(SystemExit):
        cli.main(["train-drafter", "--out", "unused", flag, value])
    assert f"{flag}: {value!r} is invalid; allowed: {allowed}" in capsys.readouterr().err


def test_a_refused_run_or_an_unprepared_pair_is_one_error_line_not_a_traceback(tmp_path, capsys):
    from vllm_dsbd import cli, pairs
    from vllm_dsbd.draft import train_drafter
    from vllm_dsbd.dtypes import machine_dtype

    pairs.prepare()  # the default pair, so that only the refusal stops the run

    data = tmp_path / f"teacher-default-seed0{train_drafter.dtype_tag(machine_dtype().dtype)}"  # --teacher-dtype auto
    assert cli.main(["train-drafter", "--out", str(tmp_path / "head"), "--stage", "train",
                     "--work-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: no teacher shards in {data}: run the 'teach' stage first\n"
    assert cli.main(["eval-head", "--head", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --head {tmp_path}: no config.json; allowed: a head train-drafter "
                                       "exported (speculators format)\n")
    assert cli.main(["eval-head", "--head", str(tmp_path), "--cache-dir", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("error: The default pair is not prepared")
    for command in (["train-drafter", "--out", "unused"], ["eval-head", "--head", "unused"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--pair", "nope"])
        assert "--pair: invalid choice: 'nope' (choose from" in capsys.readouterr().err


def test_device_is_refused_naming_the_devices_this_machine_has(monkeypatch, capsys):
    from vllm_dsbd import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert eagle3_head.training_device("cpu") == "cpu"
    assert cli.main(["train-drafter", "--out", "unused", "--stage", "train", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == ("error: --device cuda: not a device torch can train on here; allowed: cpu "
                                       "(no CUDA device found)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [eagle3_head.training_device(d) for d in ("cuda", "cuda:1")] == ["cuda", "cuda:1"]
    for bad in ("cuda:2", "gpu", "mps"):
        with pytest.raises(eagle3_head.Refused, match=rf"--device {bad}: .*; allowed: cpu, cuda, cuda:0, cuda:1$"):
            eagle3_head.training_device(bad)


def test_greedy_or_bf16_teacher_data_and_its_heads_live_apart_from_sampled_float32_ones():
    """``--teacher-temperature 0``, ``--teacher-dtype bfloat16``: their own teacher folder and checkpoint names;
    T 1 in float32 keeps the older names."""
    from vllm_dsbd.draft import train_drafter

    assert train_drafter.data_tag(1.0) == "" and train_drafter.data_tag(0.0) == "-t0"
    assert train_drafter.data_tag(0.7) == "-t0.7"
    assert train_drafter.dtype_tag("float32") == "" and train_drafter.dtype_tag("bfloat16") == "-bf16"
    from vllm_dsbd.draft import teacher

    assert teacher.engine_kwargs("t", teacher.TeacherConfig())["dtype"] == "float32"
    assert teacher.engine_kwargs("t", teacher.TeacherConfig(dtype="bfloat16"))["dtype"] == "bfloat16"


def test_aux_layers_beyond_the_target_are_refused_and_other_choices_get_their_own_checkpoint():
    from vllm_dsbd.draft import train_drafter

    assert train_drafter.aux_layer_ids(None, 30) == (2, 15, 27)
    assert train_drafter.aux_layer_ids((2, 15, 30), 30) == (2, 15, 30)
    with pytest.raises(SystemExit, match=r"--aux-layers 2,15,31: the target has 30 layers; allowed ids: 0..30"):
        train_drafter.aux_layer_ids((2, 15, 31), 30)
    assert train_drafter.aux_tag(None, 30) == "" and train_drafter.aux_tag((2, 15, 27), 30) == ""
    assert train_drafter.aux_tag((2, 15, 30), 30) == "-aux2-15-30"


def test_each_setting_away_from_its_default_gets_its_own_checkpoint_and_float32_data_keeps_the_older_name():
    from vllm_dsbd import cli
    from vllm_dsbd.draft import train_drafter
    from vllm_dsbd.dtypes import machine_dtype

    def name(*flags):  # a float32 teacher and features unless the flags say
        dtype = [x for flag in ("--teacher-dtype", "--features-dtype") if flag not in flags for x in (flag, "float32")]
        return train_drafter.checkpoint_name(cli.build_parser().parse_args(["train-drafter", "--out", "x", *dtype,
                                                                            *flags]), 30)

    assert name() == "head-default-seed0-v8192-ttt3-tok500000"
    assert name("--aux-layers", "2,15,27") == name()
    assert name("--ttt-steps", "1", "--tokens", "4000000") == "head-default-seed0-v8192-ttt1-tok4000000"
    assert name("--fc-norm") == name() + "-fcnorm"
    assert (name("--head-layers", "2", "--aux-layers", "2,15,30", "--fc-norm", "--teacher-temperature", "0")
            == name() + "-layers2-aux2-15-30-fcnorm-t0")
    assert name("--from-pretrained", "heads/default-ttt1/") == name() + "-from-default-ttt1"
    assert name("--shards", "6", "--from-pretrained", "h1") == name() + "-shards6-from-h1"
    assert name("--shards", "0") == name()
    assert name("--fc-norm", "--features-dtype", "bfloat16") == name() + "-fcnorm-featbf16"
    assert name("--teacher-dtype", "bfloat16") == name() + "-teachbf16"
    dtype = machine_dtype().dtype
    assert name("--teacher-dtype", "auto", "--features-dtype", "auto") == name("--teacher-dtype", dtype,
                                                                               "--features-dtype", dtype)


@pytest.mark.parametrize("steps, expected", [(2, [1.0, 0.0]), (1, [0.0, 0.0])])
def test_eval_head_counts_a_chain_as_agreed_only_while_every_draft_is_the_targets_top_1(tiny_pair, tmp_path, steps,
                                                                                          expected):
    """On the permutation pair (tests/eagle3_heads.py) the head with ``steps=2`` predicts the token after p from the
    feature of p - 1, so depth 1 always agrees; depth 2 reads the head's own output, which still carries token
    p - 1, so it never does. The ``steps=1`` head is one permutation step behind at every depth."""
    from eagle3_heads import _permutation, write_permutation_head, write_permutation_target

    from vllm_dsbd.draft import eval_head

    target = write_permutation_target(tiny_pair.target, tmp_path / "target")
    head = eval_head.load_head(write_permutation_head(target, tmp_path / "head", steps=steps), target)
    perm = _permutation(json.loads((target / "config.json").read_text())["vocab_size"], 0)
    seqs = []
    for start in (3, 500, 4000):  # sequences the target generates: each token the permutation of the one before
        chain = [start]
        for _ in range(13):
            chain.append(int(perm[chain[-1]]))
        seqs.append((chain[:2], chain[2:]))
    result = eval_head.chain_agreement(head, eagle3_head.TargetFeatures(target, (0, 1, 2)), seqs, depth=2,
                                       scales=(1.0, 0.5))
    assert result["positions"] == 3 * 12
    assert result["agreement"] == pytest.approx(expected, abs=0.03)
    # both distributions are nearly one-hot: they overlap fully where depth 1 agrees, hardly at all where it does not
    assert result["overlap"] == pytest.approx({"1.0": expected[0], "0.5": expected[0]}, abs=0.05)


def test_eval_head_measures_the_pairs_small_draft_on_the_answer_positions_of_depth_1(tiny_pair):
    """``eval-head --compare-pair-draft``: the small draft's top-1 agreement and overlap at T 1 over the answer
    positions (each predicted from the tokens before it): the target as its own draft agrees everywhere, and the
    tiny draft's counts equal a direct comparison of the two models' next-token logits."""
    from transformers import AutoModelForCausalLM

    from vllm_dsbd.draft import eval_head

    features = eagle3_head.TargetFeatures(tiny_pair.target, (0, 1, 2))
    gen = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(0, 1000, (n,), generator=gen).tolist(), torch.randint(0, 1000, (m,), generator=gen).tolist())
            for n, m in ((4, 9), (7, 5), (2, 12))]
    itself = eval_head.pair_draft_agreement(features, tiny_pair.target, seqs)
    assert itself["positions"] == 9 + 5 + 12
    assert itself["greedy_agreement"] == 1.0 and itself["overlap_t1"] == pytest.approx(1.0, abs=1e-4)
    result = eval_head.pair_draft_agreement(features, tiny_pair.draft, seqs)
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair.draft, dtype=torch.float32)
    hits = p_sum = 0.0
    for prompt, answer in seqs:
        with torch.no_grad():
            lp, lq = (m(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
                      for m in (features.model, draft))
        hits += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        p_sum += float(torch.minimum(lp.softmax(-1), lq.softmax(-1)).sum())
    assert result["greedy_agreement"] == pytest.approx(hits / 26, abs=1e-4) and result["greedy_agreement"] < 1
    assert result["overlap_t1"] == pytest.approx(p_sum / 26, abs=1e-4)


def test_overlap_sums_the_smaller_probability_of_each_target_token_the_draft_vocabulary_maps_to():
    """``eval_head.overlap`` against a direct sum over the full vocabulary, the head's probabilities scattered to
    their target ids (id i + d2t[i]), at two draft temperature scales and without a d2t map."""
    from vllm_dsbd.draft import eval_head

    gen = torch.Generator().manual_seed(0)
    vocab, draft = 50, 12
    target_ids = torch.randperm(vocab, generator=gen)[:draft].sort().values
    d2t = target_ids - torch.arange(draft)
    target_logits, head_logits = torch.randn(5, vocab, generator=gen), torch.randn(5, draft, generator=gen)
    for scale in (1.0, 0.6):
        p = torch.softmax(target_logits, -1)
        q = torch.zeros(5, vocab)
        q[:, target_ids] = torch.softmax(head_logits / scale, -1)
        want = torch.tensor([sum(min(float(p[r, x]), float(q[r, x])) for x in range(vocab)) for r in range(5)])
        assert torch.allclose(eval_head.overlap(target_logits, head_logits, d2t, scale), want, atol=1e-6)
    same = eval_head.overlap(target_logits, target_logits * 2, None, 2.0)  # the same distribution: overlap 1
    assert torch.allclose(same, torch.ones(5), atol=1e-6)


@pytest.mark.parametrize("value", ["0", "-1,1", "1,x", "", "nan"])
def test_eval_head_refuses_a_draft_temperature_scale_that_is_not_a_positive_number(value, capsys):
    from vllm_dsbd import cli

    with pytest.raises(SystemExit):
        cli.main(["eval-head", "--head", "unused", f"--draft-temperature-scales={value}"])
    assert (f"--draft-temperature-scales: {value!r} is invalid; allowed: finite numbers > 0 separated by commas"
            in capsys.readouterr().err)


def test_a_pair_draft_of_another_vocabulary_is_refused_naming_it(tiny_pair, tmp_path):
    """``evaluate.agreement`` (eval-draft, eval-head --compare-pair-draft) refuses a draft whose vocabulary is not
    the target's, naming the draft's folder and both sizes, before comparing any logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_dsbd.draft import eval_head

    other = tmp_path / "other-vocab-draft"
    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(other)
    features = eagle3_head.TargetFeatures(tiny_pair.target, (0, 1, 2))
    vocab = features.model.config.vocab_size
    assert vocab != 50
    with pytest.raises(ValueError, match=rf"{other.name}: vocabulary 50 is not the target's {vocab}"):
        eval_head.pair_draft_agreement(features, other, [([1, 2], [3, 4])])
