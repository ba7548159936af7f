"""Configuration: the typed training schema, DeepSpeed JSON (presets, "auto" resolution), model presets
and the rules behind `toolkit check`. Pure: nothing here imports torch at module level."""
