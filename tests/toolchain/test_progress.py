"""Stage progress: redrawn on a terminal, plain lines elsewhere, nothing when quiet or unasked."""

from __future__ import annotations

import io
import time

import pytest

from kvforge.toolchain import progress


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_stages() -> None:
    with progress.stage("load"):
        progress.total(3, "tensors")
        for _ in range(3):
            progress.advance()
            time.sleep(0.03)
    with progress.stage("export"):
        time.sleep(0.05)  # no counts: the spinner turns on its own
    with progress.stage("passes"):
        progress.count(20, 20, "passes")


def test_a_terminal_gets_one_redrawn_line_per_stage_then_a_summary() -> None:
    stream = TerminalStream()
    with progress.reporting(progress.Terminal(stream, interval=0.01)):
        run_stages()
    text = stream.getvalue()
    assert "\r\x1b[2K" in text  # redrawn in place
    assert "[" + "#" * 24 + "]" in text  # the bar, full once every tensor is in
    assert any(frame in text for frame in "/-\\")  # the spinner turned
    finals = [line.rsplit("\r\x1b[2K", 1)[-1] for line in text.split("\n")[:-1]]
    assert [f.split(" done in ")[0] for f in finals] == ["load", "export", "passes"]
    assert finals[0].endswith("(3/3 tensors)") and finals[2].endswith("(20/20 passes)")
    assert " s" in finals[1] and "(" not in finals[1]


def test_elsewhere_each_stage_is_two_plain_lines() -> None:
    stream = io.StringIO()
    with progress.reporting(progress.for_stream(stream)):
        run_stages()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert lines[0::2] == ["kvforge: load...", "kvforge: export...", "kvforge: passes..."]
    assert lines[1].startswith("kvforge: load done in ") and lines[1].endswith(" s (3/3 tensors)")
    assert lines[3].startswith("kvforge: export done in ") and lines[3].endswith(" s")
    assert lines[5].endswith("(20/20 passes)")


def test_a_failing_stage_says_so_and_the_error_goes_on() -> None:
    stream = io.StringIO()
    with progress.reporting(progress.Lines(stream)), pytest.raises(ValueError), progress.stage("verify"):
        raise ValueError("gate")
    assert stream.getvalue().splitlines()[-1].startswith("kvforge: verify failed after ")


def test_quiet_or_unasked_shows_nothing() -> None:
    assert progress.for_stream(TerminalStream(), quiet=True) is None
    assert isinstance(progress.for_stream(TerminalStream()), progress.Terminal)
    assert isinstance(progress.for_stream(io.StringIO()), progress.Lines)
    run_stages()  # no reporter: the calls are no-ops
    with progress.reporting(None):
        run_stages()


class FakeSession:
    io = "contract"
    extra = 7

    def run(self, feeds: dict[str, int]) -> dict[str, int]:
        return {"logits": feeds["x"] + 1}


def test_a_counted_session_counts_its_runs_as_steps() -> None:
    stream = io.StringIO()
    with progress.reporting(progress.Lines(stream)), progress.stage("verify"):
        session = progress.CountedSession(FakeSession())  # type: ignore[arg-type]
        assert [session.run({"x": i})["logits"] for i in range(9)] == list(range(1, 10))
        assert session.io == "contract" and session.extra == 7
    assert stream.getvalue().splitlines()[-1].endswith("(9 steps)")


def test_a_ctrl_c_python_swallows_still_ends_the_work_at_the_next_stage(capsys: pytest.CaptureFixture[str]) -> None:
    import signal
    import weakref

    class Target:
        pass

    def interrupt_in_a_callback() -> None:
        # a weakref callback's exception cannot propagate: Python reports it as unraisable and goes on
        target = Target()
        ref = weakref.ref(target, lambda _: signal.raise_signal(signal.SIGINT))
        del target
        assert ref() is None

    started = []
    # Python's own handler, as a process started at a terminal has it (a background run ignores SIGINT)
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), progress.interruptible():
            with progress.stage("export"):
                interrupt_in_a_callback()
                started.append("export went on")  # the interrupt was swallowed where it was raised
            with progress.stage("lower"):
                started.append("lower")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, outside)
    assert started == ["export went on"]
    assert "KeyboardInterrupt" not in capsys.readouterr().err  # not printed as "Exception ignored"
    with progress.stage("after"):  # the next block starts clean
        pass
