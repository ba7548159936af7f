"""What a run trains on: files tokenized once into a memory-mapped cache (corpus.py), rows, packing, collation and
the batch order both paths share (batches.py), JSON-lines input with one-line errors (jsonl.py)."""
