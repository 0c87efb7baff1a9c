"""The report of ``gradsync bench compress``: the floor, the ratios, the tables. No processes.

One *row* per run of a mode at a link rate, as a rank 0 wrote it (``compress_rank.py``):
``steps``, ``seconds`` (training time, evaluation left out), ``reached``, ``steps_to_target``,
``time_to_target``, ``bytes_per_step`` (bytes each host sent per step, counted on its
``eth0``), ``final`` (the last validation loss and accuracy), ``stop`` (why it ended), or
``failed`` (why it did not run to its end: the job's exit, a timeout).

**The floor** is the job's compute-only time to the target: the ``floor`` mode runs the same
ranks and steps with the gradient exchange skipped, which gives its time per step; times the
fp32 reference's steps to the target, it is what no scheme can beat (issue 38). The reference
is DDP over gloo at fp32 (``gloo-fp32``), or over the gradsync backend (``gs-fp32``) where
gloo's did not run. Where neither reached the target at a rate (on a slow link a float32
exchange can use up the time budget first), the steps come from an fp32 run of another rate
in the same invocation that reached it (the first in the order the rates ran): a float32
exchange is the same sum at every rate, so its steps to the target do not depend on the link,
and the report names the rate they come from (``gloo-fp32@100mbit``). Where no fp32 run
reached the target at any rate there is no floor, and no ratio. Every mode that reached the
target gets ``x_floor = time_to_target / floor``. Worked example: floor steps of 0.5 s,
``gloo-fp32`` reaching the target at step 120 in 150 s: the floor is 60 s and gloo-fp32 sits
at 2.5x; a mode that took 66 s sits at 1.1x.
"""

from __future__ import annotations

import math

__all__ = ["MODES", "FLOOR_REFERENCES", "floor_seconds", "rate_report", "report",
           "format_text", "format_markdown"]

MODES = {
    "floor": "compute only: the same ranks and steps, no gradient exchange",
    "gloo-fp32": "DDP over gloo, float32 allreduce",
    "gloo-bf16": "DDP over gloo, torch's bf16_compress_hook",
    "gloo-powersgd": "DDP over gloo, torch's powerSGD_hook (one bucket)",
    "gs-fp32": "DDP over the gradsync backend, float32",
    "gs-int8": "DDP over the gradsync backend, gradsync.compress Int8 hook",
    "gs-int4": "DDP over the gradsync backend, gradsync.compress Int4 hook (half int8's bytes)",
    "gs-powersgd": "DDP over the gradsync backend, gradsync.compress PowerSGD hook (its first "
                   "two steps plain, as torch's hook's here)",
    "gs-auto": "DDP over the gradsync backend, compression=\"auto\": per bucket, none, "
               "bf16, int8, int4 or PowerSGD from the measured link (its choice in 'choice')",
    "gs-auto-local": "gs-auto with local SGD allowed (Auto(local_sgd=--local-sgd), the "
                     "parameters attached, after_step after each step): H chosen too",
    "gs-int8-lag": "the Horovod API's DistributedOptimizer, Int8, gradient_lag=1: step t's "
                   "exchange behind step t + 1's compute",
    "gs-powersgd-lag": "the Horovod API's DistributedOptimizer, PowerSGD, gradient_lag=1",
    "gs-diloco": "gradsync.compress DiLoCo over a gradsync group: H inner steps per sync",
    "gs-streaming": "gs-diloco with each sync overlapped: it lands --streaming-delay inner "
                    "steps after it starts, the steps taken meanwhile kept (carry=True; "
                    "--streaming-overwrite: mix=0), --streaming-fragments fragments in turn",
}
"""Every mode, in the order each rate runs them (the floor first)."""

FLOOR_REFERENCES = ("gloo-fp32", "gs-fp32")
"""The fp32 runs whose steps to the target make the floor, the first that reached it."""


def floor_seconds(floor_step_s: float | None, reference_steps: int | None) -> float | None:
    """The floor: compute-only seconds per step times the fp32 reference's steps to the
    target; None when either is missing."""
    if floor_step_s is None or reference_steps is None:
        return None
    if floor_step_s <= 0 or reference_steps <= 0:
        raise ValueError(f"a floor of {floor_step_s} s per step over {reference_steps} steps")
    return floor_step_s * reference_steps


def _reference(rows: list[dict]) -> tuple[str, int] | None:
    """The fp32 run among ``rows`` whose steps to the target make the floor (the first of
    ``FLOOR_REFERENCES`` that reached it): (its mode, its steps), or None."""
    by_mode = {r["mode"]: r for r in rows}
    for mode in FLOOR_REFERENCES:
        row = by_mode.get(mode)
        if row is not None and row.get("reached") and not row.get("failed"):
            return mode, row["steps_to_target"]
    return None


def rate_report(rows: list[dict], elsewhere: tuple[str, int] | None = None) -> dict:
    """The rows of one rate (one per mode) -> the floor, its reference, and each row with
    ``x_floor`` (None where there is no floor or the mode did not reach the target).
    ``elsewhere``: (name, steps) of an fp32 run at another rate, the reference when neither
    fp32 run here reached the target (module docstring)."""
    by_mode = {r["mode"]: r for r in rows}
    floor_row = by_mode.get("floor")
    step_s = None
    if floor_row is not None and not floor_row.get("failed") and floor_row.get("steps"):
        step_s = floor_row["seconds"] / floor_row["steps"]
    found = _reference(rows) or elsewhere
    reference, steps = found if found else (None, None)
    floor = floor_seconds(step_s, steps)
    out = []
    for row in rows:
        row = dict(row)
        if row["mode"] == "floor":
            row["time_to_target"] = floor
            row["steps_to_target"] = steps
            row["x_floor"] = 1.0 if floor else None
        else:
            reached = row.get("reached") and not row.get("failed")
            row["x_floor"] = row["time_to_target"] / floor if floor and reached else None
        out.append(row)
    return {"floor_s": floor, "floor_step_s": step_s, "floor_reference": reference,
            "rows": out}


def report(rows: list[dict], settings: dict) -> dict:
    """Every rate's ``rate_report``, in the order the rates ran, with the settings."""
    rates: list[str] = []
    for row in rows:
        if row["rate"] not in rates:
            rates.append(row["rate"])
    per_rate = {rate: [r for r in rows if r["rate"] == rate] for rate in rates}
    # An fp32 reference from another rate, for a rate whose own fp32 runs fell short.
    elsewhere = next(((f"{found[0]}@{rate}", found[1]) for rate in rates
                      if (found := _reference(per_rate[rate])) is not None), None)
    return {"settings": settings,
            "rates": [{"rate": rate, **rate_report(per_rate[rate], elsewhere)}
                      for rate in rates]}


# ------------------------------------------------------------------------ tables
_COLUMNS = ("rate", "mode", "reached", "steps", "time to target s", "x floor", "s/step",
            "MB/step/host", "val loss", "val acc", "choice")


def _num(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if value is None else str(value)
    return f"{value:.{digits}f}"


def _cells(rate: str, row: dict, task: str) -> list[str]:
    if row.get("failed"):
        return [rate, row["mode"], "failed", "-", "-", "-", "-", "-", "-", "-",
                row["failed"].splitlines()[0][:60]]
    final = row.get("final") or {}
    if row["mode"] == "floor":
        reached = "-"
    elif row.get("reached"):
        reached = "yes"
    else:
        reached = f"no ({row.get('stop')})"
    steps = row.get("steps_to_target") if row.get("reached") or row["mode"] == "floor" \
        else row.get("steps")
    step_s = row["seconds"] / row["steps"] if row.get("steps") else None
    return [rate, row["mode"], reached, _num(steps, 0), _num(row.get("time_to_target"), 1),
            _num(row.get("x_floor"), 2), _num(step_s, 3),
            _num(None if row.get("bytes_per_step") is None else row["bytes_per_step"] / 1e6, 3),
            _num(final.get("loss"), 4),
            _num(final.get("accuracy"), 4) if task == "cnn" else "-", row.get("choice", "")]


def _heading(data: dict) -> str:
    s = data["settings"]
    target = (f"validation loss <= {s['target_loss']}" if s["task"] == "lm" else
              f"validation accuracy >= {s['target_accuracy']}")
    return (f"task {s['task']} ({s.get('params', '?')} parameters), {s['hosts']} hosts x "
            f"{s['ranks_per_host']} ranks, target {target}, seed {s['seed']}")


def _table_rows(data: dict) -> list[list[str]]:
    task = data["settings"]["task"]
    return [_cells(r["rate"], row, task) for r in data["rates"] for row in r["rows"]]


def _footer(data: dict) -> list[str]:
    lines = []
    for r in data["rates"]:
        if r["floor_s"] is None:
            lines.append(f"{r['rate']}: no floor (the floor or both fp32 runs missing, or "
                         "neither fp32 run reached the target): no ratios")
        else:
            lines.append(f"{r['rate']}: floor {r['floor_s']:.1f} s = {r['floor_step_s']:.3f} "
                         f"s/step x {r['floor_reference']}'s steps to target")
    autos = [(r["rate"], row) for r in data["rates"] for row in r["rows"]
             if row["mode"].startswith("gs-auto") and not row.get("failed")
             and row.get("decision")]
    for rate, row in autos:  # the choice with the numbers behind it, one line a rate
        lines.append(f"{rate}: {row['mode']} chose {row['decision']}")
    return lines


def format_text(data: dict) -> str:
    """The report as aligned columns."""
    rows = [list(_COLUMNS)] + _table_rows(data)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([_heading(data), *body, *_footer(data)]) + "\n"


def format_markdown(data: dict) -> str:
    """The report as a Markdown table."""
    lines = [_heading(data), "", "| " + " | ".join(_COLUMNS) + " |",
             "|" + " --- |" * len(_COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in _table_rows(data)]
    return "\n".join(lines + [""] + [f"- {line}" for line in _footer(data)]) + "\n"
