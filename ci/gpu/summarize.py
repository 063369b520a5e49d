"""Summaries of GPU suite runs: JUnit XML in, one small JSON per suite out, and a table.

Standard library only: it runs with whatever ``python3`` the GPU machine or container has.

    python3 ci/gpu/summarize.py suite --name vllm --junit ci/gpu/results/vllm.xml \\
        --exit-code 0 --duration 812.4 --out ci/gpu/results/vllm.json [--timed-out]
    python3 ci/gpu/summarize.py table ci/gpu/results/*.json

``suite`` writes ``{"engine", "passed", "failed", "skipped", "errors", "interrupted",
"tests", "duration_s", "exit_code", "timed_out", "junit", "junit_found", "skip_reasons",
"not_passed", "written_at"}``. Counts come from the ``<testcase>`` elements: one with an
``<error>`` counts as an error, else one with a ``<failure>`` as failed, else one with
``<skipped>`` (skips and xfails) as skipped, else passed; the nameless entry pytest writes
for a test cut off by SIGINT (the timeout) counts as ``interrupted``. A missing or
unreadable XML (pytest killed before writing it) gives zero counts, ``junit_found:
false`` and the reason in ``junit_error``. ``table`` prints one row per summary (other
JSON files in the folder are named, not shown) and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

MAX_LISTED = 50
"""At most this many not-passed test ids are listed in a summary."""


def count_junit(path: Path) -> dict[str, Any]:
    """Counts, skip reasons and not-passed test ids of one pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    not_passed: list[str] = []
    for case in root.iter("testcase"):
        test_id = "::".join(p for p in (case.get("classname"), case.get("name")) if p)
        if not case.get("name"):  # pytest's entry for the test a SIGINT (timeout) cut off
            counts["interrupted"] += 1
            continue
        if case.find("error") is not None:
            outcome = "errors"
        elif case.find("failure") is not None:
            outcome = "failed"
        elif (skipped := case.find("skipped")) is not None:
            outcome = "skipped"
            reasons[(skipped.get("message") or "").strip() or "(no reason given)"] += 1
        else:
            outcome = "passed"
        counts[outcome] += 1
        if outcome in ("errors", "failed") and len(not_passed) < MAX_LISTED:
            not_passed.append(f"{outcome}: {test_id}")
    return {
        "passed": counts["passed"], "failed": counts["failed"],
        "skipped": counts["skipped"], "errors": counts["errors"],
        "interrupted": counts["interrupted"],
        "tests": sum(counts.values()) - counts["interrupted"], "skip_reasons": dict(reasons),
        "not_passed": not_passed,
    }


def summarize(name: str, junit: Path, exit_code: int, duration_s: float,
              timed_out: bool) -> dict[str, Any]:
    """The JSON summary of one suite run (see the module docstring)."""
    summary: dict[str, Any] = {"engine": name}
    try:
        summary.update(count_junit(junit))
        summary["junit_found"] = True
    except (OSError, ET.ParseError) as exc:
        summary.update({"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "tests": 0,
                        "interrupted": 0,
                        "skip_reasons": {}, "not_passed": [], "junit_found": False,
                        "junit_error": f"{type(exc).__name__}: {exc}"})
    summary.update({
        "duration_s": round(duration_s, 3), "exit_code": exit_code, "timed_out": timed_out,
        "junit": str(junit),
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    return summary


def table(summaries: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per suite, failures first in a verdict column."""
    head = ("suite", "result", "exit", "passed", "failed", "skipped", "errors", "duration")
    rows: list[tuple[str, ...]] = [head]
    for s in summaries:
        ok = s.get("exit_code") == 0
        result = "TIMED OUT" if s.get("timed_out") else ("ok" if ok else "FAILED")
        rows.append((str(s.get("engine", "?")), result, str(s.get("exit_code", "?")),
                     *(str(s.get(k, "?")) for k in ("passed", "failed", "skipped", "errors")),
                     f"{float(s.get('duration_s', 0.0)):.0f}s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    suite = sub.add_parser("suite", help="write one suite's JSON summary")
    suite.add_argument("--name", required=True)
    suite.add_argument("--junit", required=True, type=Path)
    suite.add_argument("--exit-code", required=True, type=int)
    suite.add_argument("--duration", required=True, type=float)
    suite.add_argument("--timed-out", action="store_true")
    suite.add_argument("--out", required=True, type=Path)
    tab = sub.add_parser("table", help="print a table of JSON summaries")
    tab.add_argument("summaries", nargs="*", type=Path)
    args = parser.parse_args(argv)

    if args.command == "suite":
        summary = summarize(args.name, args.junit, args.exit_code, args.duration,
                            args.timed_out)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return 0
    loaded, ignored = [], []
    for path in args.summaries:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            loaded.append({"engine": f"{path.name} (unreadable: {exc})", "exit_code": "?"})
            continue
        if isinstance(data, dict) and {"engine", "exit_code"} <= data.keys():
            loaded.append(data)
        else:  # another tool's JSON in the results folder (e.g. trtllm-doctor.json)
            ignored.append(path.name)
    print(table(loaded) if loaded else "no suite summaries found")
    if ignored:
        print(f"(not suite summaries, not shown: {', '.join(ignored)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
