"""Streaming detokenizer against the tokenizer's own decode, on tokenizers built in code.

Three decoder families are covered, because each breaks naive streaming differently:
byte-level BPE (GPT-2/Llama 3/Qwen: characters split across byte tokens), Metaspace
unigram (SentencePiece: the first token's leading space is dropped), and a Llama-2-style
BPE with byte fallback (``<0xE6>`` tokens, Fuse and Strip decoders).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvforge.runners.detokenizer import StreamingDetokenizer
from kvforge.runners.errors import GenerationError

CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, hello there",
    "the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu — “quotes” ½ ∑ ≠ ∞",
    "日本語のテキストと中文文本 한국어 텍스트",
    "emoji: 🙂 😀 🚀 👩‍💻 🇯🇵",
    "numbers 123 4567 89.0\nnew line\ttab",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MULTIBYTE_ALPHABET = list("aé ö日本語🙂😀👩‍💻x\n") + ["ab", " the", "déjà"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@cache
def byte_level_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@cache
def metaspace_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<unk>", *SPECIALS], unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@cache
def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2 layout: characters, a few merges, and <0xXX> tokens for everything else."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in ["▁", *"abcdefghijklmnopqrstuvwxyzéö,.", "▁h", "he", "▁w", "ll", "▁he"]:
        vocab[token] = len(vocab)
    merges = [("▁", "h"), ("h", "e"), ("▁", "w"), ("l", "l"), ("▁h", "e")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {
    "byte_level": byte_level_tokenizer,
    "metaspace": metaspace_tokenizer,
    "byte_fallback": byte_fallback_tokenizer,
}


def byte_ids(text: str) -> list[int]:
    """One byte-level token per UTF-8 byte: the most fragmented encoding there is."""
    tokenizer = byte_level_tokenizer()
    chars = _bytes_to_unicode()
    ids = [tokenizer.token_to_id(chars[b]) for b in text.encode("utf-8")]
    return [_known(i) for i in ids]


def _known(token_id: int | None) -> int:
    assert token_id is not None, "the tokenizer lacks a byte token"
    return token_id


def stream(
    tokenizer: Tokenizer, ids: Sequence[int], stop: Sequence[str] = (), skip: bool = True
) -> tuple[list[str], str, StreamingDetokenizer]:
    """Feed ``ids`` one by one; return the chunks from add(), finish()'s text, the detokenizer."""
    detokenizer = StreamingDetokenizer(tokenizer, stop=stop, skip_special_tokens=skip)
    chunks = [detokenizer.add(i) for i in ids]
    return chunks, detokenizer.finish(), detokenizer


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(MULTIBYTE_ALPHABET) for _ in range(length))


def encode_in_random_pieces(tokenizer: Tokenizer, text: str, rng: random.Random) -> list[int]:
    """Token ids whose boundaries vary: the text is cut at random and each piece encoded."""
    cuts = sorted(rng.sample(range(1, len(text)), k=min(3, len(text) - 1))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids]


def random_ids(tokenizer: Tokenizer, name: str, rng: random.Random, length: int) -> list[int]:
    """Random ids from the whole vocabulary, specials and partial characters included.

    Byte fallback decodes a run of ``<0xXX>`` tokens all or nothing: one invalid byte
    turns every byte of the run into U+FFFD, retroactively, which no streamer can match
    without holding whole runs back. So for that tokenizer byte runs are drawn as whole
    valid characters; other tokens are drawn freely.
    """
    vocab = tokenizer.get_vocab_size()
    if name != "byte_fallback":
        return [rng.randrange(vocab) for _ in range(length)]
    ids: list[int] = []
    while len(ids) < length:
        token = rng.randrange(vocab)
        if (tokenizer.id_to_token(token) or "").startswith("<0x"):
            char = rng.choice("日🙂é\x13")
            ids += [_known(tokenizer.token_to_id(f"<0x{b:02X}>")) for b in char.encode()]
        else:
            ids.append(token)
    return ids


# --- (a) the stream equals decode ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_random_id_sequences_stream_to_exactly_decode(name: str, skip: bool) -> None:
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(f"{name}-{skip}")
    for _ in range(300):
        ids = random_ids(tokenizer, name, rng, rng.randrange(1, 40))
        chunks, tail, detokenizer = stream(tokenizer, ids, skip=skip)
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(chunks) + tail == expected, ids
        assert detokenizer.text == expected
        assert not detokenizer.stopped


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_encoded_text_streams_back_to_itself(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    for line in CORPUS[:7]:
        ids = tokenizer.encode(line, add_special_tokens=False).ids
        chunks, tail, _ = stream(tokenizer, ids)
        assert "".join(chunks) + tail == tokenizer.decode(ids)


def test_metaspace_keeps_the_spaces_between_streamed_words() -> None:
    tokenizer = metaspace_tokenizer()
    ids = tokenizer.encode("hello world the quick fox").ids
    assert len(ids) > 3
    chunks, tail, _ = stream(tokenizer, ids)
    assert "".join(chunks) + tail == "hello world the quick fox"
    assert tail == ""


def test_special_tokens_are_skipped_or_kept() -> None:
    tokenizer = byte_level_tokenizer()
    end = _known(tokenizer.token_to_id("<|im_end|>"))
    ids = [*tokenizer.encode("hello").ids, end, *tokenizer.encode(" world").ids]
    chunks, tail, _ = stream(tokenizer, ids, skip=True)
    assert "".join(chunks) + tail == "hello world"
    chunks, tail, _ = stream(tokenizer, ids, skip=False)
    assert "".join(chunks) + tail == "hello<|im_end|> world"


def test_text_property_accumulates_the_chunks() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer)
    assert detokenizer.text == ""
    emitted = ""
    for token in tokenizer.encode("héllo wörld 日本語 🙂").ids:
        emitted += detokenizer.add(token)
        assert detokenizer.text == emitted
    emitted += detokenizer.finish()
    assert detokenizer.text == emitted == "héllo wörld 日本語 🙂"


# --- (b) no U+FFFD unless the text really has one ------------------------------------------


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_no_chunk_has_a_replacement_char_when_the_text_has_none(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(name)
    for _ in range(200):
        text = random_text(rng, rng.randrange(1, 25))
        ids = encode_in_random_pieces(tokenizer, text, rng)
        if name == "byte_level" and rng.random() < 0.5:
            ids = byte_ids(text)
        expected = tokenizer.decode(ids)
        assert "\ufffd" not in expected
        chunks, tail, _ = stream(tokenizer, ids)
        assert all("\ufffd" not in chunk for chunk in [*chunks, tail]), (text, chunks)
        assert "".join(chunks) + tail == expected


def test_random_ids_emit_replacement_chars_only_where_decode_has_them() -> None:
    tokenizer = byte_level_tokenizer()
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 30))]
        chunks, tail, _ = stream(tokenizer, ids)
        expected = tokenizer.decode(ids)
        assert sum(c.count("\ufffd") for c in [*chunks, tail]) == expected.count("\ufffd")


def test_a_truly_invalid_ending_is_flushed_by_finish() -> None:
    tokenizer = byte_level_tokenizer()
    ids = byte_ids("ok ") + byte_ids("🙂")[:2]  # the emoji is cut off for good
    chunks, tail, _ = stream(tokenizer, ids)
    assert "".join(chunks) == "ok "
    assert tail == tokenizer.decode(ids)[len("ok ") :] and "\ufffd" in tail


# --- (c) a split character is emitted whole, once it is complete --------------------------


def test_emoji_split_over_byte_tokens_is_emitted_in_one_piece() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer)
    emoji = byte_ids("🙂")
    assert len(emoji) == 4
    assert [detokenizer.add(i) for i in emoji] == ["", "", "", "🙂"]
    assert [detokenizer.add(i) for i in byte_ids("a日")] == ["a", "", "", "日"]
    assert detokenizer.finish() == ""


def test_byte_fallback_emoji_is_emitted_in_one_piece() -> None:
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer.encode("he 🙂").ids
    assert tokenizer.encode("he 🙂").tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    chunks, tail, _ = stream(tokenizer, ids)
    assert chunks[-4:] == ["", "", "", "🙂"]
    assert "".join(chunks) + tail == "he 🙂"


def test_merged_partial_bytes_are_held_until_complete() -> None:
    """A trained byte-level merge can hold the tail of one character and the head of the next."""
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("日本語のテキスト").ids
    chunks, tail, _ = stream(tokenizer, ids)
    for chunk in chunks:
        assert "\ufffd" not in chunk
    assert "".join(chunks) + tail == "日本語のテキスト"


# --- (d) stop strings -------------------------------------------------------------------


def test_stop_string_split_across_tokens_never_leaks() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, stop=["END"])
    steps = [(c, detokenizer.add(i)) for c, i in zip("abcEND tail", byte_ids("abcEND tail"))]
    assert steps[:6] == [("a", "a"), ("b", "b"), ("c", "c"), ("E", ""), ("N", ""), ("D", "")]
    assert detokenizer.stopped
    assert all(out == "" for _, out in steps[6:])
    assert detokenizer.finish() == ""
    assert detokenizer.text == "abc"


def test_text_that_only_looks_like_a_stop_prefix_is_released() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, stop=["END"])
    outputs = [detokenizer.add(i) for i in byte_ids("xENx")]
    assert outputs == ["x", "", "", "ENx"]
    assert not detokenizer.stopped


def test_stop_at_the_very_start() -> None:
    tokenizer = byte_level_tokenizer()
    chunks, tail, detokenizer = stream(tokenizer, tokenizer.encode("hello world").ids, ["hel"])
    assert "".join(chunks) + tail == "" and detokenizer.stopped and detokenizer.text == ""


def test_stop_inside_a_single_token() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("hello world").ids
    _, tail, detokenizer = stream(tokenizer, ids, stop=["ll"])
    assert detokenizer.text == "he" and detokenizer.stopped and tail == ""


def test_multiple_stop_strings_first_to_complete_wins() -> None:
    tokenizer = byte_level_tokenizer()
    text = "one two\n\nthree STOP four"
    for stops, expected in [
        (["STOP", "\n\n"], "one two"),
        (["STOP", "three"], "one two\n\n"),
        (["four", "STOP"], "one two\n\nthree "),
        (["xyz", "none"], text),
    ]:
        for ids in (byte_ids(text), tokenizer.encode(text).ids):
            chunks, tail, detokenizer = stream(tokenizer, ids, stops)
            assert "".join(chunks) + tail == expected, stops
            assert detokenizer.stopped == (expected != text)


def test_overlapping_stop_strings_stop_where_the_first_completes() -> None:
    tokenizer = byte_level_tokenizer()
    # "bc" completes before "abcd" could, so generation stops there, whatever the tokens.
    for ids in (byte_ids("zabcd!"), tokenizer.encode("zabcd!").ids, [*byte_ids("z"), *byte_ids("abcd!")]):
        chunks, tail, _ = stream(tokenizer, ids, ["abcd", "bc"])
        assert "".join(chunks) + tail == "za"
    # Both end at the same character: the longer one is cut, so none of it is emitted.
    chunks, tail, _ = stream(tokenizer, byte_ids("xabc"), ["bc", "abc"])
    assert "".join(chunks) + tail == "x"


def test_multibyte_stop_string_split_inside_a_character() -> None:
    tokenizer = byte_level_tokenizer()
    chunks, tail, detokenizer = stream(tokenizer, byte_ids("x日本y"), ["日本"])
    assert "".join(chunks) + tail == "x" and detokenizer.stopped
    assert all("\ufffd" not in c and "日" not in c for c in chunks)


def _reference_stop(text: str, stops: Sequence[str]) -> str:
    """Character-at-a-time semantics: cut before the stop completing first (longest on ties)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(len(s) for s in hits)]
    return text


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_strings_match_character_level_reference_for_any_tokenization(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(f"stop-{name}")
    for _ in range(300):
        text = random_text(rng, rng.randrange(1, 20))
        stops = [random_text(rng, rng.randrange(1, 3)) for _ in range(rng.randrange(1, 3))]
        ids = encode_in_random_pieces(tokenizer, text, rng)
        decoded = tokenizer.decode(ids)
        chunks, tail, detokenizer = stream(tokenizer, ids, stops)
        expected = _reference_stop(decoded, stops)
        assert "".join(chunks) + tail == expected, (decoded, stops, chunks)
        assert detokenizer.stopped == (expected != decoded or any(s in decoded for s in stops))
        emitted = ""
        for chunk in chunks:  # no prefix of the text past the cut was ever shown
            emitted += chunk
            assert expected.startswith(emitted)


def test_add_after_stop_returns_nothing_and_finish_is_empty() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, stop=["!"])
    assert detokenizer.add(byte_ids("!")[0]) == ""
    assert detokenizer.stopped
    assert [detokenizer.add(i) for i in byte_ids("more")] == ["", "", "", ""]
    assert detokenizer.finish() == ""
    assert detokenizer.text == ""


# --- (e) finish() flushes stop prefixes that never completed ------------------------------


def test_finish_flushes_a_held_back_partial_stop() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, stop=["END", "<eot>"])
    emitted = "".join(detokenizer.add(i) for i in byte_ids("abcEN"))
    assert emitted == "abc"
    assert detokenizer.finish() == "EN"
    assert not detokenizer.stopped
    assert detokenizer.text == "abcEN"


def test_finish_flushes_partial_stop_and_partial_char_together() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, stop=["日本"])
    emitted = "".join(detokenizer.add(i) for i in byte_ids("a日"))
    assert emitted == "a"
    assert detokenizer.finish() == "日"


def test_finish_is_idempotent_and_add_after_finish_is_refused() -> None:
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, stop=["zz"])
    detokenizer.add(byte_ids("z")[0])
    assert detokenizer.finish() == "z"
    assert detokenizer.finish() == ""
    with pytest.raises(GenerationError, match="after finish"):
        detokenizer.add(byte_ids("a")[0])


# --- arguments and cost -----------------------------------------------------------------


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [None]])
def test_empty_or_non_string_stop_is_refused(stop: list[object]) -> None:
    with pytest.raises(GenerationError, match=r"stop\[\d\] must be a non-empty string"):
        StreamingDetokenizer(byte_level_tokenizer(), stop=stop)  # type: ignore[arg-type]


def test_a_bare_string_stop_is_refused() -> None:
    with pytest.raises(GenerationError, match="wrap it in a list"):
        StreamingDetokenizer(byte_level_tokenizer(), stop="END")


def test_negative_token_id_is_refused() -> None:
    with pytest.raises(GenerationError, match="token id must be >= 0, got -1"):
        StreamingDetokenizer(byte_level_tokenizer()).add(-1)


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_decoding_is_incremental_not_the_whole_sequence(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(" ".join(CORPUS[:7]) * 8, add_special_tokens=False).ids
    assert len(ids) > 400
    counting = _CountingTokenizer(tokenizer)
    detokenizer = StreamingDetokenizer(counting, stop=["never here"])  # type: ignore[arg-type]
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.finish()
    assert text == tokenizer.decode(ids)
    assert max(counting.lengths) <= 12  # a window of a few tokens, not the whole sequence


def test_prompt_context_keeps_the_space_before_the_first_generated_word() -> None:
    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode("the quick").ids
    generated = tokenizer.encode("hello world").ids
    detokenizer = StreamingDetokenizer(tokenizer, context_ids=prompt)
    text = "".join(detokenizer.add(i) for i in generated) + detokenizer.finish()
    assert text == " hello world"
    assert tokenizer.decode(prompt) + text == tokenizer.decode(prompt + generated)
    # without context the continuation reads as a text start, losing the space
    _, _, alone = stream(tokenizer, generated)
    assert alone.text == "hello world"


@pytest.mark.parametrize("name", ["byte_level", "metaspace", "byte_fallback"])
def test_continuation_after_random_context_equals_the_decode_difference(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(7)
    for _ in range(50):
        context = tokenizer.encode(random_text(rng, 12)).ids
        generated = tokenizer.encode(random_text(rng, 12)).ids
        detokenizer = StreamingDetokenizer(tokenizer, context_ids=context)
        text = "".join(detokenizer.add(i) for i in generated) + detokenizer.finish()
        assert tokenizer.decode(context) + text == tokenizer.decode(context + generated)


# --- invalid bytes never stall the stream ---------------------------------------------------


@cache
def merged_partial_tokenizer() -> Tokenizer:
    """Byte-level tokens for every byte, plus 'ok' fused with the lead byte of a 3-byte character.

    A model can emit such a token again and again; each one ends in a character that the
    next token never finishes, so every window ends in U+FFFD.
    """
    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab["ok" + chars[0xE6]] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_text_before_an_unfinished_character_that_never_finishes_comes_out_at_once() -> None:
    tokenizer = merged_partial_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer)
    outputs = [detokenizer.add(256) for _ in range(5)]
    # "ok" comes out with its own token; the dangling byte shows as U+FFFD once the next
    # token proves it invalid, exactly as the full decode has it.
    assert outputs == ["ok"] + ["\ufffdok"] * 4
    assert "".join(outputs) + detokenizer.finish() == tokenizer.decode([256] * 5) == "ok\ufffd" * 5


def test_an_invalid_byte_followed_by_text_releases_the_text_at_once() -> None:
    tokenizer = byte_level_tokenizer()
    chars = _bytes_to_unicode()
    invalid = [_known(tokenizer.token_to_id(chars[b])) for b in (0xFF, 0xC0, 0xF5, 0x80)]  # never in UTF-8
    detokenizer = StreamingDetokenizer(tokenizer)
    outputs = [detokenizer.add(i) for i in [*invalid, *byte_ids("hello")]]
    # Four U+FFFDs: the 4th proves the 1st can never be part of a character.
    assert outputs[:4] == ["", "", "", "\ufffd"]
    assert outputs[4:] == ["\ufffd\ufffd\ufffdh", "e", "l", "l", "o"]
    assert detokenizer.finish() == ""


def test_a_long_run_of_invalid_bytes_holds_at_most_three_replacement_chars() -> None:
    tokenizer = byte_level_tokenizer()
    continuation = _known(tokenizer.token_to_id(_bytes_to_unicode()[0x80]))
    detokenizer = StreamingDetokenizer(tokenizer)
    emitted = ""
    for count in range(1, 60):
        emitted += detokenizer.add(continuation)
        assert emitted == "\ufffd" * max(0, count - 3)
    assert emitted + detokenizer.finish() == tokenizer.decode([continuation] * 59)


def test_byte_fallback_invalid_bytes_do_not_stall_the_stream() -> None:
    tokenizer = byte_fallback_tokenizer()
    byte = {b: _known(tokenizer.token_to_id(f"<0x{b:02X}>")) for b in range(256)}
    h, e = _known(tokenizer.token_to_id("h")), _known(tokenizer.token_to_id("e"))
    detokenizer = StreamingDetokenizer(tokenizer)
    assert [detokenizer.add(i) for i in [h, byte[0xFF], e, h]] == ["h", "", "\ufffde", "h"]
    # A run of byte tokens after an invalid byte decodes to U+FFFD throughout (the full
    # decode agrees); it is released while it grows, never more than three behind.
    run = [byte[0xFF], *(byte[0x41 + i % 26] for i in range(30))]
    emitted = ""
    for count, token in enumerate(run, start=1):
        emitted += detokenizer.add(token)
        assert len(emitted) >= count - 3
    assert detokenizer.add(h).endswith("h")


# --- properties (hypothesis) ------------------------------------------------------------------

PROPERTY = settings(max_examples=150, deadline=None)
# Characters whose bytes byte-fallback ids spell out: 2, 3 and 4 bytes, and a control byte.
FALLBACK_CHARS = "é日🙂\x13"


@st.composite
def fallback_ids(draw: st.DrawFn) -> list[int]:
    """Byte-fallback ids: ordinary tokens, characters spelled in byte tokens, lone invalid bytes.

    An invalid byte is kept apart from other byte tokens by ordinary tokens on both sides:
    in one run it would turn the whole run into U+FFFD after the fact (the documented
    divergence), which no streamer can match without holding every run back.
    """
    tokenizer = byte_fallback_tokenizer()
    vocab = tokenizer.get_vocab()
    ordinary = sorted(i for t, i in vocab.items() if not t.startswith("<0x") and t not in ("<s>", "</s>"))
    specials = [vocab["<s>"], vocab["</s>"]]
    ids: list[int] = []
    for _ in range(draw(st.integers(0, 20))):
        kind = draw(st.sampled_from(["ordinary", "special", "char", "invalid"]))
        if kind == "ordinary":
            ids.append(draw(st.sampled_from(ordinary)))
        elif kind == "special":
            ids.append(draw(st.sampled_from(specials)))
        elif kind == "char":
            ids += [vocab[f"<0x{b:02X}>"] for b in draw(st.sampled_from(FALLBACK_CHARS)).encode()]
        else:
            ids += [
                draw(st.sampled_from(ordinary)),
                vocab[f"<0x{draw(st.integers(0x80, 0xFF)):02X}>"],
                draw(st.sampled_from(ordinary)),
            ]
    return ids


def any_ids(name: str) -> st.SearchStrategy[list[int]]:
    if name == "byte_fallback":
        return fallback_ids()
    return st.lists(st.integers(0, TOKENIZERS[name]().get_vocab_size() - 1), max_size=40)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_chunks_always_concatenate_to_the_full_decode(name: str, data: st.DataObject, skip: bool) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = data.draw(any_ids(name), label="ids")
    chunks, tail, detokenizer = stream(tokenizer, ids, skip=skip)
    assert "".join(chunks) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    assert detokenizer.text == "".join(chunks) + tail


def test_a_context_cut_inside_a_character_steps_back_to_its_start() -> None:
    tokenizer = byte_fallback_tokenizer()
    context = tokenizer.encode("ab日🙂").ids  # ▁ a b, then 日 and 🙂 spelled in byte tokens
    assert len(context) == 10  # so the last 6 ids start inside 日
    generated = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    detokenizer = StreamingDetokenizer(tokenizer, context_ids=context)
    text = "".join(detokenizer.add(i) for i in generated) + detokenizer.finish()
    assert text == "🙂"


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@PROPERTY
@given(data=st.data())
def test_a_continuation_reads_as_the_decode_difference(name: str, data: st.DataObject) -> None:
    tokenizer = TOKENIZERS[name]()
    prompt = "".join(data.draw(st.lists(st.sampled_from(MULTIBYTE_ALPHABET), min_size=1, max_size=12)))
    context = tokenizer.encode(prompt).ids
    ids = data.draw(any_ids(name), label="ids")
    detokenizer = StreamingDetokenizer(tokenizer, context_ids=context)
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.finish()
    assert tokenizer.decode(context) + text == tokenizer.decode(context + ids)


@PROPERTY
@given(ids=any_ids("byte_level"), skip=st.booleans())
def test_byte_level_holds_back_nothing_but_up_to_three_replacement_chars(ids: list[int], skip: bool) -> None:
    """After every id, the text not yet emitted is at most three U+FFFD: nothing valid waits."""
    tokenizer = byte_level_tokenizer()
    detokenizer = StreamingDetokenizer(tokenizer, skip_special_tokens=skip)
    emitted = ""
    for count, token in enumerate(ids, start=1):
        emitted += detokenizer.add(token)
        so_far = tokenizer.decode(ids[:count], skip_special_tokens=skip)
        held = so_far[len(emitted) :]
        assert so_far.startswith(emitted) and len(held) <= 3 and held == "\ufffd" * len(held)


@PROPERTY
@given(
    text=st.text(alphabet="ab日🙂 \n", max_size=16),
    stops=st.lists(st.text(alphabet="ab日🙂 \n", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_strings_cut_where_a_character_stream_would(text: str, stops: list[str]) -> None:
    """One token per byte, the most split encoding: a stop is never emitted, not even in part."""
    tokenizer = byte_level_tokenizer()
    chunks, tail, detokenizer = stream(tokenizer, byte_ids(text), stops)
    expected = _reference_stop(text, stops)
    assert "".join(chunks) + tail == expected
    assert detokenizer.stopped == any(s in text for s in stops)
    emitted = ""
    for chunk in chunks:
        emitted += chunk
        assert expected.startswith(emitted)


def test_a_stop_string_in_the_context_does_not_stop_generation() -> None:
    """The prompt is decoding context only: the stop matcher sees generated text alone."""
    tokenizer = byte_level_tokenizer()
    context = tokenizer.encode("hello END there").ids
    for stop in ["END", "there", "e wo"]:  # in the prompt, or across prompt and generated text
        detokenizer = StreamingDetokenizer(tokenizer, stop=[stop], context_ids=context)
        text = "".join(detokenizer.add(i) for i in tokenizer.encode(" world").ids) + detokenizer.finish()
        assert text == " world" and not detokenizer.stopped
