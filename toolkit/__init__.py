"""DeepSpeed ZeRO training toolkit. Kept import-free so `toolkit --help` stays instant."""

__version__ = "0.1.0"
