"""The rule ``kvcore bench vllm`` compares outputs by (kvcore/bench/vllm_workloads.py):
equal token for token, except an output that parts from plain vLLM's at a greedy tie
(plain's two best log-probabilities within TIE_NATS) and takes the other of the two.
Anything else is a mismatch. Pure: no vLLM needed."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.bench.vllm_workloads import TIE_NATS, _compare

TOP = [[[5, -0.5], [9, -1.5]], [[7, -1.0], [3, -1.0 - TIE_NATS / 2]], [[2, -0.1], [4, -3.0]]]
PLAIN = {"tokens": [[5, 7, 2]], "logprobs": [TOP]}


def _ours(tokens: list[int]) -> list[dict[str, Any]]:
    return [{"tokens": [tokens]}]


@pytest.mark.parametrize(
    ("ours", "expected"),
    [
        ([5, 7, 2], (True, 0)),  # equal
        ([5, 3, 8], (True, 1)),  # parts at the tie (token 1), then goes its own way
        ([9, 7, 2], (False, 0)),  # parts where plain's choice was clear by 1 nat
        ([5, 8, 2], (False, 0)),  # at the tie, but a token that was neither of the two
        ([5, 7, 4], (False, 0)),  # the runner-up, 2.9 nats behind
        ([5, 7], (False, 0)),  # an output cut short
    ],
)
def test_outputs_equal_but_for_greedy_ties(ours: list[int], expected: tuple[bool, int]) -> None:
    assert _compare(_ours(ours), [PLAIN]) == expected


def test_a_gap_just_past_the_tolerance_is_a_mismatch() -> None:
    top = [[[7, -1.0], [3, -1.0 - 2 * TIE_NATS]]]
    assert _compare(_ours([3]), [{"tokens": [[7]], "logprobs": [top]}]) == (False, 0)


def test_every_output_of_every_call_is_compared() -> None:
    ok, tied = _ours([5, 7, 2]), _ours([5, 3, 2])
    plain = {"tokens": PLAIN["tokens"] * 2, "logprobs": PLAIN["logprobs"] * 2}
    both = [{"tokens": ok[0]["tokens"] + tied[0]["tokens"]}]
    assert _compare(both, [plain]) == (True, 1)
    assert _compare([*ok, *_ours([9, 7, 2])], [PLAIN, PLAIN]) == (False, 0)
