"""Tiny classifiers for tests: a word-level tokenizer built in code ([CLS] text [SEP], pairs [CLS] a [SEP] b [SEP]),
a BERT sequence classifier from a config, and a hand-written custom classifier whose forward returns class logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def word_tokenizer(words: list[str]):
    """A PreTrainedTokenizerFast over `words` (split on whitespace), with BERT's special tokens and templates."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(set(words)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def tiny_bert_classifier(vocab_size: int, num_labels: int = 3, **config) -> nn.Module:
    """A random 2-layer, 4-head BertForSequenceClassification, eval mode, its classes named."""
    import transformers as tf

    torch.manual_seed(0)
    names = (["negative", "neutral", "positive"][:num_labels] if num_labels <= 3
             else [f"c{i}" for i in range(num_labels)])
    model = tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_labels=num_labels, id2label=dict(enumerate(names)),
        label2id={name: i for i, name in enumerate(names)}, **config))
    return model.eval()


def tiny_classifier(kind: str, vocab_size: int) -> nn.Module:
    """A random 2-layer, 4-head *ForSequenceClassification of 3 classes (llama, roberta, distilbert), eval mode; larger
    weights than the default initialisation, so that an ablation moves the class logits."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(num_labels=3, pad_token_id=0, initializer_range=0.5)
    build = {
        "llama": lambda: tf.LlamaForSequenceClassification(tf.LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common)),
        "roberta": lambda: tf.RobertaForSequenceClassification(tf.RobertaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=70, **common)),
        "distilbert": lambda: tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
            vocab_size=vocab_size, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64,
            **common)),
    }
    return build[kind]().eval()


KEYWORDS = {"bad": 0, "good": 1}  # the planted classifier's classes, read off its one keyword
FILLER = ["the", "film", "was", "a", "plot", "and", "story", "very", "so", "it", "cast", "show"]
PLANTED_HEAD = (0, 2)
HEAD_DIM = 8
DECISION, JUNK, ONE = 18, 19, 20  # residual slots after the one-hot token (18 ids)


class BidirectionalAttention(nn.Module):
    """Textbook multi-head self-attention without a causal mask, returning (output, weights); padding masked."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for w in (self.W_q, self.W_k,
                                                                                         self.W_v))
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        weights = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf")).softmax(dim=-1)
        heads = (weights @ v).transpose(1, 2).reshape(b, n, d)
        return self.W_o(heads), weights


class PlantedClassifier(nn.Module):
    """One layer of 4 heads and a readout of [CLS]'s residual stream: head 0.2 attends from every position to the
    text's keyword ("good" / "bad") and writes +1 / -1 into the decision slot, which the classifier reads
    (class 1 "good" where positive); the other heads write into a junk slot nothing reads: 0.0 attends to [SEP],
    0.1 to [CLS], 0.3 diffusely. With
    head 0.2 ablated the two logits tie and every text is called "bad": accuracy falls to the share of "bad" texts."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.vocab_size, d = len(tokenizer), 4 * HEAD_DIM
        self.max_position_embeddings = 64
        self.id2label = {index: word for word, index in KEYWORDS.items()}
        self.embed = nn.Embedding(self.vocab_size, d)
        self.attention = BidirectionalAttention(d, 4)
        self.classifier = nn.Linear(d, 2)
        self._plant(tokenizer)

    @torch.no_grad()
    def _plant(self, tokenizer) -> None:
        torch.manual_seed(0)
        for w in (self.attention.W_q, self.attention.W_k, self.attention.W_v, self.attention.W_o):
            w.weight.normal_(0, 0.1)
        self.embed.weight.zero_()
        self.embed.weight[:, :self.vocab_size] = torch.eye(self.vocab_size)
        self.embed.weight[:, ONE] = 1.0
        good, bad = (tokenizer.convert_tokens_to_ids(word) for word in ("good", "bad"))
        first = PLANTED_HEAD[1] * HEAD_DIM  # the planted head's dimensions
        for w in (self.attention.W_q, self.attention.W_k, self.attention.W_v):
            w.weight[first:first + HEAD_DIM] = 0
        self.attention.W_q.weight[first, ONE] = 40.0  # the same query everywhere ...
        self.attention.W_k.weight[first, good] = self.attention.W_k.weight[first, bad] = 1.0  # ... keyed on keywords
        self.attention.W_v.weight[first, good], self.attention.W_v.weight[first, bad] = 1.0, -1.0
        for head, token in ((0, "[SEP]"), (1, "[CLS]")):  # 0.0 attends to [SEP], 0.1 to [CLS] (a sink)
            dims = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
            self.attention.W_q.weight[dims], self.attention.W_k.weight[dims] = 0, 0
            self.attention.W_q.weight[head * HEAD_DIM, ONE] = 40.0
            self.attention.W_k.weight[head * HEAD_DIM, tokenizer.convert_tokens_to_ids(token)] = 1.0
        self.attention.W_o.weight.zero_()
        others = [h for h in range(4) if h != PLANTED_HEAD[1]]
        self.attention.W_o.weight[JUNK, [h * HEAD_DIM + i for h in others for i in range(HEAD_DIM)]] = 1.0
        self.attention.W_o.weight[DECISION, first] = 1.0
        self.classifier.weight.zero_()
        self.classifier.bias.zero_()
        self.classifier.weight[1, DECISION], self.classifier.weight[0, DECISION] = 8.0, -8.0

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        x = self.embed(input_ids)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        out, _ = self.attention(x, mask)
        return self.classifier((x + out)[:, 0])  # (batch, classes): [CLS]'s stream


def planted_texts(count: int, seed: int = 0) -> list[dict]:
    """Rows of {"text", "label"}: a few filler words and one keyword, half "good", half "bad"."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        words = [FILLER[int(j)] for j in torch.randint(len(FILLER), (int(torch.randint(3, 8, (1,),
                                                                                         generator=generator)),),
                                                        generator=generator)]
        keyword = "good" if i % 2 else "bad"
        words.insert(int(torch.randint(len(words) + 1, (1,), generator=generator)), keyword)
        rows.append({"text": " ".join(words), "label": keyword})
    return rows


def planted_tokenizer():
    return word_tokenizer(FILLER + list(KEYWORDS))


def planted_classifier():
    """`tests/classifiers.py:planted_classifier` as a model spec: (model, tokenizer)."""
    tokenizer = planted_tokenizer()
    return PlantedClassifier(tokenizer).eval(), tokenizer


def headless_bert():
    """`tests/classifiers.py:headless_bert`: a BERT without a classification head (BertModel) and a tokenizer."""
    import transformers as tf

    tokenizer = planted_tokenizer()
    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64))
    return model.eval(), tokenizer
