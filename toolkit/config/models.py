"""Named model presets: HF config fields of each shape the toolkit builds from a config (random init, no
download). Pure data, so the planner reads them without importing torch or the runtime."""

from __future__ import annotations

from typing import Any

# Shapes of the seed workloads (../shared/anchors.md) plus a tiny model for CPU tests.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=False),
    "gpt2-124m": dict(model_type="gpt2", vocab_size=50304, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=8192, rope_theta=500_000.0, tie_word_embeddings=True),
    # Shapes for planning and the largest single-GPU run (`toolkit plan`, issue 11); random init, no download.
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500_000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False),
    "llama-3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        max_position_embeddings=8192, rope_theta=500_000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=False),
    "bert-large": dict(model_type="bert", vocab_size=30522, hidden_size=1024, intermediate_size=4096,
                       num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=512),
    # No dropout: a test model must be deterministic so both paths can be compared step by step.
    "tiny-bert": dict(model_type="bert", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0),
}
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
