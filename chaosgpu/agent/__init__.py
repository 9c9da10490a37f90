"""chaosgpu.agent: `chaosgpu agent`, the node's truth and a high-rate timeline over HTTP.

`server` (HTTP server, auth, census cache, timeline window), `metrics` (Prometheus text), `cli`
(the command), `probes` (Chaos Toolkit probes that query an agent with `requests`). See
docs/agent.md. Nothing here signals processes; the node is read only through chaosgpu.node and
chaosgpu.timeline.sampler.
"""
