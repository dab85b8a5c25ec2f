"""The in-process Manager against the reference model (kvcore.testing.manager)."""

from __future__ import annotations

from hypothesis import settings

from kvcore import Manager
from kvcore.layout import KVLayout
from kvcore.testing.manager import ManagerConformance, make_state_machine


class ManagerMachine(ManagerConformance):
    def make_subject(self, layout: KVLayout) -> Manager:
        return Manager(layout)


ManagerMachine.TestCase.settings = settings(
    settings.default, max_examples=max(settings.default.max_examples, 300), stateful_step_count=40
)
TestManagerConformance = ManagerMachine.TestCase


def _recording(layout: KVLayout) -> Manager:
    return Manager(layout, record_evictions=True)


# make_state_machine: the entry point suites outside kvcore call with a factory
RecordingMachine = make_state_machine(_recording)
RecordingMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestRecordingManagerConformance = RecordingMachine.TestCase
