"""Planning before launch: model shapes on the meta device, the per-rank memory and speed model,
which Liger kernels a run gets, and `toolkit plan`."""
