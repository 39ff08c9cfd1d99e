"""A client that sends one huge prompt to a router again and again, as fast as it is answered
(`python router_load_client.py HOST:PORT SEED NUM_BYTES`). Prints the first answer's status code
and message, then keeps going until killed. Imports only grpc and the generated protos, so that
starting four of these does not load torch four times next to the measured server."""

from __future__ import annotations

import random
import sys

import grpc

from tandem.proto import router_pb2 as pb
from tandem.proto import router_pb2_grpc as pb_grpc


def english_like(num_bytes: int, seed: int) -> str:
    """ASCII words (about 4 bytes a token), exactly `num_bytes` long."""
    rng = random.Random(seed)
    words = ("the of and to in is was that for on with as by at from this which be are an "
             "river mountain system request latency token model answer question").split()
    parts, size = [], 0
    while size <= num_bytes:  # the join has one space fewer than counted
        word = rng.choice(words)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:num_bytes]


def main(target: str, seed: int, num_bytes: int) -> None:
    request = pb.GenerateRequest(prompt=english_like(num_bytes, seed))
    first = True
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RouterStub(channel)
        while True:
            try:
                list(stub.Generate(request, timeout=600))
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            if first:
                print(f"{code.name} {details}", flush=True)
                first = False


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
