"""Baseline: QLoRA the way transformers + PEFT document it, through the plain HF Trainer with a DeepSpeed JSON.

Imports nothing from `toolkit`. The recipe (PEFT's "DeepSpeed" guide, QLoRA with ZeRO; transformers' bitsandbytes
page): a bf16 base saved to a directory, loaded with `BitsAndBytesConfig(load_in_4bit=True, nf4, double quant,
compute and storage in bf16)`, `prepare_model_for_kbit_training`, `get_peft_model(LoraConfig(...))`, then
`Trainer(..., deepspeed=JSON)`. The base is the shape's random init (no hub), written once by rank 0. bench/bare_loop.py
gives the shapes, the DeepSpeed JSON and the result file; bench/hf_trainer.py the step timer and the data:

    deepspeed --num_gpus 1 --master_port P bench/qlora_hf.py --model llama-3-8b --seq 2048 --micro 4 \
        --global-batch 4 --stage 2 --warmup 1 --steps 3 --base /tmp/base --out result.json [--liger] [--grad-ckpt] \
        [--ds-json ds_configs/zero2.json]

LoRA r=8 (alpha 16, dropout 0) on q_proj and v_proj, as the toolkit's default `lora.*`. `--liger` sets the Trainer's
`use_liger_kernel=True` (its documented switch); `--grad-ckpt` turns on checkpointing as PEFT's QLoRA examples do
(reentrant). `--ds-json FILE` hands the Trainer that DeepSpeed JSON (the file the toolkit's run is launched with; the
Trainer fills its "auto" values) in place of bench/bare_loop.py's. CPU: bitsandbytes' CPU kernels, fp32 compute.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from bare_loop import ds_config, model_config, parse_args, start, write_result
from hf_trainer import train_timed
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainingArguments


def main() -> None:
    import sys

    base = Path(sys.argv[sys.argv.index("--base") + 1])
    del sys.argv[sys.argv.index("--base"):sys.argv.index("--base") + 2]
    ds_json = None
    if "--ds-json" in sys.argv:
        ds_json = sys.argv[sys.argv.index("--ds-json") + 1]
        del sys.argv[sys.argv.index("--ds-json"):sys.argv.index("--ds-json") + 2]
    ckpt = "--grad-ckpt" in sys.argv
    if ckpt:
        sys.argv.remove("--grad-ckpt")
    args = parse_args()
    cpu, device, rank, grad_accum = start(args)
    dtype = torch.float32 if cpu else torch.bfloat16
    config = model_config(args.model, args.layers)
    if rank == 0 and not (base / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(device):  # random init on the GPU: minutes faster than on the host at 8B
            AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(base)
    if not cpu:  # the peak counts training, not the base's init above
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.micro, gradient_accumulation_steps=grad_accum,
            max_steps=total, bf16=not cpu, learning_rate=1e-4, lr_scheduler_type="constant",
            deepspeed=ds_json or ds_config(args, grad_accum, not cpu), use_liger_kernel=args.liger,
            logging_steps=1, report_to=[], save_strategy="no", dataloader_drop_last=True, disable_tqdm=True,
            use_cpu=cpu, gradient_checkpointing=ckpt,
            gradient_checkpointing_kwargs={"use_reentrant": True} if ckpt else None,
        )
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=bnb, dtype=dtype,
                                                     attn_implementation="sdpa")
        # --grad-ckpt: PEFT's QLoRA recipe as its examples give it (examples/sft: gradient_checkpointing True,
        # use_reentrant True, "else QLoRA leads to high GPU memory consumption"; prepare_model_for_kbit_training's
        # default); without it, checkpointing stays off
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=ckpt,
                                                gradient_checkpointing_kwargs={"use_reentrant": True})
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        n_params = sum(p.numel() for p in model.parameters())
        timer = train_timed(model, targs, args, config.vocab_size, cpu)
    variant = "hf-peft-qlora" + ("-liger" if args.liger else "") + ("-ckpt" if ckpt else "") + ("-dsjson" if ds_json else "")
    write_result(args, variant, device, grad_accum, timer.times[args.warmup:], timer.losses, n_params, config)
    dist.barrier()


if __name__ == "__main__":
    main()
