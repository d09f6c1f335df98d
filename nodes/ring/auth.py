"""Shared-secret authentication: a server interceptor that checks the cluster token on every RPC."""

import hmac

import grpc

from prima_rpc.channel import TOKEN_KEY


def _rejecting(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as streaming responses must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if isinstance(sent, bytes):
            sent = sent.decode(errors="replace")
        if not hmac.compare_digest(sent.encode(), self._token):  # constant time
            reason = "missing cluster token" if not sent else "wrong cluster token"
            return _rejecting(handler, f"{reason} (set PRIMA_TOKEN or --token-file)")
        return handler
