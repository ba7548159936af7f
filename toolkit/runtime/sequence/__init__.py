"""Sequence parallelism: one sample's tokens spread over several ranks (`train.sequence_parallel=N`).

- `ulysses.py`: DeepSpeed's Ulysses attention (all-to-all of heads around each attention) wrapped around the
  toolkit's attention, the process groups DeepSpeed builds for it, and the slicing of each batch.
- The rules a run must meet are config-level checks: toolkit/config/checks/sequence.py (`problems`).
"""
