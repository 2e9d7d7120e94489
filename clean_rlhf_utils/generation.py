"""Generation: what the asynchronous sampling thread needs around the script's sampler (the sampling itself, what is
sampled and how, stays in the scripts): a batch sampled ahead, kept in a checkpoint as JSON and restored exactly."""

from __future__ import annotations

from concurrent.futures import Future

import torch


def sampled_pairs_to_json(data: dict | None) -> dict | None:
    """A batch of sampled preference pairs (dpo.py's `sample_pairs`: token lists, `valid`, `version`, `stats`,
    `gen_time`) as JSON (token lists, floats, booleans), for a checkpoint's state."""
    if data is None:
        return None
    return {
        "pairs": data["pairs"],
        "valid": data["valid"].tolist(),
        "version": data["version"],
        "stats": {k: float(v) for k, v in data["stats"].items()},
        "gen_time": data["gen_time"],
    }


def sampled_pairs_from_json(data: dict, device) -> dict:
    """The batch of `sampled_pairs_to_json` back in its sampled form (the floats are the float32 values, so exact)."""
    return {**data, "valid": torch.tensor(data["valid"], dtype=torch.bool, device=device)}


def done_future(result) -> Future:
    """A future that already holds `result` (a resumed async run's first batch, sampled before the checkpoint)."""
    future = Future()
    future.set_result(result)
    return future
