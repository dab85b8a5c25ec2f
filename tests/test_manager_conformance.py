"""The in-process Manager against the reference model (kvcore.testing.manager), under
every eviction policy: the model holds its evictions to the policy's plain model
(kvcore/testing/eviction_model.py) and every eviction to tails before heads."""

from __future__ import annotations

from functools import partial

from hypothesis import settings

from kvcore import Manager
from kvcore.eviction import POLICIES
from kvcore.layout import KVLayout
from kvcore.testing.manager import ManagerConformance, make_state_machine


class ManagerMachine(ManagerConformance):
    def make_subject(self, layout: KVLayout) -> Manager:
        return Manager(layout)


ManagerMachine.TestCase.settings = settings(
    settings.default, max_examples=max(settings.default.max_examples, 300), stateful_step_count=40
)
TestManagerConformance = ManagerMachine.TestCase


def _recording(layout: KVLayout, eviction: str) -> Manager:
    return Manager(layout, eviction=eviction, record_evictions=True)


# make_state_machine: the entry point suites outside kvcore call with a factory; one
# machine per policy (the default one above runs longer)
for _name in POLICIES:
    _machine = make_state_machine(partial(_recording, eviction=_name))
    _machine.TestCase.settings = settings(settings.default, stateful_step_count=40)
    globals()[f"TestRecordingManagerConformance_{_name.replace('-', '_')}"] = _machine.TestCase
