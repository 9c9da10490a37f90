"""The report's reading of journals, under its historical name: `load_journal(s)` and the
shapes they return. The work is split: chaosgpu.report.loading (files, JSON, timeline, RunView),
chaosgpu.report.events (typed facts and events), chaosgpu.report.figures (the figures),
chaosgpu.report.model (RunView, Metric, Problem, METRICS).
"""

from chaosgpu.report.events import fault_time
from chaosgpu.report.figures import total_process_series
from chaosgpu.report.loading import load_journal, load_journals
from chaosgpu.report.model import EVENT_KINDS, METRICS, Metric, Problem, RunView

__all__ = ["EVENT_KINDS", "METRICS", "Metric", "Problem", "RunView", "fault_time",
           "load_journal", "load_journals", "total_process_series"]
