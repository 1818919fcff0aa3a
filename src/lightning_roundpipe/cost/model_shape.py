"""The numbers of a decoder-only transformer's config that decide its cost (``ModelShape``).

Below both ``transformer`` (per-layer costs) and ``activations`` (activation bytes), which read it,
so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer's config that decide its cost."""

    name: str
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_layers: int
    tie_embeddings: bool = False  # LM head shares the embedding matrix
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3)
    num_experts: int = 0  # MoE: experts per layer (0: a dense MLP of ``intermediate``)
    experts_per_token: int = 0  # MoE: routed experts each token runs
    expert_intermediate: int = 0  # MoE: intermediate size of one expert
    # Base weights as stored ("nf4": a 4-bit base, cost/quantization.py; None: the compute dtype), and which
    # linear maps LoRA adapts ("all": every one but the router; "attention": q, k, v and o only).
    quantization: str | None = None
    lora_targets: str = "all"

    def __post_init__(self) -> None:
        if self.lora_targets not in LORA_TARGETS:
            raise ValueError(f"lora_targets must be one of {LORA_TARGETS}, got {self.lora_targets!r}")

    @property
    def lora_on_mlp(self) -> bool:
        """Whether LoRA adapts the MLP (every expert's in an MoE layer) besides the attention."""
        return self.lora_targets == "all"

    @property
    def is_moe(self) -> bool:
        """Whether the model has Mixture-of-Experts layers."""
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        """Width of the attention queries (heads x head dimension)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the attention keys and values (KV heads x head dimension)."""
        return self.num_kv_heads * self.head_dim

    def attention_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of the four attention projections: q, k, v, o."""
        h = self.hidden
        return [(h, self.q_dim), (h, self.kv_dim), (h, self.kv_dim), (self.q_dim, h)]

    def mlp_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one MLP (dense) or one expert (MoE): gate, up, down."""
        h, i = self.hidden, self.expert_intermediate if self.is_moe else self.intermediate
        return [(h, i), (h, i), (i, h)]

    def projection_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of the linear maps a token runs in one decoder layer (MoE: its routed experts)."""
        routed = self.experts_per_token if self.is_moe else 1
        return self.attention_shapes() + self.mlp_shapes() * routed

    def router_params(self) -> int:
        """Parameters of one MoE router."""
        return self.hidden * self.num_experts

    def active_linear_params(self) -> int:
        """Projection weights one token multiplies with in one decoder layer (router included)."""
        return sum(a * b for a, b in self.projection_shapes()) + self.router_params()

    def decoder_layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP or experts, router, norms)."""
        experts = self.num_experts if self.is_moe else 1
        linear = (sum(a * b for a, b in self.attention_shapes()) + experts * sum(a * b for a, b in self.mlp_shapes())
                  + self.router_params())
        return linear + self.decoder_norm_params()

    def decoder_norm_params(self) -> int:
        """Norm weights of one decoder layer (the two RMSNorms, and Qwen3's query and key norms)."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def lora_params_per_layer(self, rank: int) -> int:
        """Adapter parameters of one decoder layer with LoRA of ``rank`` on ``lora_targets``."""
        experts = (self.num_experts if self.is_moe else 1) if self.lora_on_mlp else 0
        return (sum(rank * (a + b) for a, b in self.attention_shapes())
                + experts * sum(rank * (a + b) for a, b in self.mlp_shapes()))

    def active_lora_params_per_layer(self, rank: int) -> int:
        """Adapter parameters one token computes with in one decoder layer (MoE: routed experts only)."""
        shapes = self.projection_shapes() if self.lora_on_mlp else self.attention_shapes()
        return sum(rank * (a + b) for a, b in shapes)

    def embedding_params(self) -> int:
        """Parameters of the token embedding."""
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """Final norm plus LM head (the head's matrix counted even when tied: it is uploaded)."""
        return self.hidden + self.vocab * self.hidden

    def num_params(self) -> int:
        """Parameter count as the model card reports it (a tied matrix counted once)."""
        head = self.hidden + (0 if self.tie_embeddings else self.vocab * self.hidden)
        return self.embedding_params() + self.num_layers * self.decoder_layer_params() + head


LORA_TARGETS = ("all", "attention")
