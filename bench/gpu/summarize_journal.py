"""Print a Chaos Toolkit journal in brief: status, deviation, each activity's status and output
(truncated), the timeline summary. `python3 bench/gpu/summarize_journal.py JOURNAL [WIDTH]`."""

import json
import sys


def main(argv: list[str]) -> int:
    """Print the summary of the journal named in argv[0]."""
    width = int(argv[1]) if len(argv) > 1 else 600
    try:
        with open(argv[0], encoding="utf-8") as handle:
            journal = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        print(f"no journal: {error}")
        return 1
    print("status", journal.get("status"), "deviated", journal.get("deviated"))
    for phase in ("before", "after"):
        state = (journal.get("steady_states") or {}).get(phase) or {}
        print(f"steady state {phase}: met={state.get('steady_state_met')}",
              json.dumps([p.get("output") for p in state.get("probes", [])])[:200])
    for entry in journal.get("run", []) + journal.get("rollbacks", []):
        output = entry.get("output")
        text = json.dumps(output, default=str)[:width] if output is not None else ""
        error = (entry.get("exception") or [""])[-1].strip()[:300] if entry.get("exception") else ""
        print(f"  {entry['activity']['name']}: {entry['status']} {entry.get('duration', 0):.2f}s "
              f"{text} {error}")
    print("  summary:", json.dumps((journal.get("chaosgpu") or {}).get("summary"))[:width])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
