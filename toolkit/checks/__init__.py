"""`toolkit check`: the rule table lives in core.py (moved from toolkit/checks.py, split next)."""

from toolkit.checks.core import Finding, check_config, check_file, run_check

__all__ = ["Finding", "check_config", "check_file", "run_check"]
