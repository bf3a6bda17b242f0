"""``TextCodec`` over small tokenizers built in memory, of the kinds SmolLM2's (the model the server tests
load) never exercises: SentencePiece-style BPE (Llama 2, Mistral), a Llama 3-style regex ``Split`` before
a byte-level step, whitespace-dropping and text-shrinking pieces, unknown-token fusing, and chat models
whose turn-end token is not their EOS.

What is pinned, and why a user notices it:

* ``max_token_chars`` / ``min_tokens``: the free lower bound on a prompt's tokens with which the server
  refuses a huge text prompt (400 "never fits") before tokenizing it. It must be known for the tokenizer
  kinds that never drop or merge text (or every huge prompt of such a model is tokenized on a request
  worker first), and it must be *absent* for the kinds that do -- each such case below shows a text with
  fewer tokens than the bound would claim, i.e. a prompt that fits would be refused.
* ``turn_end_ids``: the token ids a chat completion stops at (``<|im_end|>``, ``<|eot_id|>``, ... besides
  EOS); only for a tokenizer with a chat template.
* ``chat_prompt``: the conversation through the template, with or without the assistant's opening.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from kvledger.errors import ConfigError  # noqa: E402
from kvledger.server.text import TextCodec, longest_token_chars  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
          "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
          "\n\n{% endif %}")
TWO_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _fast(tok: Tokenizer, specials: dict[str, str] | None = None, template: str | None = None,
          extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A transformers tokenizer over ``tok`` (reloaded from its JSON, as ``from_pretrained`` reads one)."""
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()), **(specials or {}))
    if extra:
        fast.add_special_tokens({"additional_special_tokens": list(extra)})
    if template is not None:
        fast.chat_template = template
    return fast


UNK = "\ufffd"  # a one-character unknown token: unknown characters stay one token each (fuse_unk off)


def _chars(*words: str) -> dict[str, int]:
    """A vocabulary of the unknown token, every character of ``words`` and the words themselves."""
    vocab: dict[str, int] = {UNK: 0}
    for w in words:
        for piece in (*w, w):
            vocab.setdefault(piece, len(vocab))
    return vocab


def _byte_level() -> Tokenizer:
    """GPT-2-style byte-level BPE: every text encodes (one token per byte at worst)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# ---- tokenizers that keep text: a bound, and it is sound ---------------------------------------------
def sentencepiece_bpe() -> Tokenizer:
    """Llama 2 / Mistral in tokenizers' form: "▁" prepended, spaces replaced by "▁", byte fallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "▁w", "or",
                  "▁wor", "▁world"):
        vocab.setdefault(piece, len(vocab))
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("▁", "w"), ("o", "r"),
              ("▁w", "or"), ("▁wor", "ld")]
    vocab.setdefault("ld", len(vocab))
    merges.insert(0, ("l", "d"))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


def llama3_split_then_bytes() -> Tokenizer:
    """Llama 3 / Qwen 2 in tokenizers' form: a regex ``Split`` (Isolated) and then byte-level, no regex."""
    tok = _byte_level()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+|\w+|[^\s\w]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def punctuation_and_digits() -> Tokenizer:
    tok = _byte_level()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(behavior="isolated"), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


KEEPS_TEXT = {  # name: (tokenizer, the longest vocabulary entry in characters)
    "sentencepiece_bpe": (sentencepiece_bpe, len("<0x00>")),  # six characters for one byte
    "byte_level": (_byte_level, 1),  # no unknown token needed: every byte has its symbol
    "llama3_split_then_bytes": (llama3_split_then_bytes, 1),
    "punctuation_and_digits": (punctuation_and_digits, 1),
}
TEXTS = ["hello world", "hello  world  ", " w", "héllo, wörld! 1234", "\u3053\u3093\u306b\u3061\u306f " * 5,
         "a" * 300]


@pytest.mark.parametrize("name", sorted(KEEPS_TEXT))
def test_a_tokenizer_that_keeps_text_gives_a_sound_floor(name: str) -> None:
    """The floor is known (the longest vocabulary entry) and never above the real token count."""
    build, longest = KEEPS_TEXT[name]
    codec = TextCodec(_fast(build()))
    assert codec.max_token_chars == longest
    assert longest_token_chars(codec.tok) == longest
    for text in TEXTS:
        floor = codec.min_tokens(text)
        assert floor == math.ceil(len(text) / longest)
        assert 0 < floor <= len(codec.encode(text)), (name, text)


def test_a_sentencepiece_prompt_is_refused_from_its_length_alone() -> None:
    """What the floor is for: 6,000 characters of a Llama 2-style tokenizer are at least 1,000 tokens."""
    codec = TextCodec(_fast(sentencepiece_bpe()))
    assert codec.min_tokens("x" * 6000) == 1000
    assert codec.min_tokens("x" * 6001) == 1001
    assert codec.min_tokens("") == 0


# ---- tokenizers that drop or merge text: no floor ------------------------------------------------------
def whitespace_pre_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_chars("a", "b"), merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the spaces are gone
    return tok


def split_removed() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_chars("a", "b"), merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="removed")])
    return tok


def shrinking_replace() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_chars("a", "b", " "), merges=[], unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("  ", " ")])  # two spaces become one
    return tok


def regex_replace() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_chars("a", "b", " "), merges=[], unk_token=UNK))
    tok.normalizer = normalizers.Replace(Regex(" +"), " ")  # any run of spaces becomes one
    return tok


def composing_normalizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_chars("é", "e"), merges=[], unk_token=UNK))
    tok.normalizer = normalizers.NFC()  # "e" + combining acute: two characters, one "é"
    return tok


def no_unknown_token() -> Tokenizer:
    """A BPE with neither an unknown token nor byte fallback, not byte-level: "z" vanishes."""
    return Tokenizer(models.BPE(vocab={"a": 0, "b": 1, " ": 2}, merges=[]))


def fused_unknowns() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"<unk>": 0, **{c: i + 1 for i, c in enumerate("ab ")}}, merges=[],
                               unk_token="<unk>", fuse_unk=True))  # a run of unknown characters: one token
    return tok


def word_piece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


DROPS_TEXT = {  # name: (tokenizer, a text with fewer tokens than ceil(chars / longest vocabulary entry))
    "whitespace_pre_tokenizer": (whitespace_pre_tokenizer, "a" + " " * 40 + "b"),
    "split_removed": (split_removed, "a" + " " * 40 + "b"),
    "shrinking_replace": (shrinking_replace, "a" + " " * 40 + "b"),
    "regex_replace": (regex_replace, "a" + " " * 40 + "b"),
    "composing_normalizer": (composing_normalizer, "e\u0301" * 20),
    "fused_unknowns": (fused_unknowns, "z" * 40),
    "no_unknown_token": (no_unknown_token, "a" + "z" * 40 + "b"),
    "word_piece": (word_piece, "a" + " " * 40 + "b"),
}


@pytest.mark.parametrize("name", sorted(DROPS_TEXT))
def test_a_tokenizer_that_drops_or_merges_text_gives_no_floor(name: str) -> None:
    """No floor (``min_tokens`` 0), and rightly so: the text below has fewer tokens than the longest
    vocabulary entry would promise, so a floor would refuse a prompt that fits."""
    build, text = DROPS_TEXT[name]
    codec = TextCodec(_fast(build()))
    assert codec.max_token_chars is None
    assert codec.min_tokens(text) == 0 and codec.min_tokens("a" * 10**6) == 0
    longest = max(len(t) for t in codec.tok.get_vocab())
    assert 0 < len(codec.encode(text)) < math.ceil(len(text) / longest), name


def test_sequence_pieces_need_every_part_to_keep_text() -> None:
    """A normaliser Sequence with one shrinking Replace among keeping ones, and a pre-tokenizer Sequence
    with one whitespace-dropping part: no floor; the same Sequences without that part: a floor."""
    tok = sentencepiece_bpe()
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁"),
                                           normalizers.Replace("▁▁", "▁")])
    assert TextCodec(_fast(tok)).max_token_chars is None
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.Replace(" ", "▁")])
    assert TextCodec(_fast(tok)).max_token_chars == 6
    tok = llama3_split_then_bytes()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.ByteLevel(use_regex=False)])
    assert TextCodec(_fast(tok)).max_token_chars is None
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.UnicodeScripts(),
                                                 pre_tokenizers.ByteLevel(use_regex=False)])
    assert TextCodec(_fast(tok)).max_token_chars == 1


def test_the_floor_counts_added_tokens() -> None:
    """An added special token is one token for all its characters: it sets the floor's divisor."""
    codec = TextCodec(_fast(llama3_split_then_bytes(), extra=("<|start_header_id|>",)))
    assert codec.max_token_chars == len("<|start_header_id|>")
    text = "<|start_header_id|>" * 3
    assert codec.min_tokens(text) == 3 == len(codec.encode(text))


# ---- chat: turn ends and the template ----------------------------------------------------------------
def _chat_tokenizer(template: str | None, extra: tuple[str, ...]) -> PreTrainedTokenizerFast:
    return _fast(_byte_level(), {"eos_token": "</s>", "unk_token": "<unk>"}, template, extra)


def test_a_chatml_model_stops_at_its_turn_end_and_at_eos() -> None:
    """ChatML whose ``<|im_end|>`` is not its EOS: a chat completion stops at either, a plain
    completion at EOS only."""
    fast = _chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))
    codec = TextCodec(fast)
    im_end, eos = fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("</s>")
    assert im_end != eos and isinstance(im_end, int)
    assert codec.eos_ids == frozenset({eos})
    assert codec.turn_end_ids == frozenset({im_end, eos})
    assert codec.has_chat_template


def test_a_llama3_model_stops_at_eot_id() -> None:
    fast = _chat_tokenizer(LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    codec = TextCodec(fast)
    assert codec.turn_end_ids == frozenset({fast.convert_tokens_to_ids("<|eot_id|>"), *codec.eos_ids})
    assert len(codec.turn_end_ids) == 2


def test_without_a_chat_template_only_eos_ends_a_turn() -> None:
    """A base model whose vocabulary carries ``<|im_end|>`` (but no template) stops at EOS only, and
    refuses chat in one clear line."""
    codec = TextCodec(_chat_tokenizer(None, ("<|im_start|>", "<|im_end|>")))
    assert codec.turn_end_ids == codec.eos_ids == frozenset({codec.tok.convert_tokens_to_ids("</s>")})
    assert not codec.has_chat_template
    with pytest.raises(ConfigError, match=r"^this model has no chat template: use /v1/completions$"):
        codec.chat_prompt(TWO_MESSAGES)


def test_chat_prompt_with_and_without_the_assistants_opening() -> None:
    """Two messages through ChatML: the exact text, and its ids, with the assistant's opening only when
    asked; the template's special tokens are single ids, nothing added around them."""
    fast = _chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))
    codec = TextCodec(fast)
    closed = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    assert codec.chat_text(TWO_MESSAGES, add_generation_prompt=False) == closed
    assert codec.chat_text(TWO_MESSAGES) == closed + "<|im_start|>assistant\n"
    without = codec.chat_prompt(TWO_MESSAGES, add_generation_prompt=False)
    with_opening = codec.chat_prompt(TWO_MESSAGES)
    assert without == fast(closed, add_special_tokens=False).input_ids
    assert codec.decode(without) == closed.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert with_opening[:len(without)] == without
    assert codec.tok.convert_ids_to_tokens(with_opening[len(without):])[0] == "<|im_start|>"
    assert with_opening == codec.chat_prompt(TWO_MESSAGES, add_generation_prompt=True)
    assert without.count(fast.convert_tokens_to_ids("<|im_end|>")) == 2


def test_a_template_that_refuses_the_messages_is_the_clients_error() -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}" \
             "{% endif %}" + CHATML
    codec = TextCodec(_chat_tokenizer(strict, ("<|im_start|>", "<|im_end|>")))
    with pytest.raises(ConfigError, match=r"^the chat template refused these messages: the first message must"):
        codec.chat_prompt(TWO_MESSAGES)
    assert codec.chat_prompt(TWO_MESSAGES[1:])  # the user first: fine

