"""--lora-r in ppo_rlhf.py, rloo.py and remax.py: a short tiny-math run of each trains the adapters only (every base
weight ends where it started; PPO's value model is trained in full), writes `model/` as a plain model with the adapters
merged (no peft names, loads with transformers, the trained model's logits), uses the policy with its adapters disabled
as the reference (no second model loaded; it still gives the initial model's logits after training, and the KL at the
first update is 0), and resumes from a checkpoint to exactly the uninterrupted run. rloo.py and ppo_rlhf.py also run
with LoRA on two processes (gloo on CPU)."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
import tyro
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppo_rlhf
import remax
import rloo
from clean_rlhf_utils import engines, loading, packing, runs
from tests.bad_inputs import make_reward_model
from tests.faults import REPO, assert_same_run, env
from tests.launch import launch_cmd

# each script with the architecture it runs on here (tiny-llama: peft's `model` attribute is the whole causal LM, which
# ppo_rlhf.py's packed forward must not take for the body) and its batch flags (2 updates of 8 responses, 4 for ReMax)
SCRIPTS = {
    "rloo": (
        rloo,
        "tiny-llama",
        ["--per-device-batch-size", "8", "--rloo-k", "4", "--num-ppo-epochs", "2", "--num-mini-batches", "2"],
    ),
    "remax": (remax, "tiny-neox", ["--per-device-batch-size", "4", "--gradient-accumulation-steps", "2"]),
    "ppo_rlhf": (ppo_rlhf, "tiny-llama", ["--per-device-batch-size", "8", "--num-mini-batches", "2"]),
}


def _flags(assets, out, script: str, name: str, *extra: str) -> list[str]:
    model, batch = str(assets / "models" / SCRIPTS[script][1]), SCRIPTS[script][2]
    if script != "ppo_rlhf":  # the policy's checkpoint with a random score head as the reward model, no penalty for
        # responses without EOS: the responses' scores differ (all -1 on tiny-math: no advantage, nothing would train;
        # PPO's advantages come from its value model too)
        rm = out / f"rm-{SCRIPTS[script][1]}"
        if not rm.exists():
            make_reward_model(assets, rm, SCRIPTS[script][1])
        task = [
            "tiny-tldr",
            "--reward-model-path",
            str(rm),
            "--dataset-name-or-path",
            str(assets / "tiny-tldr" / "sft"),
            "--total-episodes",
            "8" if script == "remax" else "16",
            "--no-non-eos-penalty",
        ]
    else:
        task = ["tiny-math", "--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), "--total-episodes", "16"]
    return [
        *task,
        "--sft-model-path",
        model,
        "--response-length",
        "12",
        *batch,
        "--learning-rate",
        "1e-3",
        "--lora-r",
        "4",
        "--num-eval-examples",
        "3",
        "--per-device-eval-batch-size",
        "3",
        "--eval-every",
        "100",
        "--num-threads",
        "1",
        "--output-dir",
        str(out),
        "--run-name",
        name,
        *extra,
    ]


def _in_process(mod, argv: list[str]) -> dict:
    """`python <script>.py <argv>` in this process (no second import of torch); `Run`'s signal handlers put back."""
    try:
        return mod.main(tyro.extras.overridable_config_cli(mod.PRESETS, args=argv))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _logits(model) -> torch.Tensor:
    """Logits of one sequence (one row with its position ids: what ppo_rlhf.py's packed attention takes too)."""
    with torch.no_grad():
        return model(input_ids=torch.arange(5, 25)[None], position_ids=torch.arange(20)[None], use_cache=False).logits


@pytest.fixture(scope="module", params=list(SCRIPTS))
def lora_run(request, assets, tmp_path_factory):
    """One LoRA run of the script, in this process, with what it loaded and built recorded: the trained model as
    `save_model` gets it, every `load_pretrained` call, and every LoraReference made."""
    script = request.param
    mod, arch, _ = SCRIPTS[script]
    out = tmp_path_factory.mktemp(f"lora-{script}")
    seen = {"loads": [], "refs": [], "saved": None}
    # rloo.py and remax.py call the package's loader and LoraReference (`loading.`, `engines.`), ppo_rlhf.py its own
    owner = {"load_pretrained": mod if hasattr(mod, "load_pretrained") else loading}
    owner["LoraReference"] = mod if hasattr(mod, "LoraReference") else engines
    load_pretrained, save_model = owner["load_pretrained"].load_pretrained, runs.save_model  # saved by Run.finish

    def recorded_load(cls, path, args, what, *a, **kw):
        seen["loads"].append((cls.__name__, what))
        return load_pretrained(cls, path, args, what, *a, **kw)

    def saving(model, tokenizer, accelerator, path, prefix="", dtype=torch.float32):
        seen["saved"] = accelerator.unwrap_model(model)
        save_model(model, tokenizer, accelerator, path, prefix, dtype)

    class Recorded(owner["LoraReference"].LoraReference):
        def __init__(self, policy):
            super().__init__(policy)
            seen["refs"].append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner["load_pretrained"], "load_pretrained", recorded_load)
        mp.setattr(runs, "save_model", saving)
        mp.setattr(owner["LoraReference"], "LoraReference", Recorded)
        _in_process(mod, _flags(assets, out, script, "full"))
    policy = seen["saved"].policy if script == "ppo_rlhf" else seen["saved"]
    return {
        "script": script,
        "mod": mod,
        "dir": out / "full",
        "out": out,
        "policy": policy,
        **seen,
        "initial": AutoModelForCausalLM.from_pretrained(assets / "models" / arch).eval(),
    }


def test_lora_trains_the_adapters_only_and_saves_a_plain_merged_model(lora_run):
    policy, initial = lora_run["policy"], lora_run["initial"]
    assert hasattr(policy, "peft_config")
    start = initial.state_dict()
    adapters = 0
    for name, p in policy.named_parameters():
        if ".lora_" in name:
            adapters += 1
            assert p.requires_grad, name
            continue
        assert not p.requires_grad, name
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(p.detach(), start[key]), f"{name} moved"
    moved_b = [n for n, p in policy.named_parameters() if ".lora_B." in n and p.abs().max() > 0]
    assert adapters and moved_b, "the adapters did not train"

    # model/: the plain model's names only (what the SFT checkpoint holds), loaded without peft
    saved = load_file(lora_run["dir"] / "model" / "model.safetensors")
    assert not [k for k in saved if "lora_" in k or "base_layer" in k or k.startswith("base_model")]
    assert saved.keys() == load_file(f"{lora_run['initial'].name_or_path}/model.safetensors").keys()
    plain = AutoModelForCausalLM.from_pretrained(lora_run["dir"] / "model").eval()
    assert not hasattr(plain, "peft_config")
    trained = _logits(policy.eval())
    torch.testing.assert_close(_logits(plain), trained, atol=1e-5, rtol=1e-5)  # the adapters merged, at their scale
    assert (trained - _logits(initial)).abs().max() > 1e-3  # and they did change the model

    if lora_run["script"] == "ppo_rlhf":  # the value model is trained in full, as TRL's PPOTrainer does with LoRA
        value = lora_run["saved"].value_model
        assert not hasattr(value, "peft_config") and all(p.requires_grad for p in value.parameters())
        body = value.model.state_dict()
        assert any(not torch.equal(body[k], start[f"model.{k}"]) for k in body)


def test_lora_reference_is_the_policy_with_its_adapters_disabled(lora_run):
    causal_lm_loads = [what for cls, what in lora_run["loads"] if cls == "AutoModelForCausalLM"]
    assert causal_lm_loads == ["policy"]  # no second copy of the model as the reference
    assert len(lora_run["refs"]) == 1 and lora_run["refs"][0].policy[0] is lora_run["policy"]
    # after training the reference still is the initial model (the base weights never moved), the policy is not
    reference, initial = lora_run["refs"][0], lora_run["initial"]
    torch.testing.assert_close(_logits(reference), _logits(initial), atol=1e-6, rtol=1e-6)
    assert (_logits(lora_run["policy"]) - _logits(initial)).abs().max() > 1e-3
    if lora_run["script"] == "ppo_rlhf":  # PPO's rollout reads the reference's body and head on a packed row itself
        queries, responses = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17]]
        got = ppo_rlhf.reference_logits(reference, packing.pack_one_row(queries, responses, pad_id=1))
        for i, (q, r) in enumerate(zip(queries, responses)):  # each sequence alone through the initial model
            with torch.no_grad():
                want = initial(input_ids=torch.tensor([q + r])).logits[0, len(q) - 1 :]
            torch.testing.assert_close(got[i, : len(r) + 1], want, atol=1e-5, rtol=1e-5)
    # B = 0 at the start: the policy is its reference, so the first update's KL is 0 (to the sampler's rounding)
    train = [r for r in _rows(lora_run["dir"]) if "objective/kl" in r]
    assert len(train) == 2 and abs(train[0]["objective/kl"]) < 1e-4


def test_lora_run_resumes_exactly_from_a_checkpoint(lora_run, assets):
    """Stopped after update 1 (as by SIGTERM: a checkpoint of the adapters, the value model, AdamW's moments and the
    RNGs), then resumed: the metrics and the merged model/ of the uninterrupted run, to the bit."""
    mod, script, out = lora_run["mod"], lora_run["script"], lora_run["out"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs.Run, "stop_requested", lambda self: True)  # the one Run class of every script
        with pytest.raises(SystemExit) as stopped:
            _in_process(mod, _flags(assets, out, script, "resumed"))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert json.loads((out / "resumed" / "checkpoint" / "state.json").read_text())["step"] == 1
    _in_process(mod, _flags(assets, out, script, "resumed", "--resume"))
    assert_same_run(out / "resumed", lora_run["dir"])


@pytest.mark.parametrize("script", ["rloo", "ppo_rlhf"])
def test_lora_on_two_processes(assets, tmp_path, script):
    """DDP (gloo on CPU) over a policy whose base weights are frozen: both ranks train and model/ is the merged plain
    model, moved away from its start."""
    cmd = launch_cmd(REPO / f"{script}.py", *_flags(assets, tmp_path, script, "ddp"))
    proc = subprocess.run(
        cmd,
        check=False,
        cwd=tmp_path,
        env={**env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [r for r in _rows(tmp_path / "ddp") if "objective/kl" in r]
    assert [r["episode"] for r in train] == [16] and abs(train[0]["objective/kl"]) < 1e-4  # 2 ranks x 8, one update
    saved = load_file(tmp_path / "ddp" / "model" / "model.safetensors")
    assert not [k for k in saved if "lora_" in k or "base_layer" in k]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ddp" / "model").eval()
    initial = AutoModelForCausalLM.from_pretrained(assets / "models" / SCRIPTS[script][1]).eval()
    assert (_logits(model) - _logits(initial)).abs().max() > 1e-4
