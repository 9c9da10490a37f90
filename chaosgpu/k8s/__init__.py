"""Kubernetes GPU pods as chaos targets: GPU-aware selection, deletion with a measured end, and
in-pod faults and readings through the exec API (the in-target programs streamed in).

Modules: `client` (credentials the Chaos Toolkit way), `selection` (which pods; refuses an empty
selector), `deletion` (DELETE with a grace period, then follow each pod until gone), `exec` (the
exec channel protocol with a deadline), `inpod` (census and rank signals inside a pod),
`actions` / `probes` (the Chaos Toolkit surface). The node agent lives in chaosgpu.agent. This
package must not import at chaosgpu's import time (discover() imports it lazily).
"""
