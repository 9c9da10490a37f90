"""Chaos Toolkit probes on network faults: which partitions are in place.

This module owns the probes' public face; the records are chaosgpu.network.partitions. It
changes nothing.
"""

from typing import Any, Dict, List, Optional

from chaosgpu.network import partitions

__all__ = ["partitions_in_place"]


def partitions_in_place(configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The partitions chaosgpu made on this node whose nftables table is still in place (id,
    table, targets, the runner that made it, since when), after the partitions' liveness check
    (a partition whose targets have all ended loses its listening-socket rules, or is healed
    when nothing else is left). The steady state "no partition left behind" expects an empty
    list: its tolerance is `[[]]` (a list of the values accepted, the empty list the one value:
    `"tolerance": [[]]`); a bare `[]` accepts nothing and never passes."""
    return [dict(p, in_place=True) for p in partitions.active()
            if partitions.table_exists(p) is not False]
