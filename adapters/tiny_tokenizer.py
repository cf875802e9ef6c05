"""The tiny models' tokenizer: a byte-level BPE trained in-process on a small
embedded corpus (deterministic: no tokenizers trainer, ties broken lexically),
or a character-level one for vocabularies under the byte-level floor, with
bos/eos/pad, ChatML turn markers and a ChatML-style chat template. See
:mod:`.tiny_models`.

Anything changed here that changes the written bytes bumps
``tiny_models.FORMAT_VERSION``.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Tuple

__all__ = ["build_tokenizer", "tokenizer_files", "CHAT_TEMPLATE", "SPECIAL_TOKENS"]

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The library keeps a tiered cache of attention keys and values so that a prompt
which shares a prefix with an earlier prompt does not have to be processed
again. Blocks of tokens are hashed, and each block points to its parent, so a
lookup walks the chain from the first block until it finds a miss.
Memory is fast but small, the local disk is larger but slower, and a remote
store can hold almost everything while adding network latency to every fetch.
When the engine runs out of room it evicts the least recently used blocks,
writes them to the next tier, and frees the space for the request at hand.

Once upon a time there was a small village at the edge of a great forest. In
the village lived a baker who woke every morning before the sun to light her
oven. She made bread from flour, water, salt and a little yeast, and the smell
of the warm loaves drifted down the narrow streets and through the open
windows. Children ran to the shop with coins in their pockets, and the old
men sat on the bench outside, talking about the weather and the harvest.

One winter the snow fell for seven days without stopping. The roads were
closed, the river froze, and nobody could reach the market in the town across
the hills. The baker counted her sacks of flour and decided to share what she
had. Every family received one loaf each day, and in return they brought wood
for the oven, milk from their goats, or apples from their cellars.

Computers store numbers as bits. A floating point number has a sign, an
exponent and a mantissa; half precision uses sixteen bits, single precision
uses thirty two, and double precision uses sixty four. Matrix multiplication
is the heart of a neural network: the weights of each layer are multiplied
with the activations, a nonlinear function is applied, and the result is
passed to the next layer. Attention compares every query with every key,
turns the scores into probabilities with a softmax, and mixes the values.

The weather today will be cloudy in the morning with a chance of light rain
in the afternoon. Temperatures will reach eighteen degrees, and the wind will
blow from the west at twenty kilometers per hour. Tomorrow should be sunny
and warm, a good day for a walk in the park or a trip to the beach.

To make a cup of tea, boil fresh water, warm the pot, add one spoon of leaves
for each person and one for the pot, pour the water and wait three to five
minutes. Some people like milk and sugar, others prefer lemon or honey, and a
few drink it plain. Coffee is different: the beans are roasted, ground and
brewed, and the strength depends on the grind and the time.

Question: What is the capital of France? Answer: The capital of France is
Paris. Question: How many days are in a week? Answer: There are seven days in
a week. Question: Why is the sky blue? Answer: Sunlight is scattered by the
air, and blue light is scattered more than red light.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for i in range(10):
    print(i, fibonacci(i))

The quick brown fox jumps over the lazy dog. Pack my box with five dozen
liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz,
judge my vow. 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42.
"""

_WORDS = {
    "det": ["the", "a", "every", "one", "this", "that", "some", "each"],
    "adj": [
        "small", "large", "quiet", "bright", "old", "new", "red", "green",
        "fast", "slow", "happy", "careful", "strange", "simple", "heavy",
        "gentle", "clever", "distant", "warm", "cold", "busy", "empty",
    ],
    "noun": [
        "cat", "dog", "river", "mountain", "city", "garden", "teacher",
        "student", "engine", "server", "model", "window", "table", "friend",
        "market", "letter", "bridge", "forest", "cloud", "machine", "kitchen",
        "library", "station", "planet", "song", "story", "number", "memory",
        "request", "token", "layer", "block", "cache", "question", "answer",
    ],
    "verb": [
        "sees", "finds", "builds", "opens", "writes", "reads", "moves",
        "watches", "follows", "carries", "remembers", "visits", "paints",
        "answers", "stores", "loads", "computes", "shares", "holds", "keeps",
    ],
    "adv": [
        "slowly", "quickly", "quietly", "again", "today", "often", "never",
        "always", "carefully", "later", "together", "early", "almost",
    ],
    "prep": ["near", "under", "behind", "inside", "across", "beside", "after", "before"],
}


def _corpus_lines(n_generated: int = 1500) -> List[str]:
    """The embedded text plus deterministic generated sentences."""
    rng = random.Random(20240611)
    w = _WORDS
    lines = [line for line in _CORPUS.splitlines()]
    for i in range(n_generated):
        s = (
            f"{rng.choice(w['det'])} {rng.choice(w['adj'])} {rng.choice(w['noun'])} "
            f"{rng.choice(w['verb'])} {rng.choice(w['det'])} {rng.choice(w['noun'])} "
            f"{rng.choice(w['prep'])} {rng.choice(w['det'])} {rng.choice(w['adj'])} "
            f"{rng.choice(w['noun'])} {rng.choice(w['adv'])}"
        )
        s = s[0].upper() + s[1:]
        s += rng.choice([".", ".", ".", "!", "?", ", and then", ";"])
        if i % 7 == 0:
            s += f" {rng.randrange(1000)}"
        lines.append(s)
    return lines


def _bpe_train(lines: List[str], n_merges: int, alphabet: List[str]) -> List[Tuple[str, str]]:
    """Plain, deterministic byte-level BPE training (ties broken lexically).

    Implemented here rather than with ``tokenizers.trainers.BpeTrainer`` so the
    result cannot depend on the tokenizers version or hash-map iteration order.
    """
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    counts: Dict[str, int] = {}
    for line in lines:
        for piece, _ in pre.pre_tokenize_str(line + "\n"):
            counts[piece] = counts.get(piece, 0) + 1
    words = [(list(word), c) for word, c in sorted(counts.items())]
    known = set(alphabet)
    merges: List[Tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Dict[Tuple[str, str], int] = {}
        for syms, c in words:
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        a, b = best
        new = a + b
        merges.append(best)
        known.add(new)
        for syms, _ in words:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == a and syms[i + 1] == b:
                    syms[i : i + 2] = [new]
                i += 1
    return merges


def _byte_decoder() -> Dict[str, int]:
    """GPT-2 byte-level symbol -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_TOKENIZER_CACHE: Dict[int, Tuple[str, int, List[int]]] = {}


def build_tokenizer(vocab_size: int) -> Tuple[str, int, List[int]]:
    """Return (tokenizer.json text, number of tokens, unprintable ids) for a
    byte-level BPE.

    Ids 0..4 are the special tokens, then the 256 byte symbols, then merges.
    The tokenizer has at most ``vocab_size`` tokens (fewer only if the corpus
    runs out of merges; the model's extra rows are then never predicted).
    The unprintable ids are the special tokens and every token with a byte
    outside printable ASCII / tab / newline: the model never predicts them,
    so generations are EOS-free, valid UTF-8 and re-encode-stable in text.
    """
    if vocab_size in _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[vocab_size]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    n_base = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size < n_base:
        result = _char_tokenizer(vocab_size)
        _TOKENIZER_CACHE[vocab_size] = result
        return result
    merges = _bpe_train(_corpus_lines(), vocab_size - n_base, alphabet)
    vocab: Dict[str, int] = {}
    for tok in SPECIAL_TOKENS + alphabet + [a + b for a, b in merges]:
        if tok not in vocab:
            vocab[tok] = len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos_id = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    text = tok.to_str(pretty=True)
    byte_of = _byte_decoder()
    ok = set(range(0x20, 0x7F)) | {0x09, 0x0A}
    banned = sorted(
        i
        for t, i in vocab.items()
        if t in SPECIAL_TOKENS or any(byte_of[ch] not in ok for ch in t)
    )
    result = (text, tok.get_vocab_size(with_added_tokens=True), banned)
    _TOKENIZER_CACHE[vocab_size] = result
    return result


# printable ASCII, tab and newline: a character-level tokenizer of these and
# the special tokens is the smallest one that still writes English text
_CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n"]


def _char_tokenizer(vocab_size: int) -> Tuple[str, int, List[int]]:
    """A character-level tokenizer (one token per printable ASCII character,
    tab and newline; other characters are dropped) for a vocabulary smaller
    than a byte-level one: ``vocab_size=105`` makes a model whose embedding
    is read past its end by any id of 105 or more."""
    from tokenizers import Tokenizer, decoders, models, processors

    n = len(SPECIAL_TOKENS) + len(_CHARS)
    if vocab_size < n:
        raise ValueError(f"vocab_size must be >= {n} (special tokens, printable ASCII, tab, newline)")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + _CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    return tok.to_str(pretty=True), n, list(range(len(SPECIAL_TOKENS)))


def tokenizer_files(vocab_size: int, model_max_length: int) -> tuple[Dict[str, Any], int, List[int]]:
    """The tokenizer's files of a model folder (``tokenizer.json`` as text,
    the two JSON configs as objects), its number of tokens and its unprintable
    ids (see ``build_tokenizer``)."""
    tok_json, n_tokens, banned = build_tokenizer(vocab_size)
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tok_config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    files = {"tokenizer.json": tok_json, "tokenizer_config.json": tok_config, "special_tokens_map.json": special_map}
    return files, n_tokens, banned
