"""Bad input specific to remax.py (run by tests/test_bad_inputs.py with the shared cases of tests/bad_inputs.py): the
cases it shares with rloo.py (`prompt_cases`: prompt and answer fields of the training and evaluation data, prompts
that do not fit the model's positions, conversational data, tokenizers, SFT and reward models; `lora_cases`: the LoRA
flags) and ReMax's own flags. Each ends in one `error:` line before the first update."""

from __future__ import annotations

from tests.bad_inputs import BadInput
from tests.bad_inputs_rloo import lora_cases, prompt_cases

CASES = [
    *prompt_cases("remax"),
    *lora_cases("remax"),
    BadInput(
        "accumulation-not-dividing",
        "`--gradient-accumulation-steps` that does not divide the batch",
        "does not split into --gradient-accumulation-steps 3",
        lambda s, w: ["--gradient-accumulation-steps", "3"],
        ["remax"],
    ),
    BadInput(
        "kl-coef-negative", "`--kl-coef -0.05`", "--kl-coef is -0.05", lambda s, w: ["--kl-coef", "-0.05"], ["remax"]
    ),
    BadInput(
        "reward-clip-negative",
        "a negative `--reward-clip`",
        "--reward-clip is -1.0",
        lambda s, w: ["--reward-clip", "-1"],
        ["remax"],
    ),
]
