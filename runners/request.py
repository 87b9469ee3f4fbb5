"""One request record: a sequence's prompt, how it chooses tokens, how its text is made and when it ends.

Everything that generates drives the same record. `Engine.stream` and `Engine.generate`, the
server's scheduler (continuous batching, speculative verify) and the Triton backend hand it each
token chosen for its sequence and take back the text that token completes; the record then says
whether the sequence has finished and why (`end_of_row`, as vLLM's `check_stop` reads its request).
Everything about a request is checked where the record is made (`Engine.request`), once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.runners.decoding import Decoder, TokenLogprob, end_of_row
from kvforge.runners.detokenizer import StreamingDetokenizer
from kvforge.runners.sampling import SamplingParams


@dataclass(eq=False)
class GenerationRequest:
    """One sequence: prompt `ids`, its `budget` of new tokens, its detokenizer (stop strings
    included) and decoder (built from `params` when not given: no grammar, no logprobs), and its
    eos policy: an id of `eos_ids` ends it unless `ignore_eos` (vLLM's field, for load tests)."""

    ids: list[int]
    params: SamplingParams
    budget: int
    detokenizer: StreamingDetokenizer
    eos_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    decoder: Decoder | None = None
    generated: int = 0  # tokens taken, an ending eos included
    tokens: list[int] = field(default_factory=list)  # the tokens of the text (no ending eos)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token of `tokens`, when asked for
    finish_reason: str | None = None  # "stop" or "length" once finished
    ending_eos: int | None = None  # the end-of-text id that ended it, if one did

    def __post_init__(self) -> None:
        if self.decoder is None:
            self.decoder = Decoder(self.params, self.ids)
        self._logprobs_taken = 0

    @property
    def chooser(self) -> Decoder:
        assert self.decoder is not None  # made in __post_init__
        return self.decoder

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cut_short(self) -> bool:
        """Ended by its budget ("length") before its grammar had a whole sentence: the text does
        not match the --json-schema, --regex or --grammar it was constrained to."""
        return self.finish_reason == "length" and self.chooser.incomplete

    def add(self, token: int, logprob: TokenLogprob | None = None) -> str:
        """Take the sequence's next token (already chosen and accepted by its decoder): the text
        it completes ("" while the detokenizer holds it back); `finish_reason` is set when the
        sequence ends with it. An ending eos adds no text and no logprob."""
        self.generated += 1
        eos = token in self.eos_ids and not self.ignore_eos
        text = ""
        if eos:
            self.ending_eos = token
        else:
            text = self.detokenizer.add(token)
            self.tokens.append(token)
            if logprob is not None:
                self.logprobs.append(logprob)
        self.finish_reason = end_of_row(
            eos=eos,
            stopped=self.detokenizer.stopped,
            finished=self.chooser.finished,
            generated=self.generated,
            budget=self.budget,
        )
        return text

    def finish(self) -> str:
        """The text the detokenizer still holds (none of a stop string), once the sequence has ended."""
        return self.detokenizer.finish()

    def new_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The logprob entries added since the last call (a stream's delta)."""
        entries = tuple(self.logprobs[self._logprobs_taken :])
        self._logprobs_taken = len(self.logprobs)
        return entries
