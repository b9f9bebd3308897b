#!/usr/bin/env python3
"""Where the decode steps' time goes on the host, from a `lily serve` log with the engine's trace events.

    LILY_LOG=warn,lily_server::engine=trace lily serve ... 2> serve.log
    python3 scripts/step_times.py serve.log

For each step size (rows) it prints how many steps ran and the median and 90th percentile of: `launch_us`, queuing
the step; `sample_us`, the backend's sampling call, which waits for the step on a GPU; `emit_us`, handling the
tokens (detokenizing, stop checks, events); `between_us`, from the end of one step to the start of the next
(prefill calls and admission included); `ahead`, the share of steps queued before the tokens of the step before
them were handled (the engine does so while every sequence decodes and no request waits). Only the Python standard
library is used.
"""

import re
import statistics
import sys

FIELDS = ["launch_us", "sample_us", "emit_us", "between_us"]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    steps = {}
    with open(sys.argv[1], errors="replace") as log:
        for line in log:
            if "decode step" not in line:
                continue
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # colours of a terminal log
            fields = dict(re.findall(r"(\w+)=(\d+)", line))
            fields["ahead"] = "ahead=true" in line
            if "rows" in fields:
                steps.setdefault(int(fields["rows"]), []).append(fields)
    if not steps:
        sys.exit("no `decode step` events: was the server run with LILY_LOG=...,lily_server::engine=trace?")
    for rows in sorted(steps):
        found = steps[rows]
        parts = [f"rows {rows:4d}: {len(found):6d} steps"]
        for name in FIELDS:
            values = sorted(int(f[name]) for f in found if name in f)
            if values:
                p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
                parts.append(f"{name} p50 {statistics.median(values):.0f} p90 {p90}")
        parts.append(f"ahead {100 * sum(f['ahead'] for f in found) / len(found):.0f}%")
        print("; ".join(parts))


if __name__ == "__main__":
    main()
