"""Build the tiny offline world on disk: `python -m benchmark.assets [--out runs/assets] [--seed 0]`.

Writes, deterministically from the seed and in a few seconds, everything the `tiny*` presets of the
algorithm scripts load, in the same formats as the real assets, so the scripts run the very same code path
on both (`from_pretrained` on a directory, `datasets` on JSONL files):

    runs/assets/
      tokenizer/                    byte-level BPE trained here; EOS, PAD, a chat template
      models/tiny-neox/             GPT-NeoX (Pythia-shaped) causal LM, random init, ~2M parameters
      models/tiny-llama/            Llama (Qwen-shaped: GQA, tied embeddings) causal LM, random init
      tiny-math/gsm8k/{train,test}.jsonl        question, answer ("... #### 42")
      tiny-math/math/{train,test}.jsonl         problem, solution ("... \\boxed{42}"), answer, level
      tiny-math/prm/{train,test}.jsonl          prompt, completions (steps), labels (per-step bool)
      tiny-math/sft/{train,test}.jsonl          the SFT data: GSM8K schema, 60% of the training answers without working
      tiny-tldr/sft/{train,validation,test}.jsonl   id, subreddit, title, post, query, facts, summary,
                                                    reference_response
      tiny-tldr/preference/{train,validation}.jsonl id, ..., query, facts, chosen, rejected, chosen_score,
                                                    rejected_score
      MANIFEST.json                 seed, sizes, sha256 of every data file
      starts/sft_tiny-math/         copied from benchmark/starts/ by `ensure_assets` (the main job): a shipped start
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from benchmark import tiny_world

EOS, PAD, BOS = "<|endoftext|>", "<|pad|>", "<|endoftext|>"
CHAT_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>"]
# A minimal chat template in the style of Zephyr/TinyLlama: role tag, newline, content, EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def build_tokenizer(corpus: list[str], out: Path, vocab_size: int):
    """Byte-level BPE trained on the tiny world's text. Digits are split one per token (as in Llama and
    Qwen tokenizers) so that arithmetic is learnable by a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD, *CHAT_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=BOS,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=CHAT_SPECIALS,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    return hf


def build_models(tokenizer, out: Path, seed: int) -> dict[str, int]:
    """Two tiny causal LMs built from a config with random weights, saved with `save_pretrained`."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    configs = {
        # Pythia-shaped: parallel residual, partial rotary (25%), untied embeddings, as EleutherAI/pythia-*.
        "tiny-neox": (
            GPTNeoXForCausalLM,
            GPTNeoXConfig(
                hidden_size=192,
                num_hidden_layers=4,
                num_attention_heads=4,
                intermediate_size=768,
                rotary_pct=0.25,
                use_parallel_residual=True,
                tie_word_embeddings=False,
                **common,
            ),
        ),
        # Qwen2.5-shaped: RMSNorm, SwiGLU, grouped-query attention, tied embeddings.
        "tiny-llama": (
            LlamaForCausalLM,
            LlamaConfig(
                hidden_size=192,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=512,
                tie_word_embeddings=True,
                **common,
            ),
        ),
    }
    sizes = {}
    for name, (cls, config) in configs.items():
        torch.manual_seed(seed)
        model = cls(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out / name, safe_serialization=True)
        tokenizer.save_pretrained(out / name)  # a model directory loads on its own, like a hub repo
        sizes[name] = sum(p.numel() for p in model.parameters())
    return sizes


def build(
    out: str | os.PathLike = "runs/assets",
    seed: int = 0,
    n_train: int = 4000,
    n_eval: int = 200,
    vocab_size: int = 600,
    with_models: bool = True,
) -> dict:
    """Write the tiny world under `out` and return its manifest."""
    out = Path(out)
    t0 = time.time()
    files: dict[str, list[dict]] = {}
    for key, rows in tiny_world.make_tiny_math(seed, n_train, n_eval).items():
        files[f"tiny-math/{key}"] = rows
    for key, rows in tiny_world.make_tiny_tldr(seed, n_train, n_train, n_eval).items():
        files[f"tiny-tldr/{key}"] = rows
    for key, rows in tiny_world.make_tiny_tldr_noisy(seed, n_train // 4, n_eval).items():
        files[f"tiny-tldr-noisy/{key}"] = rows
    manifest = {"seed": seed, "files": {}}
    for key, rows in sorted(files.items()):
        path = out / f"{key}.jsonl"
        write_jsonl(path, rows)
        manifest["files"][f"{key}.jsonl"] = {"rows": len(rows), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    if with_models:
        corpus = []
        for key, rows in sorted(files.items()):
            # tiny-math/sft holds the GSM8K files' text, tiny-tldr-noisy tiny-tldr's words: the tokenizer predates both
            if key.startswith(("tiny-math/sft/", "tiny-tldr-noisy/")):
                continue
            for row in rows:
                for value in row.values():
                    if isinstance(value, str):
                        corpus.append(value)
                    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                        corpus.append("\n".join(value))
        tokenizer = build_tokenizer(corpus, out / "tokenizer", vocab_size)
        manifest["vocab_size"] = len(tokenizer)
        manifest["model_parameters"] = build_models(tokenizer, out / "models", seed)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    manifest["seconds"] = round(time.time() - t0, 2)
    return manifest


STARTS = Path(__file__).resolve().parent / "starts"
"""shipped models that runs start from on every host (benchmark/starts/README.md)"""


def place_starts(out: Path) -> None:
    """Copy each shipped start (STARTS/<name>/) to `out`/starts/<name>/ unless an identical copy is there: a copy
    another file replaced, or an older start, is rewritten (a folder written aside, then renamed into place)."""
    for src in sorted(p for p in STARTS.iterdir() if p.is_dir()):
        dst = out / "starts" / src.name
        files = sorted(f.name for f in src.iterdir() if f.is_file())
        if dst.is_dir() and all(
            (dst / f).is_file() and (dst / f).read_bytes() == (src / f).read_bytes() for f in files
        ):
            continue
        tmp = dst.with_name(f".{src.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)


def ensure_assets(out: str | os.PathLike = "runs/assets", seed: int = 0) -> Path:
    """Build the assets unless a complete build for this seed is already there; place the shipped starts."""
    out = Path(out)
    manifest = out / "MANIFEST.json"
    if not (
        manifest.exists()
        and json.loads(manifest.read_text()).get("seed") == seed
        and (out / "models" / "tiny-neox").exists()
        and (out / "tiny-tldr-noisy" / "preference").exists()  # a build older than tiny-tldr-noisy gets it added
    ):
        build(out, seed)
    place_starts(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/assets", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for every generator and model init")
    parser.add_argument("--n-train", type=int, default=4000, help="training rows per dataset")
    parser.add_argument("--n-eval", type=int, default=200, help="validation/test rows per dataset")
    parser.add_argument("--no-models", action="store_true", help="write the data files only")
    a = parser.parse_args()
    m = build(a.out, a.seed, a.n_train, a.n_eval, with_models=not a.no_models)
    print(
        f"wrote {len(m['files'])} data files under {a.out} in {m['seconds']}s; "
        f"vocab {m.get('vocab_size')}, model parameters {m.get('model_parameters')}"
    )


if __name__ == "__main__":
    main()
