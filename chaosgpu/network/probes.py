"""Chaos Toolkit probes on network faults: which partitions are in place.

This module owns the probes' public face; the records are chaosgpu.network.partitions. It
changes nothing.
"""

from typing import Any, Dict, List, Optional

from chaosgpu.arguments import BOOL, checked
from chaosgpu.network import partitions

__all__ = ["partitions_in_place"]


@checked(every=BOOL)
def partitions_in_place(every: bool = False, configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The partitions chaosgpu made on this node whose nftables table is still in place (id,
    table, targets, the runner that made it and whether it still runs, since when), after the
    partitions' liveness check (a partition whose targets have all ended loses its
    listening-socket rules, or is healed when nothing else is left): those this run made and
    those left behind by a runner that no longer runs. A partition another runner still running
    made (a concurrent game-day's fault) is not this run's to answer for and is left out, as
    `heal_all_partitions` leaves it; `every=true` lists it too. The steady state "no partition
    left behind" expects an empty list: its tolerance is `[[]]` (a list of the values accepted,
    the empty list the one value: `"tolerance": [[]]`); a bare `[]` accepts nothing and never
    passes."""
    listed = []
    for entry in partitions.active():
        alive = partitions.runner_alive(entry)
        if not (every or partitions.made_here(entry) or not alive):
            continue
        if partitions.table_exists(entry) is not False:
            listed.append(dict(entry, in_place=True, runner_alive=alive))
    return listed
