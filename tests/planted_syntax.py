"""A one-layer attention-only model and a word-piece tokenizer made for syntax tests: head 0 is wired to attend
from every adverb and object noun to position 1, where each test sentence has its verb, the gold head of those
words; head 1 attends to the previous token (the -1 offset baseline, as a head); heads 2 and 3 are random.

Sentences: BOS, a verb, then adverbs (advmod) and nouns (obj) in any order, each attached to the verb; so the
offset from a dependent to its head varies and no fixed-offset baseline reaches 1.0, while head 0 does.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from planted import D_MODEL, HEAD_DIM, MAX_LEN, N_HEADS, POS, SHARP, TOK, PlantedModel, TextbookAttention
from probe.models import LoadedModel

SPECIALS = ["[PAD]", "[BOS]", "[UNK]"]
VERBS = ["go", "run", "walk", "sing"]
ADVERBS = ["now", "fast", "today", "here", "there", "slowly"]
NOUNS = ["home", "school", "work"]
PIECES = ["##ing", "##s", "##now"]
VOCABULARY = SPECIALS + VERBS + ADVERBS + NOUNS + PIECES


def syntax_tokenizer() -> PreTrainedTokenizerFast:
    """Word pieces on whitespace: 'walking' -> 'walk', '##ing'; offsets come from the Rust tokenizer."""
    vocab = {word: index for index, word in enumerate(VOCABULARY)}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]", pad_token="[PAD]",
                                   unk_token="[UNK]")


def planted_syntax_model() -> PlantedModel:
    generator = torch.Generator().manual_seed(0)
    attention = TextbookAttention(D_MODEL, N_HEADS)
    w = {name: torch.zeros(D_MODEL, D_MODEL) for name in ("W_q", "W_k", "W_v", "W_o")}
    dependents = [VOCABULARY.index(word) for word in ADVERBS + NOUNS + PIECES]
    for token in dependents:  # head 0: dependents -> position 1
        w["W_q"][0, TOK + token] = SHARP
    w["W_k"][0, POS + 1] = 1.0
    first = HEAD_DIM  # head 1: position i -> position i - 1
    for i in range(MAX_LEN):
        w["W_q"][first + i, POS + i] = SHARP
    for j in range(MAX_LEN - 1):
        w["W_k"][first + j + 1, POS + j] = 1.0
    for head in (2, 3):
        rows = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        for name in ("W_q", "W_k"):
            w[name][rows, :POS + MAX_LEN] = torch.randn(HEAD_DIM, POS + MAX_LEN, generator=generator) * 0.05
    with torch.no_grad():
        for name, weight in w.items():
            getattr(attention, name).weight.copy_(weight)
    return PlantedModel([attention]).eval()


def planted_syntax() -> LoadedModel:
    model = planted_syntax_model()
    return LoadedModel(model=model, tokenizer=syntax_tokenizer(), name="planted-syntax", vocab_size=model.vocab_size)


def conllu_sentence(verb: str, dependents: list[str], index: int) -> str:
    """One CoNLL-U sentence: the verb (root) and its dependents, each attached to it."""
    lines = [f"# sent_id = {index}", f"1\t{verb}\t{verb}\tVERB\t_\t_\t0\troot\t_\t_"]
    for position, word in enumerate(dependents, start=2):
        relation = "obj" if word.rstrip("s") in NOUNS else "advmod"
        lines.append(f"{position}\t{word}\t{word}\t_\t_\t_\t1\t{relation}\t_\t_")
    return "\n".join(lines) + "\n\n"


def conllu_corpus(sentences: int = 24, seed: int = 0) -> str:
    """`sentences` random sentences: a verb and 1 to 4 adverbs or nouns."""
    generator = torch.Generator().manual_seed(seed)
    words = ADVERBS + NOUNS
    text = ""
    for index in range(sentences):
        verb = VERBS[int(torch.randint(len(VERBS), (1,), generator=generator))]
        count = 1 + int(torch.randint(4, (1,), generator=generator))
        picks = [words[int(i)] for i in torch.randint(len(words), (count,), generator=generator)]
        text += conllu_sentence(verb, picks, index)
    return text


def planted_pair() -> tuple[PlantedModel, PreTrainedTokenizerFast]:
    """For `--model tests/planted_syntax.py:planted_pair`."""
    return planted_syntax_model(), syntax_tokenizer()
