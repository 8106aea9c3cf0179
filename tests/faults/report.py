"""Prints the fault suite's table from the ledger (``make faults``).

    python -m tests.faults.report [LEDGER]

The last line is ``faults: <tried> tried, <failed> broken promises, <leaked> leaked``;
the exit status is 1 when a promise broke, something leaked or nothing was recorded.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from tests.faults.ledger import ledger_path


def _fmt_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else ledger_path()
    rows: dict[str, dict[str, object]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            row = rows.setdefault(
                rec["name"], {"tried": 0, "saw": Counter(), "leaks": Counter(), "broken": [], "runs": 0}
            )
            row["runs"] += 1  # type: ignore[operator]
            row["tried"] += rec["tried"]  # type: ignore[operator]
            row["saw"].update(rec["client_saw"])  # type: ignore[attr-defined]
            for kind, amount in rec["leaks"].items():
                row["leaks"][kind] += amount  # type: ignore[index]
            row["broken"].extend(rec["broken"])  # type: ignore[attr-defined]

    header = ("fault / attack", "tried", "what the client saw", "leaked", "promise")
    table = []
    total_tried = total_broken = 0
    total_leaked = 0.0
    for name, row in rows.items():
        saw = "; ".join(f"{what} ×{n}" if n > 1 else what for what, n in row["saw"].most_common())  # type: ignore[attr-defined]
        leaks = row["leaks"]
        leaked = sum(leaks.values())  # type: ignore[attr-defined]
        checked = ", ".join(f"{kind} {_fmt_number(v)}" for kind, v in leaks.items()) or "-"  # type: ignore[attr-defined]
        broken = row["broken"]
        table.append((name, str(row["tried"]), saw or "-", checked, "BROKEN: " + broken[0] if broken else "held"))  # type: ignore[index]
        total_tried += row["tried"]  # type: ignore[operator]
        total_broken += 1 if broken else 0
        total_leaked += leaked
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    widths[2] = min(widths[2], 90)
    print(f"fault suite ledger: {path}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"faults: {total_tried} tried, {total_broken} broken promises, {_fmt_number(total_leaked)} leaked")
    return 1 if (total_broken or total_leaked or not rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
