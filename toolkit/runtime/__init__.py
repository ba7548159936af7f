"""The training runtime: the run spec built once at the entry, model and data, kernels, the two loops,
checkpoints, resume, preemption, guards, the micro-batch autotuner and ZeRO-3-safe generation."""
