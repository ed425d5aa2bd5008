"""A resumable pipeline's journal: what it reads and computes, and each round it finished.

``<output>.journal`` sits beside ``<output>.partial`` while a
``resume=True`` run writes it: one JSON object per line, the first
describing the run (input, task, output, checksum kind), every further
one a finished round (its rows, the checksums of its input and output),
appended only after that round's rows are written and synced. A last
line cut short by a crash is ignored (and overwritten). The next run
checks the journal against itself (:func:`differences`) and the rows in
``.partial`` against the journal's checksums, and continues at the first
unfinished row, at any world size or chunking. docs/pipeline.md ("Resume").
"""

import json
import os

from spmd.errors import PipelineError

__all__ = ["Journal", "journal_path", "differences", "VERSION"]

VERSION = 1


def journal_path(output):
    """Where the journal of output lives."""
    return f"{os.fspath(output)}.journal"


def differences(recorded, now):
    """Return a line for each field of the journal's header that differs from this run's."""
    lines = []
    for key, what in (("rows", "input rows"), ("input", "input"), ("task", "task"),
                      ("checksum", "checksum kind"), ("output_dtype", "output dtype"),
                      ("output_row_shape", "output row shape")):
        if key in now and recorded.get(key) != now[key]:
            lines.append(f"{what}: the journal has {recorded.get(key)!r}, this run {now[key]!r}")
    return lines


class Journal:
    """The journal file of one output: :meth:`load` it, :meth:`start` it, :meth:`add` rounds."""

    def __init__(self, output):
        self.path = journal_path(output)
        self.header, self.rounds = None, []
        self._file = None

    def exists(self):
        return os.path.exists(self.path)

    def load(self):
        """Read the header and the finished rounds; ignore a torn last line. Return self."""
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
        except OSError as exc:
            raise PipelineError(f"cannot read the journal {self.path}: {exc}") from None
        records, good_bytes = [], 0
        for i, line in enumerate(lines):
            if i == len(lines) - 1:  # after the last newline: empty, or a torn line
                break
            try:
                records.append(json.loads(line))
            except ValueError:
                if i < len(lines) - 2:
                    raise PipelineError(f"{self.path}: line {i + 1} is not a journal record; "
                                        "delete the journal and the .partial output to start over") from None
                break
            good_bytes += len(line) + 1
        if not records or records[0].get("spmd_journal") != VERSION:
            raise PipelineError(f"{self.path} is not a version-{VERSION} spmd journal; "
                                "delete it and the .partial output to start over")
        self.header, self.rounds, self._good = records[0], records[1:], good_bytes
        expect = 0
        for r in self.rounds:
            if r["rows"][0] != expect:
                raise PipelineError(f"{self.path}: round {r['rows']} does not follow row {expect}")
            expect = r["rows"][1]
        return self

    @property
    def done(self):
        """The rows finished: every row before this one."""
        return self.rounds[-1]["rows"][1] if self.rounds else 0

    def start(self, header):
        """Write a new journal with header, replacing any; keep it open for :meth:`add`."""
        self.header, self.rounds = dict(header, spmd_journal=VERSION), []
        self._file = open(self.path, "wb")
        self._write(self.header)

    def reopen(self):
        """Open a loaded journal for more rounds, cutting a torn last line."""
        self._file = open(self.path, "r+b")
        self._file.truncate(self._good)
        self._file.seek(self._good)

    def add(self, start, stop, in_crc, out_crc):
        """Record a finished round (its rows are written and synced)."""
        record = {"rows": [int(start), int(stop)], "in": int(in_crc), "out": int(out_crc)}
        self.rounds.append(record)
        self._write(record)

    def _write(self, record):
        self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self):
        """Close and delete the journal (the output is complete)."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
