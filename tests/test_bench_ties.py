"""The rule ``kvcore bench vllm`` compares outputs by (kvcore/bench/vllm_workloads.py):
equal token for token, except an output that parts from plain vLLM's at a greedy tie
(plain's two best log-probabilities within TIE_NATS) and takes the other of the two;
and where both chose the same token (or at a tie, the token taken) its
log-probabilities on the two sides within LOGPROB_NATS. Anything else is a mismatch,
and says where. Also: the bound on ties, and the order rule of every workload. Pure:
no vLLM needed."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.bench.vllm_workloads import (
    LOGPROB_NATS,
    TIE_NATS,
    TIES_FLOOR,
    TOKENS_PER_TIE,
    Comparison,
    Mismatch,
    compare,
    kvcore_first,
    ties_allowed,
)

TOP: list[list[list[Any]]] = [
    [[5, -0.5], [9, -1.5]],
    [[7, -1.0], [3, -1.0 - TIE_NATS / 2]],
    [[2, -0.1], [4, -3.0]],
]
PLAIN: dict[str, Any] = {"tokens": [[5, 7, 2]], "logprobs": [TOP]}


def _ours(tokens: list[int], shift: float = 0.0, at: int | None = None) -> list[dict[str, Any]]:
    """The connector's side: ``tokens``, each with plain's log-probability of it at that
    position (a token plain never ranked: -5), moved by ``shift`` nats (at ``at`` only,
    if given)."""
    top = []
    for i, token in enumerate(tokens):
        known: dict[int, float] = {t: lp for t, lp in TOP[i]} if i < len(TOP) else {}
        lp = known.get(token, -5.0) + (shift if at in (None, i) else 0.0)
        top.append([[token, lp]])
    return [{"tokens": [tokens], "logprobs": [top]}]


def _summary(c: Comparison) -> tuple[bool, int, int]:
    return c.tokens_match, c.ties, c.logprob_mismatches


@pytest.mark.parametrize(
    ("ours", "expected"),
    [
        ([5, 7, 2], (True, 0, 0)),  # equal
        ([5, 3, 8], (True, 1, 0)),  # parts at the tie (token 1), then goes its own way
        ([9, 7, 2], (False, 0, 0)),  # parts where plain's choice was clear by 1 nat
        ([5, 8, 2], (False, 0, 0)),  # at the tie, but a token that was neither of the two
        ([5, 7, 4], (False, 0, 0)),  # the runner-up, 2.9 nats behind
        ([5, 7], (False, 0, 0)),  # an output cut short
    ],
)
def test_outputs_equal_but_for_greedy_ties(
    ours: list[int], expected: tuple[bool, int, int]
) -> None:
    assert _summary(compare(_ours(ours), [PLAIN])) == expected


def test_a_gap_just_past_the_tolerance_is_a_mismatch() -> None:
    top = [[[7, -1.0], [3, -1.0 - 2 * TIE_NATS]]]
    plain = {"tokens": [[7]], "logprobs": [top]}
    ours = {"tokens": [[3]], "logprobs": [[[[3, -1.0 - 2 * TIE_NATS]]]]}
    assert _summary(compare([ours], [plain])) == (False, 0, 0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_same_token_log_probability_past_1e_3_nats_is_a_mismatch(sign: float) -> None:
    moved = compare(_ours([5, 7, 2], sign * 1.5 * LOGPROB_NATS, at=2), [PLAIN])
    assert _summary(moved) == (True, 0, 1)  # the tokens match; their log-probabilities do not
    assert moved.max_logprob_diff == pytest.approx(1.5 * LOGPROB_NATS)
    [m] = moved.mismatches
    assert (m.prompt, m.position, m.kvcore, m.plain) == (0, 2, 2, 2)
    assert m.logprob_diff == pytest.approx(1.5 * LOGPROB_NATS)


def test_a_same_token_log_probability_within_1e_3_nats_is_fine() -> None:
    close = compare(_ours([5, 7, 2], 0.9 * LOGPROB_NATS), [PLAIN])
    assert _summary(close) == (True, 0, 0) and close.mismatches == ()
    assert close.max_logprob_diff == pytest.approx(0.9 * LOGPROB_NATS)
    assert compare(_ours([5, 7, 2]), [PLAIN]).max_logprob_diff == 0.0


def test_at_a_tie_the_token_taken_is_held_to_plain_s_log_probability_of_it() -> None:
    assert _summary(compare(_ours([5, 3, 8], 0.5 * LOGPROB_NATS, at=1), [PLAIN])) == (True, 1, 0)
    assert _summary(compare(_ours([5, 3, 8], 2 * LOGPROB_NATS, at=1), [PLAIN])) == (True, 1, 1)


def test_nothing_past_where_an_output_parts_is_compared() -> None:
    """Past a tie the two outputs continue different prompts: token 2 (8 against
    plain's 2, an unranked log-probability) is neither a mismatch nor a difference."""
    tied = compare(_ours([5, 3, 8]), [PLAIN])
    assert tied.tokens == 2 and tied.max_logprob_diff == 0.0
    assert tied.near_ties == 1  # token 1, within TIE_NATS
    assert compare(_ours([5, 7, 2]), [PLAIN]).tokens == 3


def test_a_mismatch_says_which_prompt_and_position() -> None:
    plain = {"tokens": PLAIN["tokens"] * 2, "logprobs": PLAIN["logprobs"] * 2}
    both = _ours([5, 7, 2])[0]["tokens"] + _ours([5, 7, 4])[0]["tokens"]
    tops = _ours([5, 7, 2])[0]["logprobs"] + _ours([5, 7, 4])[0]["logprobs"]
    c = compare([{"tokens": both, "logprobs": tops}], [plain])
    assert c.mismatches == (Mismatch(1, 2, 4, 2),)
    assert c.mismatches[0].describe() == "prompt 1 token 2: 4, plain 2"
    cut = compare(_ours([5, 7]), [PLAIN]).mismatches[0]
    assert (cut.position, cut.kvcore, cut.plain) == (2, None, 2)


def test_every_output_of_every_call_is_compared_and_numbered_in_order() -> None:
    ok, tied, wrong = _ours([5, 7, 2]), _ours([5, 3, 2]), _ours([9, 7, 2])
    assert _summary(compare([*ok, *tied], [PLAIN, PLAIN])) == (True, 1, 0)
    c = compare([*ok, *wrong], [PLAIN, PLAIN])
    assert _summary(c) == (False, 0, 0) and c.outputs == 2
    assert [(m.prompt, m.position) for m in c.mismatches] == [(1, 0)]
    later = compare(ok, [PLAIN]).then(c)  # a round's comparisons chained: numbered on
    assert [m.prompt for m in later.mismatches] == [2] and later.outputs == 3


def test_ties_are_bounded_by_the_tokens_compared() -> None:
    assert ties_allowed(0) == ties_allowed(TOKENS_PER_TIE) == TIES_FLOOR
    assert ties_allowed(11 * TOKENS_PER_TIE + 5) == 11


def test_every_workload_alternates_who_goes_first() -> None:
    """Unit by unit within a round, and each round starts on the other side."""
    assert [kvcore_first(1, k) for k in range(4)] == [True, False, True, False]
    assert [kvcore_first(2, k) for k in range(4)] == [False, True, False, True]
    assert [kvcore_first(r, 0) for r in (1, 2, 3)] == [True, False, True]


def test_a_missed_check_fails_the_command_after_its_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``kvcore bench vllm`` on a record whose outputs differ: the headline still
    printed, saying where; exit 1, each missed check named on stderr. Speed targets
    missed (here: not measured) do not fail it."""
    import argparse

    from kvcore.bench import main

    where = "chat round 2 prompt 3 token 5: 17, plain 42"
    record: dict[str, Any] = {
        "tokens_match": False,
        "logprob_mismatches": 0,
        "ties": 1,
        "ties_allowed": 2,
    }
    record |= {"max_logprob_diff": 2e-5, "first_mismatch": where}
    args = argparse.Namespace(_run=lambda _: record, benchmark="vllm", json=False)
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "NOT MET" in out and "first_mismatch" in out  # the table wraps the cell
    assert all(word in out for word in where.split())
    assert err.splitlines() == ["kvcore bench vllm: FAILED: tokens_match = False, not == True"]
    args.json = True
    assert main(args) == 1 and '"first_mismatch"' in capsys.readouterr().out
    record["tokens_match"] = True
    assert main(args) == 0
