"""The in-process Manager against the reference model (kvcore.testing.manager)."""

from __future__ import annotations

from hypothesis import settings

from kvcore import Manager
from kvcore.layout import KVLayout
from kvcore.testing.manager import make_state_machine


def _fresh(layout: KVLayout) -> Manager:
    return Manager(layout)


def _recording(layout: KVLayout) -> Manager:
    return Manager(layout, record_evictions=True)


ManagerMachine = make_state_machine(_fresh)
ManagerMachine.TestCase.settings = settings(
    settings.default, max_examples=max(settings.default.max_examples, 300), stateful_step_count=40
)
TestManagerConformance = ManagerMachine.TestCase

RecordingMachine = make_state_machine(_recording)
RecordingMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestRecordingManagerConformance = RecordingMachine.TestCase
