"""The operation table (kvcore/ops.py), the messages, the schema and spec/protocol.md agree."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from kvcore_ipc import messages as msg

from kvcore import ops
from kvcore.client import Batch, Client
from kvcore.manager import Manager
from kvcore.prefix import MAX_NAMESPACE_BYTES

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
    assert namespace["maxLength"] == MAX_NAMESPACE_BYTES  # the spec's 256 bytes, as characters


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
