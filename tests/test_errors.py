"""The errors users see are Chaos Toolkit's own exception types, and keep the Python base that
Python callers catch (ValueError for bad input, RuntimeError for a failed activity)."""

import pytest
from chaoslib.exceptions import ActivityFailed, InvalidActivity, InvalidExperiment

from chaosgpu.errors import ActivityError, InvalidArgument, UnknownVariable
from chaosgpu.gpu.injector import InjectionError
from chaosgpu.job.observe import JobError
from chaosgpu.network.partitions import PartitionError
from chaosgpu.scope import ScopeError


@pytest.mark.parametrize(("error", "chaoslib_type", "python_type"), [
    (InvalidArgument, InvalidActivity, ValueError),
    (ScopeError, InvalidActivity, ValueError),
    (UnknownVariable, InvalidExperiment, Exception),
    (ActivityError, ActivityFailed, RuntimeError),
    (JobError, ActivityFailed, ValueError),
    (PartitionError, ActivityFailed, RuntimeError),
    (InjectionError, ActivityFailed, RuntimeError),
])
def test_errors_are_chaoslib_types(error: type, chaoslib_type: type, python_type: type) -> None:
    raised = error("what was wrong")
    assert isinstance(raised, chaoslib_type) and isinstance(raised, python_type)
    assert str(raised) == "what was wrong"
