"""benchmark/tools/limits.py (issue 70): the CPU's attainable matmul rate and memory bandwidth, and the FLOP count a
stage's achieved rate is taken from. The rates are measurements (docs/speed.md); the arithmetic is tested here."""

from __future__ import annotations

import pytest
import torch

from benchmark.tools import limits


def test_model_flops_are_two_n_a_token_forward_and_six_n_with_the_backward_pass():
    assert limits.model_flops(1_000, 10, backward=False) == 20_000
    assert limits.model_flops(1_000, 10, backward=True) == 60_000


def test_the_input_embedding_is_left_out_and_the_head_counted_tied_or_not():
    class Tiny(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed, self.body = torch.nn.Embedding(50, 4), torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 50, bias=False)
            if tied:
                self.head.weight = self.embed.weight

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    assert limits.non_embedding_parameters(Tiny(tied=False)) == 4 * 4 + 4 + 4 * 50
    assert limits.non_embedding_parameters(Tiny(tied=True)) == 4 * 4 + 4 + 4 * 50  # a tied head is still a matmul


def test_a_rate_is_the_best_call_and_the_table_names_each_measure():
    calls = []
    assert limits.timed_rate(lambda: calls.append(1), 10.0, 0.001) > 0 and len(calls) >= 2  # the warm-up and more
    rows = limits.measure([1], [8, 16], 1, 0.001)
    assert set(rows[0]["matmul_gflops"]) == {8, 16} and set(rows[0]["bandwidth_gbs"]) == {"copy", "read"}
    md = limits.table(rows).splitlines()
    assert md[0].startswith("| threads | matmul 8, GFLOP/s | matmul 16, GFLOP/s | attainable GFLOP/s")
    assert len(md) == 3 and md[2].startswith("| 1 |")


@pytest.mark.parametrize("flags", [["--seconds", "0"], ["--mib", "-1"], ["--sizes", "0"], ["--threads", "0"]])
def test_a_non_positive_setting_is_one_error_line(flags):
    with pytest.raises(SystemExit, match="^error: --seconds, --mib, --sizes and --threads must be positive$"):
        limits.main(flags)


def test_an_episode_s_flops_count_each_pass_of_its_algorithm():
    # hand-computed: N = 1,000 policy, Nv = 300 value / reward, 10 tokens
    assert limits.episode_flops("rm", 10, 0, 1_000, 0, 0) == 6 * 1_000 * 10
    assert limits.episode_flops("dpo", 10, 0, 1_000, 0, 0) == (6 + 2) * 1_000 * 10
    # sampling + reference (2 N each), value + reward (2 Nv each), 4 epochs of 6 (N + Nv)
    assert limits.episode_flops("ppo", 10, 4, 1_000, 300, 4) == (4_000 + 1_200 + 4 * 6 * 1_300) * 10
    for algo in ("grpo", "rloo"):  # sampling and reference 2 N each, one training pass 6 N
        assert limits.episode_flops(algo, 10, 4, 1_000, 0, 0) == 10 * 1_000 * 10
    with pytest.raises(ValueError, match="no FLOP model for 'sft'"):
        limits.episode_flops("sft", 10, 0, 1, 0, 0)


def test_a_sampling_call_reads_the_weights_each_step_and_each_live_row_s_cache():
    # rows of prompt 3 and 5 decoding 2 and 4 tokens: contexts 3 + 4 and 5 + 6 + 7 + 8
    assert limits.row_contexts([3, 5], [2, 4]) == 7 + 26
    assert limits.decode_bytes(steps=4, contexts=33, weight_bytes=100, kv_bytes_per_token=8) == 4 * 100 + 33 * 8
