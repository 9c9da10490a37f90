"""chaosgpu.sandbox: local pods emulated with Linux namespaces (see docs/sandboxes.md).

- `runtime`: create / exec_in / terminate (kubelet semantics) / remove / list_sandboxes /
  host_pids / processes / cleanup_all, with live state in `<state>/sandboxes/<name>.json`.
- `supervisor`: the detached subreaper process that owns each sandbox's `unshare`.
- `actions`, `probes`: the Chaos Toolkit activities; `cli`: `chaosgpu sandbox ...`.
"""
