"""The maintainers' measurement tools, apart from the user's loop (benchmark/: run, study, compare, reference,
reproduce, results, frontier, status, the tiny world): each a `python -m benchmark.tools.<name>` command.

- speed: this library's scripts against Hugging Face TRL, the same algorithm and budget (docs/speed.md)
- gpu_check: the prepared check a lent GPU runs first: every real preset's model at size, speed and memory
  (docs/gpu_check.md)
- real_check: every real preset on its own tokenizer and data, under each engine (docs/real_check.md)
- vllm_speed: vLLM against the in-house sampler (docs/vllm.md)
- lora_memory, memory_speed_family, async_speed, gen_timer: memory and speed ratios against a peer in the same run
- ddp_check: two gloo processes give the one-process numbers
- limits: this CPU's attainable float32 matmul rate and memory bandwidth, the yardsticks of a stage's achieved rate
  (docs/speed.md)
- identical: two sets of runs compared row by row and weight by weight (a change that should change no number)
"""
