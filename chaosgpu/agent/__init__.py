"""chaosgpu.agent: `chaosgpu agent`, the node's truth, its jobs' verdicts and a high-rate
timeline over HTTP.

`server` (aiohttp server, auth, parameters, concurrency bounds), `cache` (the census, one in
flight shared by every request), `timeline` (the timeline window), `jobs` (the job watch:
chaosgpu.job's verdicts), `metrics` (Prometheus exposition), `cli` (the command), `probes`
(Chaos Toolkit probes that query an agent with `requests`). See docs/agent.md. Nothing here
signals processes; the node is read only through chaosgpu.node, chaosgpu.timeline.sampler and
chaosgpu.job.
"""
