"""clean_rlhf_utils: the plumbing the algorithm scripts share, once (CONTRIBUTING.md, "One algorithm, one file").

A helper lives here only if swapping it for any other correct implementation of its docstring leaves every logged
training number unchanged: it loads, validates, distributes, saves, logs, evaluates or speeds up. What is sampled and
how, which tokens count, rewards, KL, logprobs, advantages, losses and their normalisation, dropout and the update
loop stay in the scripts. This package never imports a script.

Modules, by job:
  args      the flags every script shares (run, model, LoRA, data, optimizer): the base classes of each `Args`;
            the checks of a script's own flags
  loading   hub checks, datasets, configs, tokenizers, models: offline first, one-line errors
  datafiles what a .jsonl / .json data file holds, checked before `datasets` reads it (the format to use)
  data      templates, chat messages, padding, sft.py's tokenized rows, batches of groups
  prompts   the RL prompts and what rewards and evaluations need of each row (reference, gold answer, facts)
  preferences  preference pairs: chosen and rejected responses checked, tokenized and batched
  engines   accelerate (DDP, DeepSpeed ZeRO-2/3, FSDP), LoRA, gathered saves, global means over processes
  runs      the run directory, checkpoints and resume, signals, done.json, the argument checks, loop state, batch
            sizes
  storage   faults of the disk: the output directory checked, directory renames, the checkpoint to resume from,
            torn rows read past, model directories checked for what a killed save or copy leaves out
  tracking  provenance.json (the commit, library versions, host) and Weights & Biases (--track)
  ownership  one owner per run directory (its lock), the inputs --overwrite must not delete, the flags --resume
            must not change
  metrics   what a step logs, summed and averaged over the processes
  evaluation  the harnesses (SFT, reward model, math pass@k, DPO pairs, greedy responses); they take the script's
            scoring as arguments
  judges    what evaluations score with: the tiny-world judge, answer parsers, majority vote, `eval/kl`
  generation  the samplers (KV cache, vLLM), the asynchronous sampling thread
  packing   padding-free batches that give the padded numbers faster (speed work)
"""
