"""The `tandem.v1.Router` gRPC servicer: converts protos to router values, delegates to
`Router`, and maps `RouterError` codes to gRPC status codes. No logic of its own.

Handlers are registered with `safe_deserializer`s (router/wire.py) so that an unparsable request
(e.g. invalid UTF-8) is answered with INVALID_ARGUMENT naming the field, not INTERNAL.

Whose request: Generate and Abort pass the client's connection (`context.peer()`) as the
router's `caller`, so request ids are per connection: an Abort reaches only requests started on
the same connection (the same channel), and a duplicate id is refused only within it (see
router/router.py). Clients that abort by id do it on the channel that generates.

With tracing on (tandem/otel.py), a Generate call's `traceparent` metadata (W3C trace context)
becomes the parent of the request's span; with tracing off the metadata is not read.
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

from tandem import otel
from tandem.proto import router_pb2 as pb
from tandem.router import convert
from tandem.router.errors import RouterError
from tandem.router.router import Router
from tandem.router.wire import Undecodable, safe_deserializer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name  # "tandem.v1.Router"


class RouterServicer:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: pb.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> None:
        # context.write rather than `yield`: the handler task is what gRPC cancels when the
        # client goes away or its deadline passes, and `aclosing` then closes the router's
        # stream at once (which aborts the request on its workers).
        request = await _decoded(request, context)
        try:
            async with aclosing(self.router.generate(convert.generate_input(request),
                                                     context.time_remaining(),
                                                     caller=context.peer(),
                                                     traceparent=_traceparent(context),
                                                     api="grpc")) as outputs:
                async for out in outputs:
                    await context.write(convert.generate_response(out))
        except RouterError as exc:
            await context.abort(status_code(exc), exc.message)

    async def Abort(self, request: pb.AbortRequest | Undecodable,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        request = await _decoded(request, context)
        try:
            return pb.AbortResponse(found=await self.router.abort(request.request_id,
                                                                  caller=context.peer()))
        except RouterError as exc:
            await context.abort(status_code(exc), exc.message)
            raise  # unreachable: abort raises

    async def ListWorkers(self, request: pb.ListWorkersRequest | Undecodable,
                          context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        await _decoded(request, context)
        return pb.ListWorkersResponse(
            workers=[convert.worker_status(w) for w in self.router.workers()])

    async def Stats(self, request: pb.StatsRequest | Undecodable,
                    context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        await _decoded(request, context)
        return convert.stats_response(self.router.stats())


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    """The client's W3C trace context (`traceparent` metadata), read only while tracing is on."""
    if not otel.enabled():
        return ""
    return next((v for k, v in context.invocation_metadata() or () if k == "traceparent"), "")


def status_code(exc: RouterError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.code.value]


async def _decoded(request, context: grpc.aio.ServicerContext):
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    return request


def add_router_servicer(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Like the generated `add_RouterServicer_to_server`, with explaining deserializers."""
    methods = pb.DESCRIPTOR.services_by_name["Router"].methods_by_name
    handlers = {}
    for name, method in methods.items():
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[name] = make(getattr(servicer, name),
                              request_deserializer=safe_deserializer(request_cls),
                              response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
