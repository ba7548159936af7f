"""Generation under ZeRO-3 at the speed of an unsharded model, and never hanging.

- `batched.generate_local` / `generate_all`: the importable entry points (every rank calls them): the whole
  model gathered once where it fits (`gather.py`), else layer by layer with synced_gpus; prompts in
  left-padded batches; seeded per prompt (`sample.py`).
- `shard.py`: prompts dealt to ranks evenly; `guard.py`: `synced_gpus` forced on where a sharded forward needs it.
- `evaluate.py`: `eval.generate` during and after training; `command.py`: `toolkit/generate.py`.
"""
