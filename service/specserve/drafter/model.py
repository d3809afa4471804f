"""The EAGLE-3 drafter, and EAGLE-3.1 as two switches on it.

EAGLE-3: hidden states captured from three target layers are concatenated and projected by `fc`
to one hidden state; one decoder layer takes it together with the embedding of the next token;
a final norm and a draft-vocabulary `lm_head` give the next-next token.
EAGLE-3.1 adds `fc_norm` (an RMSNorm on each captured state before `fc`, so layers with very
different scales weigh in evenly) and `norm_output` (the next draft step is fed the post-norm
hidden state instead of the pre-norm one), which keeps the drafter's attention on the prompt as
it drafts deeper.

Module and parameter names are the checkpoint names vLLM's `Eagle3LlamaForCausalLM` loads
(`midlayer.*`, `fc`, `fc_norm.{0,1,2}`, `norm`, `lm_head`, `d2t`, `t2d`), so `export` is a
state-dict copy. The layer computes exactly what vLLM's does, so what trains here drafts there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ARCHITECTURE = "Eagle3LlamaForCausalLM"
# The two drafters a build trains, by the EAGLE-3.1 switches they set (both off: EAGLE-3).
VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}


@dataclass
class DrafterConfig:
    # Shapes must match the target: the drafter reads its hidden states and shares its
    # embedding (vLLM reuses the target's `embed_tokens` when the checkpoint has none).
    hidden_size: int = 576
    intermediate_size: int = 1536  # as the target's MLP; the one layer is the whole drafter
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152  # target vocabulary
    draft_vocab_size: int = 8192  # lm_head rows: the most frequent target tokens (d2t / t2d)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    # Target layers whose input hidden states are captured: vLLM's default (2, L/2, L-3).
    aux_layer_ids: tuple[int, ...] = (2, 15, 27)
    # The two EAGLE-3.1 switches; both off is plain EAGLE-3.
    fc_norm: bool = False
    norm_output: bool = False
    extra: dict = field(default_factory=dict)  # passed through to config.json

    @classmethod
    def for_target(cls, target_config, **overrides) -> DrafterConfig:
        """Shapes from a transformers LlamaConfig of the target."""
        layers = target_config.num_hidden_layers
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None)
            or target_config.hidden_size // target_config.num_attention_heads,
            vocab_size=target_config.vocab_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
            max_position_embeddings=target_config.max_position_embeddings,
            aux_layer_ids=(2, layers // 2, layers - 3),
            **overrides,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's half-split form). x: (B, heads, T, D); positions: (B, T)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None, :, None] * freqs  # (B, 1, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# Attention kernels on a GPU. Not cuDNN's: it builds a graph for every new input shape (hundreds
# of milliseconds each), and batches of captured sequences change shape at every forward.
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def full_heads(q, k, v):
    """k and v (B, nkv, S, D) repeated to q's heads, as grouped-query attention shares them."""
    groups = q.shape[1] // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.c = c
        # Queries, keys and values read [embedding, hidden] side by side: 2H wide.
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x: (B, T, 2H) -> q (B, nh, T, D), k and v (B, nkv, T, D), rotated."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta), v

    def attend(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, D) over k, v (B, nkv, S, D) with a boolean mask (T, S) -> (B, T, H)."""
        if q.device.type == "cuda":  # every kernel takes full heads; not all take grouped ones
            k, v = full_heads(q, k, v)
            with sdpa_kernel(CUDA_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The drafter's one decoder layer (vLLM: layers.0 of Eagle3 LlamaModel)."""

    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the incoming hidden
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class Drafter(nn.Module):
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c = self.config = config
        n_aux = len(c.aux_layer_ids)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in range(n_aux))
            if c.fc_norm
            else None
        )
        self.fc = nn.Linear(n_aux * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Frozen copy of the target's embedding: used in training, never exported.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        # draft id i is target id i + d2t[i]; t2d marks target ids the draft vocabulary has.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    # -- the pieces of one draft step ---------------------------------------------------------

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Captured target states (B, T, 3H) -> the first step's hidden input (B, T, H)."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(aux)

    def layer_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """-> (B, T, 2H) attention input and the residual (the un-normed hidden)."""
        m = self.midlayer
        return torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1), hidden

    def layer_outputs(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """Attention output -> (normed, prenorm) hidden states, both (B, T, H)."""
        m = self.midlayer
        residual = attn_out + residual
        prenorm = m.mlp(m.post_attention_layernorm(residual)) + residual
        return self.norm(prenorm), prenorm

    def next_hidden(self, normed: torch.Tensor, prenorm: torch.Tensor) -> torch.Tensor:
        """What the next draft step is fed: post-norm with `norm_output` (EAGLE-3.1)."""
        return normed if self.config.norm_output else prenorm

    # -- training-time test ---------------------------------------------------------------------

    def unrolled(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        logits_from: int = 0,
        *,
        heads: bool = True,
    ) -> list[torch.Tensor]:
        """Draft-vocabulary logits for `steps` unrolled draft steps, as inference runs them.

        aux: (B, T, 3H) target states at positions 0..T-1; input_ids: (B, T + steps - 1) where
        input_ids[:, t] is the token after position t. Step j at index t sits at position t + j
        (embedding input_ids[:, t + j], hidden from step j-1 at index t) and predicts the token
        after that. Its query sees step 0's keys at indices <= t (the context, built from target
        states) and steps 1..j's keys at index t (its own earlier drafts): the attention pattern
        vLLM has when drafting. Returns one (B, T - logits_from, V_draft) tensor per step.
        Only step 0's keys and values cover the whole sequence (they are everyone's context);
        all queries, and so all logits, start at index `logits_from`, which training sets to
        skip the prompt. With `heads=False` it returns each step's post-norm hidden states
        (B, T - logits_from, H) instead, for a caller that applies `lm_head` to the rows it
        needs only (training: the answer's).
        """
        B, T, _ = aux.shape
        f = logits_from
        attn = self.midlayer.self_attn
        hidden = self.combine(aux)  # (B, T, H)
        positions = torch.arange(T, device=aux.device).expand(B, T)
        # Queries only from index f on: before it, step 0 is needed for its keys and values.
        causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()[f:]
        diagonal = torch.eye(T - f, dtype=torch.bool, device=aux.device)
        keys, values, logits = [], [], []
        for j in range(steps):
            start = 0 if j == 0 else f  # step 0: every index (the context); later: index >= f
            embeds = self.embed_tokens(input_ids[:, start + j : T + j])
            x, residual = self.layer_inputs(embeds, hidden)
            q, k, v = attn.project(x, positions[:, start:] + j)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * j, dim=1)  # (T - f, T + j * (T - f))
            out = attn.attend(
                q[:, :, f - start :], torch.cat(keys, dim=2), torch.cat(values, dim=2), mask
            )
            normed, prenorm = self.layer_outputs(out, residual[:, f - start :])
            logits.append(self.lm_head(normed) if heads else normed)
            hidden = self.next_hidden(normed, prenorm)
        return logits

    # -- vocabulary ------------------------------------------------------------------------------

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these target token ids (draft_vocab_size of them) as the draft vocabulary."""
        ids = torch.sort(target_ids.long()).values
        assert ids.numel() == self.config.draft_vocab_size, "one id per lm_head row"
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids; -100 (ignored by the loss) where the draft has no such id."""
        lookup = torch.full(
            (self.config.vocab_size,), -100, dtype=torch.long, device=self.d2t.device
        )
        lookup[self.draft_ids()] = torch.arange(
            self.config.draft_vocab_size, device=self.d2t.device
        )
        return lookup[target_ids]

    # -- checkpoints -----------------------------------------------------------------------------

    def export(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write a checkpoint vLLM loads with `speculative_config.method: eagle3`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            name: t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous()
            for name, t in self.state_dict().items()
            if not name.startswith("embed_tokens.")
        }
        save_file(tensors, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(self.hf_config(dtype), indent=2))
        return directory

    def hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        c = self.config
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "vocab_size": c.vocab_size,
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.hidden_size,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)},
            **c.extra,
        }
        # Written only when on: an EAGLE-3 checkpoint stays byte-for-byte the old format.
        if c.fc_norm:
            config["fc_norm"] = True
        if c.norm_output:
            config["norm_output"] = True
        return config

    @classmethod
    def from_pretrained(cls, directory: str | Path, embed_weight: torch.Tensor | None = None):
        """Load an exported checkpoint (ours or any vLLM-format EAGLE-3 / 3.1 Llama drafter)."""
        directory = Path(directory)
        hf = json.loads((directory / "config.json").read_text())
        config = DrafterConfig(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=hf.get("rope_theta", 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            aux_layer_ids=tuple(
                (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                or DrafterConfig.aux_layer_ids
            ),
            fc_norm=bool(hf.get("fc_norm", False)),
            norm_output=bool(hf.get("norm_output", False)),
        )
        model = cls(config)
        state = load_file(directory / "model.safetensors")
        if "d2t" not in state:  # full vocabulary: identity mapping
            state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
        if embed_weight is not None:
            state["embed_tokens.weight"] = embed_weight
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(f"{directory}: missing {missing}, unexpected {unexpected}")
        return model.float()
