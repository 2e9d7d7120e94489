"""benchmark/tools/identical.py: the check that a refactor changed no number (issue 40)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from benchmark.tools import identical


def make_run(root, name, rows, weight, config=None):
    run = root / name
    (run / "model").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps(config or {"seed": 1, "learning_rate": 1e-3}))
    save_file({"w": weight}, str(run / "model" / "model.safetensors"))
    return run


def test_same_numbers_pass_and_each_kind_of_difference_is_named(tmp_path, capsys):
    rows = [{"step": 0, "episode": 0, "time": 1.0, "loss": 0.5, "perf/episodes_per_sec": 3.0}]
    w = torch.tensor([1.0, 2.0, 3.0])
    make_run(tmp_path / "a", "r", rows, w, {"seed": 1, "learning_rate": 1e-3})
    # wall-clock and speed fields and config key order may differ
    make_run(tmp_path / "b", "r", [{**rows[0], "time": 9.0, "perf/episodes_per_sec": 7.0}], w.clone(),
             {"learning_rate": 1e-3, "seed": 1})  # fmt: skip
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0

    make_run(tmp_path / "c", "r", [{**rows[0], "loss": 0.5000001}], w)
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "loss 0.5 != 0.5000001" in capsys.readouterr().out

    make_run(tmp_path / "d", "r", rows, torch.tensor([1.0, 2.0, 3.0000002]))
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "d")]) == 1
    assert "1 tensors differ, e.g. w" in capsys.readouterr().out

    make_run(tmp_path / "e", "r", rows, w, {"seed": 2, "learning_rate": 1e-3})
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "e")]) == 1
    assert "config.json: seed 1 != 2" in capsys.readouterr().out

    # a flag added since, at its default None (off), is no difference; at a value it is one
    make_run(tmp_path / "g", "r", rows, w, {"seed": 1, "learning_rate": 1e-3, "dual_clip": None})
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "g")]) == 0
    make_run(tmp_path / "h", "r", rows, w, {"seed": 1, "learning_rate": 1e-3, "dual_clip": 3.0})
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "h")]) == 1
    assert "config.json: dual_clip None != 3.0" in capsys.readouterr().out
    # a boolean flag added off (`--use-vllm`) is none either; on, it is one
    make_run(tmp_path / "i", "r", rows, w, {"seed": 1, "learning_rate": 1e-3, "use_vllm": False})
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "i")]) == 0
    make_run(tmp_path / "j", "r", rows, w, {"seed": 1, "learning_rate": 1e-3, "use_vllm": True})
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "j")]) == 1

    make_run(tmp_path / "f", "other", rows, w)
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "f")]) == 1
    assert "missing other" in capsys.readouterr().out


def test_a_run_without_its_model_is_said_to_lack_it(tmp_path, capsys):
    """Issue 67 item 7: a missing model/ was "N tensors differ"; it is now named as missing, on either side."""
    import shutil

    rows = [{"step": 0, "episode": 0, "loss": 0.5}]
    make_run(tmp_path / "a", "r", rows, torch.tensor([1.0, 2.0]))
    make_run(tmp_path / "b", "r", rows, torch.tensor([1.0, 2.0]))
    shutil.rmtree(tmp_path / "b" / "r" / "model")
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert f"r: no model/*.safetensors in {tmp_path / 'b'} (the other side has 1 tensors)" in capsys.readouterr().out
    assert identical.main([str(tmp_path / "b"), str(tmp_path / "a")]) == 1
    assert "no model/*.safetensors in" in capsys.readouterr().out


def test_a_metric_the_change_added_is_left_out_only_where_named_and_only_where_it_is_new(tmp_path, capsys):
    """Issue 68 added logged metrics (`objective/token_entropy`, `train/grad_norm`) and changed no other number: the
    main job before and after is the same with `--added`, not without it; a named key that the before side logs too
    still counts."""
    w = torch.tensor([1.0])
    make_run(tmp_path / "a", "r", [{"step": 1, "loss": 0.5, "kl": 1.0}], w)
    make_run(tmp_path / "b", "r", [{"step": 1, "loss": 0.5, "kl": 1.0, "train/grad_norm": 2.0}], w)
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "train/grad_norm None != 2.0" in capsys.readouterr().out
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "b"), "--added", "train/grad_norm"]) == 0
    make_run(tmp_path / "c", "r", [{"step": 1, "loss": 0.5, "kl": 1.5, "train/grad_norm": 2.0}], w)
    assert identical.main([str(tmp_path / "a"), str(tmp_path / "c"), "--added", "train/grad_norm", "kl"]) == 1
    assert "kl 1.0 != 1.5" in capsys.readouterr().out
