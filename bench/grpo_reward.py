"""The benchmark's reward function, the same file for the toolkit (rl.rewards=bench/grpo_reward.py:length) and TRL
(bench/grpo_trl.py imports it): cheap, so the step's time is generation and training, and different for every
completion length, so groups have reward spread once completions stop early."""


def length(prompts, completions, completion_ids, **fields):
    return [len(ids) / 1000 for ids in completion_ids]
