"""The GPU check: one prepared command for a lent GPU (one H100/H200, no network), about 8 minutes.

    python -m benchmark.tools.gpu_check --out runs/gpu_check          # on the GPU; figures in OUT/gpu_check.{md,json}
    python -m benchmark.tools.gpu_check --small --out runs/gpu_check  # the dry run on a CPU: every section, tiny shapes

Sections, in order (each is skipped, and says so, when the time left is too short for it):
  1. env        torch / CUDA / device / library versions.
  2. attention  the CUDA branch of `packed_sdpa_attention` (`attend_gathered`: one SDPA call over the gathered
                sequences of a packed row) against causal attention computed by hand in float64, float32 and bf16,
                with grouped-query heads; its CPU branch on the same inputs; and a Qwen2-shaped model's logits on a
                packed row against each sequence run alone.
  3. mismatch   the sampler-trainer mismatch of the in-house KV-cache sampler: the logprobs it sampled with against
                the trainer's forward pass over the same tokens, in float32 and bf16, on a Qwen2.5-0.5B-shaped and a
                Pythia-1B-shaped random model (full size): the `mismatch/*` figures grpo_math.py logs.
  4. real       the real-shape check's one-process cells for every script (`tools.real_check --engines single`:
                the TL;DR Pythia-1B chain SFT -> RM -> PPO, RLOO, ReMax, DPO, and GRPO on GSM8K with Qwen2.5-0.5B),
                on CUDA.
  5. split      GRPO (Qwen2.5-0.5B-shaped) and PPO (Pythia-1B-shaped) against TRL (GRPOTrainer of TRL 1.16, the
                experimental PPOTrainer of TRL 1.12) on the same work (`tools.speed`), each side's loop split into
                generation (tools.gen_timer) and the rest, plus process time outside the loop.

What the machine needs: torch with CUDA, transformers, accelerate, peft; tyro, datasets, math-verify and TRL travel
as wheels (docs/gpus.md "The GPU check"). Real assets: `--assets` (or $CLEAN_RLHF_REAL_ASSETS). Random-weight models:
the figures are of shapes and kernels, not of trained models (a random model's next-token distribution is nearly
uniform, so its mismatch is that of flat distributions).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmark.tools.real_check import PYTHIA, QWEN2, QWEN_MODELS, SMALL

REPO = Path(__file__).resolve().parents[2]

# the models the real presets start from, at full size: the real-shape check's architectures (the published config.json
# values) with EleutherAI/pythia-1b-deduped's and Qwen/Qwen2.5-0.5B-Instruct's sizes; `--small` takes its small sizes
PYTHIA_1B = {
    **PYTHIA,
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "intermediate_size": 8192,
}
QWEN_05B = {
    **QWEN2,
    **QWEN_MODELS["qwen2.5-0.5b-instruct"],
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
}
# real-shape cells of one process covering every script (benchmark.tools.real_check --only)
REAL_CELLS = [
    "^sft_tldr-pythia-1b",
    "^rm_tldr-pythia-1b",
    "^ppo_tldr-pythia-1b",
    "^rloo_tldr-pythia-1b",
    "^remax_tldr-pythia-1b",
    "^dpo_tldr-pythia-1b",
    "^grpo_gsm8k",
]


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def env_section() -> dict:
    import importlib.metadata as md

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    else:
        out["device"] = "cpu (no CUDA: a dry run)"
    for pkg in ("transformers", "accelerate", "peft", "datasets", "tyro", "trl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def hand_causal_attention(q, k, v, lengths, scale):
    """float64 reference: each sequence of the packed row attends causally to its own earlier tokens;
    q (1, H, T, D), k / v (1, KV, T, D) -> (1, T, H, D)."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs = q[0, :, start : start + n]
        ks = k[0, :, start : start + n].repeat_interleave(rep, 0)
        vs = v[0, :, start : start + n].repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(-1, -2) * scale
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        outs.append((scores.masked_fill(future, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs, 0)[None]


def attention_section(small: bool) -> dict:
    import torch
    import torch.nn as nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from clean_rlhf_utils.packing import packed_sdpa_attention

    dev, out = device(), {}
    torch.manual_seed(0)
    lengths = [5, 17, 1, 64, 33, 128, 2]
    T, H, KV, D = sum(lengths), 14, 2, 64
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(dev)
    module = nn.Module().eval()
    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        q = torch.randn(1, H, T, D, device=dev, dtype=dt)
        k, v = torch.randn(1, KV, T, D, device=dev, dtype=dt), torch.randn(1, KV, T, D, device=dev, dtype=dt)
        ref = hand_causal_attention(q, k, v, lengths, D**-0.5)
        got, _ = packed_sdpa_attention(module, q, k, v, None, scaling=D**-0.5, position_ids=pos)
        cpu, _ = packed_sdpa_attention(module, q.cpu(), k.cpu(), v.cpu(), None, scaling=D**-0.5, position_ids=pos.cpu())
        out[dtype] = {
            "branch": "attend_gathered (CUDA)" if dev.type == "cuda" else "per-sequence (CPU)",
            "max_abs_err_vs_hand_float64": float((got.double() - ref).abs().max()),
            "max_abs_diff_vs_cpu_branch": float((got.double().cpu() - cpu.double()).abs().max()),
        }
    # a Qwen2-shaped model (two layers of the real head layout): logits on a packed row = each sequence alone
    cfg = {k: v for k, v in QWEN_05B.items() if k != "model_type"}
    cfg.update(num_hidden_layers=2, vocab_size=1024)
    config = AutoConfig.for_model("qwen2", **cfg, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).to(dev).float().eval()
    seqs = [torch.randint(0, 1024, (n,), device=dev) for n in (7, 40, 3, 90)]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        model.set_attn_implementation("packed_sdpa")
        ids = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(len(s), device=dev) for s in seqs])[None]
        packed = model(input_ids=ids, position_ids=positions).logits[0]
    out["qwen2_model_float32_max_abs_logit_diff"] = float((packed - alone).abs().max())
    out["ok"] = (
        out["float32"]["max_abs_err_vs_hand_float64"] < 1e-4
        and out["bfloat16"]["max_abs_err_vs_hand_float64"] < 5e-2
        and out["qwen2_model_float32_max_abs_logit_diff"] < 1e-3
    )
    return out


def build_random_model(spec: dict, small: bool, dtype, seed: int = 0, cls_name: str = "AutoModelForCausalLM"):
    import torch
    import transformers
    from transformers import AutoConfig

    values = dict(spec)
    model_type = values.pop("model_type")
    if small:
        values.update(SMALL[model_type])
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    with torch.device(device()):
        model = getattr(transformers, cls_name).from_config(config, dtype=dtype)
    return model


def mismatch_stats(d) -> dict:
    """`mismatch/*`'s figures of d = log pi_trainer - log pi_sampler over the sampled tokens, in float64: mean and max
    |d|, mean |ratio - 1|, and k3 = r - 1 - log r (r = e^d), KL(sampler || trainer) estimated on the sampler's draws."""
    d = d.double()
    return {
        "tokens": len(d),
        "mismatch_abs_mean": float(d.abs().mean()),
        "mismatch_max": float(d.abs().max()),
        "ratio_error_mean": float((d.exp() - 1).abs().mean()),
        "k3_kl_sampler_to_trainer": float((d.exp() - 1 - d).mean()),
    }


def mismatch_section(small: bool) -> dict:
    """Sample with the in-house KV-cache sampler (the logprob of each sampled token kept), then score the same tokens
    with one padded forward pass, as the trainer does; mismatch = log pi_trainer - log pi_sampler per token."""
    import torch

    from clean_rlhf_utils.generation import sample_with_kv_cache

    dev, out = device(), {}
    n_prompts, new_tokens = (8, 16) if small else (64, 128)
    for name, spec in (("qwen2.5-0.5b-shaped", QWEN_05B), ("pythia-1b-shaped", PYTHIA_1B)):
        for dtype in ("float32", "bfloat16"):
            model = build_random_model(spec, small, getattr(torch, dtype)).eval()
            V = model.config.vocab_size
            g = torch.Generator().manual_seed(1)
            prompts = [
                torch.randint(2, V - 1, (int(n),), generator=g).tolist()
                for n in torch.randint(16, 64, (n_prompts,), generator=g)
            ]
            torch.manual_seed(2)
            t0 = time.perf_counter()
            with torch.no_grad():
                comps, logps = sample_with_kv_cache(
                    model,
                    prompts,
                    pad_id=V - 1,
                    eos_id=V - 2,
                    max_new_tokens=new_tokens,
                    temperature=1.0,
                    batch_size=n_prompts,
                )
            if dev.type == "cuda":
                torch.cuda.synchronize()
            sample_s = time.perf_counter() - t0
            seqs = [p + c for p, c in zip(prompts, comps)]
            L = max(map(len, seqs))
            ids = torch.full((len(seqs), L), V - 1, dtype=torch.long)
            mask = torch.zeros(len(seqs), L, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
            with torch.no_grad():
                logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.float()
            lp = logits.log_softmax(-1)
            deltas = []
            for i, (p, c) in enumerate(zip(prompts, comps)):
                pos = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=dev)
                trainer = lp[i, pos].gather(1, torch.tensor(c, device=dev)[:, None]).squeeze(1)
                deltas.append(trainer.cpu() - logps[i])
            out[f"{name} {dtype}"] = {
                **mismatch_stats(torch.cat(deltas)),
                "sample_tokens_per_s": round(len(torch.cat(deltas)) / sample_s, 1),
            }
            del model, logits, lp
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run(
                cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nerror: timed out after {timeout:.0f}s\n")
            return 124


def real_section(out_dir: Path, assets: str | None, timeout: float) -> dict:
    workdir = out_dir / "real_check"
    cmd = [sys.executable, "-m", "benchmark.tools.real_check", "--engines", "single", "--workdir", str(workdir)]
    cmd += ["--timeout", "150", "--only", *REAL_CELLS] + (["--assets", assets] if assets else [])
    rc = run(cmd, out_dir / "real_check.log", timeout)
    table = workdir / "real_check.md"
    return {"exit": rc, "table": table.read_text() if table.exists() else None}


def save_models_for_split(models: Path, small: bool, assets: str | None) -> dict[str, Path]:
    """Full-size random models with the real tokenizers, saved in float32 as the tiny presets load them."""
    import torch
    from transformers import AutoTokenizer

    from benchmark.tools.real_check import default_assets

    root = Path(assets) if assets else default_assets()
    specs = {
        "qwen": (QWEN_05B, root / "tokenizers/qwen2.5-instruct", "AutoModelForCausalLM"),
        "pythia": (PYTHIA_1B, root / "tokenizers/pythia", "AutoModelForCausalLM"),
        "pythia-rm": (PYTHIA_1B, root / "tokenizers/pythia", "AutoModelForSequenceClassification"),
    }
    paths = {}
    for name, (spec, tok_path, cls) in specs.items():
        path = models / name
        paths[name] = path
        if (path / "config.json").exists():
            continue
        kw = {"num_labels": 1} if "Sequence" in cls else {}
        model = build_random_model({**spec, **kw}, small, torch.float32, cls_name=cls)
        tok = AutoTokenizer.from_pretrained(tok_path)
        if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:  # Pythia: its own <|padding|> token, id 1
            tok.pad_token = "<|padding|>"
        model.config.pad_token_id = tok.pad_token_id
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        del model
    return paths


def split_section(out_dir: Path, small: bool, assets: str | None, trl_ppo_path: str | None, left: float) -> dict:
    paths = save_models_for_split(out_dir / "models", small, assets)
    run([sys.executable, "-m", "benchmark.assets"], out_dir / "assets.log", 120)
    gen = out_dir / "gen_times"
    gen.mkdir(exist_ok=True)
    env = {**os.environ, "CLEAN_RLHF_GEN_TIMES": str(gen)}
    out, t0 = {}, time.time()
    jobs = [
        ("grpo", ["--model", str(paths["qwen"])]),
        (
            "ppo",
            ["--model", str(paths["pythia"]), "--reward-model", str(paths["pythia-rm"])]
            + (["--trl-ppo-path", trl_ppo_path] if trl_ppo_path else []),
        ),
    ]
    for algo, flags in jobs:
        remaining = left - (time.time() - t0)
        if remaining < 60:
            out[algo] = {"skipped": f"{remaining:.0f}s left"}
            continue
        steps = "2"
        cmd = [sys.executable, "-m", "benchmark.tools.speed", "--algos", algo, "--steps", steps, *flags]
        cmd += ["--timeout", str(int(remaining / 2))] + (
            ["--batch-size", "16", "--response-length", "8"] if small else []
        )
        rc = run(cmd, out_dir / f"speed_{algo}.log", remaining, env)
        res = REPO / "runs" / "speed" / "speed.json"
        r = json.loads(res.read_text())[0] if res.exists() and rc == 0 else {"skipped": f"exit {rc}"}
        if "ours" in r and "trl" in r:
            for side in ("ours", "trl"):
                s = r[side]
                s["loop_minus_generation_s"] = s["train_s"] - s.get("generation_s", float("nan"))
                s["outside_loop_s"] = s["wall_s"] - s["train_s"]
        out[algo] = r
        res.unlink(missing_ok=True)
    return out


def markdown(results: dict) -> str:
    e = results.get("env", {})
    lines = [
        "# The GPU check",
        "",
        f"`python -m benchmark.tools.gpu_check`, {results['date']}, {e.get('device')} "
        f"({e.get('memory_gib', '-')} GiB), "
        f"torch {e.get('torch')} (CUDA {e.get('cuda')}), transformers {e.get('transformers')}, accelerate "
        f"{e.get('accelerate')}, trl {e.get('trl')}; {results['seconds']:.0f} s in all.",
        "",
    ]
    a = results.get("attention")
    if isinstance(a, dict) and "float32" in a:
        lines += [
            "## packed_sdpa attention on this device",
            "",
            "| dtype | branch | max abs error vs hand float64 | max abs diff vs CPU branch |",
            "| --- | --- | --- | --- |",
        ]
        for dt in ("float32", "bfloat16"):
            r = a[dt]
            err, diff = r["max_abs_err_vs_hand_float64"], r["max_abs_diff_vs_cpu_branch"]
            lines.append(f"| {dt} | {r['branch']} | {err:.2e} | {diff:.2e} |")
        lines += [
            "",
            f"Qwen2-shaped model (2 layers), float32: packed row vs each sequence alone, max abs logit difference "
            f"{a['qwen2_model_float32_max_abs_logit_diff']:.2e}. Verdict: {'ok' if a['ok'] else 'FAILED'}.",
            "",
        ]
    m = results.get("mismatch")
    if isinstance(m, dict) and m and "skipped" not in m:
        lines += [
            "## Sampler-trainer mismatch (in-house KV-cache sampler vs one padded forward pass)",
            "",
            "| model, dtype | tokens | mean abs mismatch | max abs mismatch | mean abs ratio error | k3 KL "
            "| sampled tok/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for k, r in m.items():
            lines.append(
                f"| {k} | {r['tokens']} | {r['mismatch_abs_mean']:.2e} | {r['mismatch_max']:.2e} | "
                f"{r['ratio_error_mean']:.2e} | {r['k3_kl_sampler_to_trainer']:.2e} | {r['sample_tokens_per_s']} |"
            )
        lines.append("")
    r = results.get("real")
    if isinstance(r, dict) and r.get("table"):
        lines += ["## Real-shape check, one process on this device", "", r["table"], ""]
    s = results.get("split")
    if isinstance(s, dict) and s:
        lines += [
            "## Step split against TRL (same work both sides, float32, 2 steps)",
            "",
            "| algo, model | side | loop s | generation s | loop minus generation s | outside the loop s "
            "| episodes/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        names = {"grpo": "GRPO, Qwen2.5-0.5B-shaped", "ppo": "PPO, Pythia-1B-shaped"}
        for algo, res in s.items():
            if "ours" not in res or "trl" not in res:
                lines.append(f"| {names[algo]} | - | {res.get('skipped', 'no result')} | | | | |")
                continue
            for side in ("ours", "trl"):
                x = res[side]
                lines.append(
                    f"| {names[algo]} | {side} | {x['train_s']:.1f} | {x.get('generation_s', math.nan):.1f} | "
                    f"{x['loop_minus_generation_s']:.1f} | {x['outside_loop_s']:.1f} | {x['episodes_per_sec']:.2f} |"
                )
            lines.append(f"| {names[algo]} | speed ratio ours / TRL | {res['speed_ratio']:.2f} | | | | |")
        lines.append("")
    skipped = {k: v for k, v in results.items() if isinstance(v, dict) and "skipped" in v and k != "split"}
    lines += [f"- {k}: skipped ({v['skipped']})" for k, v in skipped.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="figures and logs go here")
    p.add_argument(
        "--budget", type=float, default=480, help="seconds for all sections (sections that would not fit are skipped)"
    )
    p.add_argument("--small", action="store_true", help="tiny shapes: the dry run on a CPU")
    p.add_argument(
        "--assets",
        default=None,
        help="real-assets directory (default: $CLEAN_RLHF_REAL_ASSETS, else ../shared/real-assets)",
    )
    p.add_argument("--trl-ppo-path", default=None, help="a directory holding trl 1.12 (the last TRL with PPOTrainer)")
    p.add_argument("--sections", nargs="+", default=["env", "attention", "mismatch", "real", "split"])
    a = p.parse_args(argv)
    out_dir = a.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    # (section, the least seconds it needs)
    plan = [("env", 0), ("attention", 20), ("mismatch", 40), ("real", 120), ("split", 120)]
    for name, need in plan:
        if name not in a.sections:
            continue
        left = a.budget - (time.time() - start)
        if left < need:
            results[name] = {"skipped": f"{left:.0f}s of the budget left, needs {need}s"}
            continue
        t0 = time.time()
        print(f"== {name} ({left:.0f}s left)", flush=True)
        try:
            if name == "env":
                results[name] = env_section()
            elif name == "attention":
                results[name] = attention_section(a.small)
            elif name == "mismatch":
                results[name] = mismatch_section(a.small)
            elif name == "real":
                results[name] = real_section(
                    out_dir, a.assets, max(60.0, min(170.0, left - 200))
                )  # the split keeps 200 s
            else:
                results[name] = split_section(out_dir, a.small, a.assets, a.trl_ppo_path, left - 10)
        except Exception as e:  # one section's failure must not lose the others' figures
            results[name] = {"skipped": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(results[name], indent=1, default=str)[:3000], flush=True)
        results[f"{name}_seconds"] = round(time.time() - t0, 1)
        results["seconds"] = time.time() - start
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (out_dir / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
