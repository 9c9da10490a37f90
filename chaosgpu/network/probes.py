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
    table, targets, since when). The steady state "no partition left behind" uses an empty
    list as its tolerance (`[]` via a jsonpath or a probe tolerance)."""
    return [dict(p, in_place=True) for p in partitions.active()
            if partitions.table_exists(p) is not False]
