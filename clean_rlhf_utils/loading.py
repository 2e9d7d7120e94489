"""Loading, offline first: a local path never touches the network, and a hub name that cannot be reached fails in
milliseconds with a one-line `error:` naming the flag that takes a local path (CONTRIBUTING.md, "Offline first").
Datasets from a file, a folder of `{split}.jsonl|json|parquet`, a `save_to_disk` folder or the hub; tokenizer checks.
Nothing here changes a number: it finds and checks what a run reads."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from clean_rlhf_utils import datafiles
from clean_rlhf_utils.datafiles import SAVE_AS_JSONL, check_json_rows
from clean_rlhf_utils.prompts import prepare_prompts
from clean_rlhf_utils.storage import check_config_json, check_loading_info, check_model_files


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection(
            (url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout
        ).close()
        return True
    except OSError:
        return False


def in_hub_cache(name: str, repo_type: str) -> bool:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(name, repo_type=repo_type, local_files_only=True)
        return True
    except Exception:
        return False


def require_hub(name: str, what: str, flag: str) -> None:
    """Fail fast, in one line naming the missing thing and how to pass a local copy, when `name` is neither a local
    path, nor in the local Hugging Face cache, nor reachable on the hub. A name that can only be a path (a hub name is
    `owner/repo`) is reported as a missing path."""
    if datafiles.special_file(name):  # a pipe or a device exists, but is neither: "no such file" would be wrong
        raise SystemExit(f"error: {flag} {name} is {datafiles.special_file(name)}, not a regular file or {what} folder")
    if os.path.isfile(name):  # a model is a directory (config.json, weights, tokenizer), not one of its files
        raise SystemExit(
            f"error: {flag} {name} is a file, not a {what} directory; pass the directory that holds it"
            + (" (config.json, weights, tokenizer)" if what == "model" else "")
        )
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise SystemExit(f"error: {flag} {name}: no such file or directory")
    if in_hub_cache(name, "dataset" if what == "dataset" else "model") or hub_reachable():
        return
    raise SystemExit(
        f"error: the {what} '{name}' ({flag}) is not a local path, is not in the Hugging Face cache, and the hub "
        "cannot be reached (no network, or HF_HUB_OFFLINE=1): download it where there is internet (`huggingface-cli "
        "download "
        f"{name}{' --repo-type dataset' if what == 'dataset' else ''} --local-dir DIR`) and pass {flag} DIR; for the "
        f"offline tiny world run `python -m benchmark.assets` and use a `tiny-*` preset"
    )


def load_split(
    name_or_path: str, split: str, config: str | None = None, flag: str = "--dataset-name-or-path", hint: str = ""
) -> Dataset:
    """A dataset split from a file, a folder of `{split}.jsonl|json|parquet`, a `save_to_disk` folder or the hub. A file
    that cannot be read (empty, truncated, not the format its name says, `datafiles.check_json_rows`; a pipe), holds no
    rows, or is read as two splits in one run (`datafiles.record_read`), and a folder holding the split in two forms,
    are one-line errors naming it; `flag` is the option named when the path is none of these, and `hint` (what the
    script reads from it, what else serves) ends the message when it cannot be found."""
    path = Path(name_or_path)
    fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    where = f"{flag} {name_or_path}"
    if path.is_dir():
        saved_here = (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists()
        files = [path / f"{split}{suffix}" for suffix in fmt if (path / f"{split}{suffix}").exists()]
        forms = [f.name for f in files] + (["a save_to_disk dataset"] if saved_here else [])
        datafiles.check_one_form(path, split, forms, flag)
        if saved_here:
            ds = load_from_disk(str(path))
            saved = list(ds) if isinstance(ds, DatasetDict) else [str(ds.split or "train")]  # one Dataset: one split
            if split not in saved:  # one Dataset served as every split would evaluate a run on its training rows
                raise SystemExit(
                    f"error: no split '{split}' in the save_to_disk folder {path} ({flag}): it holds {saved}; save a "
                    f"DatasetDict with a '{split}' split (or name a split it holds, e.g. to evaluate on training rows)"
                )
            ds = ds[split] if isinstance(ds, DatasetDict) else ds
            datafiles.record_read(ds, (str(path.resolve()), split), split, where)
            return ds
        if not files:
            csv = [f.name for f in (path / f"{split}.csv", path / f"{split}.tsv") if f.exists()]
            raise SystemExit(
                f"error: no split '{split}' in {path} ({flag}): expected {split}.jsonl, {split}.json, "
                f"{split}.parquet or a save_to_disk folder"
                + (f"; {csv[0]} is CSV, which is not read: {SAVE_AS_JSONL}" if csv else hint)
            )
        path = files[0]
    datafiles.check_not_special(path, flag)
    if path.is_file():
        if path.stat().st_size == 0:
            raise SystemExit(f"error: {path} ({flag}) is empty")
        if path.suffix in (".csv", ".tsv"):
            raise SystemExit(
                f"error: {path} ({flag}) is a {path.suffix[1:].upper()} file, which is not read (its columns' types "
                f"would be guessed); {SAVE_AS_JSONL}, or .parquet"
            )
        if path.suffix in (".jsonl", ".json"):
            check_json_rows(path, flag)
        datafiles.check_datasets_cache(f"{path} ({flag})")
        try:
            ds = load_dataset(fmt.get(path.suffix, "json"), data_files=str(path), split="train")
        except Exception as e:  # datasets reports a bad file from deep inside its builders
            reason = " ".join(str(e).split())[:200]
            raise SystemExit(
                f"error: {path} ({flag}) cannot be read as {fmt.get(path.suffix, 'json')}: {reason}; "
                "check that the file is complete, one JSON object a line for .jsonl"
            ) from None
        if len(ds) == 0:
            raise SystemExit(f"error: {path} ({flag}) holds no rows")
        datafiles.record_read(ds, (str(path.resolve()),), split, where, file=path)
        return ds
    try:
        require_hub(name_or_path, "dataset", flag)
    except SystemExit as e:
        raise SystemExit(f"{e.code}{hint}") from None
    datafiles.check_datasets_cache(f"the dataset '{name_or_path}' ({flag})")
    ds = load_dataset(name_or_path, config, split=split)
    datafiles.record_read(ds, (name_or_path, config, split), split, where)
    return ds


def ensure_pad_token(tokenizer, add_pad_token: bool, name: str):
    """A pad token distinct from EOS, or a one-line error. With no pad token (Pythia) or PAD = EOS (base Qwen2.5), EOS
    would be masked out with the padding and the model would never learn to stop (N+ detail); `--add-pad-token` adds
    `[PAD]`, as N+ does for Pythia, and says so. (Pythia and Qwen2.5 embeddings have spare rows, so no resize.)"""
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: the tokenizer of {name} has no EOS token; responses could never end")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return tokenizer
    problem = "has no pad token" if tokenizer.pad_token_id is None else f"uses its EOS {tokenizer.eos_token!r} as pad"
    if not add_pad_token:
        raise SystemExit(
            f"error: the tokenizer of {name} {problem}, so EOS would be masked out with the padding (N+ "
            "detail). Pass --add-pad-token to add a distinct '[PAD]' token."
        )
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    print(f"the tokenizer of {name} {problem}: added '[PAD]' (id {tokenizer.pad_token_id}) as its pad token")
    return tokenizer


def load_config(name_or_path: str, args, flag: str = "--sft-model-path"):
    """The model config at `flag` (read before the weights: the positions bound every row's length)."""
    local = os.path.isdir(name_or_path)
    if not local:
        require_hub(name_or_path, "model", flag)
    check_model_files(name_or_path, flag)  # what a killed save or copy leaves: no config.json, truncated weights
    try:
        return AutoConfig.from_pretrained(
            name_or_path, revision=args.revision, trust_remote_code=args.trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:  # no or a broken config.json, an unknown model type
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: {flag} {name_or_path} holds no model config that transformers can load: {reason}"
        ) from None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def load_checked_tokenizer(name_or_path: str, args, flag: str = "--sft-model-path"):
    """The tokenizer of the model at `flag`, with a pad token distinct from EOS (`ensure_pad_token`). A directory
    without tokenizer files, or whose tokenizer has far fewer tokens than the model's embedding has rows, is refused in
    one line: from such a directory (a model/ whose save was killed after the weights, or a copy without its tokenizer)
    transformers builds a tokenizer of a few tokens from the model type alone, and every text would become unknown
    tokens."""
    local = os.path.isdir(name_or_path)
    config = load_config(name_or_path, args, flag)
    if local and not any((Path(name_or_path) / f).exists() for f in TOKENIZER_FILES):
        raise SystemExit(
            f"error: {flag} {name_or_path} holds no tokenizer (no {', '.join(TOKENIZER_FILES[:3])}, ...): "
            "was its save interrupted? Pass a complete model directory (weights and tokenizer)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(
            name_or_path, revision=args.revision, trust_remote_code=args.trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:  # missing or truncated tokenizer files
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: {flag} {name_or_path} holds no tokenizer that transformers can load: {reason}"
        ) from None
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab and len(tok) < vocab // 2:
        raise SystemExit(
            f"error: the tokenizer of {flag} {name_or_path} has {len(tok)} tokens for a model "
            f"embedding of {vocab} rows: its tokenizer files are incomplete (was its save interrupted?); "
            "pass a complete model directory (weights and tokenizer)"
        )
    return ensure_pad_token(tok, args.add_pad_token, name_or_path)


def load_causal_lm(args, tokenizer, flag: str = "--model-name-or-path"):
    """The causal LM at `--model-name-or-path` in `--dtype`, its embedding grown for an added `[PAD]`, the pad token
    set in its configs. Dropout is as the checkpoint has it: the scripts turn it off (`disable_dropout`)."""
    what = "policy" if flag == "--model-name-or-path" else "teacher"
    model = load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args, what, flag, revision=args.revision)
    if flag == "--model-name-or-path":  # a teacher scores the policy's tokens: `load_teacher` checks its embedding
        check_tokenizer_fits(tokenizer, model.config, args.model_name_or_path, flag)
    if len(tokenizer) > model.config.vocab_size:  # not the weight's shape: ZeRO-3 partitions it (shape 0)
        model.resize_token_embeddings(len(tokenizer))  # the added [PAD] needs an embedding row
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def config_positions(args) -> int | None:
    """The longest sequence the model's position embeddings cover, from its config (None when it does not say, or the
    config cannot be read: loading the model reports that)."""
    try:
        config = AutoConfig.from_pretrained(
            args.model_name_or_path,
            revision=args.revision,
            trust_remote_code=args.trust_remote_code,
            local_files_only=os.path.isdir(args.model_name_or_path),
        ).get_text_config()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_train_and_eval_rows(args) -> tuple[Dataset, Dataset]:
    """The training split (its first `--max-train-samples` rows, if given) and the first `--num-eval-examples` rows of
    the evaluation split of `--dataset-name-or-path`."""
    train_rows = load_split(args.dataset_name_or_path, args.train_split)
    if args.max_train_samples:
        train_rows = train_rows.select(range(min(args.max_train_samples, len(train_rows))))
    eval_rows = load_split(args.dataset_name_or_path, args.eval_split)
    return train_rows, eval_rows.select(range(min(args.num_eval_examples, len(eval_rows))))


def load_scorer(path: str, args, flag: str, reward_type: str, tokenizer):
    """A reward model saved by reward_model.py, frozen; it must be of `reward_type` and share the policy's tokenizer
    (completions are scored as the policy's token ids, as in ppo_rlhf.py)."""
    local = os.path.isdir(path)
    what = "process reward model" if reward_type == "process" else "reward model"
    model = load_pretrained(AutoModelForSequenceClassification, path, args, what, flag, True, num_labels=1)
    if getattr(model.config, "reward_type", "outcome") != reward_type:
        article = "an" if reward_type == "outcome" else "a"
        raise SystemExit(
            f"error: {flag} {path} is not {article} {reward_type} reward model "
            f"(config.reward_type is {getattr(model.config, 'reward_type', None)!r})"
        )
    if AutoTokenizer.from_pretrained(path, local_files_only=local).get_vocab() != tokenizer.get_vocab():
        raise SystemExit(
            f"error: the tokenizer of {path} differs from the policy's; {flag} needs a model trained on the same "
            "tokenizer"
        )
    return model.eval().requires_grad_(False)


def check_causal_lm(model, path: str, flag: str, what: str) -> None:
    """A folder saved as a sequence classifier (a reward or value model) loads as a causal LM with a random LM head
    (transformers only warns): a one-line error naming `flag` instead."""
    archs = model.config.architectures or []
    if archs and all(a.endswith("ForSequenceClassification") for a in archs):
        raise SystemExit(
            f"error: {flag} {path} is a {archs[0]} (a reward model), not a causal LM: the {what} would get a random "
            "LM head; give an SFT model"
        )


def check_tokenizer_fits(tokenizer, config, path: str, flag: str) -> None:
    """A tokenizer with more tokens than the model's embedding has rows is another model's: a one-line error, instead
    of an embedding grown with random rows for its ids. The one token allowed past the embedding is the `[PAD]` that
    `ensure_pad_token` added (the SFT stage grows the embedding for it)."""
    vocab = config.get_text_config().vocab_size
    if len(tokenizer) > vocab and (len(tokenizer) > vocab + 1 or tokenizer.pad_token_id != vocab):
        raise SystemExit(
            f"error: the tokenizer of {flag} {path} has {len(tokenizer)} tokens, more than the {vocab} rows of the "
            "model's embedding: it is not the model's own tokenizer; give the tokenizer the model was trained with"
        )


def check_pad_token_in_embedding(tokenizer, model, path: str, flag: str = "--sft-model-path") -> None:
    """Padding goes through the embedding, so the pad token needs a row of it, and the tokenizer must be the model's
    (`check_tokenizer_fits`): a one-line error otherwise."""
    check_tokenizer_fits(tokenizer, model.config, path, flag)
    if tokenizer.pad_token_id >= model.config.vocab_size:
        raise SystemExit(
            f"error: the pad token id {tokenizer.pad_token_id} is past the embedding of "
            f"{path} ({model.config.vocab_size} rows); add the pad token at the SFT stage "
            "(sft.py --add-pad-token)"
        )


def load_pretrained(cls, path: str, args, what: str, flag: str, trained_head: bool = False, **kwargs):
    """A model of `cls` (AutoModelForCausalLM, AutoModelForSequenceClassification, ...) from a local directory or the
    hub in `args.dtype`, or a one-line error naming `flag`. Its weights must match the model its config builds
    (`check_loading_info`): a missing, unexpected or mismatched tensor is an error naming them, except a missing score
    head where the model gets a new one (a reward or value model started from a causal LM). With `trained_head`, a
    checkpoint without the weights of the score head (a causal LM, a base model: transformers would give it a random
    head, and its rewards would be noise) is an error too. Dropout is left as the checkpoint has it: the script turns
    it off itself, right after the load."""
    local = os.path.isdir(path)
    if not local:
        require_hub(path, "model", flag)
    check_model_files(path, flag)
    try:
        model, info = cls.from_pretrained(
            path,
            trust_remote_code=args.trust_remote_code,
            local_files_only=local,
            dtype=getattr(torch, args.dtype),
            output_loading_info=True,  # what is missing, unexpected or mismatched: `check_loading_info`
            ignore_mismatched_sizes=True,  # reported in the info, not raised as "look at the above report"
            **kwargs,
        )
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # no config.json, no weights, mismatched shapes
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(f"error: {flag} {path} cannot be loaded as the {what} ({cls.__name__}): {reason}") from None
    if cls is AutoModelForCausalLM:
        check_causal_lm(model, path, flag, what)
    if trained_head and any(k.split(".")[0] == "score" for k in info["missing_keys"]):
        kind = (model.config.architectures or ["model without a score head"])[0]
        raise SystemExit(
            f"error: {flag} {path} is not a {what}: it is a {kind} whose checkpoint holds no score head "
            "(it would score with a random one); give a model saved by reward_model.py"
        )
    check_loading_info(info, path, flag, what, new_head=cls is AutoModelForSequenceClassification)
    return model


def load_tokenizer(path: str, flag: str, trust_remote_code: bool, add_pad_token: bool, revision: str | None = None):
    """The tokenizer of the model at `path` (`flag` names the option in errors), with a pad token distinct from EOS
    (`ensure_pad_token`)."""
    local = os.path.isdir(path)
    if not local:
        require_hub(path, "model", flag)
    check_config_json(path, flag)  # transformers' message would blame the tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code, local_files_only=local
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise SystemExit(
            f"error: {flag} {path} holds no tokenizer that transformers can "
            f"load (is it a model saved with save_pretrained?): {reason}"
        ) from None
    return ensure_pad_token(tokenizer, add_pad_token, path)


def load_reward_model(args, tokenizer):
    """The frozen outcome reward model of `--reward-model-path` (saved by reward_model.py: a sequence classifier with
    one label), checked before training: a process reward model, or one whose tokenizer gives the policy's tokens
    other ids (it scores the policy's token ids), is a one-line error, and so is a checkpoint without a trained score
    head (a causal LM: it would score with a random head), as in ppo_rlhf.py. Its dropout is the caller's to turn
    off."""
    path, flag = args.reward_model_path, "--reward-model-path"
    if path is None:
        raise SystemExit("error: --reward-source model needs --reward-model-path (or --reward-source math)")
    model = load_pretrained(AutoModelForSequenceClassification, path, args, "reward model", flag, True, num_labels=1)
    kind = getattr(model.config, "reward_type", "outcome")
    if kind != "outcome":
        raise SystemExit(
            f"error: {flag} {path} is a {kind} reward model (config.reward_type); this script scores "
            "whole responses: give an outcome reward model (reward_model.py --objective outcome)"
        )
    check_same_token_ids(tokenizer, path, flag)
    return model.eval().requires_grad_(False)


def check_finite_weights(model, run, flag: str, path: str) -> None:
    """A checkpoint with a NaN or inf weight (saved by a run that diverged, or broken in conversion) is a one-line
    error now, not NaN logits at the first update. Under ZeRO-3 each process checks its shard (`ds_tensor`); the
    answer is or-ed over the processes (`run.any_process`)."""
    bad = next(
        (name for name, p in model.named_parameters() if not torch.isfinite(getattr(p, "ds_tensor", p)).all()), None
    )
    if run.any_process(bad is not None):
        raise SystemExit(
            f"error: {flag} {path} has non-finite weights ({bad or 'on another process'}): the run that "
            "saved it diverged, or the file is broken; give a finite checkpoint"
        )


def check_policy_fits(policy, tokenizer, flag: str, path: str, response_length: int) -> int | None:
    """The policy's positions (None when its config does not say), after two one-line checks: the pad token, which
    left-pads the prompts, has an embedding row (and the tokenizer is the model's), and `--response-length` leaves room
    for a prompt."""
    check_tokenizer_fits(tokenizer, policy.config, path, flag)
    if tokenizer.pad_token_id >= policy.config.vocab_size:
        raise SystemExit(
            f"error: the pad token id {tokenizer.pad_token_id} is past the embedding of "
            f"{path} ({policy.config.vocab_size} rows); add the pad token at the SFT stage "
            "(sft.py --add-pad-token)"
        )
    config = policy.config
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions is not None and response_length >= max_positions:
        raise SystemExit(
            f"error: --response-length {response_length} leaves no room for a prompt in the "
            f"{max_positions} positions of {flag} (max_position_embeddings)"
        )
    return max_positions


def model_positions(config) -> int | None:
    """The longest sequence the model's position embeddings cover (None when its config does not say)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check_same_token_ids(tokenizer, path: str, flag: str) -> None:
    """A reward model scores the policy's token ids: where a tokenizer is saved with it, every token but the pad token
    must have the policy's id, or a one-line error."""
    try:
        rm_vocab = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path)).get_vocab()
    except (OSError, ValueError, KeyError, TypeError):
        rm_vocab = None  # no tokenizer saved with it: nothing to compare
    if rm_vocab is not None:
        vocab = tokenizer.get_vocab()  # its order varies between runs: the example is the lowest id that differs
        differ = sorted(
            (t for t, i in vocab.items() if i != tokenizer.pad_token_id and rm_vocab.get(t) != i), key=vocab.get
        )
        if differ:
            raise SystemExit(
                f"error: the tokenizer of {flag} {path} differs from the policy's ({len(differ)} tokens, "
                f"e.g. {differ[0]!r}); it scores the policy's token ids, so it needs the same tokenizer"
            )


def load_trained_reward_model(args, tokenizer, kind: str):
    """The frozen reward model at `--reward-model-path` (`kind` "outcome") or `--prm-path` ("process"), saved by
    reward_model.py (a sequence classifier with one label), checked before training:
    its checkpoint holds a trained score head (`load_pretrained`), it is of `kind` (config.reward_type, "outcome" or
    "process"; a process one scores the steps of a solution at its `step_separator`), its tokenizer gives every token
    the policy's id (`check_same_token_ids`) and its embedding covers the policy's tokens. Its dropout is the caller's
    to turn off."""
    path, flag = (args.prm_path, "--prm-path") if kind == "process" else (args.reward_model_path, "--reward-model-path")
    what = "process reward model" if kind == "process" else "reward model"
    model = load_pretrained(AutoModelForSequenceClassification, path, args, what, flag, trained_head=True, num_labels=1)
    found = getattr(model.config, "reward_type", "outcome")
    if found != kind:
        fix = (
            "a process reward model (reward_model.py --objective process)"
            if kind == "process"
            else "an outcome reward model (reward_model.py --objective outcome); a process one goes to --prm-path"
        )
        raise SystemExit(f"error: {flag} {path} is not a {what}: its config.reward_type is {found!r}; give {fix}")
    if kind == "process" and not isinstance(getattr(model.config, "step_separator", None), str):
        raise SystemExit(
            f"error: {flag} {path} has no config.step_separator, the text after each step that it scores; "
            "give a process reward model saved by reward_model.py --objective process"
        )
    check_same_token_ids(tokenizer, path, flag)
    if len(tokenizer) > model.config.vocab_size:
        raise SystemExit(
            f"error: {flag} {path} has {model.config.vocab_size} embedding rows, fewer than the policy's "
            f"{len(tokenizer)} tokens; train it from the same SFT model"
        )
    return model.eval().requires_grad_(False)


def load_value_model(args, tokenizer):
    """PPO's initial value model: `--value-model-path`, else the reward model (N+), else the SFT model with a fresh
    head; its embedding must cover the policy's tokens. Its dropout is the caller's to turn off."""
    value_path = args.value_model_path or args.reward_model_path or args.sft_model_path
    value_flag = (
        "--value-model-path"
        if args.value_model_path
        else "--reward-model-path"
        if args.reward_model_path
        else "--sft-model-path"
    )
    value_model = load_pretrained(
        AutoModelForSequenceClassification, value_path, args, "value model", value_flag, num_labels=1
    )
    if len(tokenizer) > value_model.config.vocab_size:
        raise SystemExit(
            f"error: the value model ({value_flag} {value_path}) has {value_model.config.vocab_size} "
            f"embedding rows, fewer than the policy's {len(tokenizer)} tokens; start it from the same SFT "
            "model"
        )
    return value_model


def load_prompts(args, tokenizer, config, extract_answer) -> tuple[list[dict], list[dict]]:
    """The training and evaluation prompts (`prompts.prepare_prompts`, with the script's `extract_answer`), every field
    checked now, before the first update."""
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    train_ds = load_split(args.dataset_name_or_path, args.train_split, args.dataset_config)
    train_rows = prepare_prompts(
        train_ds, tokenizer, args, args.train_split, max_positions, False, extract_answer, null_as_missing=True
    )
    eval_ds = load_split(args.dataset_name_or_path, args.eval_split, args.dataset_config)
    eval_ds = eval_ds.select(range(min(args.num_eval_examples, len(eval_ds))))
    eval_rows = prepare_prompts(
        eval_ds, tokenizer, args, args.eval_split, max_positions, True, extract_answer, null_as_missing=True
    )
    if len(train_rows) < args.per_device_batch_size:  # the endless loader would never yield a batch
        raise SystemExit(
            f"error: split '{args.train_split}' has {len(train_rows)} usable prompts, fewer than one "
            f"batch of --per-device-batch-size {args.per_device_batch_size}"
        )
    return train_rows, eval_rows


def set_pad_token_id(pad_id: int, generators: tuple, scorers: tuple) -> None:
    """The pad id for `generate` (the policy and reference) and for the classifiers' own forward, which refuses batches
    without one (the score is read by position)."""
    for m in generators:
        if m is not None:
            m.generation_config.pad_token_id = pad_id
    for m in scorers:
        if m is not None:
            m.config.pad_token_id = pad_id


def load_teacher(args, tokenizer):
    """(distill) The frozen teacher of --teacher-model-path: a causal LM on the policy's tokenizer."""
    if not os.path.isdir(args.teacher_model_path):
        require_hub(args.teacher_model_path, "model", "--teacher-model-path")
    teacher_args = dataclasses.replace(args, model_name_or_path=args.teacher_model_path, revision=None)
    teacher = load_causal_lm(teacher_args, tokenizer, "--teacher-model-path").eval().requires_grad_(False)
    if teacher.get_input_embeddings().num_embeddings < len(tokenizer):
        raise SystemExit(
            f"error: --teacher-model-path {args.teacher_model_path} has "
            f"{teacher.get_input_embeddings().num_embeddings} token embeddings for the policy's "
            f"{len(tokenizer)} tokens: the teacher must use the policy's tokenizer"
        )
    return teacher
