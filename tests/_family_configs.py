"""Tiny random configs of every verified Hugging Face decoder family, each exercising its special path.

Values are chosen so that what each family's forward adds is visible: soft-caps, scales and
multipliers far from 1, sliding windows shorter than the test sequence (12 tokens), per-layer
attention types that alternate, MoE aux-loss coefficients large enough to move the loss.
Sizes are minimal so the whole parity matrix runs in a few minutes on two loaded cores.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64
SEQ = 12
WINDOW = 4  # shorter than SEQ: sliding layers really slide

_COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
               num_key_value_heads=1, head_dim=8, max_position_embeddings=64, attention_dropout=0.0,
               tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.7, output_router_logits=False)

FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "phi3": dict(sliding_window=WINDOW, partial_rotary_factor=0.5),
    "gemma": dict(tie_word_embeddings=True),
    "gemma2": dict(final_logit_softcapping=2.0, attn_logit_softcapping=1.5, sliding_window=WINDOW,
                   query_pre_attn_scalar=6, layer_types=_ALTERNATING),
    "gemma3_text": dict(final_logit_softcapping=2.0, attn_logit_softcapping=1.5, sliding_window=WINDOW,
                        query_pre_attn_scalar=6, layer_types=_ALTERNATING, tie_word_embeddings=True,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
    "olmo": dict(clip_qkv=0.5),
    "olmo2": {},
    "stablelm": dict(partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True),
    "starcoder2": dict(sliding_window=WINDOW, embedding_dropout=0.0, residual_dropout=0.0, use_bias=True),
    "cohere": dict(logit_scale=0.3, tie_word_embeddings=True, use_qk_norm=False),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=5.0),
    "glm4": dict(partial_rotary_factor=0.5),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW),
    "helium": {},
    "ministral": dict(sliding_window=WINDOW, layer_types=_ALTERNATING),
    "seed_oss": dict(attention_bias=True, residual_dropout=0.0),
    "exaone4": dict(sliding_window=WINDOW, sliding_window_pattern="LLG", layer_types=_ALTERNATING),
    "mixtral": dict(num_local_experts=4, sliding_window=WINDOW, router_jitter_noise=0.0, **_MOE),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, **_MOE),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1, norm_topk_prob=True, **_MOE),
    "olmoe": dict(num_experts=4, norm_topk_prob=False, **_MOE),
    "phimoe": dict(num_local_experts=4, sliding_window=WINDOW, router_jitter_noise=0.01, input_jitter_noise=0.0,
                   **_MOE),
    "gpt_oss": dict(num_local_experts=4, sliding_window=WINDOW, layer_types=_ALTERNATING,
                    **{k: v for k, v in _MOE.items()}),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
                        n_group=2, topk_group=1, num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=8,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.0,
                        num_key_value_heads=2),
    # other layouts (their configs name sizes differently; see _OWN_NAMES)
    "phi": dict(partial_rotary_factor=0.5, embd_pdrop=0.0, resid_pdrop=0.0),
    "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.0, classifier_dropout=0.0),
    "gpt2": dict(n_embd=16, n_layer=3, n_head=2, n_positions=64, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
                 tie_word_embeddings=True, initializer_range=0.2),
    "falcon": dict(alibi=False, new_decoder_architecture=True, num_kv_heads=1, parallel_attn=True, bias=True,
                   hidden_dropout=0.0, initializer_range=0.2),
}
"""Per family, the config values on top of the common tiny sizes."""

_OWN_NAMES = {"gpt2": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "max_position_embeddings", "attention_dropout"),
              "falcon": ("intermediate_size", "num_key_value_heads", "head_dim"),
              "gpt_neox": ("num_key_value_heads", "head_dim")}
"""Common keys a family's config does not take (it has its own names for them)."""

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss", "deepseek_v3")
AUX_LOSS_FAMILIES = tuple(f for f in MOE_FAMILIES if f != "deepseek_v3")  # deepseek_v3's loss has no aux term

LORA_TARGETS = {"phi3": ["qkv_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"], "gpt2": ["c_attn"],
                "gpt_neox": ["query_key_value"], "falcon": ["query_key_value"]}
"""peft target modules where the attention projections are not q_proj / v_proj."""


def lora_targets(family: str) -> list[str]:
    return LORA_TARGETS.get(family, ["q_proj", "v_proj"])


TRAIN_MODE_RANDOM = {"phimoe"}
"""Families whose routing samples in training mode; parity against the unpipelined model is checked
in eval mode (gradients are still computed), since the two runs cannot draw the same numbers."""


def tiny_model(family: str, seed: int = 0, attn: str = "eager"):
    """A randomly initialised tiny causal LM of ``family`` (no download)."""
    values = dict(_COMMON)
    values.update(FAMILY_CONFIGS[family])
    if family == "deepseek_v3":
        values.pop("head_dim")
    for key in _OWN_NAMES.get(family, ()):
        values.pop(key, None)
    config = AutoConfig.for_model(family, **values)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():  # some families zero-init biases or norms; random values exercise every path
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" not in name:
                param.normal_(0.0, 0.1)
    return model


def family_batch(padding: str = "right", seed: int = 1, batch: int = 6):
    """input_ids, attention_mask, labels with padding on one side and an ignored prompt (-100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, 8:] = 0
        mask[3, 5:] = 0
    elif padding == "left":
        mask[1, :4] = 0
        mask[4, :6] = 0
    labels = ids.clone()
    labels[0, :3] = -100
    labels[mask == 0] = -100
    return ids, mask, labels
