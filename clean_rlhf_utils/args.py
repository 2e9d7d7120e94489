"""The flags every script shares, declared once: the run directory, checkpoints and logging (`RunArgs`), how the
models load (`ModelArgs`) and the data (`DataArgs`). Each script's `Args` inherits the ones it uses
and lists its algorithm's own fields: every default that changes a training number (the optimizer's epsilon and
clipping, LoRA's rank and scale, the sampling temperature and length, the rewards' penalties, the schedule) is
the script's (issue 49).

A script redeclares a shared field whose default or documentation is its own (`dataset_name_or_path`
always: it has no default here); a redeclared field keeps the place of the shared one, so the flags, their
defaults and `config.json` are what the script declares. Each field's docstring is its `--help` text (tyro).

A numeric field declares the values it accepts in its docstring, in the fixed form `(range: > 0)` (also `>= 1`,
`< 1`, `<= 1`, `[0, 1]`, `[0, 0.5)`, `(0, 1]`; what follows a `;` inside the parentheses is said with the error, e.g.
`(range: >= 0; 0 is off)`), so `--help` shows it and `check_ranges` enforces every one of them before anything loads. A
script that redeclares a shared field without a range keeps the shared field's range."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import typing
from dataclasses import dataclass
from typing import Literal

from clean_rlhf_utils.data import template_fields
from clean_rlhf_utils.generation import require_vllm
from clean_rlhf_utils.runs import check_args
from clean_rlhf_utils.storage import check_not_pickled
from clean_rlhf_utils.tracking import check_parent, script_path


@dataclass
class RunArgs:
    """The run: its name and directory, checkpoints and resume, Weights & Biases, CPU threads, logging, the saved
    model (clean_rlhf_utils/runs.py)."""

    exp_name: str | None = None
    """name of this experiment; the run name starts with it; default: the script's file name and the preset,
    `<script>_<preset>` (a copy saved as `X.py` writes `runs/X_tiny-tldr__1`; the library's own scripts keep their
    names, `tracking.exp_name`)"""
    seed: int = 1
    """seed of the experiment (data order, sampling) (range: [0, 2147483647])"""
    run_name: str | None = None
    """name of the run directory under `output_dir`; default `{exp_name}__{seed}` (one that holds a run is refused:
    see `resume` and `overwrite`)"""
    output_dir: str = "runs"
    """where `runs/<run_name>/` (config.json, metrics.jsonl, samples.jsonl, checkpoint/, model/, done.json) goes"""
    save_every: int = 0
    """write a checkpoint every N updates; 0: only when stopped (SIGTERM, SIGINT, a non-finite loss) (range: >= 0)"""
    resume: bool = False
    """continue the run in `runs/<run_name>` from its checkpoint (run the same command with `--resume`)"""
    overwrite: bool = False
    """delete `runs/<run_name>` if it holds a run, and start over"""
    track: bool = False
    """log to Weights & Biases too (set WANDB_MODE=offline to log without network)"""
    wandb_project: str = "clean-rlhf"
    """wandb project name"""
    wandb_entity: str | None = None
    """wandb entity (team); None uses your default"""
    num_threads: int | None = None
    """CPU threads per process; default: the machine's cores divided by the number of processes (range: >= 1)"""
    log_every: int = 1
    """log training metrics every N updates (range: >= 1)"""
    save_model: bool = True
    """save the final policy and tokenizer to `runs/<run_name>/model` (safetensors)"""


@dataclass
class ModelArgs:
    """How the models and the tokenizer load (clean_rlhf_utils/loading.py)."""

    trust_remote_code: bool = False
    """allow custom modelling code from the hub; off unless you trust the repository"""
    add_pad_token: bool = False
    """add `[PAD]` when the tokenizer has no pad token or uses EOS as pad (N+ does this for Pythia; base Qwen2.5
    tokenizers set PAD = EOS)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the loaded weights; keep float32 and take bf16 from the accelerate config's mixed precision"""
    vllm_gpu_memory_utilization: float | None = None
    """(--use-vllm on a GPU) share of the GPU memory the engine may take, the rest for training; default 0.3
    (range: (0, 1])"""


@dataclass
class DataArgs:
    """Where the rows come from and how a prompt is built from them (clean_rlhf_utils/loading.py `load_split`,
    clean_rlhf_utils/data.py)."""

    dataset_name_or_path: str
    """a hub dataset, a `save_to_disk` folder, a folder of `{split}.jsonl|json|parquet` files, or one such file"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split to evaluate on"""
    prompt_template: str = "{query}"
    """Python format string building the prompt from a row's fields"""
    use_chat_template: bool = False
    """wrap the prompt as a user message with the tokenizer's chat template"""
    drop_overlong: bool = False
    """drop (and count) overlong prompts instead of failing"""


@dataclass
class RLArgs:
    """The plumbing fields that the RL scripts sampling from a policy (ppo_rlhf.py; rloo.py and remax.py declare the
    same) share with one default and one meaning: the SFT and reward models, the prompts and the evaluation. What
    changes a training number (the reward source, the response's length, temperature and non-EOS penalty, the
    learning-rate annealing) each script declares itself (issue 49). A script lists it first among its bases, so these
    override `DataArgs`' `dataset_name_or_path` and `train_split`."""

    sft_model_path: str = "vwxyzjn/EleutherAI_pythia-1b-deduped__sft__tldr"
    """the SFT model: initial policy and frozen reference (hub name or local directory)"""
    reward_model_path: str | None = "vwxyzjn/EleutherAI_pythia-1b-deduped__reward__tldr"
    """the outcome reward model (saved by reward_model.py); None with `reward_source=math`"""
    dataset_name_or_path: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    """prompts: hub dataset, `save_to_disk` folder, folder of `{split}.jsonl|json|parquet`, or one such file"""
    dataset_config: str | None = None
    """dataset configuration name on the hub (e.g. `main` for openai/gsm8k)"""
    train_split: str = "train"
    """split to sample prompts from"""
    max_prompt_length: int = 512
    """longest prompt in tokens (N+: 512); longer prompts are an error unless `drop_overlong` (range: >= 1)"""
    eval_task: Literal["none", "tldr", "gsm8k", "boxed"] = "none"
    """greedy evaluation: `tldr` gold judge + win rate (tiny world), `gsm8k` / `boxed` answer accuracy"""
    eval_every: int = 50
    """evaluate every N updates (and before the first and after the last) (range: >= 1)"""
    num_eval_examples: int = 200
    """evaluation prompts (range: >= 1)"""
    eval_kl: bool = False
    """also log `eval/kl`, KL(pi || pi_ref) of one response sampled at temperature 1 per evaluation prompt (the same
    estimator in every script: the benchmark's frontier plots gold reward against it); one more generation per eval"""
    per_device_eval_batch_size: int = 32
    """prompts per device at evaluation (range: >= 1)"""


# ---- flags that act only with another (issue 59): one table, checked by `runs.check_args` before anything loads ----


def ratio_moves(args) -> bool:
    """Whether the ratio pi / pi_old of an update can leave 1: a second pass (`num_ppo_epochs`, GRPO's
    `num_iterations`) or a second minibatch over a batch, or GRPO's `--async` (one step off-policy). With one of each,
    the only update starts from the policy that sampled, and the ratio is 1 (to the sampler's rounding): its clips
    never act."""
    passes = getattr(args, "num_ppo_epochs", getattr(args, "num_iterations", 1))
    return passes * args.num_mini_batches > 1 or getattr(args, "async_generation", False)


def kl_weight(args) -> float | None:
    """The weight of the KL term: `--kl-coef` (PPO, RLOO) or `--beta` (GRPO; None until its variant fills it in)."""
    return args.kl_coef if hasattr(args, "kl_coef") else getattr(args, "beta", None)


NEEDS: dict[str, tuple] = {
    # field -> (whether the run has what it acts with, that in words); applied wherever the field exists.
    # Given: the value differs from the field's default. A rule of one script only is that script's `Args.NEEDS`.
    "vllm_gpu_memory_utilization": (lambda a: getattr(a, "use_vllm", False), "--use-vllm"),
    "lora_alpha": (lambda a: a.lora_r is not None, "--lora-r (LoRA)"),
    "lora_target_modules": (lambda a: a.lora_r is not None, "--lora-r (LoRA)"),
    "generation_threads": (lambda a: a.async_generation, "--async"),
    "kl_clamp": (lambda a: kl_weight(a) != 0, "a KL term (--kl-coef or --beta above 0)"),
    "adaptive_kl": (lambda a: a.kl_coef > 0, "--kl-coef above 0 (the coefficient it adapts)"),
    "target_kl": (lambda a: a.adaptive_kl, "--adaptive-kl"),
    "kl_horizon": (lambda a: a.adaptive_kl, "--adaptive-kl"),
    "cliprange": (ratio_moves, "a ratio that can leave 1 (more than one epoch or minibatch per batch)"),
    "cliprange_value": (ratio_moves, "values that can leave the rollout's (more than one epoch or minibatch)"),
    "dual_clip": (ratio_moves, "a ratio that can leave 1 (more than one epoch, iteration or minibatch, or --async)"),
    "cliprange_high": (ratio_moves, "a ratio that can leave 1 (more than one epoch or minibatch per batch)"),
    "answer_format": (lambda a: getattr(a, "reward_source", "math") == "math", "--reward-source math"),
    "penalty_reward_value": (lambda a: a.non_eos_penalty, "--non-eos-penalty"),
    "prm_coef": (lambda a: a.prm_path is not None, "--prm-path (a process reward model)"),
    "prm_refine": (lambda a: a.prm_path is not None, "--prm-path (a process reward model)"),
    "prm_clip_eta": (
        lambda a: a.prm_path is not None and a.prm_refine in ("clip", "clip_delta"),
        "--prm-path and --prm-refine clip or clip_delta",
    ),
    "rm_coef": (lambda a: a.reward_model_path is not None, "--reward-model-path"),
    "sampler_correction_cap": (lambda a: a.sampler_correction != "none", "--sampler-correction other than none"),
    "max_sampling_rounds": (lambda a: a.dynamic_sampling is not False, "--dynamic-sampling"),
    "overlong_penalty_factor": (lambda a: a.overlong_buffer != 0, "--overlong-buffer above 0"),
}
"""The flags that act only with another, by field name: every script and fork that has the field gets its rule."""

GRPO_NEEDS: dict[str, tuple] = {
    # grpo_math.py's own rules (its `Args.NEEDS`, which a fork copies with it): --beta is None until `resolve_variant`
    # fills in the variant's default (the rule passes), then `check_grpo_args` checks them again
    "kl_estimator": (lambda a: kl_weight(a) != 0, "a KL loss term (--beta above 0)"),
    "log_ratio_clamp": (
        lambda a: ratio_moves(a) or kl_weight(a) != 0,
        "a ratio that can leave 1 (more than one iteration or minibatch, or --async) or a KL term (--beta above 0)",
    ),
}
"""grpo_math.py's flags that act only with another (`Args.NEEDS`). --kl-estimator picks the KL loss term's estimator:
beta 0 loads no reference, so there is no term (`objective/kl` logs k3 whatever it says). --log-ratio-clamp bounds the
log of pi / pi_old, which on policy is exactly 0 (`micro_batch_loss`: the old logprobs are the new ones detached), and
k3's log(pi_ref / pi), computed only with a reference (beta above 0). In ppo_rlhf.py, rloo.py and remax.py both act
on their own (tests/test_flag_needs.py INDEPENDENT_IN says why)."""


def needs_table(cls: type) -> dict[str, tuple]:
    """The rules that apply to a script's `Args`: the shared `NEEDS` of its fields, then its own (`Args.NEEDS`, a
    class attribute beside its fields, which a fork copies with the script), the class's own winning."""
    names = {f.name for f in dataclasses.fields(cls)}
    table = {name: rule for name, rule in NEEDS.items() if name in names}
    for klass in reversed(cls.__mro__):
        table.update(vars(klass).get("NEEDS", {}))
    return table


def flag_of(cls: type, name: str) -> str:
    """A field's command-line flag: `--x-y`, or the name its `tyro.conf.arg(name=...)` gives (`--async`)."""
    try:
        hint = typing.get_type_hints(cls, include_extras=True).get(name)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: the field's own name
        hint = None
    named = [m.name for m in getattr(hint, "__metadata__", ()) if isinstance(getattr(m, "name", None), str)]
    return "--" + (named[0] if named else name.replace("_", "-"))


def default_of(cls: type, name: str):
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def check_needs(args) -> None:
    """Every flag given (its value differs from the field's default) that acts only with another the run lacks
    (`needs_table`): one `error:` line; a `warning:` line on stderr instead where the value is one a preset of the
    script sets (`PRESETS` of the module that defines `Args`): a preset's flag carried into a variant chosen on the
    command line (`reward_model.py tiny-tldr --objective process` keeps the preset's `--confidence-field`). Checked
    again by a script whose defaults depend on its variant once they are filled in (grpo_math.py: `check_grpo_args`)."""
    cls = type(args)
    presets = getattr(sys.modules.get(cls.__module__), "PRESETS", {})
    for name, (has_partner, partner) in needs_table(cls).items():
        value = getattr(args, name)
        if value == default_of(cls, name) or has_partner(args):
            continue
        flag = flag_of(cls, name)
        if isinstance(value, bool):
            given = flag if value else "--no-" + flag[2:]
        else:
            words = " ".join(map(str, value)) if isinstance(value, list) else str(value)
            given = f"{flag} {words if words.isprintable() and words else repr(value)}"
        line = f"{given} acts only with {partner}, which this run lacks"
        if any(isinstance(p, tuple) and getattr(p[-1], name, None) == value for p in presets.values()):
            print(f"warning: {line}: the preset's value is ignored", file=sys.stderr)
            continue
        raise SystemExit(f"error: {line} (the flag would be ignored): drop it or add that")


def check_flags(args) -> None:
    """The checks of `runs.check_args` that read no data, before anything loads: a fork's PARENT line
    (`tracking.check_parent`), every field's range (`check_ranges`), the flags that act only with another
    (`check_needs`), model directories whose weights are only a pickle (`storage.check_not_pickled`: every
    `*model_path`, `*model_name_or_path` and `prm_path` field), and `--use-vllm`'s package (`generation.require_vllm`:
    VLLMSampler starts after the models, a minute or more later)."""
    check_parent(script_path(args))
    check_ranges(args)
    check_needs(args)
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if (f.name.endswith(("model_path", "model_name_or_path")) or f.name == "prm_path") and isinstance(value, str):
            check_not_pickled(value, "--" + f.name.replace("_", "-"))
    if getattr(args, "use_vllm", False):
        require_vllm()


# ---- the ranges of the numeric flags (`(range: ...)` in a field's docstring), checked by `runs.check_args` ----

RANGE = re.compile(r"\(range: (.+?)\)(?!\))")


@functools.cache
def field_ranges(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (range, note) of a dataclass and its bases, read from the docstrings in their source (as tyro
    reads `--help`); the most derived class that gives a field a range wins."""
    ranges: dict[str, tuple[str, str]] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # no source (an interactive class): only its bases' ranges
            continue
        for stmt, doc in zip(body, body[1:]):
            text = doc.value.value if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else None
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(text, str):
                if match := RANGE.search(text):
                    spec, _, note = match.group(1).partition(";")
                    ranges[stmt.target.id] = (spec.strip(), note.strip())
    return ranges


def in_range(value: float, spec: str) -> tuple[bool, str]:
    """Whether `value` is in `spec` (`> 0`, `>= 1`, `< 1`, `[0, 1]`, `[0, 0.5)`, ...), and the range in words."""
    if m := re.fullmatch(r"(>=|>|<=|<)\s*(\S+)", spec):
        op, bound = m.group(1), float(m.group(2))
        ok = {">": value > bound, ">=": value >= bound, "<": value < bound, "<=": value <= bound}[op]
        words = {">": "above", ">=": "at least", "<": "below", "<=": "at most"}[op]
        return ok, f"{words} {m.group(2)}"
    m = re.fullmatch(r"([\[(])\s*([^,]+?)\s*,\s*([^,]+?)\s*([\])])", spec)
    if m is None:
        raise ValueError(f"unreadable range {spec!r}")
    low, high = float(m.group(2)), float(m.group(3))
    ok = (low <= value if m.group(1) == "[" else low < value) and (value <= high if m.group(4) == "]" else value < high)
    return ok, f"in {spec}"


def check_ranges(args) -> None:
    """Every numeric field of `args` (its dataclass and the bases) inside its declared range: a one-line error naming
    the flag, the value and the range. None (a default filled in later) is not checked. First the settings under which
    nothing is learned (`check_extremes`)."""
    check_extremes(args)
    for name, (spec, note) in field_ranges(type(args)).items():
        value = getattr(args, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        ok, words = in_range(value, spec)
        if not ok:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"error: {flag} is {value}; it must be {words}" + (f" ({note})" if note else ""))
    check_templates(args)


def check_templates(args) -> None:
    """Every template flag (`--prompt-template`, `--reference-template`, ...) takes a row's fields by name only, checked
    before anything loads (`data.template_fields`): a format spec, conversion, index or attribute is one line."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name.endswith("_template") and isinstance(value, str):
            template_fields(value, "--" + f.name.replace("_", "-"))


# Settings that train nothing or only overflow (issue 51): refused by `check_args` with their own cause, not met later
# as a non-finite loss whose message says "lower --learning-rate".
MIN_TEMPERATURE = 0.01
"""the lowest sampling temperature: below it every sample is the greedy response (`check_extremes`)"""
MAX_KL_WEIGHT = 1e3
"""the largest --beta / --kl-coef: above it one nat of KL outweighs any reward 1000 times, and at 1e30 the loss
overflows"""


def check_extremes(args) -> None:
    """The settings under which nothing is learned, or that only overflow, refused with their own cause (issue 51)."""
    if getattr(args, "temperature", 1.0) < MIN_TEMPERATURE:
        raise SystemExit(
            f"error: --temperature is {args.temperature:g}; below {MIN_TEMPERATURE:g} sampling is greedy (a logit gap "
            "of 0.1 becomes 10 nats: the runner-up token is drawn with probability under 5e-5), so the two samples "
            "of a pair, the sample and its greedy baseline, and a group's samples are one response, and nothing is "
            f"learned; use a temperature of at least {MIN_TEMPERATURE:g} (0.7 to 1 is usual)"
        )
    for name in ("beta", "kl_coef"):  # an extreme one ends in a non-finite loss whose message blames the learning rate
        value = getattr(args, name, None)
        if isinstance(value, float) and value > MAX_KL_WEIGHT:
            raise SystemExit(
                f"error: --{name.replace('_', '-')} is {value:g}; a KL weight above {MAX_KL_WEIGHT:g} holds the policy "
                "at the reference (one nat of KL outweighs any reward) and overflows the loss; use at most "
                f"{MAX_KL_WEIGHT:g} (0.01 to 0.5 is usual)"
            )
    decay = getattr(args, "weight_decay", 0.0) or 0.0
    if decay * args.learning_rate >= 1:  # torch's AdamW multiplies every weight by 1 - lr x weight decay each step
        raise SystemExit(
            f"error: --weight-decay {decay:g} x --learning-rate {args.learning_rate:g} = "
            f"{decay * args.learning_rate:g}: AdamW multiplies every weight by 1 - (that product) each step, which "
            "zeroes or flips them; lower --weight-decay (0 to 0.1 is usual)"
        )


# ---- script-specific flag checks, before anything loads (`runs.check_args` checks the shared ones) ----


def check_ppo_args(args) -> None:
    """PPO's own flags, checked before anything loads (`check_args` checks the shared ones and every field's range): a
    one-line error."""
    if args.reward_source == "model" and args.reward_model_path is None:
        raise SystemExit("error: --reward-source model needs --reward-model-path (or --reward-source math)")


def check_dpo_args(args, sharded_weights: bool) -> None:
    """dpo.py's own flags, checked before anything loads (`check_args` checks those every script shares);
    `sharded_weights`: DeepSpeed ZeRO-3 or FSDP, which --async cannot copy into its generator thread."""
    if args.use_vllm and (args.mode != "online" or args.async_generation):
        raise SystemExit(
            "error: --use-vllm samples online DPO's pairs in the loop: not with --mode offline (nothing is sampled) "
            "nor with --async (a thread samples with a copy of the policy): drop one"
        )
    check_args(args, zero_means_none=("num_eval_examples", "num_eval_pairs"))  # 0 skips that evaluation; and the ranges
    if args.mode == "online" and args.judge == "rm" and not args.reward_model_path:
        raise SystemExit(
            "error: online DPO with --judge rm labels its pairs with a reward model: pass "
            "--reward-model-path (reward_model.py's output), or --judge gold on tiny-tldr"
        )
    if args.mode == "online" and args.async_generation and sharded_weights:
        raise SystemExit(
            "error: --async copies the policy's weights into a generator thread, but ZeRO-3 and FSDP shard them "
            "across processes; run online DPO under ZeRO-3 without --async (or use DDP or ZeRO-2)"
        )


def check_dpo_steps(args, total_steps: int, loader_batches: int, usable: int, batch_pairs: int) -> None:
    """dpo.py's data must make at least one optimizer step: online, the (endless) prompt loader at least one batch."""
    if args.mode == "online" and loader_batches == 0:  # the endless loader would never yield a batch
        raise SystemExit(
            f"error: split '{args.train_split}' of --prompt-dataset-name-or-path has {usable} usable "
            f"prompts, fewer than one step's {batch_pairs} (--per-device-train-batch-size x "
            "--gradient-accumulation-steps x processes)"
        )
    if total_steps == 0:
        raise SystemExit(f"error: the data makes no full batch of {batch_pairs} pairs (online: raise --total-episodes)")


def check_grpo_setup(accelerator, micro_steps: int, args, positions: int | None) -> None:
    """(grpo_math.py, once the policy is loaded) The engine's accumulation is GRPO's, and vLLM's context holds a
    prompt and a completion."""
    if accelerator.gradient_accumulation_steps != micro_steps:  # a DeepSpeed config that sets its own accumulation
        raise SystemExit(
            f"error: the accelerate/DeepSpeed config sets gradient_accumulation_steps "
            f"{accelerator.gradient_accumulation_steps}, but one optimizer step of GRPO takes "
            f"{micro_steps} backward passes (mini-batch / micro-batch); remove it from the config"
        )
    if args.use_vllm and positions and args.max_prompt_length + args.max_completion_length > positions:
        raise SystemExit(
            f"error: --use-vllm: --max-prompt-length {args.max_prompt_length} + --max-completion-length "
            f"{args.max_completion_length} exceed the {positions} positions of {args.model_name_or_path}, "
            "which vLLM refuses as its max_model_len; lower --max-prompt-length"
        )


def check_grpo_args(args, synced: bool) -> None:
    """grpo_math.py's own flags, once `resolve_variant` has filled the variant's defaults: the variants that exclude
    each other, the group and batch arithmetic, and what --async and --use-vllm cannot run under (`synced`: ZeRO-3 or
    FSDP)."""
    if args.loss_type == "cispo" and args.importance_sampling_level == "sequence":
        raise SystemExit(
            "error: --loss-type cispo weights each token; --importance-sampling-level sequence is GSPO's "
            "clipped sequence ratio: pick one"
        )
    if args.loss_type == "cispo" and args.dual_clip is not None:
        raise SystemExit(
            "error: --dual-clip bounds PPO's clipped surrogate; --loss-type cispo has none (its weights are capped at "
            "1 + --epsilon-high): drop one"
        )
    if (args.advantage_estimator == "distill") != bool(args.teacher_model_path):
        raise SystemExit(
            "error: on-policy distillation takes both --advantage-estimator distill and "
            "--teacher-model-path (the teacher that scores the student's tokens)"
        )
    if args.num_generations < 2:
        raise SystemExit(
            f"error: --num-generations is {args.num_generations}; it must be at least 2: advantages are "
            "relative to the group"
        )
    if args.questions_per_device < 1:
        raise SystemExit(f"error: --questions-per-device is {args.questions_per_device}; it must be at least 1")
    if args.overlong_buffer >= args.max_completion_length:
        raise SystemExit(
            f"error: --overlong-buffer {args.overlong_buffer} must be smaller than "
            f"--max-completion-length {args.max_completion_length}"
        )
    if (args.questions_per_device * args.num_generations) % args.num_mini_batches:
        raise SystemExit(
            f"error: --questions-per-device {args.questions_per_device} x --num-generations "
            f"{args.num_generations} = {args.questions_per_device * args.num_generations} completions per "
            f"process do not split into --num-mini-batches {args.num_mini_batches} equal mini-batches; "
            "change one of them"
        )
    for flag, value, least in (
        ("--warmup-steps", args.warmup_steps, 0),
        ("--pass-k", args.pass_k, 0),
        ("--max-sampling-rounds", args.max_sampling_rounds, 1),
    ):
        if value < least:
            raise SystemExit(f"error: {flag} is {value}; it must be at least {least}")
    if args.async_generation and (synced or args.use_vllm):
        raise SystemExit(
            "error: --async samples with a copy of the policy in a thread of its own: not under ZeRO-3 or FSDP "
            "(sharded weights) nor with --use-vllm"
        )
    if args.use_vllm and synced:
        raise SystemExit(
            "error: --use-vllm loads the policy's full weights into vLLM, which ZeRO-3 and FSDP shard across "
            "processes; use DDP or ZeRO-2 with vLLM"
        )
    check_needs(args)  # again, now that the variant's defaults (--beta, --dynamic-sampling, ...) are filled in
