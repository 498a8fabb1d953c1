"""Train a small 4-head BERT classifier offline, in about a minute on one CPU core, for probe to take apart.

The task (built here, no download): a window of 6 to 14 words of probe's embedded English text (CPython's reference
documentation) with one topic keyword put in at a random place; the label is the keyword's topic (sports, music,
food or weather, five keywords each). Nothing else in the text says the topic, so the model must find the one
keyword wherever it is, from [CLS]: a job for attention, and the heads that do it are what `probe ablate --labels`
should find. The seed texts' own build is a multi-head classifier trained on AG News with a heatmap per head; this
is that build reproduced without the data set.

    python examples/classifier/train.py --out runs/classifier     # model/, test.jsonl, pairs.jsonl, train.json

The model is a BertForSequenceClassification (2 layers x 4 heads, hidden 64) with a word-level tokenizer over the
text's words; both are saved with save_pretrained, so `probe ... --model runs/classifier/model` loads them as any
Hugging Face folder. examples/classifier/run.sh runs the probe commands on it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

TOPICS = {
    "sports": ["football", "tennis", "goalkeeper", "marathon", "referee"],
    "music": ["violin", "melody", "orchestra", "guitar", "chorus"],
    "food": ["bread", "cheese", "noodles", "pepper", "pastry"],
    "weather": ["rainfall", "thunder", "drizzle", "forecast", "snowstorm"],
}
ENGLISH = Path(__file__).resolve().parents[2] / "probe" / "inputs" / "english.txt"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def text_words() -> list[str]:
    """The embedded English text as lowercase words (letters only), in order."""
    return re.findall(r"[a-z]+", ENGLISH.read_text(encoding="utf-8").lower())


def make_rows(words: list[str], count: int, rng: random.Random) -> list[dict]:
    """`count` rows {"text", "label"}: a window of the text with one topic keyword inserted."""
    names = list(TOPICS)
    rows = []
    for index in range(count):
        topic = names[index % len(names)]
        length = rng.randint(6, 14)
        start = rng.randrange(len(words) - length)
        window = words[start:start + length]
        window.insert(rng.randint(0, length), rng.choice(TOPICS[topic]))
        rows.append({"text": " ".join(window), "label": topic})
    rng.shuffle(rows)
    return rows


def make_pairs(rows: list[dict], rng: random.Random) -> list[dict]:
    """Clean/corrupt pairs for `probe patch --labels`: a test row, and the same words with its keyword swapped for
    one of the next topic (one word for one: the same token length); answer its topic, distractor the other."""
    names = list(TOPICS)
    pairs = []
    for row in rows:
        other = names[(names.index(row["label"]) + 1) % len(names)]
        words = row["text"].split()
        keyword = next(word for word in words if word in TOPICS[row["label"]])
        corrupt = " ".join(rng.choice(TOPICS[other]) if word == keyword else word for word in words)
        pairs.append({"clean": row["text"], "corrupt": corrupt, "answer": row["label"], "distractor": other})
    return pairs


def build_tokenizer(words: list[str], size: int = 4000):
    """A word-level tokenizer over the `size` commonest words and every keyword, [CLS] text [SEP]."""
    from collections import Counter

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    common = [word for word, _ in Counter(words).most_common(size)]
    keywords = [word for topic in TOPICS.values() for word in topic]
    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(set(common) | set(keywords)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def build_model(vocab_size: int, layers: int):
    """BERT, `layers` layers x 4 heads, hidden 64, its four classes named in id2label."""
    from transformers import BertConfig, BertForSequenceClassification

    names = list(TOPICS)
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, max_position_embeddings=64, num_labels=len(names),
                        id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)},
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def accuracy(model, tokenizer, rows: list[dict]) -> float:
    batch = tokenizer([row["text"] for row in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    gold = torch.tensor([list(TOPICS).index(row["label"]) for row in rows])
    return float((logits.argmax(dim=1) == gold).double().mean())


class HeadGates:
    """A gate g_h = sigmoid(a_h) on each head's output (at the input of the attention's output projection) and a
    penalty `weight` * sum of the gates: a simple relative of Voita et al. 2019's L0 head gates ("Analyzing Multi-Head
    Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned"), which push the work onto few
    heads. `fold()` multiplies the gates into the projections' weights, leaving a plain BERT."""

    def __init__(self, model, weight: float) -> None:
        self.layers = [layer.attention.output.dense for layer in model.bert.encoder.layer]
        heads = model.config.num_attention_heads
        self.head_dim = model.config.hidden_size // heads
        self.logits = torch.nn.Parameter(torch.full((len(self.layers), heads), 3.0))
        self.weight = weight
        self.handles = [dense.register_forward_pre_hook(self._hook(i)) for i, dense in enumerate(self.layers)]

    def _hook(self, index: int):
        def gate(_module, args):
            scale = torch.sigmoid(self.logits[index]).repeat_interleave(self.head_dim)
            return (args[0] * scale,)
        return gate

    def penalty(self) -> torch.Tensor:
        return self.weight * torch.sigmoid(self.logits).sum()

    @torch.no_grad()
    def fold(self) -> list[list[float]]:
        for handle in self.handles:
            handle.remove()
        gates = torch.sigmoid(self.logits)
        for dense, layer_gates in zip(self.layers, gates):
            dense.weight.mul_(layer_gates.repeat_interleave(self.head_dim)[None, :])
        return [[round(float(g), 3) for g in row] for row in gates]


def train(model, tokenizer, rows: list[dict], epochs: int, gates: HeadGates, batch_size: int = 32) -> list[float]:
    """AdamW over the rows for `epochs` (the gates' penalty added to the loss); the mean loss of each epoch."""
    optimizer = torch.optim.AdamW([{"params": list(model.parameters())},
                                   {"params": [gates.logits], "lr": 0.05, "weight_decay": 0.0}],
                                  lr=2e-3, weight_decay=0.01)
    labels = torch.tensor([list(TOPICS).index(row["label"]) for row in rows])
    losses = []
    model.train()
    for _ in range(epochs):
        order, total = torch.randperm(len(rows)), 0.0
        for first in range(0, len(rows), batch_size):
            chosen = order[first:first + batch_size].tolist()
            batch = tokenizer([rows[i]["text"] for i in chosen], padding=True, return_tensors="pt")
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=labels[chosen]).loss
            optimizer.zero_grad()
            (loss + gates.penalty()).backward()
            optimizer.step()
            total += float(loss.detach()) * len(chosen)
        losses.append(total / len(rows))
    model.eval()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/classifier"))
    parser.add_argument("--train", type=int, default=4000, help="training rows")
    parser.add_argument("--test", type=int, default=200, help="held-out rows, written to test.jsonl for probe")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--gate-penalty", type=float, default=0.05, help="weight of the head gates' penalty (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    words = text_words()
    tokenizer = build_tokenizer(words)
    rows = make_rows(words, args.train + args.test, rng)
    train_rows, test_rows = rows[:args.train], rows[args.train:]
    model = build_model(len(tokenizer), args.layers)
    started = time.perf_counter()
    gates = HeadGates(model, args.gate_penalty)
    losses = train(model, tokenizer, train_rows, args.epochs, gates)
    folded = gates.fold()
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out / "model")
    tokenizer.save_pretrained(args.out / "model")
    (args.out / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in test_rows), encoding="utf-8")
    pairs = make_pairs(test_rows[:64], rng)
    (args.out / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs), encoding="utf-8")
    report = {"train_rows": len(train_rows), "test_rows": len(test_rows), "epochs": args.epochs,
              "epoch_losses": [round(loss, 4) for loss in losses], "train_seconds": round(seconds, 1),
              "threads": torch.get_num_threads(), "gate_penalty": args.gate_penalty, "gates": folded,
              "test_accuracy": accuracy(model, tokenizer, test_rows)}
    (args.out / "train.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
