"""The generated blocks of the docs: text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``.

A benchmark script renders its block from its results file in benchmarks/results/ and writes it here; the prose
around the markers is left alone. tests/test_doc_tables.py renders every block again from its results file and
compares it with the text between the markers, so a number in a generated table always has a results file behind
it. ``python benchmarks/doc_tables.py`` rewrites them all.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from vitconvert.writer import write_text_atomic

# Other processes' share of the CPUs under which a footer calls the machine idle rather than shared.
IDLE_SHARE = 0.10


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def read_block(text: str, name: str) -> Optional[str]:
    """The text between ``name``'s markers (without them or the newlines beside them); None if they are absent."""
    begin, end = markers(name)
    if begin not in text or end not in text.split(begin, 1)[1]:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with ``body`` between ``name``'s markers; the markers are appended at the end where absent."""
    begin, end = markers(name)
    if read_block(text, name) is None:
        text = text.rstrip() + f"\n\n{begin}\n{end}\n"
    before, rest = text.split(begin, 1)
    return f"{before}{begin}\n{body.strip(chr(10))}\n{end}{rest.split(end, 1)[1]}"


def write_block(doc: Path, name: str, body: str) -> None:
    """``doc`` (created if missing) with ``body`` between ``name``'s markers."""
    text = doc.read_text() if doc.is_file() else ""
    write_text_atomic(doc, replace_block(text, name, body))
    print(f"wrote the {name} block of {doc}")


def write_results(path: Path, record: Any) -> None:
    """A results file as JSON, whole or not at all: a run stopped while it writes leaves the previous file."""
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def measure_or_report(description: str, results: Path, measure: Callable[[], Any], doc: Path, name: str,
                      render: Callable[[Any], str]) -> None:
    """A benchmark's command line: measure into ``results`` (unless --report-only), then write its block of
    ``doc`` from that file, so the doc shows what the file holds and nothing else."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table from the results file")
    if not parser.parse_args().report_only:
        write_results(results, measure())
    write_block(doc, name, render(json.loads(results.read_text())))


def on_cpus(cpus: int, others: Optional[float], load: str, during: str = "") -> str:
    """Where a run was measured: "idle" when other processes took under IDLE_SHARE of the CPUs (``others``, at
    most, ``during`` the run), else "shared with other jobs" with the load average ``load`` describes."""
    if others is not None and others < IDLE_SHARE:
        return f"on {cpus} otherwise idle CPU cores (other processes took at most {others:.0%} of them{during})"
    taken = "" if others is None else f"; other processes took up to {others:.0%} of them{during}"
    return f"on {cpus} CPU cores shared with other jobs ({load}{taken})"


def others_at_most(cpu_s: float, wall_s: float, cpus: int) -> float:
    """The largest share of the CPUs other processes can have used while a run took ``cpu_s`` of them over
    ``wall_s``: what the run did not use itself (a bound, tight for a run that keeps every core busy)."""
    return min(max(1.0 - cpu_s / (cpus * wall_s), 0.0), 1.0)


def footer(measured: str, commands: str | Sequence[str], results: str) -> str:
    """The last line of a generated block: how and where it was measured, the command(s) that wrote it and the
    results file(s) it renders from, in one shape for every block."""
    run = " and ".join(f"`python {c}`" for c in ([commands] if isinstance(commands, str) else commands))
    return f"{measured.rstrip('.')}. Written by {run} ({results})."
