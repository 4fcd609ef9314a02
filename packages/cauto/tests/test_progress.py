import io

import pytest

from cauto.cli.progress import progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_stream_gets_one_line_per_phase():
    out = io.StringIO()
    with progress("solving", out):
        pass
    assert out.getvalue().startswith("done: solving in ") and out.getvalue().count("\n") == 1


def test_terminal_gets_redrawn_line_and_failure_is_reported():
    import time

    out = _Tty()
    with pytest.raises(ValueError), progress("profiling", out):
        time.sleep(0.35)
        raise ValueError("boom")
    text = out.getvalue()
    assert "\r" in text and "profiling" in text and "failed: profiling in 0." in text
