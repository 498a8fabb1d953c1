"""A tiny Llama with a real word-level tokenizer over the words of the task tests and the generated tasks, as a
model spec for the CLI: `tests/words.py:tiny_with_words`."""

from __future__ import annotations

import torch

SENTENCES = [("the keys to the cabinet are here", "the keys to the cabinet is here"),
             ("the author near the guards is tired", "the author near the guards are tired")]
PROMPTS = [("When Mary and John went to the store , John gave a drink to", " Mary", " John"),
           ("the pilots behind the doctor", " are", " is")]


def words_tokenizer():
    """A real word-level tokenizer (the `tokenizers` library) over the words of the tests' and generated tasks."""
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from probe.inputs import ioi_items, sva_items

    texts = [s for pair in SENTENCES for s in pair] + [" ".join(row) for row in PROMPTS]
    texts += [" ".join([i.good, i.answer, i.distractor]) for i in sva_items(40, 0) + ioi_items(40, 0)]
    words = sorted({w for text in texts for w in re.findall(r"\w+|[^\w\s]", text)} | {"Ann"})
    vocab = {"<s>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")


def tiny_with_words():
    """`tests/test_specific.py:tiny_with_words`: a tiny random Llama and the word-level tokenizer."""
    import transformers as tf

    tokenizer = words_tokenizer()
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=0)
    return tf.LlamaForCausalLM(config).eval(), tokenizer


