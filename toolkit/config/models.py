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
    # Long-context shapes (issue 35): their own 131,072 positions through Llama 3's rope scaling, as published.
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         tie_word_embeddings=False),
    # Shapes the planner's speed model was not fitted on (issue 50): head dim 128 with GQA 6:1 and 8:1 (Qwen2.5) and
    # 4:1 (Mistral), as their published configs give them.
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "qwen2.5-3b": dict(model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                       sliding_window=None, tie_word_embeddings=False),
    # Families the planner knows only from their own code (issue 60: traced, toolkit/plan/trace.py), as their published
    # configs give them: Qwen3 (q/k norms, head dim 128 over a 2,560 hidden), Phi-3 (fused qkv and gate/up projections),
    # Gemma 3 (four norms a layer, five sliding-window layers to one global, a 262K vocabulary).
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True),
    "phi3-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096, rope_theta=10_000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False),
    "gemma3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                      sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # HRM-Text-1B's shape (transformers' HRM defaults): two stacks of 16 layers run in cycles, H_cycles x (L_cycles + 1)
    # stack passes a forward, the earlier low-level ones without gradients (its num_hidden_layers becomes 128 cache slots)
    "hrm-text-1b": dict(model_type="hrm_text", vocab_size=151808, hidden_size=1536, intermediate_size=4096,
                        num_hidden_layers=16, num_attention_heads=12, head_dim=128, max_position_embeddings=2048,
                        H_cycles=2, L_cycles=3, L_bp_cycles=[2], tie_word_embeddings=False),
    # BLT-1B's shape (transformers' BLT defaults: a one-layer local encoder, a 25-layer global stack at width 2,048, a
    # nine-layer local decoder with cross-attention, 3.07B parameters of hash embeddings) without its entropy patcher:
    # every byte a patch, as transformers' BLT makes them without one, so what the global stack runs is the row's
    # whole length (a patcher at random init makes one a byte too)
    "blt-1b-bytes": dict(model_type="blt", patch_in_forward=False, tie_word_embeddings=False),
    # a character-level Reformer at width 1,024 (enwik8's scale: 258 byte tokens): 12 reversible layers, local and LSH
    # attention in turn, rows of 16,384 (the product of its axial positions, the only length it trains at)
    "reformer-16k": dict(model_type="reformer", vocab_size=258, hidden_size=1024, feed_forward_size=4096,
                         num_hidden_layers=12, num_attention_heads=8, attention_head_size=128,
                         attn_layers=["local", "lsh"] * 6, axial_pos_shape=[128, 128], axial_pos_embds_dim=[256, 768],
                         max_position_embeddings=16384, is_decoder=True, local_attn_chunk_length=128,
                         lsh_attn_chunk_length=128, num_hashes=2, tie_word_embeddings=False),
    # Mixture-of-Experts shapes (issue 32), random init as the dense presets; tiny ones for CPU tests, with every
    # MoE field set (the families' defaults are the full models': Qwen3-MoE's moe_intermediate_size is 768).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, max_position_embeddings=40960, rope_theta=1_000_000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "olmoe-1b-7b": dict(model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096,
                        rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # dimensions multiples of 16 (CPU grouped_mm wants 16-byte alignment); 8 experts, top-2
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                           decoder_sparse_step=1, max_position_embeddings=512, tie_word_embeddings=False),
    "tiny-mixtral": dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False),
    "tiny-olmoe": dict(model_type="olmoe", vocab_size=1000, hidden_size=64, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=512,
                       tie_word_embeddings=False),
    "bert-large": dict(model_type="bert", vocab_size=30522, hidden_size=1024, intermediate_size=4096,
                       num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=512),
    # No dropout: a test model must be deterministic so both paths can be compared step by step.
    "tiny-bert": dict(model_type="bert", vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0),
}
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def extend_positions(mc: Any, factor: float) -> Any:
    """model.rope_factor: the HF config `mc` with factor x its positions, through rope scaling (in place; returns
    it). A model with no rope scaling gets YaRN from its own positions; one with a scaling (llama3, yarn,
    linear, dynamic) gets that scaling's factor multiplied, the way Qwen2.5's YaRN is raised by users."""
    if factor == 1:
        return mc
    positions = int(mc.max_position_embeddings)
    attr = "rope_parameters" if hasattr(mc, "rope_parameters") else "rope_scaling"  # transformers 5 / 4
    current = dict(getattr(mc, attr, None) or {})
    theta = current.get("rope_theta", getattr(mc, "rope_theta", None))
    if current.get("rope_type", "default") == "default":
        new = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": positions}
    else:
        new = current | {"factor": float(current.get("factor", 1.0)) * factor}
        new.setdefault("original_max_position_embeddings", positions)
    if attr == "rope_parameters" and theta is not None:
        new["rope_theta"] = theta
    new.pop("type", None)
    setattr(mc, attr, new)
    mc.max_position_embeddings = int(positions * factor)
    return mc


def positions_hint(limit: int) -> str:
    """How to train past `limit` positions, for the one line that refuses a longer sequence."""
    return (f"extend them with model.rope_factor (e.g. {limit * 4:,} positions: model.rope_factor=4, rope scaling "
            "from the model's own), or take a model with more (the presets llama-3.2-1b and llama-3.1-8b: 131,072)")


def per_layer(config: Any, name: str, layers: int) -> list[Any]:
    """`name` for each of `layers` decoder layers: read from each layer's config where transformers' per_layer_config
    sets it per layer (Gemma 4's head_dim), whose global read it refuses; else the config's own value for every
    layer (None where the config has none)."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(config.per_layer_config[i], name, None) for i in range(layers)]
    return [getattr(config, name, None)] * layers


def text_config(config: Any) -> Any:
    """The language model's config: a composite (vision-language) config's text config, else the config itself (None
    stays None)."""
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
