"""Bad input, tried as a new user would: each case names what is wrong, the scripts it applies to, and what the one-line
error must say. `tests/test_bad_inputs.py` runs every case against every script it applies to; the per-script cases live
in `tests/bad_inputs_<script>.py` (a `CASES` list). `python -m tests.bad_inputs` runs them all and writes the table of
cases and messages to docs/bad_inputs.md."""

from __future__ import annotations

import importlib
import io
import json
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ["sft", "reward_model", "ppo_rlhf", "rloo", "remax", "grpo_math", "dpo"]


@dataclass
class World:
    """Where a case runs: the tiny assets, a scratch directory, and a reward model in reward_model.py's format."""

    assets: Path
    tmp: Path
    rm: Path


@dataclass
class BadInput:
    id: str
    """short name, the test id"""
    what: str
    """the bad input in words, for the docs table"""
    expect: str
    """a substring the error line must hold (the flag, file, row or field it names)"""
    flags: Callable[[str, World], list[str]] = lambda script, w: []
    """extra command-line flags, given the script and the world (they may write a bad file into `w.tmp`)"""
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    """the scripts it applies to"""
    preset: bool = True
    """False: the command line without its preset (the first argument)"""


# A small valid run of each script on the tiny world: every case adds its bad input to this.
def base_flags(script: str, w: World) -> list[str]:
    a, out = w.assets, ["--output-dir", str(w.tmp / "runs"), "--num-threads", "1", "--run-name", "bad"]
    math_rl = [
        "tiny-math",
        "--sft-model-path",
        str(a / "models" / "tiny-llama"),
        "--dataset-name-or-path",
        str(a / "tiny-math" / "gsm8k"),
        "--response-length",
        "12",
        "--num-eval-examples",
        "4",
        "--total-episodes",
        "16",
    ]
    return {
        "sft": [
            "tiny-tldr",
            "--model-name-or-path",
            str(a / "models" / "tiny-neox"),
            "--dataset-name-or-path",
            str(a / "tiny-tldr" / "sft"),
            "--max-train-samples",
            "16",
            "--per-device-train-batch-size",
            "8",
            "--num-eval-examples",
            "4",
        ],
        "reward_model": [
            "tiny-tldr",
            "--sft-model-path",
            str(a / "models" / "tiny-neox"),
            "--dataset-name-or-path",
            str(a / "tiny-tldr" / "preference"),
            "--norm-dataset-name-or-path",
            str(a / "tiny-tldr" / "sft"),
            "--max-train-samples",
            "16",
            "--per-device-train-batch-size",
            "8",
            "--num-eval-examples",
            "8",
            "--num-norm-examples",
            "16",
        ],
        "ppo_rlhf": [*math_rl, "--per-device-batch-size", "8", "--num-mini-batches", "2"],
        "rloo": [*math_rl, "--per-device-batch-size", "8", "--rloo-k", "4"],
        "remax": [*math_rl, "--per-device-batch-size", "4"],
        "grpo_math": [
            "tiny",
            "--model-name-or-path",
            str(a / "models" / "tiny-llama"),
            "--dataset-name-or-path",
            str(a / "tiny-math" / "gsm8k"),
            "--num-eval-examples",
            "4",
        ],
        "dpo": [
            "tiny-tldr",
            "--sft-model-path",
            str(a / "models" / "tiny-neox"),
            "--dataset-name-or-path",
            str(a / "tiny-tldr" / "preference"),
            "--prompt-dataset-name-or-path",
            str(a / "tiny-tldr" / "sft"),
            "--max-train-samples",
            "16",
        ],
    }[script] + out


TRAIN_DATA = {
    "sft": ("--dataset-name-or-path", "tiny-tldr/sft"),
    "reward_model": ("--dataset-name-or-path", "tiny-tldr/preference"),
    "ppo_rlhf": ("--dataset-name-or-path", "tiny-math/gsm8k"),
    "rloo": ("--dataset-name-or-path", "tiny-math/gsm8k"),
    "remax": ("--dataset-name-or-path", "tiny-math/gsm8k"),
    "grpo_math": ("--dataset-name-or-path", "tiny-math/gsm8k"),
    "dpo": ("--dataset-name-or-path", "tiny-tldr/preference"),
}
BATCH = {
    "sft": "--per-device-train-batch-size",
    "reward_model": "--per-device-train-batch-size",
    "dpo": "--per-device-train-batch-size",
    "grpo_math": "--micro-batch-size",
    "ppo_rlhf": "--per-device-batch-size",
    "rloo": "--per-device-batch-size",
    "remax": "--per-device-batch-size",
}


def bad_copy(script: str, w: World, edit: Callable[[str], str], split: str = "train") -> list[str]:
    """The script's training data with `split`.jsonl rewritten by `edit` (the whole text in, the new text out)."""
    flag, rel = TRAIN_DATA[script]
    src, dst = w.assets / rel, w.tmp / "data" / rel
    if not dst.exists():
        shutil.copytree(src, dst)
    (dst / f"{split}.jsonl").write_text(edit((src / f"{split}.jsonl").read_text()))
    return [flag, str(dst)]


def bad_file(script: str, w: World, name: str, write: Callable[[list[dict]], str]) -> list[str]:
    """The script's training rows written by `write` (the rows in, the file's text out) into one file `name`, given as
    its training data (one file is one split: a script that also evaluates on it is refused, `one-file-two-splits`;
    the cases that use it fail on its first read)."""
    flag, rel = TRAIN_DATA[script]
    rows = [json.loads(line) for line in (w.assets / rel / "train.jsonl").read_text().splitlines() if line.strip()]
    path = w.tmp / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(write(rows))
    return [flag, str(path)]


def pipe_data(script: str, w: World) -> list[str]:
    """A named pipe where the script's training data goes (nothing ever writes to it)."""
    import os

    flag, _ = TRAIN_DATA[script]
    path = w.tmp / "data" / "rows.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return [flag, str(path)]


def split_in_two_forms(script: str, w: World) -> list[str]:
    """A copy of the script's training data with its train.jsonl also saved as train.parquet beside it."""
    import pyarrow.json
    import pyarrow.parquet

    flag, rel = TRAIN_DATA[script]
    dst = w.tmp / "data" / rel
    shutil.copytree(w.assets / rel, dst)
    pyarrow.parquet.write_table(pyarrow.json.read_json(dst / "train.jsonl"), dst / "train.parquet")
    return [flag, str(dst)]


def as_csv(rows: list[dict]) -> str:
    import csv

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def key_twice(rows: list[dict]) -> str:
    """JSON Lines whose first row gives its first key twice (json.dumps cannot write that)."""
    first = json.dumps(rows[0])
    key = next(iter(rows[0]))
    return "\n".join(["{" + json.dumps(key) + ': "x", ' + first[1:], *map(json.dumps, rows[1:])]) + "\n"


def rows_edited(edit_row: Callable[[dict], dict]) -> Callable[[str], str]:
    """An `edit` for `bad_copy` that rewrites the first row only (the error must name row 0)."""

    def edit(text: str) -> str:
        lines = text.splitlines()
        return "\n".join([json.dumps(edit_row(json.loads(lines[0]))), *lines[1:]]) + "\n"

    return edit


POLICY = {s: ("--model-name-or-path" if s in ("sft", "grpo_math") else "--sft-model-path") for s in SCRIPTS}
MODEL = {s: ("tiny-neox" if s in ("sft", "reward_model", "dpo") else "tiny-llama") for s in SCRIPTS}


def foreign_tokenizer(script: str, w: World) -> list[str]:
    """The script's model with a tokenizer of 300 more tokens than its embedding has rows (another model's)."""
    from transformers import AutoTokenizer

    src, dst = w.assets / "models" / MODEL[script], w.tmp / "foreign"
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens([f"word{i}" for i in range(300)])
    tok.save_pretrained(dst)
    return [POLICY[script], str(dst)]


def broken_model(script: str, w: World, how: str) -> list[str]:
    """The script's model as a killed save or copy leaves it: `truncated`, its model.safetensors cut to half;
    `no-config`, without config.json; `bad-config`, with a config.json that is not JSON."""
    dst = w.tmp / f"model-{how}"
    shutil.copytree(w.assets / "models" / MODEL[script], dst)
    if how == "truncated":
        weights = dst / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "bad-config":
        config = dst / "config.json"
        config.write_text(config.read_text().replace('"', "'", 2))  # the first key in single quotes: not JSON
    else:
        (dst / "config.json").unlink()
    return [POLICY[script], str(dst)]


def mismatched_model(script: str, w: World, how: str) -> list[str]:
    """The script's model whose weights do not match its config: `missing`, its model.safetensors without layer 1's
    attention weights; `vocab` and `hidden`, its config.json's vocab_size grown by 64 or hidden_size doubled."""
    from safetensors.torch import load_file, save_file

    dst = w.tmp / f"model-{how}"
    shutil.copytree(w.assets / "models" / MODEL[script], dst)
    if how == "missing":
        tensors = load_file(dst / "model.safetensors")
        kept = {k: v for k, v in tensors.items() if not (".layers.1." in k and "att" in k)}
        assert len(kept) < len(tensors)
        save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    else:
        config = json.loads((dst / "config.json").read_text())
        key, grow = ("vocab_size", 64) if how == "vocab" else ("hidden_size", config["hidden_size"])
        config[key] += grow
        (dst / "config.json").write_text(json.dumps(config))
    return [POLICY[script], str(dst)]


def a_file(path: Path) -> Path:
    path.write_text("")
    return path


def one_dataset(script: str, w: World) -> list[str]:
    """The script's training rows as one `save_to_disk` Dataset (not a DatasetDict): no evaluation split of its own."""
    from datasets import load_dataset

    flag, rel = TRAIN_DATA[script]
    load_dataset("json", data_files=str(w.assets / rel / "train.jsonl"), split="train").save_to_disk(w.tmp / "one")
    return [flag, str(w.tmp / "one")]


def has_flag(script: str, flag: str) -> bool:
    import dataclasses

    module = importlib.import_module(script)
    return flag.lstrip("-").replace("-", "_") in {f.name for f in dataclasses.fields(module.Args)}


def scripts_with(flag: str) -> list[str]:
    return [s for s in SCRIPTS if has_flag(s, flag)]


def chat_template_model(script: str, w: World, template: str, name: str) -> list[str]:
    """The script's model with `template` as its tokenizer's chat template, and `--use-chat-template`."""
    from transformers import AutoTokenizer

    dst = w.tmp / name
    shutil.copytree(w.assets / "models" / MODEL[script], dst)
    tokenizer = AutoTokenizer.from_pretrained(dst)
    tokenizer.chat_template = template
    for old in ("chat_template.jinja", "chat_template.json"):
        (dst / old).unlink(missing_ok=True)
    tokenizer.save_pretrained(dst)
    return [POLICY[script], str(dst), "--use-chat-template"]


def gold_answer(answer: str) -> Callable[[str, World], list[str]]:
    """The math training data with the first row's GSM8K answer `answer` (a worked line, then the final answer)."""
    return lambda s, w: bad_copy(s, w, rows_edited(lambda row: {**row, "answer": f"3 + 4 = 7\n{answer}"}))


MATH_SCRIPTS = ["ppo_rlhf", "rloo", "remax", "grpo_math"]


def pickled_copy(src: Path, w: World, name: str) -> str:
    """A copy of the model directory `src` whose weights are only a pickle, `pytorch_model.bin` (torch.save's format:
    transformers would load it), no safetensors."""
    from safetensors.torch import load_file

    dst = w.tmp / name
    if not dst.exists():
        shutil.copytree(src, dst)
        for file in dst.glob("*.safetensors"):
            torch.save(load_file(file), dst / "pytorch_model.bin")
            file.unlink()
    return str(dst)


def kl_off(script: str) -> list[str]:
    return ["--beta", "0"] if script == "grpo_math" else ["--kl-coef", "0"]


ONE_PASS = {  # one pass over one minibatch: the update starts from the sampling policy, its ratio is 1
    "ppo_rlhf": ["--num-ppo-epochs", "1", "--num-mini-batches", "1"],
    "rloo": [],
    "grpo_math": ["--num-mini-batches", "1"],
}


CASES = [
    BadInput("batch-size-0", "a batch size of 0", "at least 1", lambda s, w: [BATCH[s], "0"]),
    BadInput("batch-size-negative", "a negative batch size", "at least 1", lambda s, w: [BATCH[s], "-4"]),
    BadInput(
        "accumulation-0",
        "--gradient-accumulation-steps 0",
        "--gradient-accumulation-steps",
        lambda s, w: ["--gradient-accumulation-steps", "0"],
        scripts_with("--gradient-accumulation-steps"),
    ),
    BadInput(
        "eval-every-0",
        "--eval-every 0",
        "--eval-every",
        lambda s, w: ["--eval-every", "0"],
        scripts_with("--eval-every"),
    ),
    BadInput("lr-nan", "--learning-rate nan", "--learning-rate", lambda s, w: ["--learning-rate", "nan"]),
    BadInput("lr-0", "--learning-rate 0", "--learning-rate", lambda s, w: ["--learning-rate", "0"]),
    BadInput(
        "max-train-samples-0",
        "--max-train-samples 0 (was taken as: all rows)",
        "--max-train-samples",
        lambda s, w: ["--max-train-samples", "0"],
        scripts_with("--max-train-samples"),
    ),
    BadInput(
        "warmup-negative",
        "a negative warm-up ratio",
        "--warmup-ratio",
        lambda s, w: ["--warmup-ratio", "-0.1"],
        scripts_with("--warmup-ratio"),
    ),
    BadInput(
        "temperature-0",
        "temperature 0 where the algorithm samples",
        "--temperature",
        lambda s, w: ["--temperature", "0"],
        scripts_with("--temperature"),
    ),
    BadInput(
        "temperature-greedy",
        "`--temperature 1e-9`: greedy sampling, identical samples (was: trained on nothing, exit 0)",
        "--temperature is 1e-09; below 0.01 sampling is greedy",
        lambda s, w: ["--temperature", "1e-9"],
        scripts_with("--temperature"),
    ),
    BadInput(
        "kl-weight-huge",
        "`--beta 1e30` / `--kl-coef 1e30` (was: non-finite loss, 'lower --learning-rate')",
        "is 1e+30; a KL weight above 1000 holds the policy at the reference",
        lambda s, w: ["--kl-coef" if has_flag(s, "--kl-coef") else "--beta", "1e30"],
        sorted(set(scripts_with("--kl-coef")) | set(scripts_with("--beta")), key=SCRIPTS.index),
    ),
    BadInput(
        "weight-decay-huge",
        "`--weight-decay 1e6` (was: non-finite loss, 'lower --learning-rate')",
        "--weight-decay 1e+06 x --learning-rate",
        lambda s, w: ["--weight-decay", "1e6"],
        scripts_with("--weight-decay"),
    ),
    BadInput("save-every-negative", "--save-every -1", "--save-every", lambda s, w: ["--save-every", "-1"]),
    # ---- the declared ranges of the numeric flags (`(range: ...)` in the docstrings, clean_rlhf_utils/args.py) ----
    BadInput(
        "max-grad-norm-negative",
        "`--max-grad-norm -1` (was: gradient ascent)",
        "--max-grad-norm is -1.0; it must be above 0",
        lambda s, w: ["--max-grad-norm", "-1"],
    ),
    BadInput(
        "max-grad-norm-0",
        "`--max-grad-norm 0` (was: no learning)",
        "--max-grad-norm is 0.0; it must be above 0",
        lambda s, w: ["--max-grad-norm", "0"],
    ),
    BadInput(
        "adam-eps-negative",
        "a negative `--adam-eps` (was: a traceback)",
        "--adam-eps is -1.0",
        lambda s, w: ["--adam-eps", "-1"],
    ),
    BadInput(
        "weight-decay-negative",
        "a negative `--weight-decay` (was: a traceback)",
        "--weight-decay is -0.1",
        lambda s, w: ["--weight-decay", "-0.1"],
        scripts_with("--weight-decay"),
    ),
    BadInput(
        "dual-clip-1",
        "`--dual-clip 1` (dual-clip PPO bounds ratios above 1, issue 52)",
        "--dual-clip is 1.0; it must be above 1",
        lambda s, w: ["--dual-clip", "1"],
        scripts_with("--dual-clip"),
    ),
    BadInput(
        "kl-clamp-0",
        "`--kl-clamp 0` (would zero every KL estimate, issue 52)",
        "--kl-clamp is 0.0; it must be above 0",
        lambda s, w: ["--kl-clamp", "0"],
        scripts_with("--kl-clamp"),
    ),
    BadInput(
        "entropy-coef-negative",
        "a negative `--entropy-coef` (an entropy penalty, issue 52)",
        "--entropy-coef is -0.01; it must be at least 0",
        lambda s, w: ["--entropy-coef", "-0.01"],
        scripts_with("--entropy-coef"),
    ),
    BadInput("seed-negative", "`--seed -1` (was: a traceback)", "--seed is -1", lambda s, w: ["--seed", "-1"]),
    BadInput(
        "seed-huge",
        "`--seed 2**70` (was: a traceback)",
        f"--seed is {2**70}; it must be in [0, 2147483647]",
        lambda s, w: ["--seed", str(2**70)],
    ),
    # ---- the kind of each model a run loads ----
    BadInput(
        "policy-is-reward-model",
        "a reward model (sequence classifier) as the policy (was: trained with a random LM head)",
        "is a GPTNeoXForSequenceClassification (a reward model), not a causal LM",
        lambda s, w: [POLICY[s], str(w.rm)],
        [s for s in SCRIPTS if s != "reward_model"],  # reward_model.py may start from a reward model
    ),
    BadInput(
        "rm-is-causal-lm",
        "a causal LM as the reward model (was: a warning, then rewards from a random head)",
        "is not a reward model: it is a",
        lambda s, w: [
            *(["--reward-source", "model"] if s != "dpo" else []),
            "--reward-model-path",
            str(w.assets / "models" / MODEL[s]),
        ],
        ["rloo", "remax", "dpo"],  # ppo_rlhf.py: its own `reward-model-is-causal-lm`
    ),
    BadInput(
        "foreign-tokenizer",
        "a tokenizer larger than the model's embedding (was: the embedding grown with random rows)",
        "is not the model's own tokenizer",
        foreign_tokenizer,
    ),
    BadInput(
        "one-saved-dataset",
        "one `save_to_disk` Dataset as the data (was: evaluated on its own training rows)",
        "no split '",
        one_dataset,
    ),
    BadInput(
        "float16-on-cpu",
        "`--dtype float16` without a GPU (was: a diverging run)",
        "--dtype float16 needs a GPU",
        lambda s, w: ["--dtype", "float16"],
        [] if torch.cuda.is_available() else list(SCRIPTS),  # a GPU runs float16
    ),
    BadInput(
        "num-threads-negative",
        "`--num-threads -1` (was: a traceback)",
        "--num-threads is -1",
        lambda s, w: ["--num-threads", "-1"],
    ),
    BadInput(
        "resume-and-overwrite",
        "--resume with --overwrite",
        "pass one of them",
        lambda s, w: ["--resume", "--overwrite"],
    ),
    BadInput(
        "resume-nothing",
        "--resume where no run was checkpointed",
        "holds no complete checkpoint",
        lambda s, w: ["--resume"],
    ),
    BadInput("empty-file", "an empty training file", "is empty", lambda s, w: bad_copy(s, w, lambda text: "")),
    BadInput(
        "lone-surrogate",
        "a training row whose text holds half of a UTF-16 surrogate pair (was: 'check the file is complete', no row)",
        "line 1 holds a lone UTF-16 surrogate \\ud83d",
        lambda s, w: bad_copy(
            s, w, rows_edited(lambda row: {**row, next(iter(row)): str(row[next(iter(row))]) + "\ud83d"})
        ),
    ),
    BadInput(
        "truncated-file",
        "a training file cut off mid-row",
        "is not a JSON object",
        lambda s, w: bad_copy(s, w, lambda text: text[: len(text) // 2]),
    ),
    BadInput(
        "jsonl-array",
        "a JSON array of rows saved as .jsonl",
        "line 1 is a JSON array, not one object per line; save one JSON object per line (JSON Lines",
        lambda s, w: bad_file(s, w, "rows.jsonl", json.dumps),
    ),
    BadInput(
        "json-columns",
        'a .json of columns, {"query": [...], ...}, not rows',
        "holds one JSON object of columns",
        lambda s, w: bad_file(
            s, w, "columns.json", lambda rows: json.dumps({k: [r[k] for r in rows] for k in rows[0]})
        ),
    ),
    BadInput(
        "csv-file", "a CSV file", "is a CSV file, which is not read", lambda s, w: bad_file(s, w, "rows.csv", as_csv)
    ),
    BadInput(
        "csv-as-jsonl",
        "CSV text in a .jsonl file",
        "line 1 looks like CSV",
        lambda s, w: bad_file(s, w, "rows.jsonl", as_csv),
    ),
    BadInput(
        "key-twice",
        "a row that gives a key twice",
        "line 1 gives the key",
        lambda s, w: bad_file(s, w, "rows.jsonl", key_twice),
    ),
    BadInput(
        "one-file-two-splits",
        "the training rows as one .jsonl file, which served as the evaluation split too (was: evaluated on its own "
        "training rows, no word)",
        "rows.jsonl is one file, read as split '",
        lambda s, w: bad_file(s, w, "rows.jsonl", lambda rows: "".join(json.dumps(r) + "\n" for r in rows)),
    ),
    BadInput(
        "data-pipe",
        "a named pipe (FIFO; bash's `<(zcat rows.jsonl.gz)`) as the data (was: 'no such file or directory')",
        "is a named pipe (FIFO), not a regular file or folder",
        lambda s, w: pipe_data(s, w),
    ),
    BadInput(
        "split-in-two-forms",
        "a data folder holding train.jsonl and train.parquet (was: the .jsonl read, silently)",
        "holds split 'train' in 2 forms (train.jsonl, train.parquet)",
        lambda s, w: split_in_two_forms(s, w),
    ),
    BadInput(
        "no-preset",
        "flags without the preset first (`python X.py --output-dir runs`)",
        "needs a preset first: python",
        preset=False,
    ),
    BadInput(
        "missing-data",
        "a data path that does not exist (and is no reachable hub name)",
        "--dataset-name-or-path",
        lambda s, w: ["--dataset-name-or-path", str(w.tmp / "nowhere")],
    ),
    # ---- storage faults: what a killed save or copy leaves, and an output directory that cannot be written ----
    BadInput(
        "model-truncated",
        "the policy's model.safetensors cut short, as a killed copy leaves it (was: a traceback)",
        "model.safetensors is not a whole safetensors file",
        lambda s, w: broken_model(s, w, "truncated"),
    ),
    BadInput(
        "model-no-config",
        "the policy's directory without config.json (was: a traceback)",
        "holds no config.json",
        lambda s, w: broken_model(s, w, "no-config"),
    ),
    BadInput(
        "model-config-not-json",
        "the policy's config.json not valid JSON (was: reported as a tokenizer problem)",
        "config.json is not valid JSON (line 2 column 3): Expecting property name enclosed in double quotes",
        lambda s, w: broken_model(s, w, "bad-config"),
    ),
    BadInput(
        "model-path-is-file",
        "the policy's path names its config.json, a file (was: no such file or directory)",
        "config.json is a file, not a model directory",
        lambda s, w: [POLICY[s], str(w.assets / "models" / MODEL[s] / "config.json")],
    ),
    BadInput(
        "model-missing-tensors",
        "the policy's model.safetensors without layer 1's attention weights (was: trained with random weights there)",
        "its weights do not match the",
        lambda s, w: mismatched_model(s, w, "missing"),
    ),
    BadInput(
        "model-vocab-mismatch",
        "the policy's config.json with a vocab_size 64 larger than its weights' (was: a size-mismatch traceback)",
        "its weights do not match the",
        lambda s, w: mismatched_model(s, w, "vocab"),
    ),
    BadInput(
        "model-hidden-size-mismatch",
        "the policy's config.json with hidden_size doubled (was: a size-mismatch traceback)",
        "its weights do not match the",
        lambda s, w: mismatched_model(s, w, "hidden"),
    ),
    BadInput(
        "output-dir-file",
        "`--output-dir` naming a file (was: a traceback after all the loading)",
        "is a file, not a directory",
        lambda s, w: ["--output-dir", str(a_file(w.tmp / "a-file"))],
    ),
    BadInput(
        "output-dir-unwritable",
        "`--output-dir` where this user cannot write (/sys; was: a traceback after all the loading)",
        "cannot be written",
        lambda s, w: ["--output-dir", "/sys/clean-rlhf-runs"],
    ),
    BadInput(
        "lora-r-beyond-model",
        "`--lora-r 100000` on layers 64-192 wide (was: accepted, 500 times slower)",
        "is above the size of a layer it adapts",
        lambda s, w: ["--lora-r", "100000"],
        scripts=scripts_with("--lora-r"),
    ),
    BadInput(
        "run-name-dot",
        "`--run-name . --overwrite` (was: the whole --output-dir deleted, other runs in it included, exit 0)",
        "not a plain directory name",
        lambda s, w: ["--run-name", ".", "--overwrite"],
    ),
    BadInput(
        "run-name-dotdot",
        "`--run-name .. --overwrite` (was: the parent of --output-dir deleted)",
        "not a plain directory name",
        lambda s, w: ["--run-name", "..", "--overwrite"],
    ),
    BadInput(
        "run-name-slash",
        "`--run-name a/b` (a directory elsewhere than --output-dir/NAME)",
        "not a plain directory name",
        lambda s, w: ["--run-name", "sub/bad"],
    ),
    BadInput(
        "run-name-too-long",
        "a 300-character `--run-name` (was: a traceback after all the loading)",
        "bytes long",
        lambda s, w: ["--run-name", "x" * 300],
    ),
    BadInput(
        "run-dir-symlink",
        "a run directory that is a symbolic link, with --overwrite (was: two names ran into one directory at once; a "
        "traceback on --overwrite)",
        "is a symbolic link",
        lambda s, w: ["--run-name", "link", "--overwrite", *symlinked_run_dir(w)],
    ),
    # ---- --overwrite deletes only a run of this library; --resume only this run's checkpoint (issue 59, 1 and 5) ----
    BadInput(
        "overwrite-foreign-dir",
        "`--overwrite` of a run directory holding a user's notes.txt and data/ (was: deleted with it)",
        "which is not a run of this library: it holds data/, notes.txt",
        lambda s, w: ["--overwrite", *run_dir_with(w, {"notes.txt": "mine", "data/x.csv": "1,2"})],
    ),
    BadInput(
        "overwrite-run-with-foreign-file",
        "`--overwrite` of a finished run into which a user saved best.safetensors (was: deleted with it)",
        "it holds best.safetensors",
        lambda s, w: ["--overwrite", *run_dir_with(w, {**FINISHED, "best.safetensors": "weights"})],
    ),
    BadInput(
        "overwrite-model-dir",
        "`--overwrite` with `--run-name` naming a model directory (was: the model deleted)",
        "it holds chat_template.jinja, config.json (not a run's arguments), generation_config.json",
        lambda s, w: ["--run-name", "model", "--overwrite", *model_as_run_dir(s, w)],
    ),
    BadInput(
        "overwrite-foreign-previous",
        "`--overwrite` of a finished run whose `.NAME.previous` beside it holds a user's folder (was: deleted)",
        ".bad.previous, which is not a run of this library: it holds notes.txt",
        lambda s, w: ["--overwrite", *run_dir_with(w, {**FINISHED, "../.bad.previous/notes.txt": "mine"})],
    ),
    BadInput(
        "resume-config-dir",
        "`--resume` of a run whose config.json is a directory (was: 'config.json is missing or unreadable')",
        "config.json is a directory where the run writes a file",
        lambda s, w: ["--resume", *run_dir_with(w, {"samples.jsonl": "", "config.json/x": "", **A_CHECKPOINT})],
    ),
    BadInput(
        "resume-done-dir",
        "`--resume` of a run whose done.json is a directory (was: 'finished its run')",
        "done.json is a directory where the run writes a file",
        lambda s, w: ["--resume", *run_dir_with(w, {**A_RUN, "done.json/x": "", **A_CHECKPOINT})],
    ),
    BadInput(
        "resume-samples-not-utf8",
        "`--resume` of a run whose samples.jsonl is not UTF-8 (was: a UnicodeDecodeError traceback)",
        "samples.jsonl cannot be read as the run wrote it",
        lambda s, w: ["--resume", *run_dir_with(w, {**A_RUN, "samples.jsonl": b"\xff\xfe", **A_CHECKPOINT})],
    ),
    BadInput(
        "resume-provenance-not-json",
        "`--resume` of a run whose provenance.json is not JSON (was: a JSONDecodeError traceback after the loading)",
        "provenance.json cannot be read as the run wrote it",
        lambda s, w: ["--resume", *run_dir_with(w, {**A_RUN, "provenance.json": "{", **A_CHECKPOINT})],
    ),
    BadInput(
        "resume-checkpoint-a-file",
        "`--resume` of a run whose checkpoint is a file (was: 'holds no complete checkpoint')",
        "checkpoint is a file where the run writes a directory",
        lambda s, w: ["--resume", *run_dir_with(w, {**A_RUN, "checkpoint": "x"})],
    ),
    BadInput(
        "resume-state-json-dir",
        "`--resume` of a run whose checkpoint/state.json is a directory (was: 'its state.json is missing, empty or "
        "torn')",
        "its state.json is a directory",
        lambda s, w: ["--resume", *run_dir_with(w, {**A_RUN, "checkpoint/state.json/x": ""})],
    ),
    BadInput(
        "resume-checkpoint-of-another-run",
        "`--resume` of a run whose checkpoint was copied from run `other` of seed 7 (was: a real copy resumed, "
        "continuing that run as this one)",
        "was written by another run (--run-name other, --seed 7), not by this one (--run-name bad, --seed",
        lambda s, w: ["--resume", *checkpoint_of_another_run(w)],
    ),
    # ---- templates take fields by name only; chat templates render every prompt (issue 51 item 6) ----
    BadInput(
        "template-format-spec",
        "`--prompt-template '{query:.5}'` (was: every prompt cut to 5 characters)",
        "{query} has ':.5' (a format spec)",
        lambda s, w: ["--prompt-template", "{query:.5}"],
        scripts_with("--prompt-template"),
    ),
    BadInput(
        "template-index",
        "`--prompt-template '{query[0]}'` (was: every prompt its first character)",
        "{query} has '[0]' (an index or attribute)",
        lambda s, w: ["--prompt-template", "{query[0]}"],
        scripts_with("--prompt-template"),
    ),
    BadInput(
        "template-attribute",
        "`--prompt-template '{query.__class__}'` (was: a memory address in every prompt)",
        "{query} has '.__class__' (an index or attribute)",
        lambda s, w: ["--prompt-template", "{query.__class__}"],
        scripts_with("--prompt-template"),
    ),
    BadInput(
        "template-conversion",
        "`--prompt-template '{query!r}'` (was: every prompt in quotes)",
        "{query} has '!r' (a conversion)",
        lambda s, w: ["--prompt-template", "{query!r}"],
        scripts_with("--prompt-template"),
    ),
    BadInput(
        "chat-template-not-jinja",
        "a chat template that is not valid Jinja, with `--use-chat-template` (was: a traceback)",
        "the tokenizer's chat template cannot render the prompt (TemplateSyntaxError",
        lambda s, w: chat_template_model(s, w, "{% if messages %}{{ messages[0].content }}", "chat-not-jinja"),
        scripts_with("--use-chat-template"),
    ),
    BadInput(
        "chat-template-raises",
        "a chat template that raises (`raise_exception`), with `--use-chat-template` (was: a traceback)",
        "cannot render the prompt (TemplateError: no roles here",
        lambda s, w: chat_template_model(s, w, "{{ raise_exception('no roles here') }}", "chat-raises"),
        scripts_with("--use-chat-template"),
    ),
    BadInput(
        "chat-template-sandbox",
        "a chat template the sandbox blocks (`''.__class__.__mro__`), with `--use-chat-template` (was: a traceback)",
        "cannot render the prompt (SecurityError",
        lambda s, w: chat_template_model(s, w, "{{ messages[0].content }}{{ ''.__class__.__mro__ }}", "chat-sandbox"),
        scripts_with("--use-chat-template"),
    ),
    BadInput(
        "chat-template-empty",
        "a chat template that renders empty prompts, with `--use-chat-template` (was: trained 8 steps, then a crash)",
        "the tokenizer's chat template renders an empty prompt",
        lambda s, w: chat_template_model(s, w, "{% if false %}{{ messages }}{% endif %}", "chat-empty"),
        scripts_with("--use-chat-template"),
    ),
    # ---- a GSM8K gold answer is exactly one number after one `####` (issue 51 item 7) ----
    BadInput(
        "gold-fraction",
        "a GSM8K gold answer `#### 3/4` (was: graded as 3)",
        "is `#### 3/4`, not exactly one number",
        gold_answer("#### 3/4"),
        MATH_SCRIPTS,
    ),
    BadInput(
        "gold-exponent",
        "a GSM8K gold answer `#### 1e3` (was: graded as 1)",
        "is `#### 1e3`, not exactly one number",
        gold_answer("#### 1e3"),
        MATH_SCRIPTS,
    ),
    BadInput(
        "gold-words",
        "a GSM8K gold answer `#### 12 apples or 13` (was: graded as 12)",
        "is `#### 12 apples or 13`, not exactly one number",
        gold_answer("#### 12 apples or 13"),
        MATH_SCRIPTS,
    ),
    BadInput(
        "gold-two-markers",
        "a GSM8K answer with two `####` markers (was: the last taken, silently)",
        "holds 2 `####` final-answer markers",
        gold_answer("#### 7\n#### 8"),
        MATH_SCRIPTS,
    ),
    # ---- a flag that acts only with another the run lacks (issue 59: `clean_rlhf_utils/args.py` NEEDS, checked before
    # anything loads; tests/test_flag_needs.py runs every rule) ----
    BadInput(
        "lora-alpha-without-lora-r",
        "`--lora-alpha 16` without `--lora-r` (was: ignored, recorded as used)",
        "error: --lora-alpha 16.0 acts only with --lora-r (LoRA), which this run lacks",
        lambda s, w: ["--lora-alpha", "16"],
        scripts_with("--lora-alpha"),
    ),
    BadInput(
        "vllm-memory-without-use-vllm",
        "`--vllm-gpu-memory-utilization 0.5` without `--use-vllm` (was: ignored, recorded as used)",
        "error: --vllm-gpu-memory-utilization 0.5 acts only with --use-vllm, which this run lacks",
        lambda s, w: ["--vllm-gpu-memory-utilization", "0.5"],
        scripts_with("--vllm-gpu-memory-utilization"),
    ),
    BadInput(
        "kl-clamp-without-kl",
        "`--kl-clamp 10` with the KL term off (`--kl-coef 0`, `--beta 0`; was: ignored)",
        "error: --kl-clamp 10.0 acts only with a KL term (--kl-coef or --beta above 0), which this run lacks",
        lambda s, w: ["--kl-clamp", "10", *kl_off(s)],
        scripts_with("--kl-clamp"),
    ),
    BadInput(
        "dual-clip-ratio-one",
        "`--dual-clip 3` with one pass over one minibatch, where the ratio is always 1 (was: ignored)",
        "error: --dual-clip 3.0 acts only with a ratio that can leave 1",
        lambda s, w: [*ONE_PASS[s], "--dual-clip", "3"],
        scripts_with("--dual-clip"),
    ),
    BadInput(
        "generation-threads-without-async",
        "`--generation-threads 1` without `--async` (was: ignored)",
        "error: --generation-threads 1 acts only with --async, which this run lacks",
        lambda s, w: ["--generation-threads", "1"],
        scripts_with("--generation-threads"),
    ),
    BadInput(
        "penalty-value-without-penalty",
        "`--penalty-reward-value -2 --no-non-eos-penalty` (was: ignored)",
        "error: --penalty-reward-value -2.0 acts only with",
        lambda s, w: ["--no-non-eos-penalty", "--penalty-reward-value", "-2", *(["--mode", "online"] * (s == "dpo"))],
        scripts_with("--penalty-reward-value"),
    ),
    # ---- a model directory whose weights are only a pickle (issue 59 item 7), refused before anything loads ----
    BadInput(
        "reward-model-pickle-only",
        "a `--reward-model-path` directory whose weights are only `pytorch_model.bin` (was: loaded from the pickle)",
        "holds its weights only as a pickle (pytorch_model.bin), which this library does not load",
        lambda s, w: ["--reward-model-path", pickled_copy(w.rm, w, "pickled-rm")],
        scripts_with("--reward-model-path"),
    ),
    BadInput(
        "prm-pickle-only",
        "a `--prm-path` directory whose weights are only `pytorch_model.bin` (was: loaded from the pickle)",
        "error: --prm-path",
        lambda s, w: ["--prm-path", pickled_copy(w.rm, w, "pickled-prm")],
        scripts_with("--prm-path"),
    ),
]


def symlinked_run_dir(w: World) -> list[str]:
    """runs/link -> a directory elsewhere holding a file that must survive."""
    (w.tmp / "elsewhere").mkdir(parents=True, exist_ok=True)
    (w.tmp / "elsewhere" / "keep.txt").write_text("mine")
    (w.tmp / "runs").mkdir(parents=True, exist_ok=True)
    if not (w.tmp / "runs" / "link").is_symlink():
        (w.tmp / "runs" / "link").symlink_to(w.tmp / "elsewhere")
    return []


# as an unfinished run has them (no metrics.jsonl: `run_case` takes one for a run that began training)
A_RUN = {"config.json": '{"run_name": "bad"}', "samples.jsonl": ""}
FINISHED = {**A_RUN, "done.json": "{}"}
A_CHECKPOINT = {"checkpoint/state.json": '{"step": 1}'}  # none of the cases that use it gets as far as reading it


def run_dir_with(w: World, layout: dict, name: str = "bad") -> list[str]:
    """runs/<name> written from `layout`: a path inside it to its text (bytes as they are; a name ending in `/x`
    makes the directory before it), None leaving a name out."""
    root = w.tmp / "runs" / name
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in layout.items():
        path = root / rel
        if text is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("/x"):
            continue
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return []


def model_as_run_dir(script: str, w: World) -> list[str]:
    """runs/model: a copy of the script's model (config.json, model.safetensors, the tokenizer)."""
    dst = w.tmp / "runs" / "model"
    if not dst.exists():
        shutil.copytree(w.assets / "models" / MODEL[script], dst)
    return []


def checkpoint_of_another_run(w: World) -> list[str]:
    """runs/bad whose checkpoint/ records run `other`, seed 7: a state.json whose digest is right (as a copy keeps it),
    beside a config.json that names no flag (so only the checkpoint's owner can refuse it)."""
    from clean_rlhf_utils import storage

    checkpoint = w.tmp / "runs" / "bad" / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint.parent / "config.json").write_text("{}")
    state = {"step": 1, "episode": 8, "num_processes": 1, "rows": {}, "run": {"run_name": "other", "seed": 7}}
    state["digest"] = storage.state_digest(checkpoint, state)
    (checkpoint / "state.json").write_text(json.dumps(state))
    return []


def all_cases() -> list[BadInput]:
    """The shared cases above and every script's own (`tests/bad_inputs_<script>.py`)."""
    cases = list(CASES)
    for script in SCRIPTS:
        try:
            cases += importlib.import_module(f"tests.bad_inputs_{script}").CASES
        except ModuleNotFoundError as e:
            if e.name != f"tests.bad_inputs_{script}":
                raise
    return cases


def run_case(case: BadInput, script: str, w: World) -> tuple[str, float]:
    """Runs the script's `main` in this process, as its command line would; returns the error line and the seconds it
    took. Fails unless it ended in `SystemExit("error: ...")` before the first step (no metrics written)."""
    from clean_rlhf_utils.runs import cli

    module = importlib.import_module(script)
    argv = [*base_flags(script, w), *case.flags(script, w)][0 if case.preset else 1 :]
    start = time.time()
    sink = io.StringIO()
    try:
        with redirect_stdout(sink), redirect_stderr(sink):
            args = cli(module.PRESETS, args=argv, prog=f"{script}.py")
            module.main(args)
    except SystemExit as e:
        message = str(e.code)
    else:
        raise AssertionError(f"{script} {case.id}: ran to the end without an error")
    finally:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # `Run` installs its handlers in-process
        signal.signal(signal.SIGINT, signal.default_int_handler)
    elapsed = time.time() - start
    assert message.startswith("error: "), f"{script} {case.id}: {message!r}"
    assert "\n" not in message, f"{script} {case.id}: more than one line: {message!r}"
    assert not (w.tmp / "runs" / "bad" / "metrics.jsonl").exists(), f"{script} {case.id}: failed after training began"
    return message, elapsed


def write_docs(out: Path = REPO / "docs" / "bad_inputs.md") -> None:
    import tempfile

    from benchmark.assets import build

    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        build(root / "assets", seed=0)
        rm = make_reward_model(root / "assets", root / "rm")
        for case in all_cases():
            for script in case.scripts:
                tmp = root / f"{case.id}-{script}"
                tmp.mkdir()
                message, elapsed = run_case(case, script, World(root / "assets", tmp, rm))
                message = message.replace(str(root), "...").replace("|", "\\|")
                rows.append(f"| `{case.id}` | {case.what} | `{script}.py` | {message} |")
    old = out.read_text() if out.exists() else ""
    kept = old[old.index("\n## ") + 1 :] if "\n## " in old else ""  # the tools' sections, written by hand
    text = [
        "# Bad input and its messages",
        "",
        "Generated by `python -m tests.bad_inputs` from the cases of `tests/test_bad_inputs.py` (the shared ones in",
        "`tests/bad_inputs.py`, each script's own in `tests/bad_inputs_<script>.py`). Every case ends before the",
        "first training step with this one line on stderr and exit code 1; temporary paths are shown as `...`.",
        "The sections after the table (the benchmark tools' bad input, each tested in its own test file) are written",
        "by hand; the generator keeps them.",
        "",
        "| case | bad input | script | message |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
    ]
    out.write_text("\n".join(text) + (f"\n{kept}" if kept else ""))


def make_reward_model(assets: Path, out: Path, model: str = "tiny-neox") -> Path:
    """A reward model in reward_model.py's format (random head) on the tiny tokenizer, from the tiny `model`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(assets / "models" / model, num_labels=1)
    rm.config.reward_type, rm.config.reward_bias = "outcome", 0.0
    rm.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(assets / "models" / model).save_pretrained(out)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    write_docs()
