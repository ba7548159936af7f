"""Speed levers applied to the built model: per-layer torch.compile (compile.py), float8 matmuls (fp8.py), Liger
kernels (kernels.py), and the micro-batch search behind train.micro_batch_size=auto (autotune.py). What each run
gets is decided in toolkit/runtime/resolved.py; these modules apply it."""
