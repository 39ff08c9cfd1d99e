# Environment for the GPU scripts (source it from the repository root):
#   - the package bundle (.devbundle: flashinfer, ray, nixl, mooncake), unpacked once per machine
#     into /tmp/devsite; a later call on the same warm machine may carry only
#     .devbundle/activate.sh;
#   - grpcio/protobuf new enough for the checked-in stubs (the GPU machine's grpcio 1.84 is older
#     than router_pb2_grpc.py asks for), from .devgrpc/grpc.tar.xz, unpacked once into
#     /tmp/devgrpc. Build it with:
#       pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 grpcio==1.85.3 grpcio-health-checking==1.85.1 \
#         grpcio-reflection==1.85.1 protobuf==7.36.2 -d W; unzip every wheel into W/site;
#       tar -cJf .devgrpc/grpc.tar.xz -C W/site .        # ~5.5 MiB
#     The whole .devbundle and .devgrpc together pass the 64 MiB carry limit: carry .devbundle
#     in one call and `.devbundle/activate.sh` + `.devgrpc` in the next.
source .devbundle/activate.sh
if [ -f .devgrpc/grpc.tar.xz ] && [ ! -f /tmp/devgrpc/.ok ]; then
  rm -rf /tmp/devgrpc && mkdir -p /tmp/devgrpc && tar -xJf .devgrpc/grpc.tar.xz -C /tmp/devgrpc \
    && touch /tmp/devgrpc/.ok
fi
if [ -f /tmp/devgrpc/.ok ]; then export PYTHONPATH=/tmp/devgrpc${PYTHONPATH:+:$PYTHONPATH}; fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export RAY_AUTH_MODE=disabled NIXL_LOG_LEVEL=WARN MC_LOG_LEVEL=WARNING
