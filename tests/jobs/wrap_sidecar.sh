#!/bin/bash
# A per-rank wrapper script, as `torchrun --no-python bash wrap_sidecar.sh python train.py ...`
# runs it: it starts a sidecar (standing for a metrics agent, `nvidia-smi dmon`, `tail -f`)
# with the rank's environment, then the trainer (its arguments), and ends the sidecar when the
# trainer is done. Exits with the trainer's status.
sleep 600 &
sidecar=$!
"$@"
status=$?
kill "$sidecar"
exit "$status"
