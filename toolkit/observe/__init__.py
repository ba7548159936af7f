"""Observers: per-rank memory, metrics, TensorBoard, profiling, the console, and `toolkit report`.
Observers never drive training."""
