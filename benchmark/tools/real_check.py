"""Real-shape check: every stage of the real suites, on the real tokenizers and data, under every engine.

`python -m benchmark.run tldr` and `python -m benchmark.run math` launch the real reproductions (Pythia 1B/2.8B/6.9B on
TL;DR, Qwen2.5 on GSM8K and MATH) on 8 GPUs. This check runs each of those commands as the suite writes it -- same
script, preset and accelerate config -- with only the model paths, dataset paths and sizes overridden:

  * models: small random-weight models built from the real architectures' configs (Pythia-1B/2.8B/6.9B's GPT-NeoX,
    Qwen2.5-0.5B-Instruct's and Qwen2.5-Math-1.5B's Qwen2), scaled to 2 layers and hidden size 64 but with the real
    vocabulary, special tokens and tokenizer;
  * data: the real tokenizers and the real-schema rows of `shared/real-assets` (TL;DR in the two N+ schemas, GSM8K,
    MATH-500, MATH), or any directory with the same layout (`--assets`, or env `CLEAN_RLHF_REAL_ASSETS`); with hub
    access, `--pythia-tokenizer EleutherAI/pythia-1b-deduped` etc. point the same check at the real hub files;
  * sizes: batch sizes, budgets (1-2 updates) and sampling lengths of the math presets; length limits are kept.

Engines (cells of the table): `single` (`python script.py`), `ddp` (multi_gpu.yaml, 2 processes, gloo on CPU), `zero2`
and `zero3` (deepspeed_zero2/3.yaml, 2 processes; DeepSpeed's CPU accelerator with `DS_ACCELERATOR=cpu` on a machine
without GPU), `fsdp` (fsdp.yaml: FSDP2, 2 processes; over gloo without GPU), `2machines` (multi_gpu.yaml as two
machines of one process each: two launchers with `--num_machines 2 --machine_rank 0|1 --main_process_ip
127.0.0.1`). `zero3` runs the stages the suites launch with ZeRO-3. Each engine runs the suite's chain in order
(SFT -> reward model -> RL), each stage reading the models its predecessors wrote under that engine.

    python -m benchmark.tools.real_check              # every stage x engine; table in runs/real_check/real_check.md
    python -m benchmark.tools.real_check --only tldr-pythia-1b --engines single zero2
    python -m benchmark.tools.real_check --dry-run              # the commands only
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark.launch import accelerate_config_problem
from benchmark.suites import REPO, Stage, math_stages, tldr_stages
from clean_rlhf_utils import storage

CONFIGS = REPO / "benchmark" / "accelerate_configs"

# The real architectures (values of the models' published config.json files), scaled down: `SMALL` replaces the sizes.
# Vocabulary, special tokens, rotary settings, norms, tying and the parallel residual stay the real ones.
PYTHIA = {  # EleutherAI/pythia-{1b,2.8b,6.9b}-deduped: GPT-NeoX
    "model_type": "gpt_neox",
    "vocab_size": 50304,
    "hidden_act": "gelu",
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000,
    "max_position_embeddings": 2048,
    "layer_norm_eps": 1e-5,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "attention_bias": True,
}
PYTHIA_SIZES = {"1b": {"vocab_size": 50304}, "2.8b": {"vocab_size": 50304}, "6.9b": {"vocab_size": 50432}}
QWEN2 = {  # Qwen2.5: Qwen2 architecture, grouped-query attention with q/k/v biases
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
    "bos_token_id": 151643,
}
QWEN_MODELS = {
    "qwen2.5-0.5b-instruct": {
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    },
    "qwen2.5-math-1.5b": {
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 151643,
    },
}
SMALL = {
    "gpt_neox": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256},
    "qwen2": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}

ENGINES = {  # engine: (accelerate config, processes); None: plain `python`
    "single": (None, 1),
    "ddp": ("multi_gpu", 2),
    "zero2": ("deepspeed_zero2", 2),
    "zero3": ("deepspeed_zero3", 2),
    "fsdp": ("fsdp", 2),
    # two machines of one process each, as a two-node job starts: one launcher per node (issue 41 item 12), both on
    # this host with --main_process_ip 127.0.0.1 (tests/test_two_machines.py checks what the second node writes and
    # that the numbers equal one machine's)
    "2machines": ("multi_gpu", 2),
}
DEFAULT_ENGINES = ["single", "ddp", "zero2", "zero3"]

# Sizes of each script for 1-2 optimizer updates with gradient accumulation and several processes still exercised.
# Length limits (prompt, response, max_length) stay the presets' own: they must fit the real data.
EVAL = "--num-eval-examples 4 --per-device-eval-batch-size 2 --eval-every 1000"
RL = "--per-device-batch-size 4 --gradient-accumulation-steps 2 --total-episodes 16 " + EVAL
SIZES = {
    script: flags.split()
    for script, flags in {
        "sft.py": "--per-device-train-batch-size 2 --gradient-accumulation-steps 2 --log-every 1 " + EVAL,
        "reward_model.py": "--per-device-train-batch-size 2 --gradient-accumulation-steps 2 --num-norm-examples 4 "
        "--log-every 1 " + EVAL,
        "ppo_rlhf.py": "--num-mini-batches 2 " + RL,
        "rloo.py": "--num-mini-batches 1 " + RL,
        "remax.py": RL,
        "grpo_math.py": "--questions-per-device 2 --num-generations 4 --micro-batch-size 2 --generation-batch-size 8 "
        "--total-steps 2 --num-eval-examples 4 --pass-k 0 --eval-every 1000",
        "dpo.py": "--per-device-train-batch-size 2 --gradient-accumulation-steps 2 --num-eval-pairs 4 " + EVAL,
    }.items()
}
# math presets sample hundreds to thousands of tokens per response; here a few
MATH_LENGTHS = {
    "ppo_rlhf.py": ["--response-length", "16"],
    "rloo.py": ["--response-length", "16"],
    "remax.py": ["--response-length", "16"],
    "grpo_math.py": ["--max-completion-length", "16"],
}
# a 2-layer random model rarely emits EOS: the TL;DR limits (53 tokens) stay, the evaluation batch is small


def default_assets() -> Path | None:
    env = os.environ.get("CLEAN_RLHF_REAL_ASSETS")
    if env:
        return Path(env)
    candidate = REPO.parent / "shared" / "real-assets"
    return candidate if candidate.is_dir() else None


@dataclass
class Sources:
    """Where the real tokenizers and datasets come from: directories of the real-assets layout, or hub names."""

    pythia_tokenizer: str
    qwen_instruct_tokenizer: str
    qwen_math_tokenizer: str
    tldr_sft: str
    tldr_preference: str
    gsm8k: str
    math_train: str
    math_eval: str

    @classmethod
    def from_assets(cls, assets: Path | None, **overrides) -> Sources:
        def at(rel: str) -> str:
            return str(assets / rel) if assets is not None else ""

        values = {
            "pythia_tokenizer": at("tokenizers/pythia"),
            "qwen_instruct_tokenizer": at("tokenizers/qwen2.5-instruct"),
            "qwen_math_tokenizer": at("tokenizers/qwen2.5-math"),
            "tldr_sft": at("tldr/sft"),
            "tldr_preference": at("tldr/preference"),
            "gsm8k": at("gsm8k"),
            "math_train": at("math/math_test_1000.jsonl"),
            "math_eval": at("math/math500_test.jsonl"),
        }
        values.update({k: v for k, v in overrides.items() if v})
        missing = [k for k, v in values.items() if not v]
        if missing:
            raise SystemExit(
                f"error: no real assets found: pass --assets DIR (or set CLEAN_RLHF_REAL_ASSETS), or each of "
                f"{', '.join('--' + k.replace('_', '-') for k in missing)}"
            )
        for k, v in values.items():
            if v.startswith("/") and not Path(v).exists():
                raise SystemExit(f"error: {v} does not exist (--{k.replace('_', '-')}, or --assets)")
        return cls(**values)


def build_model(out: Path, arch: dict, tokenizer: str, seed: int = 0) -> Path:
    """A random-weight causal LM of the real architecture, at small size, saved with the real tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    values = dict(arch)
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values, **SMALL[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)
    tmp.rename(out)
    return out


def build_models(workdir: Path, src: Sources, build: bool = True) -> dict[str, Path]:
    """hub name -> local directory of its small random-weight stand-in (built once per workdir)."""
    models = workdir / "models"
    specs = {
        f"EleutherAI/pythia-{size}-deduped": (f"pythia-{size}", {**PYTHIA, **extra}, src.pythia_tokenizer)
        for size, extra in PYTHIA_SIZES.items()
    }
    specs["Qwen/Qwen2.5-0.5B-Instruct"] = (
        "qwen2.5-0.5b-instruct",
        {**QWEN2, **QWEN_MODELS["qwen2.5-0.5b-instruct"]},
        src.qwen_instruct_tokenizer,
    )
    specs["Qwen/Qwen2.5-Math-1.5B"] = (
        "qwen2.5-math-1.5b",
        {**QWEN2, **QWEN_MODELS["qwen2.5-math-1.5b"]},
        src.qwen_math_tokenizer,
    )
    if build:
        models.mkdir(parents=True, exist_ok=True)
    return {
        hub: build_model(models / name, arch, tok) if build else models / name
        for hub, (name, arch, tok) in specs.items()
    }


def stages() -> list[tuple[str, Stage]]:
    """(suite, stage) for seed 1 of both real suites, in the order the suite runs them."""
    return [("tldr", s) for s in tldr_stages([1])] + [("math", s) for s in math_stages([1])]


def base_model(stage: Stage) -> str | None:
    """The hub model a stage starts from when no earlier stage provides it."""
    if stage.script == "sft.py":
        return "EleutherAI/pythia-" + re.search(r"pythia-([\d.]+b)", stage.preset).group(1) + "-deduped"
    if stage.preset.startswith("gsm8k"):
        return "Qwen/Qwen2.5-0.5B-Instruct"
    if stage.preset.startswith("math"):
        return "Qwen/Qwen2.5-Math-1.5B"
    return None


def overrides(suite: str, stage: Stage, models: dict[str, Path], src: Sources) -> list[str]:
    """Model paths, dataset paths and sizes: everything else is the suite's command as written."""
    extra = []
    model = base_model(stage)
    if model is not None:
        flag = "--sft-model-path" if stage.script in ("ppo_rlhf.py", "rloo.py", "remax.py") else "--model-name-or-path"
        extra += [flag, str(models[model])]
    if suite == "tldr":
        data = {"sft.py": src.tldr_sft, "reward_model.py": src.tldr_preference, "dpo.py": src.tldr_preference}
        extra += ["--dataset-name-or-path", data.get(stage.script, src.tldr_sft)]
        if stage.script == "reward_model.py":
            extra += ["--norm-dataset-name-or-path", src.tldr_sft]
        if stage.script == "dpo.py":
            extra += ["--prompt-dataset-name-or-path", src.tldr_sft]
    elif stage.preset.startswith("gsm8k"):
        extra += ["--dataset-name-or-path", src.gsm8k, *MATH_LENGTHS[stage.script]]
    else:
        extra += [
            "--dataset-name-or-path",
            src.math_train,
            "--eval-dataset-name-or-path",
            src.math_eval,
            *MATH_LENGTHS[stage.script],
        ]
    return extra + SIZES[stage.script]


def command(suite: str, stage: Stage, engine: str, models: dict[str, Path], src: Sources, runs: Path) -> list[str]:
    """The suite's command for `stage` (benchmark.run), launched under `engine`, with the check's overrides."""
    cmd = stage.command([sys.executable])
    i = (
        cmd.index(stage.script)
        if stage.script in cmd
        else next(j for j, c in enumerate(cmd) if c.endswith(stage.script))
    )
    config, nproc = ENGINES[engine]
    launch = (
        [sys.executable, str(REPO / stage.script)]
        if config is None
        else [
            "accelerate",
            "launch",
            "--config_file",
            f"benchmark/accelerate_configs/{config}.yaml",
            "--num_processes",
            str(nproc),
            stage.script,
        ]
    )
    rest = [a.replace("runs/", f"{runs}/", 1) if a.startswith("runs/") else a for a in cmd[i + 1 :]]
    return [*launch, *rest, "--output-dir", str(runs), *overrides(suite, stage, models, src)]


def node_commands(cmd: list[str], port: int) -> list[list[str]]:
    """`accelerate launch ...` as the two launchers of a two-machine job: node 0 at 127.0.0.1:port, node 1."""
    i = cmd.index("launch") + 1
    return [
        [*cmd[:i], "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        + ["--main_process_port", str(port), *cmd[i:]]
        for rank in (0, 1)
    ]


def engines_for(stage: Stage, engines: list[str], also_zero3: list[str] = ()) -> dict[str, str | None]:
    """engine -> None (run it) or the reason it is not run here."""
    out = {}
    for e in engines:
        if (
            e == "zero3"
            and stage.accelerate_config != "deepspeed_zero3"
            and not any(matches(o, stage.run_name) for o in also_zero3)
        ):
            out[e] = "the suite does not launch this stage with ZeRO-3"
        else:
            out[e] = None
    return out


def matches(pattern: str, run_name: str) -> bool:
    """`--only` entries: a part of the run name, or with a leading ^ its start (^grpo_gsm8k, not dr-grpo_gsm8k)."""
    return run_name.startswith(pattern[1:]) if pattern.startswith("^") else pattern in run_name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_for(engine: str) -> dict:
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if engine.startswith("zero"):
        import torch

        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator (gloo and shared-memory collectives)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def last_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or re.match(r"^(\[rank\d+\]: )?\w*(Error|Exception)\b", ln):
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_check(
    workdir: Path,
    src: Sources,
    engines: list[str],
    only: list[str] | None = None,
    dry_run: bool = False,
    timeout: int = 900,
    also_zero3: list[str] = (),
    read_from: dict[str, str] | None = None,
) -> dict[tuple[str, str], str]:
    """Run the cells; returns {(run name, engine): 'ok' | 'FAILED: ...' | 'blocked: ...' | 'not run: ...'}.
    `read_from` {engine: other}: the engine's stages read the SFT and reward models that `other` trained (default
    {"zero3": "zero2"}, as the suites do)."""
    read_from = {"zero3": "zero2"} if read_from is None else read_from
    for engine in engines:  # accelerate would stop every cell of the engine with a traceback of its own
        problem = ENGINES[engine][0] and accelerate_config_problem(CONFIGS / f"{ENGINES[engine][0]}.yaml")
        if problem:
            raise SystemExit(
                f"error: {problem} (engine {engine}); restore it (git checkout -- {CONFIGS.relative_to(REPO)})"
            )
    models = build_models(workdir, src, build=not dry_run)
    todo = [(suite, st) for suite, st in stages() if not only or any(matches(o, st.run_name) for o in only)]
    result: dict[tuple[str, str], str] = {}
    for engine in engines:
        runs = workdir / engine / "runs"
        for suite, stage in todo:
            reason = engines_for(stage, [engine], also_zero3)[engine]
            if reason:
                result[stage.run_name, engine] = f"not run: {reason}"
                continue
            cmd = command(suite, stage, engine, models, src, runs)
            # a stage reads the models its predecessors wrote under the same engine; the suites train no SFT or reward
            # model under ZeRO-3 (ZeRO-2 there), so ZeRO-3 stages read the zero2 ones
            source = read_from.get(engine, engine)
            if source != engine:
                cmd = [
                    a.replace(f"{workdir}/{engine}/runs/", f"{workdir}/{source}/runs/")
                    if any(a.startswith(f"{workdir}/{engine}/runs/{d}/") for d in stage.needs)
                    else a
                    for a in cmd
                ]
            if dry_run:
                print(shlex.join(cmd))
                result[stage.run_name, engine] = "dry-run"
                continue
            missing = [d for d in stage.needs if not (workdir / source / "runs" / d / "model" / "config.json").exists()]
            if missing:
                result[stage.run_name, engine] = f"blocked: no model from {', '.join(missing)} under {source}"
                continue
            problem = storage.not_a_run_problem(runs / stage.run_name, "the real check", "pass another --workdir")
            if problem:  # it deletes only a run of its own before running a cell again
                result[stage.run_name, engine] = f"FAILED: {problem}"
                continue
            shutil.rmtree(runs / stage.run_name, ignore_errors=True)
            runs.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            print(f"[{engine}] {shlex.join(cmd)}", flush=True)
            with open(runs / f"{stage.run_name}.log", "w") as f:
                nodes = node_commands(cmd, free_port()) if engine == "2machines" else [cmd]
                procs = [
                    subprocess.Popen(c, cwd=REPO, env=env_for(engine), stdout=f, stderr=subprocess.STDOUT)
                    for c in nodes
                ]
                try:
                    codes = [p.wait(timeout=max(1.0, timeout - (time.time() - t0))) for p in procs]
                    rc = next((c for c in codes if c != 0), 0)
                except subprocess.TimeoutExpired:
                    for p in procs:
                        p.kill()
                        p.wait()
                    rc = None
            log = (runs / f"{stage.run_name}.log").read_text(errors="replace")
            if rc is None:
                log += f"\nerror: timed out after {timeout}s"
            saved = (runs / stage.run_name / "model" / "config.json").exists()
            if rc == 0 and saved:
                result[stage.run_name, engine] = f"ok ({time.time() - t0:.0f}s)"
            elif rc == 0:
                result[stage.run_name, engine] = "FAILED: exit 0 but no model/ was saved"
            else:
                result[stage.run_name, engine] = f"FAILED: {last_error(log)}"
            print(f"[{engine}] {stage.run_name}: {result[stage.run_name, engine]}", flush=True)
    return result


def table(result: dict[tuple[str, str], str], engines: list[str]) -> str:
    names = list(dict.fromkeys(name for name, _ in result))
    lines = ["| stage | " + " | ".join(engines) + " |", "| --- |" + " --- |" * len(engines)]
    for name in names:
        cells = []
        for e in engines:
            r = result.get((name, e), "")
            cells.append("-" if r.startswith("not run") else r.replace("|", "/"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--assets",
        type=Path,
        default=None,
        help="real-assets directory (default: $CLEAN_RLHF_REAL_ASSETS, else ../shared/real-assets)",
    )
    for name in Sources.__dataclass_fields__:
        parser.add_argument("--" + name.replace("_", "-"), default=None, help=f"override the {name} path or hub name")
    parser.add_argument("--workdir", type=Path, default=Path("runs/real_check"), help="models and runs go here")
    parser.add_argument("--engines", nargs="+", default=DEFAULT_ENGINES, choices=sorted(ENGINES))
    parser.add_argument(
        "--only", nargs="+", default=None, help="keep stages whose run name contains one of these (^x: starts with x)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument(
        "--num-processes", type=int, default=None, help="processes of the launched engines (default 2; 1 on one GPU)"
    )
    a = parser.parse_args()
    if a.num_processes:
        for e, (config, _) in list(ENGINES.items()):
            ENGINES[e] = (config, a.num_processes if config else 1)
    src = Sources.from_assets(a.assets or default_assets(), **{k: getattr(a, k) for k in Sources.__dataclass_fields__})
    workdir = a.workdir.resolve()
    result = run_check(workdir, src, a.engines, a.only, a.dry_run, a.timeout)
    if a.dry_run:
        return
    text = table(result, a.engines)
    notes = sorted({r for r in result.values() if r.startswith("not run")})
    text += "".join(f"\n- {n}" for n in notes) + ("\n" if notes else "")
    (workdir / "real_check.md").write_text(text)
    print(text)
    sys.exit(1 if any(r.startswith(("FAILED", "blocked")) for r in result.values()) else 0)


if __name__ == "__main__":
    main()
