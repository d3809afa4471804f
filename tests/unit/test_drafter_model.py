import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specserve.drafter.model import Drafter, DrafterConfig, full_heads

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    draft_vocab_size=100,
    aux_layer_ids=(1, 2, 3),
)


def make(**switches) -> Drafter:
    torch.manual_seed(0)
    model = Drafter(DrafterConfig(**TINY, **switches))
    model.set_draft_vocab(torch.randperm(300)[:100])
    # Non-trivial norm weights so the switches have something to change.
    for p in model.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return model


def inputs(B=2, T=7, steps=3):
    torch.manual_seed(1)
    aux = torch.randn(B, T, 3 * 64)
    aux[..., :64] *= 50  # layers at very different scales, as in real targets
    return aux, torch.randint(0, 300, (B, T + steps - 1))


def test_unrolled_shapes():
    logits = make().unrolled(*inputs(), steps=3)
    assert len(logits) == 3 and all(x.shape == (2, 7, 100) for x in logits)


def test_fc_norm_normalises_each_captured_state_before_fc():
    plain, norm = make(), make(fc_norm=True)
    assert plain.fc_norm is None and len(norm.fc_norm) == 3
    aux, _ = inputs()
    # Scaling one captured layer changes EAGLE-3's fc input but not EAGLE-3.1's.
    scaled = aux.clone()
    scaled[..., 64:128] *= 10
    assert not torch.allclose(plain.combine(aux), plain.combine(scaled))
    torch.testing.assert_close(norm.combine(aux), norm.combine(scaled), rtol=1e-4, atol=1e-4)


def test_norm_output_feeds_post_norm_state_to_next_step_only():
    base, switched = make(), make(norm_output=True)
    switched.load_state_dict(base.state_dict())
    aux, ids = inputs()
    a, b = base.unrolled(aux, ids, 3), switched.unrolled(aux, ids, 3)
    torch.testing.assert_close(a[0], b[0])  # step 0 reads target states either way
    assert not torch.allclose(a[1], b[1])  # later steps read a different hidden state
    normed, prenorm = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    assert switched.next_hidden(normed, prenorm) is normed
    assert base.next_hidden(normed, prenorm) is prenorm


def test_step_j_sees_context_up_to_t_and_its_own_drafts_only():
    model = make()
    aux, ids = inputs(B=1, T=6)
    ref = model.unrolled(aux, ids, 3)
    # Changing the future (index 5) must not change steps at index 2.
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[:, 5] += 1
    ids2[:, 5 + 2 :] = (ids2[:, 5 + 2 :] + 1) % 300
    out = model.unrolled(aux2, ids2, 3)
    for j in range(3):
        torch.testing.assert_close(ref[j][:, :3], out[j][:, :3])


@pytest.mark.parametrize("switches", [{}, {"fc_norm": True, "norm_output": True}])
def test_unrolling_from_an_index_gives_the_same_logits_there(switches):
    # Training skips the prompt in steps >= 1; what it computes for the answer must not change.
    model = make(**switches)
    aux, ids = inputs(B=2, T=9)
    full = model.unrolled(aux, ids, 3)
    for start in (1, 4, 8):
        part = model.unrolled(aux, ids, 3, logits_from=start)
        for j in range(3):
            torch.testing.assert_close(part[j], full[j][:, start:])


def test_full_heads_attend_as_grouped_query_attention():
    """What the GPU path feeds kernels that take no grouped heads attends as the CPU path does."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 7, 8, generator=g) for h in (6, 2, 2))
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    grouped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    full = F.scaled_dot_product_attention(q, *full_heads(q, k, v), attn_mask=mask)
    torch.testing.assert_close(full, grouped)
    assert not torch.allclose(  # the grouping matters: heads repeated the other way differ
        F.scaled_dot_product_attention(
            q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), attn_mask=mask
        ),
        grouped,
    )


def test_draft_vocab_mapping_round_trips():
    model = make()
    ids = model.draft_ids()
    assert model.t2d.sum() == 100 and model.t2d[ids].all()
    assert torch.equal(model.to_draft(ids), torch.arange(100))
    missing = (~model.t2d).nonzero()[0]
    assert model.to_draft(missing).item() == -100


@pytest.mark.parametrize("switches", [{}, {"fc_norm": True, "norm_output": True}])
def test_export_uses_vllm_names_and_round_trips(tmp_path, switches):
    model = make(**switches)
    model.export(tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert config["draft_vocab_size"] == 100
    assert config.get("fc_norm", False) == bool(switches)
    assert config.get("norm_output", False) == bool(switches)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "midlayer.self_attn.q_proj.weight" in names
    assert not any(n.startswith("embed_tokens") for n in names)
    assert ({"fc_norm.0.weight", "fc_norm.2.weight"} <= names) == bool(switches)
    if not switches:
        assert "fc_norm" not in config and "norm_output" not in config  # plain EAGLE-3 format

    loaded = Drafter.from_pretrained(tmp_path, embed_weight=model.embed_tokens.weight)
    aux, ids = inputs()
    for a, b in zip(model.unrolled(aux, ids, 2), loaded.unrolled(aux, ids, 2), strict=True):
        torch.testing.assert_close(a, b)


def test_target_layer_init_copies_the_last_layer_and_passes_the_last_state(tmp_path):
    from safetensors.torch import save_file

    from specserve.drafter.train import init_from_target_layer

    torch.manual_seed(2)
    h, inter, kv = 64, 128, 2 * 16
    shapes = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    target = {
        f"model.layers.{layer}.{name}": torch.randn(shape)
        for layer in (0, 1, 4)
        for name, shape in shapes.items()
    }
    save_file(target, tmp_path / "model.safetensors")
    model = make()
    embedding_half = model.midlayer.self_attn.q_proj.weight[:, :h].clone()
    init_from_target_layer(model, str(tmp_path))

    last = "model.layers.4."  # the highest-numbered layer, wherever numbering stops
    attn, mlp = model.midlayer.self_attn, model.midlayer.mlp
    assert torch.equal(attn.q_proj.weight[:, h:], target[last + "self_attn.q_proj.weight"])
    assert torch.equal(attn.q_proj.weight[:, :h], embedding_half)  # kept random
    assert torch.equal(attn.v_proj.weight[:, h:], target[last + "self_attn.v_proj.weight"])
    assert torch.equal(mlp.down_proj.weight, target[last + "mlp.down_proj.weight"])
    assert torch.equal(model.midlayer.hidden_norm.weight, target[last + "input_layernorm.weight"])
    aux, _ = inputs()
    assert torch.allclose(model.combine(aux), aux[..., 2 * h :])  # fc passes the last through
