"""The operation table (kvcore/ops.py), the messages, the schema and spec/protocol.md agree."""

from __future__ import annotations

import inspect
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import msgspec
from kvcore_ipc import messages as msg

from kvcore import ops
from kvcore.client import Batch, Client
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.prefix import MAX_KEY_PART_BYTES

SPEC = Path(__file__).resolve().parents[1] / "spec"


def spec_ops() -> dict[str, str]:
    """The rows of spec/protocol.md's operations table: op name -> the row's text."""
    text = (SPEC / "protocol.md").read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}


def test_every_operation_is_in_the_table_or_served_by_the_session() -> None:
    names = {op.name for op in ops.OPERATIONS.values()}
    assert names | ops.SESSION_OPS == msg.OP_NAMES
    assert not names & ops.SESSION_OPS
    assert set(ops.OPERATIONS) == set(msg.BATCH_OPS)


def test_spec_lists_exactly_the_operations_with_their_fields() -> None:
    rows = spec_ops()
    assert set(rows) - set(msg.ERROR_CODES) - {"op", "code"} == set(msg.OP_NAMES)  # headers
    for op in msg.OPS:
        row = rows[op.__struct_config__.tag]  # type: ignore[index]
        for field in op.__struct_fields__:
            assert f"`{field}`" in row, f"spec row of {op.__name__} does not name `{field}`"
    batch_row = rows["batch"]
    for op in msg.BATCH_OPS:
        assert op.__struct_config__.tag in batch_row, f"spec: batch does not list {op.__name__}"


def test_schema_has_every_request_and_result() -> None:
    schema = json.loads((SPEC / "protocol.schema.json").read_text())
    for op in msg.OPS:
        assert op.__name__ in schema["$defs"]
        assert op.Result.__name__ in schema["messages"]["results"]
    namespace = schema["$defs"]["Allocate"]["properties"]["namespace"]["anyOf"][0]
    assert namespace["maxLength"] == MAX_KEY_PART_BYTES  # the spec's 256 bytes, as characters


def test_client_and_batch_methods_come_from_the_table() -> None:
    for op in ops.OPERATIONS.values():
        assert inspect.getattr_static(Client, op.name) is op
        assert inspect.getattr_static(Batch, op.name).op is op
        manager_params = list(inspect.signature(getattr(Manager, op.name)).parameters)[1:]
        assert list(op.signature.parameters) == manager_params
        assert callable(getattr(Manager, op.name))


def test_a_bound_operation_documents_itself() -> None:
    class Recorder:
        allocate = ops.allocate

        def run_op(self, op: ops.Operation[..., object], request: msg.BatchOp) -> object:
            return request

    bound = Recorder().allocate
    assert bound(1, (4, 5)) == msg.Allocate(1, [4, 5], None)  # namespace None: the session's
    assert bound.__name__ == "allocate"
    assert "OutOfPages" in (bound.__doc__ or "") and "AllocateOk" in (bound.__doc__ or "")
    assert str(inspect.signature(bound)).startswith("(seq_id: 'int', tokens:")


PAGE_SIZE = 4
EXAMPLES: dict[type[msg.BatchOp], msg.BatchOp] = {
    msg.Allocate: msg.Allocate(2, list(range(100, 110))),
    msg.Extend: msg.Extend(1, 3),
    msg.Commit: msg.Commit(1, list(range(8))),
    msg.Fork: msg.Fork(1, 2),
    msg.Free: msg.Free(1),
    msg.Lookup: msg.Lookup(list(range(9))),
    msg.BlockTable: msg.BlockTable(1),
    msg.NumTokens: msg.NumTokens(1),
    msg.AllocatePages: msg.AllocatePages(2, list(range(100, 108))),
    msg.LookupPages: msg.LookupPages(struct.pack("<8I", *range(8))),  # packed tokens
    msg.CommitPages: msg.CommitPages(1, list(range(8))),
}
"""One request per operation, for a Manager holding seq 1 (13 tokens, 4 pages of 4)."""


@dataclass(slots=True)
class _Books:
    """The daemon's books as the table reads them (kvcore.ops.Books)."""

    page_size: int
    tokens: dict[int, int]

    def held(self, seq: int) -> int | None:
        return self.tokens.get(seq)


def test_every_operation_declares_its_work_growth_and_release() -> None:
    """Each op's ``work``, ``grows`` and ``ends`` agree with what its Manager method does,
    so a new op that carries tokens, grows a sequence or ends one cannot skip
    max_request_tokens, the quotas or the ledger."""
    assert set(EXAMPLES) == set(ops.OPERATIONS), "give every operation an example here"
    layout = KVLayout(1, 1, 8, PAGE_SIZE, "float16", num_pages=16)
    for kind, request in EXAMPLES.items():
        op = ops.OPERATIONS[kind]
        assert ops.operation_of(request) is op
        manager = Manager(layout)
        manager.allocate(1, list(range(13)))
        books = _Books(PAGE_SIZE, {1: 13})
        fields = msgspec.structs.astuple(request)
        carried = sum(len(v) for v in fields if isinstance(v, list))
        carried += sum(len(v) // 4 for v in fields if isinstance(v, bytes))  # packed tokens
        assert ops.carried(request) == carried, f"{op.name}: carried is its tokens"
        work = op.work(request, books)
        op.serve(manager, request, "default")
        grown = op.grows(request, books)
        if grown is not None:
            seq, tokens = grown
            assert (seq in books.tokens) is (op.creates is None), f"{op.name} grows {seq}"
            assert work >= tokens - books.tokens.get(seq, 0), f"{op.name}: its growth is work"
            books.tokens[seq] = tokens
        if op.creates is not None:
            assert grown is not None, f"{op.name} creates a sequence: the quotas must see it"
        if op.ends is not None:
            del books.tokens[getattr(request, op.ends)]
        assert work >= carried, f"{op.name}: the tokens it carries are work (the up-front check)"
        live = {seq: manager.num_tokens(seq) for seq in (1, 2) if seq in manager}
        assert books.tokens == live, f"{op.name}: the books do not follow the Manager"


def test_a_fork_costs_the_parents_pages_in_tokens() -> None:
    """The fork's price (max_request_tokens): the parent's block table in whole pages."""
    books = _Books(PAGE_SIZE, {1: 13})
    assert ops.fork.work(msg.Fork(1, 2), books) == 16
    assert ops.fork.work(msg.Fork(9, 2), books) == 0  # not on the books: the Manager refuses it
    assert ops.fork.grows(msg.Fork(9, 2), books) is None


def test_a_fork_is_priced_against_the_books_as_they_are_when_it_runs() -> None:
    """A chained fork (the parent forked just before, in the same batch) costs the
    parent's pages once the earlier fork is booked: the price reads the books then."""
    books = _Books(PAGE_SIZE, {1: 13})
    assert ops.fork.work(msg.Fork(2, 3), books) == 0  # 2 is not made yet
    grown = ops.fork.grows(msg.Fork(1, 2), books)
    assert grown == (2, 13)
    books.tokens[grown[0]] = grown[1]  # the ledger books the first fork
    assert ops.fork.work(msg.Fork(2, 3), books) == 16
