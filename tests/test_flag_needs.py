"""A flag that acts only with another says so (issue 59, class 6): one table of rules, `clean_rlhf_utils/args.py`
`NEEDS` (by field name, for every script and fork that has the field) and each script's own `Args.NEEDS`, checked by
`check_needs` before anything loads. Here every rule of every script is run both ways, every preset passes them, and
every field of every script's `Args` is either under a rule or named below as acting on its own: a new flag is
classified or this file fails. And (class 7) a model directory whose weights are only a pickle is refused before any
model loads."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch
import transformers

from clean_rlhf_utils.args import NEEDS, check_needs, default_of, flag_of, needs_table
from clean_rlhf_utils.tracking import declared_parent
from tests.bad_inputs import REPO, World, base_flags, make_reward_model, pickled_copy

LIBRARY = ["sft", "reward_model", "ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"]
# the library's forks (those that keep a variant record, as tests/test_forks.py takes them): their own fields too; a
# user's copy in the checkout is left alone
FORKS = sorted(
    p.stem for p in REPO.glob("*.py") if declared_parent(p.read_text()) and p.with_suffix(".variant.diff").is_file()
)
SCRIPTS = LIBRARY + FORKS
MODULES = {name: importlib.import_module(name) for name in SCRIPTS}

ONE_PASS = {"num_ppo_epochs": 1, "num_iterations": 1, "num_mini_batches": 1, "async_generation": False}
TWO_PASSES = {"num_ppo_epochs": 2, "num_iterations": 2, "num_mini_batches": 1}
TRAINER = {"sampler_logprobs": False}  # the old logprobs from a forward pass, which a correction weights
ONLINE, OFFLINE = {"mode": "online"}, {"mode": "offline"}
OUTCOME, PROCESS = {"objective": "outcome"}, {"objective": "process"}
EXAMPLES = {
    # field -> (a value given, the fields that take its partner away, the fields that give it); a field a script does
    # not have is left out
    "vllm_gpu_memory_utilization": (0.5, {"use_vllm": False}, {"use_vllm": True}),
    "lora_alpha": (16.0, {"lora_r": None}, {"lora_r": 4}),
    "lora_target_modules": (["q_proj"], {"lora_r": None}, {"lora_r": 4}),
    "generation_threads": (1, {"async_generation": False}, {"async_generation": True, **ONLINE}),
    "kl_clamp": (10.0, {"kl_coef": 0.0, "beta": 0.0}, {"kl_coef": 0.05, "beta": 0.04}),
    "adaptive_kl": (True, {"kl_coef": 0.0}, {"kl_coef": 0.05}),
    "target_kl": (3.0, {"adaptive_kl": False}, {"adaptive_kl": True}),
    "kl_horizon": (500, {"adaptive_kl": False}, {"adaptive_kl": True}),
    "cliprange": (0.1, ONE_PASS, TWO_PASSES),
    "cliprange_value": (0.1, ONE_PASS, TWO_PASSES),
    "dual_clip": (3.0, ONE_PASS, TWO_PASSES),
    "cliprange_high": (0.28, ONE_PASS, TWO_PASSES),
    "answer_format": ("boxed", {"reward_source": "model"}, {"reward_source": "math"}),
    "penalty_reward_value": (-2.0, {"non_eos_penalty": False, **ONLINE}, {"non_eos_penalty": True, **ONLINE}),
    "prm_coef": (0.5, {"prm_path": None}, {"prm_path": "prm"}),
    "prm_refine": ("delta", {"prm_path": None}, {"prm_path": "prm"}),
    "prm_clip_eta": (0.3, {"prm_path": "prm", "prm_refine": "delta"}, {"prm_path": "prm", "prm_refine": "clip"}),
    "rm_coef": (0.5, {"reward_model_path": None}, {"reward_model_path": "rm"}),
    "sampler_correction_cap": (
        2.0,
        {"sampler_correction": "none"},
        {"sampler_correction": "token_truncate", **TRAINER},
    ),
    "max_sampling_rounds": (8, {"dynamic_sampling": False}, {"dynamic_sampling": True}),
    "overlong_penalty_factor": (0.5, {"overlong_buffer": 0}, {"overlong_buffer": 4}),
    # grpo_math.py (GRPO_NEEDS) and its forks; the log-ratio bound's other partner, a moving ratio: its own test below
    "kl_estimator": ("k2", {"beta": 0.0}, {"beta": 0.04}),
    "log_ratio_clamp": (10.0, {**ONE_PASS, "beta": 0.0}, {**ONE_PASS, "beta": 0.04}),
    # the forks' own Args.NEEDS: grpo_clip_cov.py
    "clip_cov_ratio": (0.01, {"loss_type": "cispo"}, {"loss_type": "grpo"}),
    "clip_cov_lb": (0.5, {"loss_type": "cispo"}, {"loss_type": "grpo"}),
    "clip_cov_ub": (10.0, {"loss_type": "cispo"}, {"loss_type": "grpo"}),
    # grpo_kl_cov.py
    "kl_cov_ratio": (0.01, ONE_PASS, TWO_PASSES),
    "kl_cov_coef": (0.5, ONE_PASS, TWO_PASSES),
    # dpo.py
    "judge": ("gold", OFFLINE, ONLINE),
    "total_episodes": (64, OFFLINE, ONLINE),
    "temperature": (0.9, OFFLINE, ONLINE),
    "non_eos_penalty": (False, OFFLINE, ONLINE),
    "async_generation": (True, OFFLINE, ONLINE),
    "precompute_ref_logprobs": (False, ONLINE, OFFLINE),
    "num_train_epochs": (2, ONLINE, OFFLINE),
    "label_smoothing": (0.1, {"loss_type": "ipo"}, {"loss_type": "sigmoid"}),
    "ipo_average": (False, {"loss_type": "sigmoid"}, {"loss_type": "ipo"}),
    # reward_model.py
    "chosen_field": ("better", PROCESS, OUTCOME),
    "rejected_field": ("worse", PROCESS, OUTCOME),
    "margin_field": ("margin", PROCESS, OUTCOME),
    "confidence_field": ("sure", PROCESS, OUTCOME),
    "pack_pairs": (False, PROCESS, OUTCOME),
    "center_rewards_coef": (0.01, PROCESS, OUTCOME),
    "steps_field": ("steps", OUTCOME, PROCESS),
    "labels_field": ("marks", OUTCOME, PROCESS),
    "step_separator": ("\n\n", OUTCOME, PROCESS),
}

# Every other field of every script acts on its own (or is checked by a rule of its own elsewhere): a new field goes
# under a rule above (`NEEDS` / `Args.NEEDS` and an example) or here, knowingly.
INDEPENDENT = {
    # the run, logging, the model's loading, the data (RunArgs, ModelArgs, DataArgs, RLArgs and their redeclarations)
    *("exp_name", "seed", "run_name", "output_dir", "save_every", "resume", "overwrite", "track", "wandb_project"),
    *("wandb_entity", "num_threads", "log_every", "save_model", "trust_remote_code", "add_pad_token", "dtype"),
    *("dataset_name_or_path", "train_split", "eval_split", "prompt_template", "use_chat_template", "drop_overlong"),
    *("dataset_config", "max_prompt_length", "eval_task", "eval_every", "num_eval_examples", "eval_kl"),
    *("per_device_eval_batch_size", "max_train_samples", "revision", "reference_template", "eval_dataset_name_or_path"),
    # the models and switches the rules above refer to
    *("model_name_or_path", "sft_model_path", "reward_model_path", "value_model_path", "prm_path", "lora_r"),
    *("use_vllm", "mode", "objective", "loss_type", "reward_source", "teacher_model_path", "advantage_estimator"),
    # optimisation and schedule
    *("learning_rate", "adam_eps", "max_grad_norm", "lr_schedule", "warmup_ratio", "warmup_steps", "weight_decay"),
    *("anneal_lr", "per_device_train_batch_size", "per_device_batch_size", "gradient_accumulation_steps"),
    *("num_ppo_epochs", "num_mini_batches", "num_iterations", "micro_batch_size", "separate_backward"),
    # sampling and rewards (acting in every variant)
    *("response_length", "max_response_length", "max_completion_length", "max_length", "stop_token", "rloo_k"),
    *("num_generations", "questions_per_device", "total_steps", "generation_batch_size", "sampler_logprobs"),
    *("sampler_correction", "format_reward_coef", "reward_clip", "normalize_advantage", "whiten_rewards", "gamma"),
    *("lam", "vf_coef", "entropy_coef", "kl_coef", "beta", "response_template", "max_prompt_length"),
    *("prompt_dataset_name_or_path", "num_eval_pairs", "pass_k", "overlong_filtering", "normalize"),
    # grpo_math.py: filled in by `resolve_variant` before `check_grpo_args` when not given (a rule on them would see
    # the filled value as given; the variant checks of `check_grpo_args` cover their combinations)
    *("epsilon_low", "epsilon_high", "loss_aggregation", "scale_rewards", "dynamic_sampling"),
    *("overlong_buffer", "importance_sampling_level", "advantage_eps"),
    # reward_model.py: a command may carry the normalisation data for either objective (tests/bad_inputs.py does)
    *("norm_dataset_name_or_path", "norm_split", "norm_response_template", "num_norm_examples"),
    # under a rule of dpo.py's or reward_model.py's own `Args.NEEDS`, on their own in the other scripts
    *("async_generation", "chosen_field", "rejected_field", "pack_pairs", "non_eos_penalty", "num_train_epochs"),
    *("temperature", "total_episodes"),
}
INDEPENDENT_IN = {
    # fields under a rule of grpo_math.py (GRPO_NEEDS) that act on their own in these scripts, and why:
    # the estimator of the in-reward KL penalty is also that of the logged `objective/kl`, so it changes a logged
    # number at --kl-coef 0 too (where no KL term is trained)
    "kl_estimator": {"ppo_rlhf", "rloo", "remax"},
    # the old logprobs are another forward pass's (or the sampler's), so a ratio on policy is 1 only to rounding, which
    # a small enough bound moves (the logged ratio and approxkl); and it bounds k3's log ratio in the logged KL
    "log_ratio_clamp": {"ppo_rlhf", "rloo"},
}


# a shared rule whose partner is every run of that script (math)
ALWAYS_HOLDS = {(s, "answer_format") for s in SCRIPTS if hasattr(MODULES[s], "resolve_variant")}


def rules() -> list:
    return [
        pytest.param(script, name, id=f"{script}-{name}")
        for script in SCRIPTS
        for name in needs_table(MODULES[script].Args)
    ]


def tiny_preset(script: str):
    """The script's first tiny preset, copied (the rules read no file: the paths stay as the preset has them)."""
    presets = MODULES[script].PRESETS
    return copy.deepcopy(next(args for name, (_, args) in presets.items() if name.startswith("tiny")))


def with_fields(args, **fields):
    return dataclasses.replace(args, **{k: v for k, v in fields.items() if hasattr(args, k)})


def check(script: str, args) -> None:
    """The rules as a run meets them: `runs.check_args` (`check_needs`), and grpo_math.py's (and its forks') variant
    defaults, after which `check_grpo_args` runs them again."""
    check_needs(args)
    if hasattr(MODULES[script], "resolve_variant"):
        MODULES[script].resolve_variant(args)


@pytest.mark.parametrize("script, name", rules())
def test_a_flag_without_its_partner_is_one_line(script, name):
    value, without, _ = EXAMPLES[name]
    args = with_fields(tiny_preset(script), **without, **{name: value})
    if (script, name) in ALWAYS_HOLDS:
        check(script, args)
        return
    with pytest.raises(SystemExit) as e:
        check(script, args)
    message = str(e.value.code)
    flag = flag_of(type(args), name)
    given = ("--no-" + flag[2:] if value is False else flag) + ("" if isinstance(value, bool) else " ")
    assert message.startswith(f"error: {given}") and " acts only with " in message and "\n" not in message, message


@pytest.mark.parametrize("script, name", rules())
def test_a_flag_with_its_partner_passes(script, name, capsys):
    value, _, partner = EXAMPLES[name]
    if not any(hasattr(tiny_preset(script), k) for k in partner):
        pytest.skip(f"{script}.py has not the partner flag: there the flag always means nothing")
    args = with_fields(tiny_preset(script), **partner, **{name: value})
    check(script, args)
    assert flag_of(type(args), name) not in capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_preset_passes_the_rules(script, capsys):
    for name, (_, args) in MODULES[script].PRESETS.items():
        check(script, copy.deepcopy(args))
        assert capsys.readouterr().err == "", name


def test_a_presets_value_carried_into_another_variant_is_a_warning(capsys):
    """reward_model.py's tiny-tldr preset names `--confidence-field confidence` (outcome data); with `--objective
    process` it is ignored, which the run says in a warning instead of refusing a flag the user did not give."""
    rm = MODULES["reward_model"]
    check_needs(dataclasses.replace(copy.deepcopy(rm.PRESETS["tiny-tldr"][1]), objective="process"))
    assert capsys.readouterr().err.strip() == (
        "warning: --confidence-field confidence acts only with --objective outcome, which this run lacks: the "
        "preset's value is ignored"
    )
    given = dataclasses.replace(copy.deepcopy(rm.PRESETS["tiny-tldr"][1]), objective="process", confidence_field="c")
    with pytest.raises(SystemExit, match="^error: --confidence-field c acts only with --objective outcome"):
        check_needs(given)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_field_is_under_a_rule_or_acts_on_its_own(script):
    """A new flag cannot forget: each field of `Args` (a fork's own fields too: FORKS) is under a rule (with an
    example above) or in INDEPENDENT, or INDEPENDENT_IN names the script, which no rule of it may then contradict."""
    assert "grpo_clip_cov" in FORKS
    table = needs_table(MODULES[script].Args)
    fields = {f.name for f in dataclasses.fields(MODULES[script].Args)}
    own = {name for name, scripts in INDEPENDENT_IN.items() if script in scripts}
    assert not own & set(table), f"{script}.py: under a rule, and in INDEPENDENT_IN: {own & set(table)}"
    unclassified = fields - set(table) - INDEPENDENT - own
    assert not unclassified, f"{script}.py: add a rule (NEEDS / Args.NEEDS) or list it in INDEPENDENT: {unclassified}"
    assert set(table) <= set(EXAMPLES), f"give each rule an example here: {set(table) - set(EXAMPLES)}"


def test_every_rule_names_a_field_of_a_script():
    assert not set(NEEDS) & INDEPENDENT, set(NEEDS) & INDEPENDENT  # a shared rule holds wherever its field is
    assert not set(INDEPENDENT_IN) & (INDEPENDENT | set(NEEDS)), set(INDEPENDENT_IN) & (INDEPENDENT | set(NEEDS))
    fields = {f.name for module in MODULES.values() for f in dataclasses.fields(module.Args)}
    own = {name for module in MODULES.values() for name in vars(module.Args).get("NEEDS", {})}
    assert not (set(NEEDS) | own) - fields, (set(NEEDS) | own) - fields


@pytest.mark.parametrize("script", [s for s in SCRIPTS if hasattr(MODULES[s], "resolve_variant")])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("estimator", ["group", "reinforce_pp_baseline"])
def test_grpo_variants_never_fill_a_ruled_flag_before_the_rules_run_again(script, loss_type, level, estimator):
    """`check_grpo_args` runs the rules again inside `resolve_variant`, so no rule may be on a field filled in before
    it (the filled value would read as given); --kl-estimator, under a rule, is filled in after it."""
    if loss_type == "cispo" and level == "sequence":
        pytest.skip("refused by check_grpo_args")
    grpo, seen = MODULES[script], []
    before = with_fields(tiny_preset(script), loss_type=loss_type, importance_sampling_level=level)
    before.advantage_estimator = estimator
    after = copy.deepcopy(before)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo, "check_grpo_args", lambda a, synced: seen.append(copy.deepcopy(a)))
        grpo.resolve_variant(after)
    (checked,) = seen
    filled = {f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(checked, f.name)}
    assert not filled & set(needs_table(grpo.Args)), filled & set(needs_table(grpo.Args))
    assert checked.kl_estimator is None and after.kl_estimator in ("k2", "k3")  # filled in after the check


@pytest.mark.parametrize("script", [s for s in SCRIPTS if hasattr(MODULES[s], "resolve_variant")])
def test_grpo_log_ratio_clamp_acts_with_a_moving_ratio_or_a_kl_term(script):
    """Issue 67 item 6: --log-ratio-clamp bounds log(pi / pi_old), exactly 0 on policy, and k3's log ratio to the
    reference, which beta 0 does not load: given with neither it was ignored; a second minibatch (or iteration, or
    --async) or a KL term each gives it something to bound."""
    args = with_fields(tiny_preset(script), **ONE_PASS, beta=0.0, log_ratio_clamp=5.0)
    with pytest.raises(SystemExit, match=r"^error: --log-ratio-clamp 5.0 acts only with a ratio that can leave 1 "):
        check(script, copy.deepcopy(args))
    for partner in (TWO_PASSES, {"num_mini_batches": 2}, {"async_generation": True}, {"beta": 0.04}):
        check(script, with_fields(copy.deepcopy(args), **partner))
    with pytest.raises(SystemExit, match=r"^error: --kl-estimator k2 acts only with a KL loss term \(--beta above 0\)"):
        check(script, with_fields(tiny_preset(script), loss_type="dapo", kl_estimator="k2"))  # DAPO's beta: 0


@pytest.mark.parametrize("script", [s for s in SCRIPTS if hasattr(MODULES[s], "resolve_variant")])
def test_what_grpo_refuses_changes_no_number(script, monkeypatch):
    """Where GRPO_NEEDS refuses them, --kl-estimator and --log-ratio-clamp change no bit of the loss or its gradient:
    on policy (no old logprobs: the new ones detached) with beta 0 (no reference logprobs), as `main` calls
    `micro_batch_loss` then."""
    grpo = MODULES[script]
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 30

    def update(estimator, bound, beta=0.0, ref=None):
        args = with_fields(tiny_preset(script), **ONE_PASS, beta=beta)
        grpo.resolve_variant(args)
        args.kl_estimator, args.log_ratio_clamp = estimator, bound  # past the rules that refuse them
        leaf = logits.clone().requires_grad_(True)
        monkeypatch.setattr(grpo, "completion_logprobs", lambda m, p, t, entropy_grad: (leaf.log_softmax(1), leaf))
        adv, mask = torch.tensor([1.0, -0.5, 0.25]), torch.ones(3, 5)
        torch.manual_seed(0)  # a fork may draw (Clip-Cov's tokens cut)
        out = grpo.micro_batch_loss(None, {}, adv, mask, None, ref, args, 3, 15.0)
        out["loss"].backward()
        return out["loss"].detach(), out["ratio"], out["kl"], leaf.grad

    first, *others = [update(e, b) for e, b in (("k3", 20.0), ("k2", 20.0), ("k3", None), ("k3", 1e-9), ("k2", 1e-9))]
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other))
    ref = torch.zeros(3, 5).log_softmax(1)  # with a reference (beta above 0) each flag moves the loss
    assert not torch.equal(update("k3", 20.0, 0.04, ref)[0], update("k2", 20.0, 0.04, ref)[0])
    assert not torch.equal(update("k3", 20.0, 0.04, ref)[0], update("k3", 1e-9, 0.04, ref)[0])


def test_a_forks_own_rule_is_checked():
    """A fork adds a rule to its `Args.NEEDS` (beside its fields, copied with the script): the same check reads it."""
    sft = MODULES["sft"]

    @dataclasses.dataclass
    class ForkArgs(sft.Args):
        extra_bonus: float = 0.0
        """a fork's flag that acts only with its own --use-bonus"""
        use_bonus: bool = False
        """the fork's switch"""
        NEEDS = {"extra_bonus": (lambda a: a.use_bonus, "--use-bonus")}

    args = ForkArgs(dataset_name_or_path="d", extra_bonus=0.5)
    with pytest.raises(SystemExit, match=r"^error: --extra-bonus 0.5 acts only with --use-bonus, which this run lacks"):
        check_needs(args)
    check_needs(dataclasses.replace(args, use_bonus=True))
    assert default_of(ForkArgs, "extra_bonus") == 0.0 and set(needs_table(ForkArgs)) >= {"extra_bonus", "lora_alpha"}


# ---- class 7: a model directory whose weights are only a pickle, refused before any model loads ----


@pytest.fixture(scope="module")
def tiny_rm(assets, tmp_path_factory):
    return make_reward_model(assets, tmp_path_factory.mktemp("rm"))


@pytest.fixture
def no_model_loads(monkeypatch, tiny_rm):
    """Any model load fails the test (a load would come before the check under test); the reward model is made first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize(
    "script, flag",
    [("ppo_rlhf", "--reward-model-path"), ("ppo_rlhf", "--prm-path"), ("grpo_math", "--teacher-model-path")],
)
def test_a_pickle_only_model_directory_is_refused_before_anything_loads(
    script, flag, assets, tiny_rm, tmp_path, no_model_loads
):
    from clean_rlhf_utils.runs import cli

    w = World(assets, tmp_path, tiny_rm)
    pickled = pickled_copy(assets / "models" / "tiny-llama" if flag == "--teacher-model-path" else tiny_rm, w, "pkl")
    extra = ["--advantage-estimator", "distill"] if flag == "--teacher-model-path" else []
    if script == "ppo_rlhf" and flag == "--reward-model-path":
        extra = ["--reward-source", "model"]
    argv = [*base_flags(script, w), *extra, flag, pickled]
    with pytest.raises(SystemExit) as e:
        MODULES[script].main(cli(MODULES[script].PRESETS, args=argv, prog=f"{script}.py"))
    assert str(e.value.code) == (
        f"error: {flag} {pickled} holds its weights only as a pickle (pytorch_model.bin), which this library does not "
        "load; save them as safetensors (transformers' default: `save_pretrained(dir)`) and pass that directory"
    )
    assert not (tmp_path / "runs" / "bad").exists()


def test_grpo_async_moves_the_ratio():
    """GRPO's --async samples with the weights a step behind: its ratio leaves 1 with one iteration and minibatch."""
    args = with_fields(tiny_preset("grpo_math"), **ONE_PASS, dual_clip=3.0)
    with pytest.raises(SystemExit, match="^error: --dual-clip 3.0 acts only with a ratio that can leave 1"):
        check_needs(args)
    check_needs(dataclasses.replace(args, async_generation=True))
