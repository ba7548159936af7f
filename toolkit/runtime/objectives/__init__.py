"""Training objectives beyond next-token SFT: preference losses (losses.py) on selected-token log-probs computed in
chunks from the hidden states (logprobs.py)."""
