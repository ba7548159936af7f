"""Build DeepSpeed's JIT ops once before timed runs (fused_adam on CUDA, cpu_adam for offload).

Goes through toolkit.launch.dist.prepare_env first, so a TORCH_CUDA_ARCH_LIST that DeepSpeed's builder
cannot parse (e.g. 9.0a on Hopper images) is fixed the way toolkit/train.py fixes it.
    python bench/prebuild_ops.py [fused_adam] [cpu_adam]
"""

import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from toolkit.launch.dist import prepare_env  # noqa: E402

for note in prepare_env():
    print(note, flush=True)

from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder  # noqa: E402

wanted = sys.argv[1:] or ["fused_adam", "cpu_adam"]
for builder in (FusedAdamBuilder(), CPUAdamBuilder()):
    if builder.name not in wanted:
        continue
    t0 = time.perf_counter()
    if builder.is_compatible():
        builder.load()
        print(f"built {builder.name} in {time.perf_counter() - t0:.0f}s", flush=True)
