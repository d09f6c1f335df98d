"""The errors a request or frame ends with, each carrying the gRPC status its client or peer gets."""

import grpc


class Rejected(Exception):
    """A request or frame refused before use, with the gRPC status it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class PrefixMissed(Rejected):
    """A frame names a cached prompt prefix this node does not hold (evicted, re-planned, restarted): ABORTED,
    which the head answers by prefilling the request from position 0."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.ABORTED, message)


class KvMissing(Rejected):
    """A frame past a request's first position reaches a node without its KV cache (lost to a re-plan, a restart, an
    eviction while the frame went round): ABORTED, which the head answers by replaying the request."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.ABORTED, message)


class RequestFailed(Exception):
    """A request ended before it finished, with the gRPC status its client gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class RequestCancelled(RequestFailed):
    """The client cancelled the request."""

    def __init__(self):
        super().__init__(grpc.StatusCode.CANCELLED, "cancelled")


class LinkDown(Exception):
    """The successor could not be reached."""
