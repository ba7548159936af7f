"""The two training paths: run.py sets a run up and closes it, raw.py is the deepspeed.initialize loop, trainer.py
the HF Trainer path; state.py the run's typed state, evaluate.py the held-out loss. They read the resolved record
(toolkit/runtime/resolved.py) and decide nothing."""
