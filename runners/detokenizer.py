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

from kvforge.runners.errors import GenerationError

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context: enough for any decoder's look-behind.
_CONTEXT_TOKENS = 6
# Trailing U+FFFDs that may still become a character: an unfinished UTF-8 character has
# at most 3 of its 4 bytes, and each byte-fallback byte decodes to one U+FFFD.
_MAX_PENDING = 3
# Held tokens after which a window that keeps ending in U+FFFD is cut short.
_REANCHOR_TOKENS = 8


class _IncrementalDecoder:
    """Turns a growing id sequence into text deltas, decoding only a short window.

    ``prefix_offset`` marks where the window starts and ``read_offset`` where the text of
    whole tokens already returned ends; both move forward when the window's text is
    complete (does not end in U+FFFD), so windows start on character boundaries.

    While the window ends in U+FFFD the tail is held, but only the part that could still
    change. Appending bytes changes the decoded text only at its end: a byte-level
    decoder (lossy UTF-8) turns an unfinished character into one trailing U+FFFD; a
    byte-fallback decoder turns the whole trailing run of ``<0xXX>`` tokens into one
    U+FFFD per byte until the run is valid. So text before the trailing U+FFFDs is final
    and is returned at once (``_extra`` keeps it), and of the trailing U+FFFDs at most
    ``_MAX_PENDING`` are held: an unfinished UTF-8 character has at most three bytes, and
    four or more U+FFFDs mean an invalid byte that no later byte can repair. Valid text
    after an invalid byte therefore never waits for ``flush``.

    A window that keeps ending in U+FFFD does not slide, so after ``_REANCHOR_TOKENS``
    held tokens it is cut where the text splits cleanly (see ``_reanchor``), keeping each
    step's decode short.

    One known divergence from ``decode`` of the whole sequence: a byte-fallback decoder
    replaces a whole run of byte tokens with U+FFFD when any byte in it is invalid, so
    bytes streamed as valid characters before an invalid byte arrived appear as themselves
    here but as U+FFFD in the full decode (and a long invalid run may be cut, see
    ``_reanchor``). Only invalid UTF-8 is affected; matching it would mean holding back
    every run of byte tokens until it ends.
    """

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool, context_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Context ids start the window as if already emitted, so the first generated
        # token decodes as a continuation (its leading space kept), not as a text start.
        self._ids: list[int] = self._context_tail([int(i) for i in context_ids])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._extra = ""  # text returned past the prefix text while the tail was held

    def _context_tail(self, context: list[int]) -> list[int]:
        """The last few context ids, starting on a character boundary.

        A tail cut inside a character spelled in byte tokens would decode as U+FFFD and
        could poison the run it joins; stepping back up to three more tokens reaches the
        character's first byte. Without such a start, decode without context.
        """
        last = len(context) - _CONTEXT_TOKENS
        for start in range(max(last, 0), max(last - 4, -1), -1):
            tail = context[start:]
            if not self._decode(tail).startswith(REPLACEMENT_CHAR):
                return tail
        return []

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` completes; "" while only an unfinished character is new."""
        self._ids.append(token_id)
        prefix_text, window_text = self._decode_window()
        shown = prefix_text + self._extra
        new = window_text[len(shown) :]
        if not new:
            return ""
        if not new.endswith(REPLACEMENT_CHAR):
            self._advance()
            return new
        settled = ""
        if window_text.startswith(shown):  # else a byte-fallback run was re-rendered: wait for it to settle
            pending = len(new) - len(new.rstrip(REPLACEMENT_CHAR))
            settled = new[: len(new) - min(pending, _MAX_PENDING)]
            self._extra += settled
        if len(self._ids) - self._read_offset > _REANCHOR_TOKENS:
            settled += self._reanchor(window_text, len(shown) + len(settled))
        return settled

    def flush(self) -> str:
        """Whatever is still held, U+FFFD included: the sequence really ends there."""
        prefix_text, window_text = self._decode_window()
        rest = window_text[len(prefix_text) + len(self._extra) :]
        self._advance()
        return rest

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._extra = ""

    def _reanchor(self, window_text: str, shown: int) -> str:
        """Start the window at a token boundary where the text splits cleanly; return the text
        before that boundary not returned yet.

        A boundary is clean when the two sides decode to exactly the window's text and the
        right side is not empty. A character or an invalid sequence cut in two decodes to
        more pieces than it did whole (each stray continuation byte is a U+FFFD of its own),
        so the equality means no byte sequence crosses the boundary; its bytes are at most
        four, so one of the last few boundaries is clean. A byte-fallback run poisoned by an
        invalid byte may have none, as its halves decode to valid text: then the window is
        cut a few tokens back anyway, what the window showed before the cut is returned,
        and the run's rendering (garbage) may differ from a full decode, as described in the
        class docstring.
        """
        end = len(self._ids)
        for cut in range(end - _MAX_PENDING, max(self._read_offset, end - 2 * _REANCHOR_TOKENS), -1):
            left = self._decode(self._ids[self._prefix_offset : cut])
            right = self._decode(self._ids[cut:])
            if right and left + right == window_text:
                return self._restart(cut, window_text, shown, right)
        return self._restart(end - _MAX_PENDING, window_text, shown, self._decode(self._ids[end - _MAX_PENDING :]))

    def _restart(self, cut: int, window_text: str, shown: int, right: str) -> str:
        """Make ``cut`` the window's start, where ``right`` (its text) ends ``window_text``."""
        boundary = max(0, len(window_text) - len(right))
        self._prefix_offset = self._read_offset = cut
        self._extra = right[: max(0, shown - boundary)]
        return window_text[shown:boundary]

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
        self._decoder = _IncrementalDecoder(tokenizer, skip_special_tokens, context_ids)
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
