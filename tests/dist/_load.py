"""What a wall-time bound saw when it failed: the machine's load, so that a failure from load (a busy 2-core CI
machine, another suite beside this one) can be told from a regression."""

import os


def load_seen() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f}/{five:.1f}/{fifteen:.1f} (1/5/15 min) on {os.cpu_count()} cores"
