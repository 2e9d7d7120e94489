"""LoRA through peft (Hu et al. 2021, arXiv:2106.09685) in sft.py and dpo.py (`--lora-r`): only the adapters train
(every base weight ends as it started), `model/` is the plain model with the adapters merged (no peft names, loads
with transformers alone, the trained model's outputs), DPO's reference is the policy with its adapters disabled (no
second copy loaded; the generator thread of --async uses its own copy's), and a stopped run resumes exactly."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import dpo
import sft
from clean_rlhf_utils import runs
from tests.bad_inputs import make_reward_model
from tests.faults import assert_same_run, env
from tests.launch import launch_cmd

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parent.parent
X = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])  # any tokens: the models are compared on their logits
LoraReference = dpo.LoraReference  # the class itself, before a test records its instances


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=X).logits


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _recorded(monkeypatch, module, name: str) -> list:
    """What each call of `module.name` returns (or, for a class, each instance made), in order."""
    out, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: out.append(original(*a, **k)) or out[-1])
    return out


def _only_adapters_moved(peft_model, start: Path) -> None:
    """Every base weight of the trained peft model equals the one it was loaded from; some adapter moved."""
    initial = AutoModelForCausalLM.from_pretrained(start).state_dict()
    weights = peft_model.get_base_model().state_dict()
    base = {k.replace(".base_layer.", "."): v for k, v in weights.items() if ".lora_" not in k}
    assert base.keys() == initial.keys()
    assert all(torch.equal(base[k], initial[k]) for k in initial)
    assert any(v.abs().sum() > 0 for k, v in weights.items() if ".lora_B." in k)  # B starts at 0: training moved it


def _merged_model_is_the_trained_one(run_dir: Path, peft_model, start: Path) -> None:
    """model/ holds no peft names, loads without peft, and gives the trained peft model's outputs (not the start's)."""
    saved = load_file(run_dir / "model" / "model.safetensors")
    assert not [k for k in saved if "lora_" in k or "base_layer" in k or k.startswith("base_model.")]
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    out, trained = _logits(merged), _logits(peft_model.eval())
    torch.testing.assert_close(out, trained, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, _logits(AutoModelForCausalLM.from_pretrained(start).eval()), atol=1e-3)


def _stop_at(monkeypatch, module, step: int) -> None:
    """`Run.stop_requested` says yes at the end of step `step`, as after a SIGTERM."""
    calls = []
    monkeypatch.setattr(module.Run, "stop_requested", lambda self: calls.append(1) or len(calls) == step)


def _restore_signals() -> None:  # `Run` installs its handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---- sft.py ----


def _sft_args(assets: Path, tmp_path: Path, **kw) -> sft.Args:
    base = {
        "model_name_or_path": str(assets / "models" / "tiny-neox"),
        "dataset_name_or_path": str(assets / "tiny-tldr" / "sft"),
        "max_prompt_length": 96,
        "max_response_length": 48,
        "max_train_samples": 24,
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-2,
        "num_eval_examples": 2,
        "per_device_eval_batch_size": 2,
        "eval_every": 100,
        "log_every": 1,
        "output_dir": str(tmp_path),
        "num_threads": 1,
        "lora_r": 4,
        "lora_alpha": 8.0,
    }
    return sft.Args(**{**base, **kw})


def test_sft_lora_trains_the_adapters_only_and_saves_the_merged_model(assets, tmp_path, monkeypatch):
    policies = _recorded(monkeypatch, sft, "add_lora")
    sft.main(_sft_args(assets, tmp_path, run_name="lora"))
    (policy,) = policies
    assert hasattr(policy, "peft_config")
    start = assets / "models" / "tiny-neox"
    _only_adapters_moved(policy, start)
    _merged_model_is_the_trained_one(tmp_path / "lora", policy, start)


def test_sft_lora_stopped_and_resumed_is_the_uninterrupted_run(assets, tmp_path, monkeypatch):
    """accelerate's checkpoint holds the peft model's weights and the adapters' optimizer state: a run stopped after
    step 1 of 3 and resumed ends with the metrics and merged weights of the uninterrupted run, exactly."""
    sft.main(_sft_args(assets, tmp_path, run_name="full"))
    with monkeypatch.context() as m:
        _stop_at(m, runs, 1)  # sft.py's Run is clean_rlhf_utils.runs.Run
        with pytest.raises(SystemExit) as stopped:
            sft.main(_sft_args(assets, tmp_path, run_name="killed"))
    _restore_signals()
    assert stopped.value.code == 128 + signal.SIGTERM
    sft.main(_sft_args(assets, tmp_path, run_name="killed", resume=True))
    _restore_signals()
    assert_same_run(tmp_path / "killed", tmp_path / "full")


# ---- dpo.py ----


@pytest.fixture(scope="module")
def tiny_rm(assets, tmp_path_factory):
    return make_reward_model(assets, tmp_path_factory.mktemp("rm"))


def _dpo_args(assets: Path, tmp_path: Path, preset: str = "tiny-tldr", **kw) -> dpo.Args:
    base = {
        "sft_model_path": str(assets / "models" / "tiny-neox"),
        "dataset_name_or_path": str(assets / "tiny-tldr" / "preference"),
        "prompt_dataset_name_or_path": str(assets / "tiny-tldr" / "sft"),
        "output_dir": str(tmp_path),
        "max_train_samples": 16,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "response_length": 12,
        "num_eval_examples": 2,
        "num_eval_pairs": 4,
        "per_device_eval_batch_size": 4,
        "eval_every": 100,
        "log_every": 1,
        "num_threads": 1,
        "lora_r": 4,
        "lora_alpha": 8.0,
    }
    return dataclasses.replace(dpo.PRESETS[preset][1], **{**base, **kw})


def _online(tiny_rm: Path, **kw) -> dict:
    """3 steps of 8 prompts, two samples each, labelled by the random reward model (its scores rarely tie)."""
    return dict(
        preset="tiny-tldr-online",
        reward_model_path=str(tiny_rm),
        judge="rm",
        max_train_samples=24,
        total_episodes=24,
        non_eos_penalty=False,
        **kw,
    )


def _record_dpo(monkeypatch) -> tuple[list, list, list]:
    """The models dpo.py loads (what: policy, reference, ...), the LoraReferences it makes, and each sampling call's
    (generating policy, reference)."""
    loads, samplers = [], []
    load, sample = dpo.load_pretrained, dpo.sample_pairs

    def counted_load(cls, path, args, what, *a, **k):
        loads.append(what)
        return load(cls, path, args, what, *a, **k)

    def recorded_sample(gen_policy, ref_policy, *a, **k):
        samplers.append((gen_policy, ref_policy))
        return sample(gen_policy, ref_policy, *a, **k)

    monkeypatch.setattr(dpo, "load_pretrained", counted_load)
    monkeypatch.setattr(dpo, "sample_pairs", recorded_sample)
    refs = _recorded(monkeypatch, dpo, "LoraReference")
    return loads, refs, samplers


def _reference_is_the_base(refs: list, start: Path) -> None:
    """After training, the reference (the policy with its adapters disabled) still gives the initial model's outputs."""
    initial = _logits(AutoModelForCausalLM.from_pretrained(start).eval())
    for ref in refs:
        assert torch.equal(_logits(ref), initial)


@pytest.mark.parametrize("precompute", [True, False], ids=["cached-ref", "live-ref"])
def test_offline_dpo_lora_takes_the_policy_without_adapters_as_reference(assets, tmp_path, monkeypatch, precompute):
    """Cached (before training) or live (each step and at evaluation) reference logprobs come from the policy with its
    adapters disabled: one model loaded; at step 1 policy = reference (B = 0), so the loss is log 2."""
    loads, refs, _ = _record_dpo(monkeypatch)
    dpo.main(_dpo_args(assets, tmp_path, run_name="off", precompute_ref_logprobs=precompute))
    assert loads.count("reference") == 0 and loads.count("policy") == 1 and len(refs) == 1
    policy = refs[0].policy[0]
    assert hasattr(policy, "peft_config")
    train = [r for r in _rows(tmp_path / "off") if "train/loss" in r]
    assert len(train) == 2 and train[0]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert train[-1]["rewards/margins"] != 0.0  # the policy moved away from the reference
    start = assets / "models" / "tiny-neox"
    _reference_is_the_base(refs, start)
    _only_adapters_moved(policy, start)
    _merged_model_is_the_trained_one(tmp_path / "off", policy, start)


@pytest.mark.parametrize("extra", [{}, {"async_generation": True, "num_threads": 2}], ids=["sync", "async"])
def test_online_dpo_lora_reference_and_kl(assets, tiny_rm, tmp_path, monkeypatch, extra):
    """The KL to the reference is 0 on the first batch (sampled by the initial policy, B = 0) and above 0 once the
    adapters trained. Each batch's reference logprobs come from the sampling policy with its adapters disabled:
    with --async the generator thread's copy, never the learner's (switching those off from the thread would switch
    them off under the learner's forward pass)."""
    loads, refs, samplers = _record_dpo(monkeypatch)
    dpo.main(_dpo_args(assets, tmp_path, run_name="on", **_online(tiny_rm, **extra)))
    assert loads.count("reference") == 0 and loads.count("policy") == 1
    learner = refs[0].policy[0]
    assert len(samplers) == 3 and all(isinstance(ref, LoraReference) for _, ref in samplers)
    assert all(ref.policy[0] is gen for gen, ref in samplers)
    assert all((gen is learner) != bool(extra) for gen, _ in samplers)  # async: a copy
    train = [r for r in _rows(tmp_path / "on") if "train/loss" in r]
    assert train[0]["objective/kl"] == 0.0 and train[0]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert train[-1]["objective/kl"] != 0.0
    start = assets / "models" / "tiny-neox"
    _reference_is_the_base(refs + [ref for _, ref in samplers], start)
    _only_adapters_moved(learner, start)
    _merged_model_is_the_trained_one(tmp_path / "on", learner, start)


def test_online_dpo_lora_stopped_and_resumed_is_the_uninterrupted_run(assets, tiny_rm, tmp_path, monkeypatch):
    """Stopped after step 1 of 3 and resumed: the resumed run's reference (the restored policy, adapters disabled) and
    its samples are the uninterrupted run's, so are its metrics and merged weights, exactly."""
    dpo.main(_dpo_args(assets, tmp_path, run_name="full", **_online(tiny_rm)))
    with monkeypatch.context() as m:
        _stop_at(m, dpo, 1)
        with pytest.raises(SystemExit) as stopped:
            dpo.main(_dpo_args(assets, tmp_path, run_name="killed", **_online(tiny_rm)))
    _restore_signals()
    assert stopped.value.code == 128 + signal.SIGTERM
    dpo.main(_dpo_args(assets, tmp_path, run_name="killed", resume=True, **_online(tiny_rm)))
    _restore_signals()
    assert_same_run(tmp_path / "killed", tmp_path / "full")


def test_offline_dpo_lora_on_two_processes(assets, tmp_path):
    """DDP (gloo, 2 processes): each merged weight differs from the start by a matrix of rank at most r (B A, with
    alpha / r); the weights LoRA does not adapt (embeddings, norms, biases) are the start's."""
    cmd = launch_cmd(
        str(REPO / "dpo.py"),
        "tiny-tldr",
        "--run-name",
        "ddp",
        "--sft-model-path",
        str(assets / "models" / "tiny-neox"),
        "--dataset-name-or-path",
        str(assets / "tiny-tldr" / "preference"),
        "--prompt-dataset-name-or-path",
        str(assets / "tiny-tldr" / "sft"),
        "--output-dir",
        str(tmp_path),
        "--max-train-samples",
        "16",
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-2",
        "--num-eval-examples",
        "2",
        "--num-eval-pairs",
        "4",
        "--per-device-eval-batch-size",
        "2",
        "--response-length",
        "8",
        "--eval-every",
        "100",
        "--log-every",
        "1",
        "--num-threads",
        "1",
        "--lora-r",
        "4",
    )
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env={**env(), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [r for r in _rows(tmp_path / "ddp") if "train/loss" in r]
    assert len(train) == 2 and train[0]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    start = load_file(assets / "models" / "tiny-neox" / "model.safetensors")
    merged = load_file(tmp_path / "ddp" / "model" / "model.safetensors")
    assert merged.keys() == start.keys()
    adapted = [k for k in start if start[k].dim() == 2 and "embed" not in k]
    # rank at most r, up to float32 rounding (relative 1e-6 of the largest singular value)
    assert adapted and all(torch.linalg.matrix_rank((merged[k] - start[k]).double(), rtol=1e-4) <= 4 for k in adapted)
    assert any(not torch.equal(merged[k], start[k]) for k in adapted)
    assert all(torch.equal(merged[k], start[k]) for k in start if k not in adapted)
