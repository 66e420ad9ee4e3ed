#!/usr/bin/env python3
"""A Control client written with nothing of RVBox but its protos.

Stubs come from protos/rvbox/v1/*.proto through grpcio-tools:

    python -m grpc_tools.protoc -I protos --python_out=gen \
        --grpc_python_out=gen protos/rvbox/v1/*.proto

Then, as the server's account (the socket is mode 0600):

    PYTHONPATH=gen python rvbox_client.py /run/rvbox-server/control.sock web-1

It runs a command on the client, follows its events to the end
(FollowCommand), reads its output (GetOutput), and sends malformed
requests, checking that each is refused with the structured
rvbox.v1.ErrorDetail in the gRPC status details. It prints one line per
check and exits 0 when every check holds, 1 otherwise.
"""

import os
import sys
import time
import uuid

import grpc
from grpc_status import rpc_status

from rvbox.v1 import common_pb2, control_pb2, control_pb2_grpc


def uuid7() -> str:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, version, random."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))


failures = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(("ok    " if ok else "FAIL  ") + name + (f": {detail}" if detail else ""))
    if not ok:
        failures.append(name)


def refused(call, request, code: str, field: str, name: str) -> None:
    """`call(request)` must fail with ErrorDetail `code` naming `field`."""
    try:
        call(request, timeout=30)
    except grpc.RpcError as e:
        status = rpc_status.from_call(e)
        if status is None or not status.details:
            check(name, False, f"no status details ({e.code()}: {e.details()})")
            return
        detail = common_pb2.ErrorDetail()
        if not status.details[0].Unpack(detail):
            check(name, False, f"detail is {status.details[0].type_url}")
            return
        got = common_pb2.ErrorCode.Name(detail.code)
        check(
            name,
            got == f"ERROR_CODE_{code}" and detail.field == field,
            f"{got} field={detail.field!r} reason={detail.reason!r}",
        )
        return
    check(name, False, "the request was accepted")


def main() -> int:
    socket, client_id = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(
        "unix:" + socket,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            # the socket path is not an authority
            ("grpc.default_authority", "localhost"),
        ],
    )
    stub = control_pb2_grpc.ControlStub(channel)

    # run a command and follow it to its end
    issue = uuid7()
    text = "echo from python; echo to stderr >&2; exit 3"
    run = stub.RunCommand(
        control_pb2.RunCommandRequest(
            request_id=issue,
            client_id=client_id,
            spec=common_pb2.ExecutionSpec(command_text=text),
        ),
        timeout=30,
    )
    check("RunCommand returns the request id as the command", run.issue_uuid == issue)
    output_bytes = 0
    result = None
    for item in stub.FollowCommand(
        control_pb2.FollowCommandRequest(issue_uuid=issue, after_event_seq=0), timeout=60
    ):
        if item.HasField("event"):
            ev = item.event.event
            if ev.HasField("output"):
                output_bytes += ev.output.raw_length
            if ev.HasField("lifecycle") and ev.lifecycle.HasField("exit_result"):
                result = ev.lifecycle.exit_result
    check(
        "FollowCommand ends with the exit result",
        result is not None and result.exit_code == 3,
        str(result).replace("\n", " "),
    )
    page = stub.GetOutput(
        control_pb2.GetOutputRequest(
            issue_uuid=issue,
            streams=[common_pb2.OUTPUT_STREAM_STDOUT, common_pb2.OUTPUT_STREAM_STDERR],
        ),
        timeout=30,
    )
    # the two streams are two pipes: their order against each other is
    # the order the client read them in, each stream's own order is kept
    items = [i.data for i in page.items if i.HasField("data")]
    out = b"".join(d.data for d in items if d.stream == common_pb2.OUTPUT_STREAM_STDOUT)
    err = b"".join(d.data for d in items if d.stream == common_pb2.OUTPUT_STREAM_STDERR)
    check(
        "GetOutput returns the bytes the follow counted",
        out == b"from python\n"
        and err == b"to stderr\n"
        and output_bytes == len(out) + len(err),
        repr((out, err)),
    )
    again = stub.RunCommand(
        control_pb2.RunCommandRequest(
            request_id=issue,
            client_id=client_id,
            spec=common_pb2.ExecutionSpec(command_text=text),
        ),
        timeout=30,
    )
    check("a replayed RunCommand answers the same", again.issue_uuid == issue)

    # malformed requests: structured refusals
    refused(
        stub.GetCommand,
        control_pb2.GetCommandRequest(issue_uuid="not-a-uuid"),
        "INVALID_ARGUMENT",
        "issue_uuid",
        "a bad UUID",
    )
    refused(
        stub.RunCommand,
        control_pb2.RunCommandRequest(
            request_id="01234567-89ab-4def-8123-456789abcdef",
            client_id=client_id,
            spec=common_pb2.ExecutionSpec(command_text="true"),
        ),
        "INVALID_ARGUMENT",
        "request_id",
        "a request id that is a UUIDv4",
    )
    refused(
        stub.RunCommand,
        control_pb2.RunCommandRequest(
            request_id=uuid7(),
            client_id="c" * 200,
            spec=common_pb2.ExecutionSpec(command_text="true"),
        ),
        "INVALID_ARGUMENT",
        "client_id",
        "an oversized client id",
    )
    refused(
        stub.AppendStdin,
        control_pb2.AppendStdinRequest(
            request_id=uuid7(),
            issue_uuid=issue,
            data=b"x" * (1024 * 1024 + 1),
            newline=common_pb2.STDIN_NEWLINE_RAW,
        ),
        "TOO_LARGE",
        "data",
        "an oversized stdin append",
    )
    refused(
        stub.RunCommand,
        control_pb2.RunCommandRequest(
            request_id=uuid7(),
            client_id=client_id,
            spec=common_pb2.ExecutionSpec(command_text="true", shell_type=99),
        ),
        "INVALID_ARGUMENT",
        "spec.shell_type",
        "an unknown shell type",
    )
    refused(
        stub.SignalCommand,
        control_pb2.SignalCommandRequest(request_id=uuid7(), issue_uuid=issue, signal=42),
        "INVALID_ARGUMENT",
        "signal",
        "an unknown signal",
    )
    refused(
        stub.RunCommand,
        control_pb2.RunCommandRequest(
            request_id=issue,
            client_id=client_id,
            spec=common_pb2.ExecutionSpec(command_text="false"),
        ),
        "CONFLICT",
        "request_id",
        "a request id reused for another command",
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
