"""The `toolkit` command. Each handler is a few lines calling a library function.

Nothing heavy is imported at module level: `toolkit --help` must not pay for torch or deepspeed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from toolkit import __version__
from toolkit.config.ds_config import CONSUMERS, DEFAULT_TARGETS  # pure dict code: no torch, fast
from toolkit.config.models import text_config

OFFLOADS = ("none", "cpu", "nvme")
PRECISIONS = ("bf16", "fp16", "fp32", "auto")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _gen_options(args: argparse.Namespace) -> dict[str, object]:
    """What gen-config's flags set besides stage and offload; --all applies them to every preset."""
    return {"nvme_path": args.nvme_path, "precision": args.precision, "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum, "world_size": args.world_size, "lr": args.lr,
            "targets": tuple(args.consumer or DEFAULT_TARGETS), "optimizer": args.optimizer,
            "optimizer_states": args.optimizer_states}


def _cmd_gen_config(args: argparse.Namespace) -> int:
    from toolkit.config import ds_config as dc

    if args.all:
        out_dir = Path(args.output or "ds_configs")
        if out_dir.exists() and not out_dir.is_dir():
            raise dc.ConfigError(f"{out_dir} is not a directory")
        for name, (stage, opt, par) in dc.PRESETS.items():
            path = out_dir / f"{name}.json"
            dc.write_config(dc.gen_config(stage, opt, par, **_gen_options(args)), path, force=args.force)
            print(f"wrote {path}")
        return 0
    if args.stage is None:
        raise dc.ConfigError("give --stage {0,1,2,3} or --all")
    cfg = dc.gen_config(args.stage, offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
                        **_gen_options(args))
    if args.expert_parallel:  # DeepSpeed's AutoEP block; `toolkit check` applies its rules (and DeepSpeed's)
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": args.expert_parallel}
        if args.ep_preset:
            cfg["expert_parallel"]["preset_model"] = args.ep_preset
    if args.output:
        dc.write_config(cfg, Path(args.output), force=args.force)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(dc.dumps(cfg))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from toolkit.config.checks import run_check

    if args.explain:
        from toolkit.runtime.spec import explain

        target = None
        if args.gpu_mem is not None:
            from toolkit.runtime.resolved import Machine

            target = Machine.target(args.gpu_mem, args.gpus or min(args.world_size, 8), args.host_mem)
        elif args.gpus is not None or args.host_mem is not None:
            print("error: --gpus and --host-mem describe the target GPU nodes: give --gpu-mem with them",
                  file=sys.stderr)
            return 1
        return explain(args.config, args.file, args.overrides, args.world_size, args.json, target)
    if args.overrides or args.config or args.gpu_mem is not None or args.host_mem is not None:
        print("error: --config, --gpu-mem, --host-mem and section.key=value overrides go with --explain",
              file=sys.stderr)
        return 2

    if args.model and args.sequence_parallel > 1:  # the model's heads, for the sequence-parallel rules
        from toolkit.config.schema import load_config
        from toolkit.runtime.model import model_config

        text = model_config(load_config(None, [f"model.name={args.model}"]))
        text = text_config(text)
        q = getattr(text, "num_attention_heads", None)
        args.heads = (q, getattr(text, "num_key_value_heads", q)) if q else None
    return run_check(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from toolkit.observe.report import run_report

    return run_report(args)


def _cmd_merge_adapter(args: argparse.Namespace) -> int:
    from toolkit.runtime.quant.merge import merge_adapter

    r = merge_adapter(Path(args.adapter), Path(args.base), Path(args.out), base_weights=args.base_weights,
                      quant_type=args.quant_type, dtype=args.dtype)
    how = f"{r['base_weights']} base" + (f" ({r['rounded_linears']} Linears through {r['quant_type']})"
                                         if r["base_weights"] == "dequantized" else "")
    print(f"merged {args.adapter} into the {how} of {args.base}: {args.out} ({r['dtype']})")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from toolkit.launch.envcheck import run_env

    return run_env(args)


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        # `toolkit check DS --explain --world-size 2 train.lr=1e-4`: overrides after an option are positionals
        # argparse has already closed; they are the explain's overrides, anything else stays an error
        ns, extra = self.parse_known_args(args, namespace)
        if extra and not (getattr(ns, "explain", False) and all("=" in x and not x.startswith("-") for x in extra)):
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        if extra:
            ns.overrides = [*ns.overrides, *extra]
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="toolkit", description="DeepSpeed ZeRO training toolkit")
    parser.add_argument("--version", action="version", version=f"toolkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("gen-config", help="write a DeepSpeed ZeRO config",
                       description="Generate a DeepSpeed config. Values the training config owns are \"auto\" "
                                   "where every --consumer fills them, numbers elsewhere.")
    g.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    g.add_argument("--offload-optimizer", choices=OFFLOADS, default="none", help="optimizer state offload")
    g.add_argument("--offload-param", choices=OFFLOADS, default="none", help="parameter offload (stage 3 only)")
    g.add_argument("--nvme-path", default="/local_nvme", help="NVMe directory for nvme offload")
    g.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: from the training config")
    g.add_argument("--micro-batch", type=_positive_int, help="fix train_micro_batch_size_per_gpu")
    g.add_argument("--grad-accum", type=_positive_int, help="fix gradient_accumulation_steps")
    g.add_argument("--world-size", type=_positive_int, help="with both above, fixes train_batch_size")
    g.add_argument("--lr", type=float, default=None, help="fix optimizer.params.lr (needed for --consumer deepspeed)")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: DeepSpeed's Muon for the 2-D hidden matrices, Adam for the rest (docs/optimizers.md)")
    g.add_argument("--optimizer-states", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: master weights, gradients and optimizer states in bf16 (ZeRO 1-3; 6 bytes a parameter "
                        "less than fp32's 12 with AdamW)")
    g.add_argument("--consumer", action="append", choices=CONSUMERS, metavar="CONSUMER",
                   help=f"who will read the file (repeat for several; default: {' '.join(DEFAULT_TARGETS)}); "
                        f"one of {', '.join(CONSUMERS)}. See `toolkit check --help`")
    g.add_argument("-o", "--output", help="file to write (a directory with --all); stdout if omitted")
    g.add_argument("--force", action="store_true", help="overwrite existing files")
    g.add_argument("--expert-parallel", type=_positive_int, default=None, metavar="N",
                   help="Mixture-of-Experts: DeepSpeed's AutoEP with autoep_size N (expert_parallel block)")
    g.add_argument("--ep-preset", default=None, metavar="NAME",
                   help="with --expert-parallel: AutoEP's preset_model (mixtral, qwen3_moe, deepseek_v3, ...)")
    g.add_argument("--all", action="store_true", help="write the standard preset set (default dir ds_configs/)")
    g.set_defaults(func=_cmd_gen_config)

    c = sub.add_parser("check", help="validate a DeepSpeed config before launch",
                       description="Static rules plus DeepSpeed's own validation. Exit 0: will run; 1: will not; 2: usage.")
    c.add_argument("file", help="DeepSpeed JSON/HJSON config")
    c.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel world size of the launch")
    c.add_argument("--optimizer", default=None,
                   help="client optimizer the training code passes (e.g. torch.adamw, bnb.adamw8bit, DeepSpeedCPUAdam); "
                        "omit when the config's optimizer section is used")
    c.add_argument("--consumer", "--path", dest="consumer", choices=CONSUMERS, default="trainer", metavar="CONSUMER",
                   help="who reads the file, which decides the \"auto\" values that get filled: trainer or raw "
                        "(toolkit/train.py's paths; --path is the old spelling), hf-trainer (your own HF Trainer "
                        "script), accelerate (accelerate launch --deepspeed_config_file), deepspeed (bare "
                        "deepspeed.initialize: fills none). Default: trainer")
    c.add_argument("--micro-batch", type=_positive_int, default=None, help="micro batch the training config gives")
    c.add_argument("--grad-accum", type=_positive_int, default=None, help="accumulation the training config gives")
    c.add_argument("--sequence-parallel", type=_positive_int, default=1, metavar="N",
                   help="train.sequence_parallel of the run: its rules against --world-size (ranks), the config's "
                        "ZeRO stage and, with --model, the model's heads and --seq-len")
    c.add_argument("--model", default=None, help="with --sequence-parallel: model.name (a preset or a local directory)")
    c.add_argument("--seq-len", type=_positive_int, default=None, help="with --sequence-parallel: data.seq_len")
    c.add_argument("--json", action="store_true", help="print findings as a JSON list (with --explain: the record)")
    c.add_argument("--explain", action="store_true",
                   help="resolve the whole run as toolkit/train.py would for this DeepSpeed config, --config, the "
                        "overrides and --world-size, on this machine, and print every setting with its reason "
                        "(the block a run prints first; --json: its resolved.json); nothing is launched")
    c.add_argument("--config", default=None, help="with --explain: the training YAML")
    c.add_argument("--gpu-mem", type=float, default=None, metavar="GIB",
                   help="with --explain: resolve for GPU nodes with this much memory per GPU, not this machine "
                        "(as toolkit plan takes it: a login node sees what the GPU nodes will decide)")
    c.add_argument("--gpus", type=_positive_int, default=None, help="with --gpu-mem: GPUs per node (default: "
                                                                    "the world size, at most 8)")
    c.add_argument("--host-mem", type=float, default=None, metavar="GIB", help="with --gpu-mem: host RAM per node")
    c.add_argument("overrides", nargs="*", help="with --explain: section.key=value, as toolkit/train.py takes them")
    c.set_defaults(func=_cmd_check)

    r = sub.add_parser("report", help="tables and a plot of one run, or several runs compared",
                       description="One RUN_DIR: report.md and report.png (loss, tokens/s, per-rank memory). "
                                   "Several: compare.md and compare.png (settings that differ, results, "
                                   "runs overlaid). Reads only the run directories; needs no GPU or torch.")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.run_dir of a toolkit/train.py run")
    r.add_argument("-o", "--output", default=None,
                   help="directory to write into (default: RUN_DIR for one run, the current directory for several)")
    r.add_argument("--force", action="store_true", help="compare runs of different models or data anyway")
    r.set_defaults(func=_cmd_report)

    from toolkit.plan.command import add_parser as add_plan_parser  # no torch: planning is arithmetic

    add_plan_parser(sub)

    m = sub.add_parser("merge-adapter", help="merge a LoRA/QLoRA adapter into its float base (one HF directory)",
                       description="After training: PEFT's merge of RUN_DIR/adapter into the base model directory. "
                                   "For a 4-bit run the base is first rounded through the run's 4-bit format "
                                   "(--base-weights dequantized, the default there), so the merged model computes "
                                   "what the trained one did; --base-weights original merges into the float weights "
                                   "as they are.")
    m.add_argument("adapter", help="the adapter directory (RUN_DIR/adapter, written with train.export=true)")
    m.add_argument("--base", required=True, help="the HF model directory the run started from")
    m.add_argument("--out", required=True, help="where to write the merged model")
    m.add_argument("--base-weights", choices=("dequantized", "original"), default=None,
                   help="default: dequantized for a model.load_in_4bit run (read from RUN_DIR/config.yaml), else "
                        "original")
    m.add_argument("--quant-type", choices=("nf4", "fp4"), default=None, help="default: the run's")
    m.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    m.set_defaults(func=_cmd_merge_adapter)

    e = sub.add_parser("env", help="pre-flight checks: versions, GPUs, op builds, NCCL, hosts")
    e.add_argument("--hostfile", default=None,
                   help="probe every host over ssh: reachable, versions, interface to use, slots")
    e.add_argument("--ssh-timeout", type=float, default=5.0, help="seconds per host")
    e.add_argument("--no-build", action="store_true", help="skip the DeepSpeed op build checks")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from toolkit.config.ds_config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
