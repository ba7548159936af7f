"""`toolkit check`: will this DeepSpeed config run? DeepSpeed's own validation plus the toolkit's rules.

Order of work (each step feeds the next):
  1. fill "auto" the way training will (`ds_config.resolve` with placeholder values); keys the
     consumer (`--consumer`: who reads the file, ds_config.FILLS) cannot fill are errors;
  2. DeepSpeed's own parser (`DeepSpeedConfig`, its pydantic models) on the resolved dict, one error
     at a time (DeepSpeed stops at the first), plus a trace of which keys it reads at all;
  3. the rule table (RULES): things DeepSpeed only finds at `initialize` time, on N ranks, or never.

deepspeed is imported lazily inside functions: `import toolkit.config.checks` stays free of side effects so
the training entry point can call `check_config` before any process-group work.

Where things live (imports run one way: base <- rule modules <- core <- this file):
  base.py             Finding, Ctx (what every rule sees), the _err/_warn/_num helpers;
  core.py             "auto" resolution, the RULES table (the one list of rules, in order),
                      check_config / check_file / run_check;
  consumer.py         rule_consumer_auto: every "auto" the consumer reading the file leaves unfilled
                      (the toolkit's paths, a plain HF Trainer script, accelerate, bare deepspeed);
  batch.py            rule_batch: batch arithmetic at the real world size;
  optimizer.py        rule_optimizer: optimizer section or client optimizer x offload_optimizer;
  offload.py          rule_offload: stage x offload, partial offload, nvme_path;
                      rule_precision: fp16 and bf16 both on, torch_autocast with either;
  keys.py             rule_stage3_keys, rule_deprecated: stage-3-only and deprecated ZeRO keys;
  muon.py             rule_muon, rule_low_precision_states: Muon and bf16 master weights/states, what
                      DeepSpeed rejects at initialize or mis-runs silently;
  leaf.py             rule_leaf_threshold: leaf modules picked by stage3_module_granularity_threshold;
  deepspeed_parse.py  step 2: DeepSpeedConfig one error at a time, the traced reads that find
                      unknown (never read) keys, and the lazy, quiet deepspeed import.
A new rule is a function Ctx -> list[Finding] in the module of its concern, added to RULES in core.py.
Module names here must not shadow the standard library or a dependency (`deepspeed toolkit/train.py`
puts toolkit/ first on sys.path, making this package importable as top-level `checks`).
"""

from toolkit.config.checks.base import Finding
from toolkit.config.checks.core import check_config, check_file, run_check

__all__ = ["Finding", "check_config", "check_file", "run_check"]
