"""Network faults: partition training ranks or any declared processes (nftables drop rules,
no reset), heal them, and see which partitions are in place. `partitions` owns the rules and
their records; `actions` and `probes` are the Chaos Toolkit face."""
