"""Tiny random Hugging Face models of the families probe reads, built from configs (seconds each): the ones read
through transformers' attention interface and the ones read through a `probe.hooks.families` adapter."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

SMALL = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256)
GPT_STYLE = dict(vocab_size=120, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0)
MLA = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, max_position_embeddings=256, kv_lora_rank=16, q_lora_rank=32, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
"""Multi-head latent attention (DeepSeek): low-rank queries and keys/values, the second layer a mixture of experts."""
ENCODER = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, pad_token_id=0)


def _configs() -> dict[str, tuple[str, str, dict]]:
    """name -> (config class, model class, config arguments)."""
    return {
        # read through transformers' attention interface
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT_STYLE),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SMALL),
        "llama": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, "num_key_value_heads": 2}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {**SMALL, "num_key_value_heads": 2}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**SMALL, "num_key_value_heads": 2}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {**SMALL, "num_key_value_heads": 1, "head_dim": 16}),
        "phi": ("PhiConfig", "PhiForCausalLM", SMALL),
        # value heads smaller than query/key heads: 16 against 16 + 8; 12 against 8 + 8 (heads * 12 != hidden size)
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
            **MLA, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
            **MLA, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_group": 2, "topk_group": 1}),
        # AltUp (block outputs (predictions, batch, positions, hidden)), per-layer inputs, and layers 4, 5 reading
        # the keys and values that layers 2, 3 store
        "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {
            **SMALL, "num_hidden_layers": 6, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 3, "vocab_size_per_layer_input": 120,
            "hidden_size_per_layer_input": 8, "altup_num_inputs": 2, "num_kv_shared_layers": 2, "laurel_rank": 8,
            "activation_sparsity_pattern": [0.0] * 6}),
        "bert": ("BertConfig", "BertModel", ENCODER),
        "roberta": ("RobertaConfig", "RobertaModel", {**ENCODER, "pad_token_id": 1}),
        "distilbert": ("DistilBertConfig", "DistilBertModel", dict(vocab_size=120, dim=64, hidden_dim=128, n_layers=2,
                                                                   n_heads=4, max_position_embeddings=256)),
        "albert": ("AlbertConfig", "AlbertModel", {**ENCODER, "num_hidden_layers": 3, "embedding_size": 32}),
        # read through a family adapter
        "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(
            vocab_size=120, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256, window_size=5,
            attention_types=[[["global", "local"], 1]], bos_token_id=0, eos_token_id=0)),
        "gptj": ("GPTJConfig", "GPTJForCausalLM", {**GPT_STYLE, "rotary_dim": 8}),
        "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=120, hidden_size=64, n_layer=2, n_head=4)),
        "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=120, hidden_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4)),  # multi-query, rotary
        "falcon_alibi": ("FalconConfig", "FalconForCausalLM", dict(
            vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
            multi_query=False)),
        "falcon_gqa": ("FalconConfig", "FalconForCausalLM", dict(
            vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True)),
        "mpt": ("MptConfig", "MptForCausalLM", dict(vocab_size=120, d_model=64, n_heads=4, n_layers=2,
                                                    max_seq_len=256)),
        "codegen": ("CodeGenConfig", "CodeGenForCausalLM", {**GPT_STYLE, "rotary_dim": 8, "n_ctx": 256}),
    }


FAMILY_MODELS = list(_configs())
ADAPTED = ["gpt_neo", "gptj", "bloom", "falcon", "falcon_alibi", "falcon_gqa", "mpt", "codegen"]

PROJECTIONS = {
    "gpt2": "transformer.h.{}.attn.c_proj", "gpt_neox": "gpt_neox.layers.{}.attention.dense",
    "llama": "model.layers.{}.self_attn.o_proj", "mistral": "model.layers.{}.self_attn.o_proj",
    "qwen2": "model.layers.{}.self_attn.o_proj", "gemma": "model.layers.{}.self_attn.o_proj",
    "phi": "model.layers.{}.self_attn.dense",
    "deepseek_v2": "model.layers.{}.self_attn.o_proj", "deepseek_v3": "model.layers.{}.self_attn.o_proj",
    "gemma3n": "model.layers.{}.self_attn.o_proj",
    "bert": "encoder.layer.{}.attention.output.dense",
    "roberta": "encoder.layer.{}.attention.output.dense",
    "distilbert": "transformer.layer.{}.attention.out_lin",
    "albert": "encoder.albert_layer_groups.0.albert_layers.0.attention.dense",  # one module, called by every layer
    "gpt_neo": "transformer.h.{}.attn.attention.out_proj", "gptj": "transformer.h.{}.attn.out_proj",
    "bloom": "transformer.h.{}.self_attention.dense", "falcon": "transformer.h.{}.self_attention.dense",
    "falcon_alibi": "transformer.h.{}.self_attention.dense", "falcon_gqa": "transformer.h.{}.self_attention.dense",
    "mpt": "transformer.blocks.{}.attn.out_proj", "codegen": "transformer.h.{}.attn.out_proj",
}
"""name -> the module path of layer i's output projection, written out by hand (independent of probe's discovery)."""


def tiny_family(name: str) -> torch.nn.Module:
    """A small random model of the named family, in eval mode, float32."""
    import transformers as tf

    config_class, model_class, arguments = _configs()[name]
    torch.manual_seed(0)
    config = getattr(tf, config_class)(**arguments)
    return getattr(tf, model_class)(config).eval()


ENCODER_DECODER_PROJECTIONS = {
    "t5": {"encoder": "encoder.block.{}.layer.0.SelfAttention.o", "decoder": "decoder.block.{}.layer.0.SelfAttention.o",
           "cross": "decoder.block.{}.layer.1.EncDecAttention.o"},
    "bart": {"encoder": "model.encoder.layers.{}.self_attn.out_proj",
             "decoder": "model.decoder.layers.{}.self_attn.out_proj",
             "cross": "model.decoder.layers.{}.encoder_attn.out_proj"},
}
"""Encoder-decoders probe reads: stack -> the module path of that stack's layer i's output projection, by hand."""


def tiny_encoder_decoder(name: str) -> torch.nn.Module:
    """A small random T5, BART or Whisper (seq2seq LM), in eval mode, float32."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "t5":  # relative position bias in the first layer of each stack
        config = tf.T5Config(vocab_size=120, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                             decoder_start_token_id=0)  # as in every released T5 config: the pad token
        return tf.T5ForConditionalGeneration(config).eval()
    if name == "bart":
        config = tf.BartConfig(vocab_size=120, d_model=64, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                               decoder_ffn_dim=128, max_position_embeddings=64,
                               init_std=0.2)  # larger than 0.02, so that a head's effect is well above 1e-5
        return tf.BartForConditionalGeneration(config).eval()
    return tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=120, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=0)).eval()


def zero_head_slices(args: tuple, heads: Sequence[int], head_dim: int) -> tuple:
    """A projection pre-hook's new arguments: the heads' slices of its input zeroed (the reference ablation)."""
    edited = args[0].clone()
    for head in heads:
        edited[..., head * head_dim:(head + 1) * head_dim] = 0
    return (edited, *args[1:])


@contextmanager
def pre_hooks(hooks: list[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """Forward pre-hooks on modules for the body of the `with`, removed after."""
    handles = [module.register_forward_pre_hook(hook) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
