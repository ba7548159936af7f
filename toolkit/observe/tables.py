"""Plain-text pieces every report section shares: Markdown tables, number cells, per-rank peaks and the
one-line error exit. Its own module so report, compare and plan-vs-run import it without importing
each other."""

from __future__ import annotations

import sys

from toolkit.observe.rundata import RunData


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _max(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def md_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A Markdown pipe table, also readable as plain text: the first ``left`` columns (labels)
    align left, the rest (numbers) right."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        padded = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    sep = (
        "|"
        + "|".join(":" + "-" * (w + 1) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def run_peaks(data: RunData) -> dict[int, dict[str, float | None]]:
    """Per rank over the whole run: peak allocated (a snapshot's peak covers only the window since the
    previous one, so the run's peak is the max; allocated where no peak was read) and host RSS."""
    out: dict[int, dict[str, float | None]] = {}
    for rank, snaps in sorted(data.memory.items()):
        out[rank] = {
            "peak_allocated_gib": _max(
                [
                    r["peak_allocated_gib"] if r["peak_allocated_gib"] is not None else r["allocated_gib"]
                    for r in snaps
                ]
            ),
            "host_rss_gib": _max([r["host_rss_gib"] for r in snaps]),
        }
    return out


def error(msg: str) -> int:
    """Bad input: one line on stderr, exit status 1."""
    print(f"error: {msg}", file=sys.stderr)
    return 1
