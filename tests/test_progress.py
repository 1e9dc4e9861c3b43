"""Progress bars (tqdm) are drawn on a terminal only."""

import io
import sys

from dsgd import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_is_drawn_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with progress.bar(4, "training") as bar:
        for _ in range(4):
            bar.set_postfix(loss="0.5000", refresh=False)
            bar.update()
    drawn = sys.stderr.getvalue()
    assert "training" in drawn and "4/4" in drawn and "loss=0.5000" in drawn


def test_bar_is_silent_otherwise_but_lines_are_written(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress.bar(None, "training") as bar:  # unknown total (streaming data)
        bar.update(3)
        progress.write("step 3: loss 0.5")
    assert sys.stderr.getvalue() == "step 3: loss 0.5\n"
