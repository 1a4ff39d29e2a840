"""The tiny random Llama the runner tests build in memory (no files): peaked, tie-free distributions."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab: int = 300, hidden: int = 64, intermediate: int = 128, layers: int = 2,
               max_positions: int = 512, varied_norms: bool = False, **extra) -> LlamaForCausalLM:
    """`varied_norms`: RMSNorm weights that are not all ones, so a path that forgot to apply them differs."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, **extra)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        if varied_norms:
            for layer in model.model.layers:
                layer.input_layernorm.weight.normal_(1.0, 0.3)
                layer.post_attention_layernorm.weight.normal_(1.0, 0.3)
    return model
