"""Helpers shared by the launcher tests (imported by module name: tests/launcher is on
sys.path under pytest's default import mode)."""
import sys

LAUNCH = [sys.executable, "-m", "hvdlite.runner.launch"]


def rank_lines(text, stream="stdout"):
    """{rank: [lines]} from prefixed launcher output; other lines under None."""
    out = {}
    for line in text.splitlines():
        if line.startswith("[") and f"]<{stream}>: " in line:
            head, _, rest = line.partition(f"]<{stream}>: ")
            out.setdefault(int(head[1:]), []).append(rest)
        else:
            out.setdefault(None, []).append(line)
    return out
