"""clean_rlhf_utils: the plumbing the algorithm scripts share, once (CONTRIBUTING.md, "One algorithm, one file").

A helper lives here only if swapping it for any other correct implementation of its docstring leaves every logged
training number unchanged: it loads, validates, distributes, saves, logs, evaluates or speeds up. What is sampled and
how, which tokens count, rewards, KL, logprobs, advantages, losses and their normalisation, dropout and the update
loop stay in the scripts. This package never imports a script.

Modules, by job:
  loading   hub checks, datasets, tokenizers: offline first, one-line errors
  data      prompt templates and padding
  engines   accelerate (DDP, DeepSpeed ZeRO-2/3, FSDP), LoRA, gathered saves, global means over processes
  runs      the run directory, checkpoints and resume, signals, done.json, the shared argument checks
  evaluation  harnesses that take the script's scoring as arguments; the tiny world's gold judge
  packing   padding-free batches of query + response sequences (speed work)
"""
