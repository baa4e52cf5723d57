"""Rank output: prefix every line with its rank and stream it, optionally also to files.

The launcher's one I/O thread (io_loop.py, Note [One thread watches the ranks]) reads every
rank's pipes and writes each whole line, prefixed `[RANK]<stdout>: ` or `[RANK]<stderr>: `,
under a single lock shared with the launcher's own messages, so lines never interleave
mid-line. A rank's stdout goes to the launcher's stdout and
its stderr to the launcher's stderr. With an output directory, each rank also gets
DIR/rank.N/stdout and DIR/rank.N/stderr holding its lines without prefixes.
"""
import os
import sys
import threading
import time
from typing import BinaryIO, IO, Optional

from .io_loop import IoLoop


class OutputMux:
    def __init__(self, stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
                 output_dir: Optional[str] = None, timestamps: bool = False) -> None:
        self._timestamps = timestamps  # --prefix-output-with-timestamp
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._dir = output_dir
        self._lock = threading.Lock()
        self.loop = IoLoop()  # also watches the ranks' exits (workers.py)
        if output_dir:
            os.makedirs(output_dir, exist_ok=True)

    def attach(self, rank: int, stdout_pipe: BinaryIO, stderr_pipe: BinaryIO) -> None:
        """Start streaming one rank's pipes; returns at once."""
        for pipe, name in ((stdout_pipe, "stdout"), (stderr_pipe, "stderr")):
            self.loop.watch_pipe(pipe, *self.rank_sink(rank, name))

    def rank_sink(self, rank: int, name: str):
        """(on_line, on_end) for one rank's stream `name`: on_line(raw bytes of one line) writes
        it prefixed (and to the rank's file), on_end closes the file. For lines that arrive
        some other way than a pipe of this process (an agent's frames, workers.py)."""
        prefix = f"[{rank}]<{name}>: "
        sink = self._out if name == "stdout" else self._err
        file = self._rank_file(rank, name)
        return ((lambda raw: self._line(raw, prefix, file, sink)),
                (lambda: file.close()) if file is not None else (lambda: None))

    def _rank_file(self, rank: int, name: str) -> Optional[BinaryIO]:
        if not self._dir:
            return None
        rank_dir = os.path.join(self._dir, f"rank.{rank}")
        os.makedirs(rank_dir, exist_ok=True)
        return open(os.path.join(rank_dir, name), "wb")

    def _line(self, raw: bytes, prefix: str, file: Optional[BinaryIO], sink: IO[str]) -> None:
        if file is not None:
            try:
                file.write(raw)
                file.flush()
            except (OSError, ValueError):
                pass
        line = raw.decode(errors="replace")
        if not line.endswith("\n"):
            line += "\n"  # a last line without newline still ends whole
        if self._timestamps:  # "[1]<stdout>[Mon Nov 30 21:20:06 2026]: ..."
            stamp = time.strftime("%a %b %d %H:%M:%S %Y")
            self.write_line(f"{prefix[:-2]}[{stamp}]: {line}", sink)
        else:
            self.write_line(prefix + line, sink)

    def write_line(self, text: str, sink: Optional[IO[str]] = None) -> None:
        """Write text (one or more whole lines) without interleaving with rank output."""
        sink = sink or self._err
        with self._lock:
            try:
                sink.write(text)
                sink.flush()
            except (OSError, ValueError):
                pass  # a closed terminal must not stop the I/O thread

    def drain(self, timeout: float) -> bool:
        """Wait for every pipe to reach end of file; False if some are still open."""
        return self.loop.wait_pipes(timeout)

    def close(self) -> None:
        """Stops the I/O thread (after drain: output still in a pipe is dropped)."""
        self.loop.stop()
