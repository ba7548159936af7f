"""Checkpoints and faults: atomic saves and the run directory (checkpoint.py), shard digests and full disks
(integrity.py), resume on the same or another rank count (resume.py), SIGTERM (preempt.py), NaN/Inf (guards.py),
dead hosts, ranks and hangs (watchdog.py)."""
