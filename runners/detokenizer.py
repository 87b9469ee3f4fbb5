"""Streaming detokenizer: token ids in, text out, only at safe points.

Two things make streaming text harder than decoding at the end:

* A token need not end on a character boundary. Byte-level BPE (GPT-2, Llama 3, Qwen)
  and SentencePiece byte fallback split a multibyte character across tokens, and
  decoding such a prefix yields U+FFFD. Text is emitted only once it no longer ends in
  U+FFFD, so a reader never sees a replacement character the final text does not have.
* Decoders are context dependent: a SentencePiece/Metaspace decoder drops the leading
  space of the first token it sees. Decoding each token alone would lose spaces, and
  decoding the whole sequence at every step is quadratic. The prefix/read offset window
  used by vLLM and transformers' TextIteratorStreamer avoids both: decode a short
  window that starts one emitted step back, and emit what the new tokens added to it.

Stop strings are applied to the text: everything before the first stop string to
complete is emitted, the stop string and what follows never are, and a tail of
pending text that could still become a stop string is held back until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from runners.errors import GenerationError

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context: enough for any decoder's look-behind.
_CONTEXT_TOKENS = 6


class _IncrementalDecoder:
    """Turns a growing id sequence into text deltas, decoding only a short window.

    ``prefix_offset`` marks where the window starts and ``read_offset`` where the text
    already returned ends. Both move forward only when the window's text is complete
    (does not end in U+FFFD), so windows start on character boundaries of valid text.

    One known divergence from ``decode`` of the whole sequence: a byte-fallback decoder
    (``<0xE6>`` tokens) replaces a whole run of byte tokens with U+FFFD when any byte in
    it is invalid, so bytes streamed as valid characters before an invalid byte arrived
    appear as themselves here but as U+FFFD in the full decode. Only invalid UTF-8 is
    affected; matching it would mean holding back every run of byte tokens until it ends.
    """

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool, context_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Context ids start the window as if already emitted, so the first generated
        # token decodes as a continuation (its leading space kept), not as a text start.
        self._ids: list[int] = [int(i) for i in context_ids]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` completes; "" while a character is still partial."""
        self._ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held, U+FFFD included: the sequence really ends there."""
        prefix_text, window_text = self._decode_window()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        return prefix_text, window_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class _StopMatcher:
    """Finds stop strings in text that arrives in pieces, holding back possible prefixes."""

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise GenerationError(f"stop must be a sequence of strings, got the string {stop!r}; wrap it in a list")
        for index, item in enumerate(stop):
            if not isinstance(item, str) or not item:
                raise GenerationError(f"stop[{index}] must be a non-empty string, got {item!r}; remove it")
        self._stop = tuple(stop)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return what is safe to emit and whether a stop string was found."""
        self._pending += text
        found = self._first_stop()
        if found is not None:
            safe, self._pending = self._pending[:found], ""
            return safe, True
        cut = len(self._pending) - self._held_length()
        safe, self._pending = self._pending[:cut], self._pending[cut:]
        return safe, False

    def flush(self) -> str:
        """The held-back tail: no more text is coming, so it can no longer become a stop."""
        held, self._pending = self._pending, ""
        return held

    def _first_stop(self) -> int | None:
        """Start of the stop string that completes first in the pending text, if any.

        "First" means the earliest end: that is where generation would have stopped had
        the text arrived one character at a time, so the result does not depend on how
        the text was split into tokens. Among stops ending at the same place the longest
        wins, so no part of it is emitted. Occurrences can only start in pending text:
        emitted text never ends in a proper prefix of a stop string (that is held back).
        """
        best: tuple[int, int] | None = None
        for stop in self._stop:
            start = self._pending.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _held_length(self) -> int:
        """Length of the longest tail of pending text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class StreamingDetokenizer:
    """Feeds generated ids one at a time and returns the text that is safe to show.

    Without a stop string hit, the chunks returned by ``add`` plus ``finish()`` equal
    ``tokenizer.decode(ids)`` of all ids added. With ``context_ids`` (the prompt), they
    equal ``decode(context + ids)`` minus ``decode(context)``: the continuation as it
    reads after the prompt, so SentencePiece-style decoders keep the first word's space.
    Once a stop string is found, ``stopped`` is True and nothing more is emitted.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._decoder = _IncrementalDecoder(tokenizer, skip_special_tokens, context_ids[-_CONTEXT_TOKENS:])
        self._matcher = _StopMatcher(stop)
        self._chunks: list[str] = []
        self._finished = False
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]  # join once, not on every read
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Take the next generated id; return the text newly safe to emit (may be "")."""
        if self._finished:
            raise GenerationError(
                "StreamingDetokenizer.add() called after finish(); start a new detokenizer for a new sequence"
            )
        if self.stopped:
            return ""
        if token_id < 0:
            raise GenerationError(f"token id must be >= 0, got {token_id}")
        return self._emit(*self._matcher.feed(self._decoder.add(int(token_id))))

    def finish(self) -> str:
        """Flush held-back text at the end of generation; nothing past a stop string.

        Calling it again returns "".
        """
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        safe, stopped = self._matcher.feed(self._decoder.flush())
        if not stopped:
            safe += self._matcher.flush()
        return self._emit(safe, stopped)

    def _emit(self, text: str, stopped: bool) -> str:
        self.stopped = self.stopped or stopped
        if text:
            self._chunks.append(text)
        return text
