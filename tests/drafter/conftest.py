"""A tiny randomly initialised Llama target with the embedded model's tokenizer: the drafter
toolkit's whole path in seconds."""

import pytest
import torch

from specserve.models import resolve_model_source


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = resolve_model_source("embedded://SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,  # aux layers (2, 4, 5): distinct
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,  # the generation engine's context
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
