"""A failed gRPC call as one line for a person: who answered, the node's own message, and what to do.

Shared by prima-ctl (`error: ...`) and the HTTP API (OpenAI's error message), so both say the same.
"""

import grpc

ADVICE = {
    grpc.StatusCode.UNAVAILABLE: "is prima-node running there? (prima-ctl up --local 3 starts a local ring)",
    grpc.StatusCode.UNAUTHENTICATED: "set PRIMA_TOKEN or --token-file to the ring's secret",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the node did not answer in time; prima-ctl status shows the ring",
    grpc.StatusCode.FAILED_PRECONDITION: "prima-ctl status shows the ring; prima-ctl start assigns windows",
}


def rpc_message(code: grpc.StatusCode, details: str, address: str = "") -> str:
    """address: the node that was called, when `details` does not name it (a PrimaError's message does)."""
    details = " ".join((details or "").split()) or code.name
    if address:
        who = {grpc.StatusCode.UNAVAILABLE: f"cannot reach node {address}",
               grpc.StatusCode.UNAUTHENTICATED: f"{address} refused the token"}.get(code, address)
        details = f"{who}: {details}"
    advice = ADVICE.get(code)
    return f"{details}; {advice}" if advice else details
