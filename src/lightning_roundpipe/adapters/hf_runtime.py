"""The pipelined ``forward`` of a Hugging Face causal LM (plain or peft-wrapped).

Takes the arguments users pass in a training step (``input_ids``, ``attention_mask``,
``position_ids``, ``labels``) and returns the same ``CausalLMOutputWithPast`` the model would.
With labels, the loss is computed inside the pipeline's last stage, per microbatch, and only
scalars come home: ``loss = sum(loss_sum_i) / (non-ignored tokens of the whole batch)``, which is
exactly HF's mean; ``logits`` is then ``None`` (full logits are never materialised). Without
labels, logits come back as usual.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .hf_causal_lm import CausalLMLayers, count_loss_tokens, unwrap_peft

_IGNORED_KWARGS = {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "cache_position",
                   "logits_to_keep", "num_items_in_batch"}


def causal_lm_runtime_parts(module: nn.Module) -> tuple[nn.Module, list[nn.Module], Callable]:
    """(module whose forward is patched, layers, forward factory) for a causal LM."""
    adapter = CausalLMLayers.from_model(module)
    inner = unwrap_peft(module)

    def make_forward(runtime) -> Callable:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, past_key_values=None,
                    inputs_embeds=None, **kwargs: Any):
            if inputs_embeds is not None or input_ids is None:
                raise ValueError("the RoundPipe pipeline of a causal LM takes input_ids (inputs_embeds is not supported)")
            if past_key_values is not None or kwargs.get("use_cache"):
                raise ValueError("the RoundPipe pipeline trains and evaluates without a KV cache: pass use_cache=False "
                                 "and no past_key_values (use the plain model for generation)")
            unknown = sorted(set(kwargs) - _IGNORED_KWARGS)
            if unknown:
                raise ValueError(f"the RoundPipe pipeline of a causal LM does not take {unknown}")
            batch = {"input_ids": input_ids}
            if attention_mask is not None:
                batch["attention_mask"] = attention_mask
            if position_ids is not None:
                batch["position_ids"] = position_ids.expand(input_ids.shape[0], -1) if position_ids.shape[0] == 1 else position_ids
            if labels is None:
                adapter.set_postfix_mode("logits")
                out = runtime.run(batch, tokens=int(input_ids.numel()))
                return CausalLMOutputWithPast(loss=None, logits=out["logits"])
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
            batch["labels"] = labels
            adapter.set_postfix_mode("loss")
            count = count_loss_tokens(labels)
            scale = 1.0 / count if count > 0 else float("nan")
            loss = runtime.run(batch, loss_scale=scale, tokens=int(input_ids.numel()))
            return CausalLMOutputWithPast(loss=loss, logits=None)

        return forward

    return inner, adapter.layers, make_forward
