"""DeepSpeed ZeRO training toolkit. Kept import-free so `toolkit --help` stays instant: the library
names below load on first use (`from toolkit import ToolkitCallback` imports transformers then)."""

from typing import Any

__version__ = "0.1.0"

# name -> module that defines it
_LAZY = {"ToolkitCallback": "toolkit.runtime.hf_callback", "NonFiniteError": "toolkit.runtime.faults.guards"}
__all__ = ["NonFiniteError", "ToolkitCallback", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
