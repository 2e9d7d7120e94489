"""The speed harness's bookkeeping (no timing is asserted here: speed is measured by
`python -m benchmark.tools.speed`)."""

import pytest

from benchmark.tools import speed


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_train_seconds_cumulative_uses_the_last_row():
    # rate since the loop started: 64 episodes at 4/s, then 128 at 5/s -> 128 / 5 = 25.6 s
    rows = [
        {"step": 0, "episode": 0, "eval/x": 1.0},
        {"step": 1, "episode": 64, "perf/episodes_per_sec": 4.0},
        {"step": 2, "episode": 128, "perf/episodes_per_sec": 5.0},
    ]
    assert speed.train_seconds(rows, "cumulative") == pytest.approx((25.6, 128))


def test_train_seconds_window_sums_each_window():
    # per-window rates: 32 episodes at 16/s (2 s) + 32 at 8/s (4 s) + 64 at 32/s (2 s) = 8 s for 128 episodes
    rows = [
        {"episode": 32, "perf/episodes_per_sec": 16.0},
        {"episode": 64, "perf/episodes_per_sec": 8.0},
        {"episode": 64, "eval/loss": 0.3},
        {"episode": 128, "perf/episodes_per_sec": 32.0},
    ]
    assert speed.train_seconds(rows, "window") == pytest.approx((8.0, 128))
    with pytest.raises(ValueError):
        speed.train_seconds([{"episode": 0, "eval/loss": 1.0}], "window")


def test_ratios_and_verdict():
    r = speed.ratios({"episodes_per_sec": 30.0, "peak_rss_gb": 1.0}, {"episodes_per_sec": 20.0, "peak_rss_gb": 2.0})
    assert r == pytest.approx({"speed_ratio": 1.5, "mem_ratio": 0.5})
    assert speed.verdict(r) == "ok"
    assert speed.verdict({"speed_ratio": 0.99, "mem_ratio": 0.5}).startswith("FAIL")
    assert speed.verdict({"speed_ratio": 1.2, "mem_ratio": 1.1}) == "faster, below 1.5x, more memory"


def test_repeated_rounds_report_the_median_paired_ratio_and_the_largest_memory():
    def round_(ours_s, trl_s, ours_gb, trl_gb):
        o = {
            "train_s": ours_s,
            "episodes_per_sec": 512 / ours_s,
            "tokens_per_sec": 512 * 100 / ours_s,
            "peak_rss_gb": ours_gb,
        }
        t = {
            "train_s": trl_s,
            "episodes_per_sec": 512 / trl_s,
            "tokens_per_sec": 512 * 100 / trl_s,
            "peak_rss_gb": trl_gb,
        }
        return {"algo": "ppo", "work": {}, "ours": o, "trl": t, **speed.ratios(o, t)}

    # a slow stretch of the machine (round 2) slows both sides; the paired ratios are 1.5, 1.4, 1.6 -> median 1.5
    rounds = [round_(80, 120, 1.0, 1.2), round_(100, 140, 1.1, 1.2), round_(75, 120, 1.0, 1.3)]
    r = speed.combine(rounds)
    assert r["speed_ratio"] == pytest.approx(1.5)
    assert [x["speed_ratio"] for x in r["rounds"]] == pytest.approx([1.5, 1.4, 1.6])
    assert r["ours"]["episodes_per_sec"] == pytest.approx(512 / 80) and r["trl"]["train_s"] == pytest.approx(120)
    assert (
        r["ours"]["peak_rss_gb"] == 1.1
        and r["trl"]["peak_rss_gb"] == 1.3
        and r["mem_ratio"] == pytest.approx(1.1 / 1.3)
    )
    assert "rounds" not in speed.combine(rounds[:1]) and speed.combine(rounds[:1])["speed_ratio"] == pytest.approx(1.5)
    skipped = {"algo": "ppo", "work": {}, "skipped": "TRL side failed"}
    assert speed.combine([rounds[0], skipped]) is skipped


@pytest.mark.parametrize("algo", ["rm", "ppo", "grpo", "rloo", "dpo"])
def test_our_command_does_the_same_work_as_the_trl_side(algo):
    a = speed.parse_args(["--steps", "3", "--model", "M", "--reward-model", "RM"])
    w = speed.work(algo, a)
    cmd = speed.ours_command(w, "scratch_x")
    assert cmd[1] == speed.SCRIPTS[algo] and flag(cmd, "--num-threads") == "1" and flag(cmd, "--seed") == "1"
    if algo in ("rm", "dpo"):  # one epoch over exactly steps x batch pairs
        assert (
            int(flag(cmd, "--max-train-samples"))
            == 3 * w["batch"]
            == 3 * int(flag(cmd, "--per-device-train-batch-size"))
        )
    if algo in ("ppo", "rloo"):  # steps batches of `batch` sampled responses
        assert int(flag(cmd, "--total-episodes")) == 3 * int(flag(cmd, "--per-device-batch-size")) == 3 * w["batch"]
        assert int(flag(cmd, "--response-length")) == w["response_length"]
    if algo == "ppo":
        assert flag(cmd, "--reward-model-path") == "RM" and flag(cmd, "--num-mini-batches") == str(w["mini_batches"])
    if algo == "grpo":  # questions x generations = batch, minibatches x micro = batch
        assert int(flag(cmd, "--questions-per-device")) * int(flag(cmd, "--num-generations")) == w["batch"]
        assert int(flag(cmd, "--num-mini-batches")) * int(flag(cmd, "--micro-batch-size")) == w["batch"]
        assert flag(cmd, "--total-steps") == "3"
    if algo == "rloo":
        assert flag(cmd, "--rloo-k") == str(w["generations"])


def test_a_missing_script_is_skipped_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setattr(speed, "REPO", tmp_path)  # no scripts there
    r = speed.measure("rloo", speed.parse_args(["--model", "M"]), tmp_path)
    assert "rloo.py does not exist" in r["skipped"]
    assert "skipped: rloo.py does not exist" in speed.table([r])


def test_the_limit_table_takes_each_side_s_model_flops_and_our_sampling_s_bytes(monkeypatch, tmp_path):
    import json

    from benchmark.tools import gen_timer

    shapes = {"sft": {"n": 1_000, "kv_bytes": 8}, "rm": {"n": 300, "kv_bytes": 8}}
    monkeypatch.setattr(speed, "model_shape", lambda path, reward: shapes[path])
    w = {"algo": "ppo", "model": "sft", "reward_model": "rm", "response_length": 32, "ppo_epochs": 4}
    # TRL counts prompt + budget (40 + 32); our runs sampled 12 tokens an episode on average -> 52 tokens
    result = {
        "algo": "ppo",
        "work": w,
        "ours": {"episodes_per_sec": 10.0, "completion_length": 12.0},
        "trl": {"episodes_per_sec": 5.0, "tokens_per_episode": 72.0},
    }
    calls = [  # the evaluation's call (8 prompts) is left out; two rollout calls of 2 s and 3 s
        {"seconds": 9.0, "prompts": 8, "steps": 5, "contexts": 1},
        {"seconds": 2.0, "prompts": 64, "steps": 10, "contexts": 100},
        {"seconds": 3.0, "prompts": 64, "steps": 20, "contexts": 300},
    ]
    (tmp_path / "ppo_ours.json").write_text(json.dumps({"calls": calls}))
    machine = {"threads": 1, "matmul_gflops": {128: 40.0, 256: 80.0}, "bandwidth_gbs": {"copy": 5.0, "read": 10.0}}
    [row] = speed.limit_rows([result], machine, str(tmp_path))
    flops = (4 * 1_000 + 4 * 300 + 4 * 6 * 1_300) * 52
    assert row["tokens"] == 52 and row["gflop"] == pytest.approx(flops / 1e9)
    assert row["ours_gflops"] == pytest.approx(flops * 10 / 1e9) and row["trl_share"] == pytest.approx(flops * 5 / 80e9)
    moved = 30 * 4_000 + 400 * 8  # 30 decoding steps of 4,000 weight bytes, 400 contexts of 8 bytes
    assert row["sampling_gbs"] == pytest.approx(moved / 5.0 / 1e9) and row["sampling_share"] == pytest.approx(
        moved / 5.0 / 10e9
    )
    assert "| ppo | 1,000 / 300 | 52 |" in speed.limit_table([row], machine)
    # asked for (CLEAN_RLHF_GEN_TIMES) and not written by the side: the cell says so, not a bare "-"
    (tmp_path / "ppo_ours.json").rename(tmp_path / "kept.json")
    assert "| no ppo_ours.json (none written) |" in speed.limit_table(
        speed.limit_rows([result], machine, str(tmp_path)), machine
    )
    (tmp_path / "kept.json").rename(tmp_path / "ppo_ours.json")
    # a fork that logs no completion length has no row (its tokens an episode are unknown), not a wrong one
    result["ours"]["completion_length"] = None
    assert speed.limit_rows([result], machine, str(tmp_path)) == []
    assert gen_timer.generation_calls(tmp_path / "ppo_ours.json", 8) == calls[1:]


def test_the_generation_timer_makes_its_folder(tmp_path, monkeypatch):
    """CLEAN_RLHF_GEN_TIMES=DIR names a folder that may not exist yet: the calls must still land there (an error in an
    atexit hook is only printed, and the limit table's sampling column then read "-" for every algorithm)."""
    from benchmark.tools import gen_timer

    monkeypatch.setattr(gen_timer, "CALLS", [{"seconds": 1.0, "prompts": 64}])
    gen_timer.write_calls(str(tmp_path / "gen" / "ppo_ours.json"))
    assert gen_timer.generation_calls(tmp_path / "gen" / "ppo_ours.json", 8) == [{"seconds": 1.0, "prompts": 64}]


def test_the_generation_timer_reads_each_sampler_s_steps_and_contexts():
    import torch

    from benchmark.tools import gen_timer

    def sample_with_kv_cache(model, prompts, pad_id, eos_id, max_new_tokens, temperature, batch_size, synced=False):
        return [[7, 2], [7, 7, 7, 2]], []

    def sample_responses(model, queries, qmask, eos_id, pad_id, max_new_tokens, temperature, synced=False):
        return torch.tensor([[7, 2, 0, 0], [7, 7, 7, 2]]), None, None

    list_args = (None, [[1, 1, 1], [1] * 5], 0, 2, 4, 1.0, 2)
    lists = gen_timer.decoded(sample_with_kv_cache, list_args, {}, sample_with_kv_cache(*list_args))
    assert lists == {"steps": 4, "contexts": (3 + 4) + (5 + 6 + 7 + 8)}
    qmask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    args = (None, torch.zeros(2, 5), qmask, 2, 0, 4, 1.0)
    result = sample_responses(*args)
    assert gen_timer.decoded(sample_responses, args, {}, result) == lists
    timed = gen_timer.timed(sample_responses, shapes=gen_timer.decoded)
    n = len(gen_timer.CALLS)
    assert timed(*args)[0] is not None and gen_timer.CALLS[n]["steps"] == 4 and gen_timer.CALLS[n]["prompts"] == 2
