"""Draw the plots of docs/benchmarks.md from the tables on that page.

The page is the record: each plotted table follows a marker line ``<!-- plot:NAME -->``, and
this script reads the rows of that table, so a plot can never show a figure the page does not.
It writes small PNGs into docs/img/:

- ``allreduce.png``: gradsync's speed-up over the peer of the same run, for the shared-memory
  (``plot:shm``) and TCP (``plot:tcp``) allreduce tables;
- ``backend.png``: the torch backend's speed-up over gloo by size, one line per collective
  (``plot:backend``);
- ``ps.png``: the parameter server's speed-up over gRPC by size, shared memory and TCP
  (``plot:ps``);
- ``scale_init.png``, ``scale_sockets.png``, ``scale_store.png``, ``scale_rss.png``: the
  runtime against the number of ranks N (``plot:scale``, the summary that ``gradsync bench
  scale --markdown`` prints): init() beside the limit measured in the same run, sockets per
  rank, the whole job's store requests during init(), and the memory per rank; one line per
  machine. A table not measured yet (no numeric N) is skipped with a note.

Run from the repository root: ``python3 scripts/plot_benchmarks.py`` (needs matplotlib).
``--scale-json FILE ...`` draws the scale plots from ``gradsync bench scale --json`` files
instead of the page, to look at a sweep before its table goes in; the table the bench prints
with ``--markdown`` is the same rows, so the page then gives the same plots.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

__all__ = ["main", "read_table"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "docs" / "img"
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def read_table(text: str, name: str) -> list[dict[str, str]]:
    """Return the rows of the table after ``<!-- plot:name -->``, as header -> cell dicts.

    Args:
        text: the page's markdown.
        name: the marker's name.

    Raises:
        ValueError: no such marker, or no table right after it.
    """
    lines = text.splitlines()
    marker = f"<!-- plot:{name} -->"
    if marker not in lines:
        raise ValueError(f"{PAGE.name} has no line {marker!r}")
    rows = []
    for line in lines[lines.index(marker) + 1:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    if len(rows) < 3:
        raise ValueError(f"no table after {marker!r}")
    header, body = rows[0], rows[2:]  # rows[1] is the |---| line
    return [dict(zip(header, row)) for row in body]


def _bytes(size: str) -> int:
    """``"64 MiB"`` -> 67108864."""
    number, unit = size.split()
    return int(float(number) * _UNITS[unit])


def _allreduce(plt, text: str) -> None:
    """Horizontal bars: speed-up over the peer of the same run, shared memory and TCP."""
    labels, values, colors = [], [], []
    for name, transport, color in (("tcp", "TCP", "tab:orange"), ("shm", "shm", "tab:blue")):
        for row in reversed(read_table(text, name)):
            peer = row["peer, same run"].split()[0:2]
            peer = " ".join(p for p in peer if not re.match(r"[\d.]+$", p))
            labels.append(f"{transport} {row['size']} vs {peer}")
            values.append(float(row["speed-up"]))
            colors.append(color)
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, v in enumerate(values):
        ax.text(v + 0.05, i, f"{v:.2f}×", va="center", fontsize=8)
    ax.set_xlabel("peer's time ÷ gradsync's time (above 1: gradsync faster)", fontsize=8)
    ax.set_title("Allreduce, 2 ranks: speed-up over the peer in the same run", fontsize=9)
    ax.set_xlim(0, max(values) * 1.18)
    _save(fig, "allreduce.png")


def _by_size(plt, rows, key: str, column: str, title: str, filename: str,
             ylabel: str = "") -> None:
    """One line per value of ``key``: the speed-up in ``column`` against size (log 2 axis)."""
    fig, ax = plt.subplots(figsize=(6.0, 3.2), dpi=100)
    groups: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        groups.setdefault(row[key], []).append((_bytes(row["size"]), float(row[column])))
    for label, points in groups.items():
        points.sort()
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    sizes = sorted({_bytes(r["size"]) for r in rows})
    ax.set_xticks(sizes, [_label(s) for s in sizes], fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel or column, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, filename)


def _label(size: int) -> str:
    """67108864 -> ``"64 MiB"``."""
    for unit in ("GiB", "MiB", "KiB"):
        if size >= _UNITS[unit]:
            return f"{size // _UNITS[unit]} {unit}"
    return f"{size} B"


def _save(fig, filename: str) -> None:
    """Write ``fig`` into docs/img/ and say so."""
    fig.tight_layout()
    path = OUT / filename
    fig.savefig(path, dpi=100)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def _scale_rows(paths: list[str] | None, text: str) -> list[dict[str, str]]:
    """The scale summary's rows: from the bench's JSON files, else from the page."""
    if not paths:
        return read_table(text, "scale")
    sys.path.insert(0, str(ROOT))  # this checkout's gradsync, for its one row format
    from gradsync.bench.scale import summary_rows

    points = []
    for path in paths:
        points += json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    return summary_rows(points)


def _number(cell: str) -> float | None:
    """A table cell as a number; None for "n/a" or anything else that is not one."""
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def _scale(plt, rows: list[dict[str, str]]) -> None:
    """Four small plots against N (log 2 axis), one line per machine."""
    rows = [r for r in rows if r["N"].isdigit()]
    if not rows:
        print("skipped the scale plots: the plot:scale table has no measured rows yet")
        return
    machines = list(dict.fromkeys(r["machine"] for r in rows))
    counts = sorted({int(r["N"]) for r in rows})
    figures = (
        ("scale_init.png", "seconds from launch", "init() beside the limit (start, import, "
         "meet at the store), same run", (("init s", "init()", "-"),
                                          ("limit s", "limit", "--"))),
        ("scale_sockets.png", "sockets per rank (max)", "Sockets per rank after the "
         "allreduces", (("sockets per rank", "", "-"),)),
        ("scale_store.png", "store requests, whole job", "Store requests of init(), summed "
         "over ranks", (("store requests", "", "-"),)),
        ("scale_rss.png", "MiB per rank (median)", "Memory per rank: RSS and its growth over "
         "the pre-init baseline", (("RSS MiB", "RSS", "-"),
                                   ("RSS growth MiB", "growth", "--"))),
    )
    for filename, ylabel, title, series in figures:
        fig, ax = plt.subplots(figsize=(6.0, 3.2), dpi=100)
        drawn = False
        for index, machine in enumerate(machines):
            mine = sorted((int(r["N"]), r) for r in rows if r["machine"] == machine)
            for column, label, style in series:
                points = [(n, _number(r[column])) for n, r in mine]
                points = [(n, v) for n, v in points if v is not None]
                if not points:
                    continue
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                        color=f"C{index}", label=" ".join(x for x in (machine, label) if x))
                drawn = True
        if not drawn:
            plt.close(fig)
            print(f"skipped {filename}: no numbers in its column")
            continue
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts], fontsize=8)
        ax.set_xlabel("ranks N", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        _save(fig, filename)


def main(argv: list[str] | None = None) -> int:
    """Draw every plot; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale-json", nargs="+", metavar="FILE",
                        help="draw the scale plots from these gradsync bench scale --json "
                             "files instead of the page's plot:scale table")
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = PAGE.read_text(encoding="utf-8")
    OUT.mkdir(parents=True, exist_ok=True)
    _allreduce(plt, text)
    _by_size(plt, read_table(text, "backend"), "collective", "speed-up over gloo",
             "torch backend \"gradsync\", 2 ranks, shared memory: speed-up over gloo",
             "backend.png")
    _by_size(plt, read_table(text, "ps"), "data path", "speed-up",
             "Parameter server (AMD), 2 workers, 1 server: speed-up over gRPC", "ps.png",
             ylabel="speed-up over gRPC")
    _scale(plt, _scale_rows(args.scale_json, text))
    plt.close("all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
